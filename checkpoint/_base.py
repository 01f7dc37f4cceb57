"""The base checkpointers: hooks only (``StorageCheckpointerBase``), and with zstore's options.

``_Configured`` (codec, chunking, storage options, progress; staged dumps committed
last) is the base of every zstore checkpointer: the tensor, H5, compressed and
ensemble ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from zstore.codecs import CodecSpec, with_default_checksum

from ._dest import Destination, as_spec
from ._result import DumpResult


class StorageCheckpointerBase:
    """Base checkpointer: holds save/load hooks; ``dumps``/``loads`` must be overridden.

    Unlike TorchRL's base, it never "saves" silently: calling it raises.
    """

    def __init__(self) -> None:
        self._save_hooks: list[Callable] = []
        self._load_hooks: list[Callable] = []

    def register_save_hook(self, hook: Callable) -> None:
        """Add a hook applied to data before it is saved: ``hook(data, path=url) -> data``."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable) -> None:
        """Add a hook applied to data after it is loaded: ``hook(data, out=None) -> data``."""
        self._load_hooks.append(hook)

    def dumps(self, storage: Any, path: Any) -> Any:
        """Save ``storage`` to ``path``; zstore's checkpointers return a :class:`DumpResult`."""
        raise NotImplementedError(f"{type(self).__name__} cannot save {type(storage).__name__}")

    def loads(self, storage: Any, path: Any) -> None:
        """Load ``storage`` from ``path``."""
        raise NotImplementedError(f"{type(self).__name__} cannot load {type(storage).__name__}")

    def _detach_from_load_path(self, storage: Any) -> None:
        """Nothing to detach: loaded data never references the checkpoint's files."""


class _Configured(StorageCheckpointerBase):
    """A checkpointer with zstore's options: codec, chunking, storage options, progress."""

    def __init__(self, *, codec: Any = None, chunks: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, progress: bool = True) -> None:
        super().__init__()
        # raw checkpoint chunks are written as plain bytes (no codec runs): no checksum
        self.codec = with_default_checksum(CodecSpec.parse(codec), remote=False)
        self.chunks = chunks
        self.storage_options = dict(storage_options or {})
        self.progress = progress

    def _dest(self, path: Any) -> Destination:
        return Destination(as_spec(path, self.storage_options))

    def dumps(self, storage: Any, path: Any) -> DumpResult:
        """Stage a new generation of ``storage`` at ``path``, commit it, delete the old one."""
        start = time.perf_counter()
        dest = self._dest(path)
        dest.check_writable()
        record = self._stage(storage, dest)
        self._finish(storage, dest, record)
        return DumpResult.of(dest.redacted(), record, time.perf_counter() - start)

    def _stage(self, storage: Any, dest: Destination) -> dict[str, Any]:
        """Write a new generation at ``dest`` (not yet committed); return its commit record."""
        raise NotImplementedError(f"{type(self).__name__} cannot save {type(storage).__name__}")

    @staticmethod
    def _finish(storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        """Commit a staged generation and delete the others."""
        dest.commit(record)
        dest.remove_others(keep=record["generation"])
