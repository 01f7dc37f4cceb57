"""``StoreSpec``: a URL + storage options, as a JSON-serialisable value that opens a Zarr store.

One place turns what a user gives (a local path, ``file://``, ``memory://``,
``s3://bucket/prefix``, any other fsspec URL, plus ``storage_options``) into a
Zarr v3 store. A :class:`StoreSpec` is a small JSON-serialisable value: it is
what a storage pickles into and what travels to other processes, never a live
filesystem object.

S3 data (chunks, shards, ``zarr.json``) goes through one of two clients, the
*transport* (:attr:`StoreSpec.transport`): ``"fsspec"`` (s3fs, the default) or
``"obstore"`` (the Rust ``object_store`` client, ``pip install 'zstore[s3fast]'``),
chosen by ``storage_options["transport"]``, else the ``ZSTORE_S3_CLIENT``
environment variable. Listings, deletes of whole stores and the lease's
conditional writes always use s3fs (:meth:`StoreSpec.filesystem`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import errno
import functools
import inspect
import json
import os
import re
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Mapping, NoReturn
from urllib.parse import quote

import fsspec
from zarr.abc.store import (ByteRequest, OffsetByteRequest, RangeByteRequest, Store,
                             SuffixByteRequest)
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import FsspecStore, LocalStore, ObjectStore
from zarr.storage._common import _dereference_path  # (FsspecStore's own path rule)

from ._aws_credentials import botocore_chain
from .credentials import CHECK_ENDPOINT, no_credentials_error, store_errors_named
from .errors import (BackendNotInstalledError, InvalidURLError, NotAZStoreError, ReadOnlyError,
                     StoreNotFoundError, sealed_dataset)

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

#: The storage option naming the S3 data client (never passed to fsspec); ``ZSTORE_S3_CLIENT``
#: sets it for every spec that does not.
TRANSPORT_OPTION = "transport"
TRANSPORT_ENV = "ZSTORE_S3_CLIENT"
TRANSPORTS = ("fsspec", "obstore")
@functools.cache
def _s3_option_names() -> frozenset[str]:
    """Every storage option an S3 store takes: s3fs's own, those s3fs passes on to botocore's
    session and fsspec's listing cache, fsspec's ``skip_instance_cache``, and zstore's
    ``region`` and ``transport``; empty when s3fs is not installed (nothing is checked)."""
    try:
        import s3fs
        from aiobotocore.session import AioSession
        from fsspec.dircache import DirCache
    except ImportError:
        return frozenset()
    names = {"skip_instance_cache", "region", TRANSPORT_OPTION}
    for function in (s3fs.S3FileSystem.__init__, AioSession.__init__, DirCache.__init__):
        names.update(name for name, parameter in inspect.signature(function).parameters.items()
                     if name != "self" and parameter.kind is not parameter.VAR_KEYWORD)
    return frozenset(names)


#: s3fs options with no obstore meaning that the obstore transport ignores: fsspec's caches.
_FSSPEC_ONLY = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time",
                          "max_paths", "default_block_size", "default_fill_cache"})

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


def _without_userinfo(url: str) -> str:
    """``url`` with the credentials of its authority (``user:password@``) as ``***@``."""
    return re.sub(r"^([A-Za-z][\w+.-]*://)[^/@]*@", r"\1***@", url)


@dataclasses.dataclass(frozen=True, repr=False)
class StoreSpec:
    """Where a buffer lives: a URL, fsspec ``storage_options`` and a read-only flag.

    >>> StoreSpec.parse("memory://rb").protocol
    'memory'
    """

    url: str
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    read_only: bool = False
    #: read-only because it holds a sealed dataset (what a refused write then says)
    sealed: bool = dataclasses.field(default=False, compare=False)

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
        text = os.fspath(url) if isinstance(url, (str, os.PathLike)) else None
        if not isinstance(text, str) or not text:
            raise InvalidURLError(f"a store URL must be a non-empty string or path, got {url!r}")
        if text.startswith(("file://", "local://")):  # (fsspec's two names of local files)
            scheme, _, text = text.partition("://")
            if not text:  # (else the working directory)
                raise InvalidURLError(f"{url!r} names no location: write it as {scheme}:///PATH")
        elif re.match(r"(file|local):/(?!/)", text):  # RFC 8089's file:/path
            text = text.partition(":")[2]
        _refuse_a_slash_short(text)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options of {text!r} must be a mapping (endpoint_url=..., "
                            f"key=...), got {storage_options!r}" + (
                                f": to open it read-only, write mode={storage_options!r}"
                                if storage_options in ("r", "r+", "w", "a") else ""))
        if "://" not in text:  # ("..": resolved as the OS does, through symlinks before it, so
            text = os.path.expanduser(text)  # a folder has one spelling, as ensembles record)
            text = os.path.realpath(text) if ".." in Path(text).parts else str(Path(text).absolute())
        scheme, sep, path = text.partition("://")
        if sep and not path.strip("/"):  # (stripped, "memory://" was the local path "memory:")
            bucket = "object_store" in CAPABILITIES.get(scheme, ())
            first = "BUCKET" if bucket else "NAME" if scheme == "memory" else "HOST"
            raise InvalidURLError(f"{text!r} names no {'bucket' if bucket else 'location'}: "
                                  f"write it as {scheme}://{first}/PATH")
        spec = cls(text.rstrip("/") or "/", dict(storage_options or {}), read_only)
        spec._refuse_ambiguous(text)
        if _DELETIONS:  # (a location is used only once its deletion has ended)
            wait_for_deletions(spec.url)
        return spec

    def _refuse_ambiguous(self, text: str) -> None:
        """Raise ``ValueError`` for what the two S3 clients would read differently: an empty
        path segment of an object store's URL ``text`` (``s3://bucket//rb``), an S3
        ``endpoint_url`` without ``http://`` or ``https://``, and two different regions."""
        if self.is_object_store:
            path = self.url.split("://", 1)[1]
            if "@" in path.split("/", 1)[0]:
                raise InvalidURLError(f"{self.shown_url!r} holds credentials in its bucket name, "
                                      "which object store clients do not read there: pass them "
                                      "as storage options (key=..., secret=...)")
            if re.search(r"\?\w+=", path):
                raise InvalidURLError(f"{self.shown_url!r} has a query string, which object store "
                                      "clients do not read: pass its options (endpoint_url=...) "
                                      "as storage options")
            if not path or path.startswith("/") or "//" in path:
                fixed = f"{self.protocol}://" + "/".join(part for part in path.split("/") if part)
                raise InvalidURLError(f"{text!r} has an empty path segment ('//'), which object "
                                      f"store clients read differently: write it as {fixed!r}")
        if self.protocol not in ("s3", "s3a"):
            return
        options = self.storage_options
        client = options.get("client_kwargs") or {}
        for name, value in (("endpoint_url", options.get("endpoint_url")),
                            ('client_kwargs["endpoint_url"]', client.get("endpoint_url"))):
            if value and not str(value).startswith(("http://", "https://")):
                raise InvalidURLError(f"{self.shown_url}: storage option {name}={value!r} has no "
                                      f"scheme: write it as 'http://{value}' or 'https://{value}'")
        region, region_name = options.get("region"), client.get("region_name")
        if region and region_name and region != region_name:
            raise InvalidURLError(f"{self.shown_url}: storage options region={region!r} and "
                                  f'client_kwargs["region_name"]={region_name!r} differ: give one')
        known = _s3_option_names()
        unknown = sorted(set(options) - known) if known else []
        if unknown:  # s3fs hands them to botocore's session, which fails at the first request
            near = {name: difflib.get_close_matches(name, known, 1) for name in unknown}
            hints = [f"{name!r}" + (f" (did you mean {near[name][0]!r}?)" if near[name] else "")
                     for name in unknown]
            raise InvalidURLError(f"{self.shown_url}: unknown storage option(s) {', '.join(hints)}; S3 "
                                  "takes s3fs's options (key, secret, token, endpoint_url, "
                                  "client_kwargs, config_kwargs, anon, profile ...), region and "
                                  "transport")

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

    @property
    def shown_url(self) -> str:
        """The URL as messages show it: without credentials in it (``user:password@``)."""
        return _without_userinfo(self.url)

    def redacted(self) -> str:
        """The URL and options with every credential (of the options, or in the URL:
        ``https://user:password@host/...``) replaced by ``***``."""
        if not self.storage_options:
            return self.shown_url
        return f"{self.shown_url} {_redact(self.storage_options)}"

    def __repr__(self) -> str:  # never the credentials
        return (f"StoreSpec(url={self.shown_url!r}, "
                f"storage_options={_redact(self.storage_options)!r}, read_only={self.read_only})")

    def as_read_only(self, sealed: bool = False) -> "StoreSpec":
        """The same location, opened read-only (a new value; this one is unchanged);
        ``sealed``: because it holds a sealed dataset."""
        return dataclasses.replace(self, read_only=True, sealed=sealed)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict that :meth:`from_json` turns back into this spec."""
        return {"url": self.url, "storage_options": dict(self.storage_options),
                "read_only": self.read_only}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StoreSpec":
        """Inverse of :meth:`to_json`."""
        return cls(data["url"], dict(data.get("storage_options") or {}), bool(data["read_only"]))

    @property
    def transport(self) -> str:
        """The client of :meth:`open`'s S3 data path: ``"fsspec"`` (s3fs) or ``"obstore"``.

        ``storage_options["transport"]``, else ``$ZSTORE_S3_CLIENT``, else ``"fsspec"``;
        always ``"fsspec"`` for other protocols, and in a process forked from one that
        used obstore (:func:`obstore_runtime_inherited`).
        """
        if self.protocol not in ("s3", "s3a"):
            return "fsspec"
        chosen = self.storage_options.get(TRANSPORT_OPTION) or os.environ.get(TRANSPORT_ENV) or "fsspec"
        if chosen not in TRANSPORTS:
            raise InvalidURLError(f"unknown S3 transport {chosen!r} for {self.shown_url}: choose one "
                                  f"of {', '.join(TRANSPORTS)}")
        if chosen == "obstore" and obstore_runtime_inherited():
            _warn_forked_obstore(self)
            return "fsspec"
        return chosen

    def _fsspec_options(self) -> dict[str, Any]:
        """The options for fsspec: their dicts and lists copied (s3fs and botocore change
        nested dicts such as ``config_kwargs["retries"]`` in place), without ``transport``, and
        on S3 with ``region`` as s3fs's ``client_kwargs["region_name"]`` (as the obstore
        transport reads it)."""
        options = _copy_containers({k: v for k, v in self.storage_options.items()
                                    if k != TRANSPORT_OPTION})
        if self.protocol in ("s3", "s3a") and "region" in options:
            region = options.pop("region")
            client = options["client_kwargs"] = dict(options.get("client_kwargs") or {})
            if region and not client.get("region_name"):
                client["region_name"] = region
        return options

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The fsspec filesystem and the path inside it (a fresh instance per process)."""
        try:
            fs, path = fsspec.core.url_to_fs(self.url, **self._fsspec_options())
        except ImportError as exc:
            hint = _INSTALL_HINTS.get(self.protocol, f"the fsspec backend for {self.protocol!r}")
            raise BackendNotInstalledError(
                f"cannot open {self.shown_url}: install {hint} to use {self.protocol}:// URLs ({exc})"
            ) from exc
        except ValueError as exc:
            if "Protocol not known" in str(exc):
                raise BackendNotInstalledError(
                    f"cannot open {self.shown_url}: fsspec knows no protocol {self.protocol!r}"
                ) from exc
            raise
        return fs, path

    def exists(self) -> bool:
        """Whether anything is stored at this location."""
        if self.is_local:
            return Path(self.url).exists()
        fs, path = self.filesystem()
        with store_errors_named(self.redacted()):
            return fs.exists(path)

    def objects(self) -> dict[str, dict[str, Any]]:
        """``{key relative to this location: fsspec info}`` of every object stored below it, in
        one listing (empty when nothing is there)."""
        fs, root = self.filesystem()
        fs.invalidate_cache(root)
        for attempt in range(3):
            try:
                found = fs.find(root, detail=True)
                break
            except FileNotFoundError:
                return {}
            except RuntimeError:
                # memory:// is one dict, iterated by find: a garbage collection in the middle
                # can run an owned storage's finalizer that deletes from it ("dictionary
                # changed size"); the finalizer has finished by now, so list again
                if not self.is_memory or attempt == 2:
                    raise
        fs.invalidate_cache()  # the listing filled the cache of every folder below: drop it,
        # or a look through this filesystem after a later write reads the listing (s3fs)
        prefix = root.rstrip("/") + "/"
        return {path[len(prefix):].replace(os.sep, "/"): info
                for path, info in found.items() if path.startswith(prefix)}

    def stored_bytes(self, ignore: tuple[str, ...] = ()) -> int:
        """Bytes of every object at or below this location (0 when nothing is there),
        except the top-level objects named in ``ignore``.

        A local file counts the bytes the filesystem allocated to it where they are
        fewer than its size: a sparse memory-mapped chunk file holds only the pages
        written, not its whole capacity.
        """
        if self.is_local:
            def held(stat: os.stat_result) -> int:
                blocks = getattr(stat, "st_blocks", None)  # not on Windows
                return stat.st_size if blocks is None else min(stat.st_size, blocks * 512)

            root = Path(self.url)
            if root.is_file():
                return held(root.stat())
            total = 0
            for folder, _, names in os.walk(root):
                top = Path(folder) == root
                for name in names:
                    if top and name in ignore:
                        continue
                    try:
                        total += held(os.stat(os.path.join(folder, name)))
                    except FileNotFoundError:  # replaced or deleted while listed
                        pass
            return total
        fs, path = self.filesystem()
        skip = {f"{path.rstrip('/')}/{name}" for name in ignore}
        if self.is_memory:  # fsspec's du lists every folder by a scan of every object of the
            # process (quadratic: 15 s for a summary of 4,000 chunks); one scan here
            below = path.rstrip("/") + "/"
            return sum(file.size for name, file in list(fs.store.items())
                       if (name == path or name.startswith(below)) and name not in skip)
        try:
            with store_errors_named(self.redacted()):  # (a server down: named, with the fix)
                sizes = fs.du(path, total=False)
        except FileNotFoundError:
            return 0
        return int(sum(size for name, size in sizes.items() if name not in skip))

    def is_empty(self, ignore: tuple[str, ...] = ()) -> bool:
        """Whether nothing is stored at (or below) this location, except top-level names that
        start with one of ``ignore``."""
        if self.is_local:
            path = Path(self.url)
            return not path.exists() or (path.is_dir() and
                                         not any(not p.name.startswith(ignore) for p in path.iterdir()))
        fs, path = self.filesystem()
        try:
            names = fs.ls(path, detail=False)
        except FileNotFoundError:
            return True
        return not [name for name in names if not name.rstrip("/").rsplit("/", 1)[-1].startswith(ignore)]

    def check_parent(self) -> None:
        """Raise :class:`StoreNotFoundError` when the bucket (or root) to write in is missing."""
        bucket = self.missing_bucket()
        if bucket is not None:
            raise StoreNotFoundError(
                f"bucket {bucket!r} of {self.redacted()} does not exist; create it first")

    def missing_bucket(self) -> str | None:
        """The name of this object-store URL's bucket when it does not exist (one request),
        else None (it exists, it may not be listed, or the store has no buckets)."""
        if not self.is_object_store:
            return None
        fs, path = self.filesystem()
        bucket = path.split("/", 1)[0]
        if not hasattr(fs, "call_s3"):  # gs://, az:// ...: their filesystem's word
            try:
                return None if fs.exists(bucket) else bucket
            except PermissionError:
                return None
        try:  # s3fs's exists() answers False to a refusal too: ask the server itself
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return bucket  # 404: no such bucket
        except Exception:  # noqa: BLE001 - 403 (a principal that may not list it), the network
            return None
        return None

    def refuse_a_file(self, fix: str = "", *, reading: bool = True) -> None:
        """:class:`NotAZStoreError` when this local path, or (to write) the nearest of its
        folders that exists, is a file: a store is a directory (``fix``: what to pass instead, in the
        caller's words; for an HDF5 file, when ``reading``, the importer to use)."""
        path = self.local_path
        if path is not None and path.exists() and not path.is_dir():
            if not fix and reading and path.suffix.lower() in (".hdf5", ".h5"):
                fix = ("an HDF5 file (a D4RL dataset?) is imported into one first: "
                       f"zstore.dataset.import_d4rl({str(path)!r}, DEST), or `zstore import d4rl "
                       "FILE DEST`")
            raise NotAZStoreError(f"{self.redacted()} is a file; a zstore buffer or dataset is a "
                                  "directory" + (f": {fix}" if fix else ""))
        if path is None or self.read_only:
            return
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():  # (the OS: a bare "Not a directory")
            raise NotAZStoreError(f"cannot create a buffer at {self.redacted()}: {parent} is a "
                                  "file, not a folder; choose a location inside a folder")

    def open(self) -> Store:
        """Open the Zarr store: LocalStore for local paths, zarr's ObjectStore over obstore for
        S3 with the ``"obstore"`` :attr:`transport`, FsspecStore otherwise (on S3, one that
        reads whole objects without s3fs's HEAD first)."""
        if self.is_local:
            self.refuse_a_file()
            if not self.read_only:
                Path(self.url).mkdir(parents=True, exist_ok=True)
            elif not Path(self.url).exists():
                raise StoreNotFoundError(f"no such directory: {self.shown_url}")
            return LocalStore(self.url, read_only=self.read_only)
        if self.transport == "obstore":
            return _obstore_s3(self)
        self.filesystem()  # install hints for a missing backend
        kind = (_S3FsspecStore if self.protocol in ("s3", "s3a")
                else _HttpFsspecStore if self.protocol in ("http", "https")
                else _MemoryFsspecStore if self.is_memory else _ExactFsspecStore)
        return kind.from_url(self.url, storage_options=self._fsspec_options(),
                             read_only=self.read_only)

    def require_writable(self, action: str) -> None:
        """Raise :class:`ReadOnlyError` naming ``action`` when this spec is read-only."""
        if self.sealed:
            raise sealed_dataset(action, self.shown_url)
        if self.read_only:
            raise ReadOnlyError(f"cannot {action}: {self.shown_url} is opened read-only")

    def delete(self) -> None:
        """Remove everything at this location (used by temporary scratch stores); at a
        bucket's root, every object in it, and not the bucket."""
        self.require_writable("delete the store")
        if self.is_local:
            import shutil

            shutil.rmtree(self.url, ignore_errors=True)
            return
        fs, path = self.filesystem()
        if self.is_memory:
            _delete_memory_tree(fs, path)
        elif "/" not in path.strip("/"):  # a bucket's root: its objects, never the bucket
            if fs.exists(path) and (objects := fs.find(path)):
                fs.rm(objects)
        elif fs.exists(path):
            fs.rm(path, recursive=True)


class _ExactFsspecStore(FsspecStore):
    """zarr's FsspecStore, deleting objects by their exact paths: its deletes go through
    fsspec's ``rm``, which reads ``*``, ``?`` and ``[`` in a path as a pattern, and a key
    may hold them (rewriting chunk 1 of a key ``*`` with zeros deleted chunk 1 of every
    key). Paths without them are deleted as zarr deletes them."""

    async def delete(self, key: str) -> None:
        """Delete the object at ``key`` (nothing where there is none)."""
        path = _dereference_path(self.path, key)
        if not _has_pattern(path):
            return await super().delete(key)
        self._check_writable()
        with contextlib.suppress(FileNotFoundError):
            await self.fs._rm_file(path)

    async def delete_dir(self, prefix: str) -> None:
        """Delete every object below ``prefix``."""
        path = _dereference_path(self.path, prefix)
        if not _has_pattern(path):
            return await super().delete_dir(prefix)
        self._check_writable()
        found = await self.fs._find(path)
        await asyncio.gather(*(self.fs._rm_file(name) for name in found))


def _refuse_a_slash_short(text: str) -> None:
    """Raise :class:`InvalidURLError` for a URL one slash short (``s3:/bucket/rb``): read as
    a local path, it wrote a folder ``s3:`` in the working directory, its storage options
    ignored."""
    scheme, colon, rest = text.partition(":/")
    if colon and not rest.startswith("/") and len(scheme) > 1 and scheme in (
            set(fsspec.available_protocols()) - {"file", "local"}):
        raise InvalidURLError(f"{text!r} is one slash short of a URL: write it as "
                              f"'{scheme}://{rest}'")


def _has_pattern(path: str) -> bool:
    """Whether fsspec reads ``path`` as a glob pattern."""
    return any(character in path for character in "*?[")


class _S3FsspecStore(_ExactFsspecStore):
    """zarr's FsspecStore on s3fs, whose whole-object reads are ranged from byte 0.

    s3fs sends a plain GET only after a HEAD (sizing a concurrent download), a
    ranged one alone: opening a buffer reads its ``zarr.json`` objects in half the
    requests. An empty object has no byte 0 (``416``): it is read plainly.
    """

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        """The object at ``key`` (or ``byte_range`` of it); ``None`` when it is missing."""
        if byte_range is not None:
            return await super().get(key, prototype, byte_range)
        try:
            return await super().get(key, prototype, OffsetByteRequest(0))
        except OSError as exc:
            if "InvalidRange" not in str(exc) and "not satisfiable" not in str(exc):
                raise
            return await super().get(key, prototype)


#: Most reads a process has in flight at once to HTTP(S) stores (a browser's connections
#: to one host): a static file server may accept few connections at once (``python -m
#: http.server`` queues 5 and drops the rest, which the client retries after 1, 3, 7 s...:
#: 2,048 rows of 128 chunks a key read in 14-28 s at 64 in flight, 0.2 s at 6; 1.0 s at 8).
HTTP_IN_FLIGHT = 6


def _http_in_flight() -> int:
    """:data:`HTTP_IN_FLIGHT`, or the ``ZSTORE_HTTP_IN_FLIGHT`` environment variable's."""
    told = os.environ.get("ZSTORE_HTTP_IN_FLIGHT")
    if told is None:
        return HTTP_IN_FLIGHT
    if not told.strip().isdigit() or int(told) < 1:
        raise ValueError(f"ZSTORE_HTTP_IN_FLIGHT={told!r}: the most reads in flight to an HTTP "
                         "store is a whole number of at least 1 (unset it for 6)")
    return int(told)


class _HttpFsspecStore(_ExactFsspecStore):
    """zarr's FsspecStore over HTTP(S), each key percent-encoded into its object's URL: a key
    path may hold ``?``, ``#`` or ``%`` (a field ``obs?x``), which a URL reads as the start
    of a query or fragment, or as an escape (every read of such a key missed its object).
    At most :data:`HTTP_IN_FLIGHT` reads are in flight at once."""

    #: fsspec's HTTP filesystem retries no request: zstore's reads retry a failed one
    client_retries = False

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        """The object at ``key`` (or ``byte_range`` of it); ``None`` when it is missing."""
        async with _http_slot():
            return await super().get(quote(key, safe="/"), prototype, byte_range)

    async def exists(self, key: str) -> bool:
        """Whether the object at ``key`` exists."""
        return await super().exists(quote(key, safe="/"))


_HTTP_SLOTS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = \
    weakref.WeakKeyDictionary()


def _http_slot() -> asyncio.Semaphore:
    """The running event loop's slots of HTTP reads (:func:`_http_in_flight` of them)."""
    loop = asyncio.get_running_loop()
    slots = _HTTP_SLOTS.get(loop)
    if slots is None:
        slots = _HTTP_SLOTS[loop] = asyncio.Semaphore(_http_in_flight())
    return slots


class _MemoryFsspecStore(_ExactFsspecStore):
    """zarr's FsspecStore on fsspec's memory filesystem, whose reads run on the event loop.

    zarr runs each call of a synchronous filesystem on a worker thread (``asyncio.to_thread``):
    33 us and two thread hand-offs a read, for a dict look-up and a copy (300 concurrent
    reads: 10.0 ms, here 2.8). A read here calls the memory filesystem itself; the rest goes
    through zarr.
    """

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        """The object at ``key`` (or ``byte_range`` of it); ``None`` when it is missing."""
        if byte_range is None:
            start, end = None, None
        elif isinstance(byte_range, RangeByteRequest):
            start, end = byte_range.start, byte_range.end
        elif isinstance(byte_range, OffsetByteRequest):
            start, end = byte_range.offset, None
        elif isinstance(byte_range, SuffixByteRequest):
            start, end = -byte_range.suffix, None
        else:
            raise ValueError(f"unexpected byte range {byte_range!r} for {key!r}")
        root = self.path.rstrip("/")
        try:
            return prototype.buffer.from_bytes(
                self.fs.sync_fs.cat_file(f"{root}/{key}" if root else key, start, end))
        except FileNotFoundError:
            return None


def _copy_containers(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied all the way down; other objects (a
    session, a credential provider) are shared, not copied."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_containers(v) for v in value)
    return value


def _obstore_s3(spec: StoreSpec) -> Store:
    """zarr's ObjectStore on an obstore ``S3Store`` configured from s3fs-style options.

    Understood: ``key``, ``secret``, ``token`` (or botocore's ``aws_access_key_id``,
    ``aws_secret_access_key``, ``aws_session_token`` in ``client_kwargs``), ``profile``,
    ``endpoint_url`` (or in ``client_kwargs``), ``region`` / ``client_kwargs["region_name"]``,
    ``anon``, and of botocore's ``config_kwargs`` the timeouts and ``retries``'
    ``total_max_attempts`` or ``max_attempts`` (its checksum settings have no obstore meaning);
    fsspec's cache options are ignored; any other option is refused (it would be silently
    lost), as is a missing obstore. Without a key or ``anon``, credentials (and a region not
    given) come from botocore's chain, as s3fs's do (:mod:`zstore._aws_credentials`).
    """
    try:
        from obstore.store import S3Store
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"cannot open {spec.shown_url} with the obstore transport: install obstore "
            f"(pip install 'zstore[s3fast]') or use transport='fsspec' ({exc})") from exc
    options = dict(spec.storage_options)
    client = dict(options.pop("client_kwargs", None) or {})
    endpoint = options.pop("endpoint_url", None) or client.pop("endpoint_url", None)
    region = options.pop("region", None) or client.pop("region_name", None)
    config: dict[str, Any] = {}
    for name, boto_name, field in (("key", "aws_access_key_id", "access_key_id"),
                                   ("secret", "aws_secret_access_key", "secret_access_key"),
                                   ("token", "aws_session_token", "session_token")):
        value, boto_value = options.pop(name, None), client.pop(boto_name, None)
        value = value or boto_value  # s3fs's own option wins, as in s3fs
        if value:
            config[field] = value
    if options.pop("anon", False):
        config["skip_signature"] = True
    profile = options.pop("profile", None)
    botocore = dict(options.pop("config_kwargs", None) or {})
    named = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    http: dict[str, Any] = {"allow_http": bool(named and named.startswith("http://"))}
    for name in ("connect_timeout", "read_timeout"):
        if name in botocore:
            http[name] = f"{botocore.pop(name)}s"
    retries = dict(botocore.pop("retries", None) or {})
    # botocore: total_max_attempts counts the first request and wins; max_attempts counts retries
    total, extra = retries.pop("total_max_attempts", None), retries.pop("max_attempts", None)
    max_retries = int(total) - 1 if total is not None else None if extra is None else int(extra)
    retries.pop("mode", None)
    for name in ("response_checksum_validation", "request_checksum_calculation"):
        botocore.pop(name, None)
    unknown = (sorted(set(options) - _FSSPEC_ONLY - {TRANSPORT_OPTION}) + sorted(client)
               + [f"config_kwargs.{name}" for name in sorted(botocore)]
               + [f"config_kwargs.retries.{name}" for name in sorted(retries)])
    if unknown:
        raise InvalidURLError(f"the obstore transport of {spec.redacted()} cannot honour "
                              f"storage options {unknown}: use transport='fsspec'")
    if endpoint:
        config["endpoint"] = endpoint
        config["virtual_hosted_style_request"] = False  # a custom endpoint: path-style, as s3fs
    if region:
        config["region"] = region
    bucket, _, prefix = spec.url.split("://", 1)[1].partition("/")
    retry = None if max_retries is None else {"max_retries": max_retries}
    client = _s3_client(S3Store, bucket, prefix or None, config, http, retry, profile=profile,
                        where=spec.redacted())
    return _ObjectStoreS3(client, read_only=spec.read_only, spec=spec)


#: Clients this process built, by everything that configures them (see :func:`_s3_client`).
_S3_CLIENTS: "OrderedDict[str, Any]" = OrderedDict()
_S3_CLIENTS_LOCK = threading.Lock()
#: How many clients :data:`_S3_CLIENTS` keeps (the least recently used goes first).
S3_CLIENTS_KEPT = 32
#: The process that built an obstore client (None: none has been built here or in a parent).
_OBSTORE_PROCESS: int | None = None
_FORK_WARNED: set[int] = set()


def obstore_runtime_inherited() -> bool:
    """Whether this process was forked from one that used obstore.

    obstore runs its requests on threads of a runtime started at its first use, and a
    forked child has none of its parent's threads: every request of the child waits
    forever (measured: a child's first ``get`` never returns). Such a child reads and
    writes through s3fs instead; a child started with ``spawn`` or ``forkserver``, or
    forked before the parent's first obstore request, has a runtime of its own."""
    return _OBSTORE_PROCESS is not None and _OBSTORE_PROCESS != os.getpid()


def _warn_forked_obstore(spec: "StoreSpec") -> None:
    """Say once per process that the obstore transport fell back to s3fs after a fork."""
    if os.getpid() in _FORK_WARNED:
        return
    _FORK_WARNED.add(os.getpid())
    warnings.warn(
        f"{spec.redacted()}: this process was forked from one that used the obstore transport, "
        "whose threads a forked child does not have: it reads and writes through s3fs instead "
        "(slower). Start worker processes with the 'spawn' or 'forkserver' method to keep "
        "obstore in them", RuntimeWarning, stacklevel=3)


def _s3_client(factory: Callable[..., Any], bucket: str, prefix: str | None,
               config: dict[str, Any], http: dict[str, Any], retry: dict[str, Any] | None, *,
               profile: str | None, where: str) -> Any:
    """obstore's ``S3Store`` for these settings, built once per process and reused.

    Building one took 3.4 ms (its HTTP client), as much as the rest of a ``zstore.open``,
    and a new one opens new connections. The key holds every argument and the
    ``AWS_*`` variables obstore and botocore read besides, so a changed credential builds a
    new client; the process id keeps a forked child from its parent's clients (and see
    :func:`obstore_runtime_inherited`). Without a key or ``skip_signature`` in ``config``,
    botocore's chain (for ``profile``) gives the credentials and a region ``config`` lacks
    (:func:`~zstore._aws_credentials.botocore_chain`, for the store at ``where``); a
    custom endpoint's region is otherwise ``us-east-1``, as s3fs's.
    """
    global _OBSTORE_PROCESS
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    key = json.dumps([os.getpid(), bucket, prefix, config, http, retry, profile, environment],
                     sort_keys=True, default=str)
    with _S3_CLIENTS_LOCK:
        client = _S3_CLIENTS.pop(key, None)
        if client is None:
            config, provider = dict(config), None
            if "access_key_id" not in config and "skip_signature" not in config:
                provider, region = botocore_chain(profile, where)
                if region and "region" not in config:
                    config["region"] = region
            if "endpoint" in config:
                config.setdefault("region", "us-east-1")
            _OBSTORE_PROCESS = os.getpid()
            try:
                client = factory(bucket, prefix=prefix, config=config, client_options=http,
                                 retry_config=retry, credential_provider=provider)
            except Exception as exc:  # (its settings refused: "Missing SecretAccessKey" ...)
                raise _obstore_error(exc, where) from None
        _S3_CLIENTS[key] = client
        while len(_S3_CLIENTS) > S3_CLIENTS_KEPT:
            _S3_CLIENTS.popitem(last=False)
    return client


#: Paths of the EC2 instance metadata service, where obstore looks for credentials last.
_METADATA_PATHS = ("/latest/api/token", "/latest/meta-data/")


def _obstore_error(exc: Exception, where: str) -> Exception:
    """obstore's error ``exc`` about the store at ``where`` as the error s3fs raises in its
    place: :class:`NoCredentialsError` when obstore found no credentials (its last resort,
    the instance metadata service, failed), ``PermissionError`` for a refusal (403),
    ``ConnectionError`` when the server cannot be reached, ``OSError`` for any other error
    the server answered (obstore's ``GenericError``); ``exc`` itself otherwise. Each keeps
    the first line of obstore's message, not the Rust debug dump that follows."""
    if not type(exc).__module__.startswith("obstore"):
        return exc
    first = _first_line(str(exc))
    if any(path in first for path in _METADATA_PATHS):
        return no_credentials_error(
            where, f"the instance metadata service did not give any: {first}")
    if "Missing SecretAccessKey" in first or "Missing AccessKeyId" in first:  # (half a pair)
        return no_credentials_error(where, first)
    if type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError") \
            or "403 Forbidden" in first:
        return PermissionError(f"{where}: {first}")
    if "error sending request" in first:
        return ConnectionError(f"{where}: its server cannot be reached ({first}); {CHECK_ENDPOINT}")
    if type(exc).__name__ == "GenericError":  # (an errno, as s3fs's: a failed request)
        answered = OSError(f"{where}: {first}")
        answered.errno = errno.EIO
        return answered
    return exc


def _first_line(message: str) -> str:
    """The first line of obstore's ``message``, ending in the S3 error's code and message
    where the server's XML answer follows it on the next lines."""
    first = re.sub(r"\s*<\?xml[^>]*\?>\s*$", "", message.strip().split("\n", 1)[0])
    code, text = (re.search(f"<{tag}>(.*?)</{tag}>", message) for tag in ("Code", "Message"))
    if code is None or code[1] in first:
        return first
    return f"{first.rstrip(': ')}: {code[1]}" + (f" ({text[1]})" if text else "")


#: obstore's refusal of a ranged GET answered ``200`` (with a ``Content-Range``).
_NON_PARTIAL = "non-partial response"
#: Endpoints whose ranged GETs came back whole in this process: stores on them range through
#: s3fs from their first read, without a refused request each.
_WHOLE_RANGE_ENDPOINTS: set[str] = set()


class _ObjectStoreS3(ObjectStore):
    """zarr's ObjectStore on obstore, reading from every S3 server s3fs reads from.

    A whole-object read is a plain GET (zstore asks for one as a range from byte 0, which
    spares s3fs a HEAD). A ranged GET the server answers whole (``200`` with a
    ``Content-Range``, as ``rclone serve s3`` does), which obstore refuses, is sent again
    through s3fs, and so is every later ranged read of a store on that endpoint in this
    process. Its reads' and writes' errors are the ones s3fs raises (:func:`_obstore_error`).
    """

    def __init__(self, store: Any, *, read_only: bool = False,
                 spec: "StoreSpec | None" = None) -> None:
        super().__init__(store, read_only=read_only)
        self._spec = spec
        self._endpoint = str(store.config.get("endpoint") or "")
        self._ranged: Store | None = None  # s3fs, once the server answered a range whole

    def with_read_only(self, read_only: bool = False) -> "_ObjectStoreS3":
        """This store, read-only or not."""
        return type(self)(self.store, read_only=read_only, spec=self._spec)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_ranged"] = None  # the server is probed again where this store is unpickled
        return state

    def _ranges_through_s3fs(self) -> bool:
        """Whether this store's endpoint answered a ranged GET whole in this process."""
        return self._spec is not None and self._endpoint in _WHOLE_RANGE_ENDPOINTS

    def _s3fs(self) -> Store:
        """s3fs on this store's location, for its ranged reads."""
        if self._ranged is None:
            options = {**self._spec.storage_options, TRANSPORT_OPTION: "fsspec"}
            self._ranged = StoreSpec.parse(self._spec.url, options,
                                           read_only=self.read_only).open()
        return self._ranged

    def _raise_plain(self, exc: Exception) -> NoReturn:
        """Raise :func:`_obstore_error` of ``exc`` (naming this store's URL) from ``exc``, or
        ``exc`` itself where it has no plainer form."""
        where = self._spec.redacted() if self._spec is not None else str(self.store)
        error = _obstore_error(exc, where)
        if error is exc:
            raise exc
        raise error from exc

    def _s3fs_for_ranges(self, exc: Exception) -> Store | None:
        """s3fs for this store's ranged reads when ``exc`` is obstore's refusal of a range
        the server answered whole; ``None`` for any other error."""
        if _NON_PARTIAL not in str(exc) or self._spec is None:
            return None
        _WHOLE_RANGE_ENDPOINTS.add(self._endpoint)
        return self._s3fs()

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        """The object at ``key`` (or ``byte_range`` of it); ``None`` when it is missing."""
        if isinstance(byte_range, OffsetByteRequest) and byte_range.offset == 0:
            byte_range = None
        if byte_range is not None and self._ranges_through_s3fs():
            return await self._s3fs().get(key, prototype, byte_range)
        try:
            return await super().get(key, prototype, byte_range)
        except Exception as exc:
            fallback = None if byte_range is None else self._s3fs_for_ranges(exc)
            if fallback is None:
                self._raise_plain(exc)
        return await fallback.get(key, prototype, byte_range)

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key``; obstore's errors as :func:`_obstore_error` puts them."""
        try:
            await super().set(key, value)
        except Exception as exc:
            self._raise_plain(exc)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Any) -> list[Buffer | None]:
        """Byte ranges of several objects, as :meth:`get` reads them."""
        key_ranges = list(key_ranges)
        if not self._ranges_through_s3fs():
            try:
                return await super().get_partial_values(prototype, key_ranges)
            except Exception as exc:
                if self._s3fs_for_ranges(exc) is None:
                    self._raise_plain(exc)
        return await self._s3fs().get_partial_values(prototype, key_ranges)


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


#: Deletions running on threads of their own (:func:`delete_in_background`): the URL of each.
_DELETIONS: dict[threading.Thread, str] = {}
_DELETIONS_LOCK = threading.Lock()


def delete_in_background(spec: StoreSpec, delete: Callable[[], None]) -> None:
    """Run ``delete`` (of the store at ``spec``) on a thread of its own; until it ends, a
    parse of that location, or of one inside it or around it, waits for it
    (:func:`wait_for_deletions`): a new storage there never meets the old one's objects,
    nor loses its own to the deletion."""
    def run() -> None:
        try:
            delete()
        finally:
            with _DELETIONS_LOCK:
                _DELETIONS.pop(threading.current_thread(), None)

    deleting = threading.Thread(target=run, daemon=True, name="zstore-delete-temporary")
    with _DELETIONS_LOCK:
        _DELETIONS[deleting] = spec.url
    deleting.start()


def wait_for_deletions(url: str | None = None) -> None:
    """Wait for the background deletions of ``url``, of a location inside it and of one it
    lies in (``None``: of every location)."""
    def related(other: str) -> bool:
        return url is None or any(a == b or a.startswith(b.rstrip("/") + "/")
                                  for a, b in ((url, other), (other, url)))

    with _DELETIONS_LOCK:
        running = [deleting for deleting, where in _DELETIONS.items() if related(where)]
    for deleting in running:
        if deleting is not threading.current_thread():
            deleting.join()


def run_deferred() -> None:
    """Run the queued ``memory://`` work; call only where no store is being iterated."""
    while _DEFERRED:
        action = _DEFERRED.pop()
        try:
            action()
        except Exception:  # noqa: BLE001 - best effort, as the finalizer it stands for
            pass
