"""``StoreSpec``: a URL + storage options, as a JSON-serialisable value that opens a Zarr store.

One place turns what a user gives (a local path, ``file://``, ``memory://``,
``s3://bucket/prefix``, any other fsspec URL, plus ``storage_options``) into a
Zarr v3 store. A :class:`StoreSpec` is a small JSON-serialisable value: it is
what a storage pickles into and what travels to other processes, never a live
filesystem object.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Mapping

import fsspec
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

from .errors import BackendNotInstalledError, NotAZStoreError, ReadOnlyError, StoreNotFoundError

_INSTALL_HINTS = {
    "s3": "s3fs (pip install 'zstore[s3]')",
    "s3a": "s3fs (pip install 'zstore[s3]')",
    "gs": "gcsfs (pip install gcsfs)",
    "gcs": "gcsfs (pip install gcsfs)",
    "az": "adlfs (pip install adlfs)",
    "abfs": "adlfs (pip install adlfs)",
    "http": "aiohttp (pip install aiohttp)",
    "https": "aiohttp (pip install aiohttp)",
}
_SECRET_WORDS = ("secret", "token", "password", "key", "credential", "session")

#: What zstore relies on from each fsspec protocol's store, read through :class:`StoreSpec`'s
#: properties (``is_local``, ``is_memory``, ``is_object_store``, ``atomic_conditional_writes``,
#: ``cheap_listing``). A protocol not listed (``http``, ``sftp``, ``adl`` — Azure Data Lake
#: Gen1, a filesystem whose paths name no bucket — ...) is a remote filesystem with none of them.
CAPABILITIES: Mapping[str, frozenset[str]] = {
    "file": frozenset({"local", "cheap_listing"}),
    "memory": frozenset({"memory", "cheap_listing"}),
    "s3": frozenset({"object_store", "atomic_conditional_writes"}),
    "s3a": frozenset({"object_store", "atomic_conditional_writes"}),
    "gs": frozenset({"object_store"}),
    "gcs": frozenset({"object_store"}),
    "az": frozenset({"object_store"}),
    "abfs": frozenset({"object_store"}),
    "oss": frozenset({"object_store"}),
}


def _redact(options: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = _redact(value)
        elif any(word in name.lower() for word in _SECRET_WORDS):
            out[name] = "***"
        else:
            out[name] = value
    return out


@dataclasses.dataclass(frozen=True, repr=False)
class StoreSpec:
    """Where a buffer lives: a URL, fsspec ``storage_options`` and a read-only flag.

    >>> StoreSpec.parse("memory://rb").protocol
    'memory'
    """

    url: str
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    read_only: bool = False

    @classmethod
    def parse(
        cls,
        url: str | os.PathLike | "StoreSpec",
        storage_options: Mapping[str, Any] | None = None,
        read_only: bool = False,
    ) -> "StoreSpec":
        """Normalise a path or URL (``~`` expanded, local paths made absolute)."""
        if isinstance(url, StoreSpec):
            return dataclasses.replace(url, read_only=url.read_only or read_only)
        text = os.fspath(url)
        if not isinstance(text, str) or not text:
            raise ValueError(f"a store URL must be a non-empty string or path, got {url!r}")
        if text.startswith("file://"):
            text = text[len("file://"):]
        if "://" not in text:
            text = str(Path(text).expanduser().absolute())
        return cls(text.rstrip("/") or "/", dict(storage_options or {}), read_only)

    @property
    def protocol(self) -> str:
        """The fsspec protocol (``"file"`` for local paths)."""
        return self.url.split("://", 1)[0] if "://" in self.url else "file"

    def _can(self, capability: str) -> bool:
        return capability in CAPABILITIES.get(self.protocol, frozenset())

    @property
    def is_local(self) -> bool:
        """Whether the store is a directory on this machine's filesystem (``file``)."""
        return self._can("local")

    @property
    def local_path(self) -> Path | None:
        """The store's directory on this machine, or ``None`` when it is not local."""
        return Path(self.url) if self.is_local else None

    @property
    def is_memory(self) -> bool:
        """Whether the store is fsspec's ``memory://``: it lives inside this one process."""
        return self._can("memory")

    @property
    def is_remote(self) -> bool:
        """Whether reaching the store crosses a network: neither local nor ``memory://``."""
        return not (self.is_local or self.is_memory)

    @property
    def is_object_store(self) -> bool:
        """Whether the URL is ``bucket/prefix`` in an object store (S3, GCS, Azure Blob, OSS):
        objects are written whole, so buffers use large shards, and the bucket must exist."""
        return self._can("object_store")

    @property
    def atomic_conditional_writes(self) -> bool:
        """Whether the store writes an object only if its ETag matches or it is absent, atomically
        (S3's ``If-Match`` / ``If-None-Match``), so leases compare-and-swap on it directly."""
        return self._can("atomic_conditional_writes")

    @property
    def cheap_listing(self) -> bool:
        """Whether listing and sizing the stored objects is cheap (a local directory or
        ``memory://``), so summaries list stored bytes without being asked."""
        return self._can("cheap_listing")

    def redacted(self) -> str:
        """The URL and options with every credential replaced by ``***``."""
        if not self.storage_options:
            return self.url
        return f"{self.url} {_redact(self.storage_options)}"

    def __repr__(self) -> str:  # never the credentials
        return (f"StoreSpec(url={self.url!r}, storage_options={_redact(self.storage_options)!r}, "
                f"read_only={self.read_only})")

    def as_read_only(self) -> "StoreSpec":
        """The same location, opened read-only (a new value; this one is unchanged)."""
        return dataclasses.replace(self, read_only=True)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict that :meth:`from_json` turns back into this spec."""
        return {"url": self.url, "storage_options": dict(self.storage_options),
                "read_only": self.read_only}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StoreSpec":
        """Inverse of :meth:`to_json`."""
        return cls(data["url"], dict(data.get("storage_options") or {}), bool(data["read_only"]))

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The fsspec filesystem and the path inside it (a fresh instance per process)."""
        try:
            fs, path = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except ImportError as exc:
            hint = _INSTALL_HINTS.get(self.protocol, f"the fsspec backend for {self.protocol!r}")
            raise BackendNotInstalledError(
                f"cannot open {self.url}: install {hint} to use {self.protocol}:// URLs ({exc})"
            ) from exc
        except ValueError as exc:
            if "Protocol not known" in str(exc):
                raise BackendNotInstalledError(
                    f"cannot open {self.url}: fsspec knows no protocol {self.protocol!r}"
                ) from exc
            raise
        return fs, path

    def exists(self) -> bool:
        """Whether anything is stored at this location."""
        if self.is_local:
            return Path(self.url).exists()
        fs, path = self.filesystem()
        return fs.exists(path)

    def stored_bytes(self, ignore: tuple[str, ...] = ()) -> int:
        """Bytes of every object at or below this location (0 when nothing is there),
        except the top-level objects named in ``ignore``."""
        fs, path = self.filesystem()
        try:
            sizes = fs.du(path, total=False)
        except FileNotFoundError:
            return 0
        skip = {f"{path.rstrip('/')}/{name}" for name in ignore}
        return int(sum(size for name, size in sizes.items() if name not in skip))

    def is_empty(self, ignore: tuple[str, ...] = ()) -> bool:
        """Whether nothing is stored at (or below) this location, except top-level ``ignore`` names."""
        if self.is_local:
            path = Path(self.url)
            return not path.exists() or (path.is_dir() and
                                         not any(p.name not in ignore for p in path.iterdir()))
        fs, path = self.filesystem()
        try:
            names = fs.ls(path, detail=False)
        except FileNotFoundError:
            return True
        return not [name for name in names if name.rstrip("/").rsplit("/", 1)[-1] not in ignore]

    def check_parent(self) -> None:
        """Raise :class:`StoreNotFoundError` when the bucket (or root) to write in is missing."""
        if self.is_local:
            return
        fs, path = self.filesystem()
        if self.is_object_store:
            bucket = path.split("/", 1)[0]
            try:
                found = fs.exists(bucket)
            except PermissionError:
                found = True  # cannot list, but may still write
            if not found:
                raise StoreNotFoundError(
                    f"bucket {bucket!r} of {self.redacted()} does not exist; create it first"
                )

    def open(self) -> Store:
        """Open the Zarr store (LocalStore for local paths, FsspecStore otherwise)."""
        if self.is_local:
            if Path(self.url).exists() and not Path(self.url).is_dir():
                raise NotAZStoreError(f"{self.url} is a file; a zstore buffer is a directory")
            if not self.read_only:
                Path(self.url).mkdir(parents=True, exist_ok=True)
            elif not Path(self.url).exists():
                raise StoreNotFoundError(f"no such directory: {self.url}")
            return LocalStore(self.url, read_only=self.read_only)
        self.filesystem()  # install hints for a missing backend
        return FsspecStore.from_url(self.url, storage_options=dict(self.storage_options),
                                    read_only=self.read_only)

    def require_writable(self, action: str) -> None:
        """Raise :class:`ReadOnlyError` naming ``action`` when this spec is read-only."""
        if self.read_only:
            raise ReadOnlyError(f"cannot {action}: {self.url} is opened read-only")

    def delete(self) -> None:
        """Remove everything at this location (used by temporary scratch stores)."""
        self.require_writable("delete the store")
        if self.is_local:
            import shutil

            shutil.rmtree(self.url, ignore_errors=True)
            return
        fs, path = self.filesystem()
        if self.is_memory:
            _delete_memory_tree(fs, path)
        elif fs.exists(path):
            fs.rm(path, recursive=True)


def _delete_memory_tree(fs: Any, path: str) -> None:
    """Remove ``path`` and everything under it from an fsspec memory filesystem.

    fsspec's ``rm`` lists the store by iterating its dict while allocating, so a
    garbage collection (or another thread) that changes the dict mid-listing
    breaks it; ``list(dict)`` takes the snapshot in one step that cannot be
    interrupted.
    """
    prefix = path.rstrip("/") + "/"
    for key in [key for key in list(fs.store) if key == path or key.startswith(prefix)]:
        fs.store.pop(key, None)
    for directory in [d for d in list(fs.pseudo_dirs) if d == path or d.startswith(prefix)]:
        if directory in fs.pseudo_dirs:
            fs.pseudo_dirs.remove(directory)


_DEFERRED: list[Callable[[], None]] = []  # memory:// work from finalizers (append/pop are atomic)


def defer_memory_work(action: Callable[[], None]) -> None:
    """Queue ``action`` — a finalizer's change to a ``memory://`` store — for :func:`run_deferred`.

    A ``memory://`` store is one dict shared by every thread, and a garbage
    collection can run a finalizer in the middle of an iteration over it (a
    listing, a delete); changing the dict there breaks that iteration.
    """
    _DEFERRED.append(action)


def run_deferred() -> None:
    """Run the queued ``memory://`` work; call only where no store is being iterated."""
    while _DEFERRED:
        action = _DEFERRED.pop()
        try:
            action()
        except Exception:  # noqa: BLE001 - best effort, as the finalizer it stands for
            pass
