"""zstore: TorchRL's replay-buffer storage layer on chunked Zarr v3 arrays at any fsspec URL.

>>> import torch, zstore
>>> from tensordict import TensorDict
>>> rb = zstore.LazyMemmapStorage(1000, scratch_dir="memory://zstore-doc")
>>> rb.set(torch.arange(10), TensorDict(obs=torch.randn(10, 4), batch_size=[10]))
>>> rb.get(torch.tensor([0, 9]))["obs"].shape
torch.Size([2, 4])

The public names are imported on first use (``zstore.X``, ``from zstore import X``):
``import zstore`` itself imports neither torch nor tensordict, so the ``zstore``
command starts without them.
"""

from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

#: Public name -> the submodule that defines it.
_SOURCES = {
    "open": "api",
    "CacheStats": "cache", "cache_tier": "cache",
    "CodecSpec": "codecs",
    "Dataset": "dataset", "open_dataset": "dataset", "seal": "dataset",
    "ReplayBuffer": "replay_buffer",
    "RandomSampler": "samplers", "Sampler": "samplers", "SliceSampler": "samplers",
    "StoreSpec": "store",
    "ImmutableDatasetWriter": "writers", "RoundRobinWriter": "writers",
    "TensorDictRoundRobinWriter": "writers", "Writer": "writers",
    **dict.fromkeys(["CompressedListStorage", "LazyMemmapStorage", "LazyStackStorage",
                     "LazyTensorStorage", "ListStorage", "Storage", "StorageEnsemble",
                     "TensorStorage", "stack_items"], "storages"),
    **dict.fromkeys(["ZStoreError", "BackendNotInstalledError", "StoreNotFoundError",
                     "InvalidURLError", "NotAZStoreError", "FormatVersionError", "ReadOnlyError", "NoCredentialsError",
                     "SchemaError", "MissingKeyError", "InvalidKeyError", "CorruptChunkError",
                     "StoreExistsError", "LeaseError", "SourceFileError"], "errors"),
}

__all__ = [
    "open", "open_dataset", "seal", "Dataset", "Storage", "ListStorage", "LazyStackStorage", "TensorStorage", "LazyTensorStorage",
    "LazyMemmapStorage", "CompressedListStorage", "StorageEnsemble", "stack_items", "Writer", "RoundRobinWriter", "TensorDictRoundRobinWriter",
    "ImmutableDatasetWriter", "ReplayBuffer", "Sampler", "RandomSampler", "SliceSampler",
    "StoreSpec", "CodecSpec", "CacheStats", "cache_tier",
    "ZStoreError", "BackendNotInstalledError", "StoreNotFoundError", "InvalidURLError",
    "NotAZStoreError",
    "FormatVersionError", "ReadOnlyError", "NoCredentialsError", "SchemaError", "MissingKeyError",
    "InvalidKeyError",
    "CorruptChunkError", "StoreExistsError", "LeaseError", "SourceFileError", "display", "plots",
]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES, __all__, globals())
