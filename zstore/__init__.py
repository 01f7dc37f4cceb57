"""zstore: TorchRL's replay-buffer storage layer on chunked Zarr v3 arrays at any fsspec URL.

>>> import torch, zstore
>>> from tensordict import TensorDict
>>> rb = zstore.LazyMemmapStorage(1000, scratch_dir="memory://zstore-doc")
>>> rb.set(torch.arange(10), TensorDict(obs=torch.randn(10, 4), batch_size=[10]))
>>> rb.get(torch.tensor([0, 9]))["obs"].shape
torch.Size([2, 4])
"""

__version__ = "0.1.0"

from . import display, plots
from .api import open
from .cache import CacheStats, cache_tier
from .codecs import CodecSpec
from .dataset import Dataset, open_dataset, seal
from .errors import (
    BackendNotInstalledError,
    CorruptChunkError,
    FormatVersionError,
    InvalidKeyError,
    LeaseError,
    MissingKeyError,
    NotAZStoreError,
    ReadOnlyError,
    SchemaError,
    StoreExistsError,
    StoreNotFoundError,
    ZStoreError,
)
from .storages import (
    CompressedListStorage,
    LazyMemmapStorage,
    LazyStackStorage,
    LazyTensorStorage,
    ListStorage,
    Storage,
    StorageEnsemble,
    TensorStorage,
    stack_items,
)
from .replay_buffer import ReplayBuffer
from .samplers import RandomSampler, Sampler, SliceSampler
from .store import StoreSpec
from .writers import ImmutableDatasetWriter, RoundRobinWriter, TensorDictRoundRobinWriter, Writer

__all__ = [
    "open", "open_dataset", "seal", "Dataset", "Storage", "ListStorage", "LazyStackStorage", "TensorStorage", "LazyTensorStorage",
    "LazyMemmapStorage", "CompressedListStorage", "StorageEnsemble", "stack_items", "Writer", "RoundRobinWriter", "TensorDictRoundRobinWriter",
    "ImmutableDatasetWriter", "ReplayBuffer", "Sampler", "RandomSampler", "SliceSampler",
    "StoreSpec", "CodecSpec", "CacheStats", "cache_tier",
    "ZStoreError", "BackendNotInstalledError", "StoreNotFoundError", "NotAZStoreError",
    "FormatVersionError", "ReadOnlyError", "SchemaError", "MissingKeyError", "InvalidKeyError",
    "CorruptChunkError", "StoreExistsError", "LeaseError", "display", "plots",
]
