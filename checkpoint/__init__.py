"""Checkpointers for zstore storages (TorchRL's public names), at any fsspec URL.

``storage.dumps(url)`` / ``storage.loads(url)`` delegate to these. Every
checkpoint is staged and committed last (an interrupted dump leaves the previous
checkpoint loadable); tensor storages dump incrementally; the TED checkpointers
(Flat, Nested, H5) compact losslessly. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

from ._compressed import CompressedListStorageCheckpointer
from ._dest import CheckpointError
from ._ensemble import StorageEnsembleCheckpointer
from ._h5 import H5StorageCheckpointer
from ._ted import H5Combine, H5Split, Flat2TED, Nested2TED, TED2Flat, TED2Nested
from ._tensor import (
    FlatStorageCheckpointer,
    ListStorageCheckpointer,
    NestedStorageCheckpointer,
    StorageCheckpointerBase,
    TensorStorageCheckpointer,
)

__all__ = [
    "StorageCheckpointerBase", "ListStorageCheckpointer", "TensorStorageCheckpointer",
    "CompressedListStorageCheckpointer", "FlatStorageCheckpointer", "NestedStorageCheckpointer",
    "H5StorageCheckpointer", "StorageEnsembleCheckpointer", "TED2Flat", "Flat2TED",
    "TED2Nested", "Nested2TED", "H5Split", "H5Combine", "CheckpointError",
]
