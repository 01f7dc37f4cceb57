"""Checkpointers for zstore storages (TorchRL's public names).

The full set (TensorStorage-, Flat-, Nested-, H5-, CompressedListStorage- and
StorageEnsemble-Checkpointer) is tracked by the checkpointers issue; this
package already provides the base class and the list checkpointer, whose
behaviour is to refuse serialisation clearly.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["StorageCheckpointerBase", "ListStorageCheckpointer"]


class StorageCheckpointerBase:
    """Base checkpointer: holds save/load hooks; ``dumps``/``loads`` must be overridden.

    Unlike TorchRL's base, it never "saves" silently: calling it raises.
    """

    def __init__(self) -> None:
        self._save_hooks: list[Callable] = []
        self._load_hooks: list[Callable] = []

    def register_save_hook(self, hook: Callable) -> None:
        """Add a hook applied to data before it is saved."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable) -> None:
        """Add a hook applied to data after it is loaded."""
        self._load_hooks.append(hook)

    def dumps(self, storage: Any, path: Any) -> None:
        """Save ``storage`` to ``path``."""
        raise NotImplementedError(f"{type(self).__name__} cannot save {type(storage).__name__}")

    def loads(self, storage: Any, path: Any) -> None:
        """Load ``storage`` from ``path``."""
        raise NotImplementedError(f"{type(self).__name__} cannot load {type(storage).__name__}")


class ListStorageCheckpointer(StorageCheckpointerBase):
    """ListStorage holds arbitrary Python objects: like TorchRL, it refuses dumps/loads."""

    def dumps(self, storage: Any, path: Any) -> None:
        raise NotImplementedError("ListStorage doesn't support serialization via `dumps` - `loads` API.")

    def loads(self, storage: Any, path: Any) -> None:
        raise NotImplementedError("ListStorage doesn't support serialization via `dumps` - `loads` API.")

