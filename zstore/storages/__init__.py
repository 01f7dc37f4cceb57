"""Storage classes (TorchRL's public names and behaviour, on Zarr where persistent)."""

from .._registry import register_storage_class
from .base import Storage
from .compressed import CompressedListStorage, ItemList, stack_items
from .ensemble import StorageEnsemble
from .list import LazyStackStorage, ListStorage
from .memmap import LazyMemmapStorage
from .tensor import LazyTensorStorage, TensorStorage

# the classes zstore.open (_registry.reopen) picks by the storage_class a store records
register_storage_class(LazyMemmapStorage, CompressedListStorage, StorageEnsemble)

__all__ = ["Storage", "ListStorage", "LazyStackStorage", "TensorStorage", "LazyTensorStorage",
           "LazyMemmapStorage", "CompressedListStorage", "StorageEnsemble", "ItemList", "stack_items"]
