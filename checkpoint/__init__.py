"""Checkpointers for zstore storages (TorchRL's public names), at any fsspec URL.

``storage.dumps(url)`` / ``storage.loads(url)`` delegate to these. Every
checkpoint is staged and committed last (an interrupted dump leaves the previous
checkpoint loadable); tensor storages dump incrementally; the TED checkpointers
(Flat, Nested, H5) compact losslessly. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

from ._base import StorageCheckpointerBase
from ._compressed import CompressedListStorageCheckpointer
from ._dest import CheckpointError
from ._ensemble import StorageEnsembleCheckpointer
from ._h5 import H5StorageCheckpointer
from ._result import DumpResult
from ._ted import Flat2TED, H5Combine, H5Split, Nested2TED, TED2Flat, TED2Nested
from ._tensor import (
    FlatStorageCheckpointer,
    ListStorageCheckpointer,
    NestedStorageCheckpointer,
    TensorStorageCheckpointer,
)

__all__ = [
    "CheckpointError",
    "CompressedListStorageCheckpointer",
    "DumpResult",
    "Flat2TED",
    "FlatStorageCheckpointer",
    "H5Combine",
    "H5Split",
    "H5StorageCheckpointer",
    "ListStorageCheckpointer",
    "Nested2TED",
    "NestedStorageCheckpointer",
    "StorageCheckpointerBase",
    "StorageEnsembleCheckpointer",
    "TED2Flat",
    "TED2Nested",
    "TensorStorageCheckpointer",
]
