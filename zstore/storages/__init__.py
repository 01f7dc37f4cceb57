"""Storage classes (TorchRL's public names and behaviour, on Zarr where persistent)."""

from .base import Storage
from .compressed import CompressedListStorage, ItemList, stack_items
from .ensemble import StorageEnsemble
from .list import LazyStackStorage, ListStorage
from .memmap import LazyMemmapStorage
from .tensor import LazyTensorStorage, TensorStorage

#: Storage classes that can be reopened from a store, by the name recorded in its metadata.
PERSISTENT_CLASSES = {"LazyMemmapStorage": LazyMemmapStorage,
                      "CompressedListStorage": CompressedListStorage,
                      "StorageEnsemble": StorageEnsemble}

__all__ = ["Storage", "ListStorage", "LazyStackStorage", "TensorStorage", "LazyTensorStorage",
           "LazyMemmapStorage", "CompressedListStorage", "StorageEnsemble", "ItemList", "stack_items",
           "PERSISTENT_CLASSES"]
