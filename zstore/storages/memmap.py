"""LazyMemmapStorage on Zarr: a persistent tensor storage at any URL (SPEC §2.7).

The first write creates a Zarr group at ``scratch_dir`` (a path or any fsspec
URL; a temporary local directory by default) with one array per key. Local,
uncompressed buffers are memory-mapped (TorchRL's speed, Zarr's format); every
other store reads through the hot-chunk cache. Committed metadata (length,
cursor) is written after the data, so :func:`zstore.open` in another process
sees exactly the committed rows.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future
from multiprocessing.context import get_spawning_popen
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Mapping

import torch
from tensordict import LazyStackedTensorDict, is_tensor_collection, is_tensorclass

from .. import autocommit
from ..cache import DEFAULT_CACHE_BYTES, CacheStats, byte_budget, cache_tier
from ..codecs import checked_rows_per, choose_layout, is_remote, parse_codecs
from ..errors import (LeaseError, MissingKeyError, SchemaError, StoreExistsError,
                      ZStoreError, sealed_dataset)
from ..display import KeyRow, Summary, dtype_name, text_dtype
from ..group import (carrying_nodes, commit, create_group, existing_buffer, nodes_metadata,
                     open_group)
from ..format_version import refuse_newer_fields
from ..layout import Schema, StoreMeta, ragged_keys, refuse_keys_of_a_new_buffer
from ..lease import DEFAULT_TTL, LEASE_NAME
from ..processes import runs_here
from ..sharing import count_rows, dirty_at, stamp_dirty
from ..signals import shielded
from ..store import StoreSpec, run_deferred
from ..text import TEXT_BYTES, widest
from ..table import ChunkedTable, MmapTable, Table
from .base import ClosedByWith, CompressionRatio, sizes_listed, stored_bytes_under, unlisted_sizes_fact
from .checkpoint_contract import TensorExport
from .leasing import LeasedWriter
from .sealing import seal_storage
from .lifecycle import shared_temporary_store, temporary_store, track, untrack
from .row_index import (as_index_tensor, broadcast_tensor_index, is_int, is_key, is_negative,
                        rows_of)
from .stored_rows import StoredRows
from .tensor import LazyTensorStorage, TensorStorage, map_leaves, non_text_keys

_monotonic = time.monotonic  # the commit clock's due-check in set()


class LazyMemmapStorage(autocommit.CommitClock, LeasedWriter, ClosedByWith, CompressionRatio,
                        LazyTensorStorage):
    """A tensor storage on a Zarr store at any URL, created at the first write.

    Args:
        max_size: capacity in cells.
        scratch_dir: where the buffer lives: a local path or any fsspec URL
            (``memory://rb``, ``s3://bucket/rb`` ...). ``None``: a temporary
            local directory, deleted at exit.
        device: where samples are returned; ``None``: where the cache tier returns them
            (the CPU, or the current GPU with ``cache="cuda"``). A CUDA device needs
            ``cache="cuda"``; any other device is refused, naming the fix.
        ndim: cell dims (``2`` for ``[time, env]`` data).
        existsok: adopt a buffer already at ``scratch_dir`` (its rows, length,
            cursor, codecs and layout) instead of refusing it: when the storage is built,
            so a writer continues after its rows; one of another capacity is refused at
            the first write.
        auto_cleanup: delete the store at exit (default: only for temporary ones).
        storage_options: fsspec options (``endpoint_url``, ``key``, ``secret`` ...).
        codec: compression preset (``None``, ``"zstd"``, ``"lz4"``, ``"blosc-zstd"``), or a
            mapping ``{key path: preset, "default": preset}`` overriding it per key
            (e.g. ``{"default": "zstd", "next/reward": None}``). Compressed chunks
            carry a crc32c checksum (a corrupt one raises
            :class:`~zstore.CorruptChunkError`), and so do raw chunks on remote
            stores; ``"+nocrc"`` (``"zstd+nocrc"``, ``"raw+nocrc"``) stores none. Only
            all-raw local buffers are memory-mapped.
        chunks: rows per chunk, for every key or as ``{key path: rows}`` (default:
            one chunk for local raw buffers, so they are memory-mapped; else
            about 1 MiB of each key).
        shards: rows per shard object, likewise (default: about 32 MiB of each
            key on object stores, none elsewhere).
        cache_bytes: byte budget of the hot-chunk cache: bytes, or a size ("512MB", "4GiB").
        cache: cache tier, ``"host"``, ``"pinned"`` or ``"cuda"``.
        read_only: refuse every write.
        autocommit_seconds: rows are committed at most this long after they were
            written, whether or not another write comes (a background thread
            commits an idle buffer; see :mod:`zstore.autocommit`). ``flush()`` and
            ``close()`` commit at once, and so do interpreter exit and SIGTERM. A
            killed writer loses at most the rows of its last ``autocommit_seconds``;
            ``math.inf`` commits only on those calls.
        tail_log: a commit stores the rows written since the last one into chunks or
            shards that are not complete yet as small log segments, instead of
            rewriting those objects whole (:mod:`zstore.tail`); ``close()`` and
            ``seal()`` store them whole, so that zarr alone reads every row again.
            Default: on for remote stores (S3, GCS ...), where rewriting costs uploads.
        lease_ttl: seconds the single-writer lease stays valid without renewal.
            The first write takes the store's lease (a second writer gets
            :class:`~zstore.errors.LeaseError`); commits renew it, ``close()``
            releases it, and a lease older than its ttl is taken over by the
            next writer (docs/scaling.md). ``None``: no lease (the caller
            guarantees a single writer).
        text_bytes: bytes of UTF-8 a string leaf (a tensorclass's ``str`` field, a
            ``set_non_tensor`` string) keeps per cell: its column is ``uint8`` of that
            width, set at the first write (wider if that write holds a longer string); a
            longer string later raises :class:`~zstore.SchemaError` (:mod:`zstore.text`).

    >>> s = LazyMemmapStorage(100, scratch_dir="memory://doc-rb")
    >>> s.set(torch.arange(4), TensorDict(obs=torch.arange(4.0), batch_size=[4]))
    >>> s.flush(); zstore.open("memory://doc-rb").get(3)["obs"].item()
    3.0
    """

    #: whether a container (a ``CompressedListStorage``) keeps its items in this storage
    _inner_table = False

    def __init__(self, max_size: int, *, scratch_dir: Any = None, device: Any = None,
                 ndim: int = 1, existsok: bool = False, compilable: bool = False,
                 shared_init: bool = False, auto_cleanup: bool | None = None,
                 storage_options: Mapping[str, Any] | None = None, codec: Any = None,
                 chunks: int | Mapping[str, int] | None = None,
                 shards: int | Mapping[str, int] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host",
                 read_only: bool = False, autocommit_seconds: float = 5.0,
                 tail_log: bool | None = None, lease_ttl: float | None = DEFAULT_TTL,
                 text_bytes: int = TEXT_BYTES):
        tier = cache_tier(cache, device)
        super().__init__(max_size, device=tier.device, ndim=ndim, compilable=compilable,
                         shared_init=shared_init)
        chunks, shards = checked_rows_per("chunks", chunks), checked_rows_per("shards", shards)
        temporary = scratch_dir is None
        if temporary:
            scratch_dir = tempfile.mkdtemp(prefix="zstore_")
        self.spec = StoreSpec.parse(scratch_dir, storage_options, read_only)
        self.scratch_dir = self.spec.url
        self.existsok = existsok
        self.codec, self.key_codecs = parse_codecs(codec, remote=is_remote(self.spec))
        self.chunks = chunks
        self.shards = shards
        self.cache_bytes = byte_budget(cache_bytes)
        self.cache = tier.name
        self.autocommit_seconds = autocommit_seconds
        self.tail_log = self.spec.is_remote if tail_log is None else bool(tail_log)
        self.lease_ttl = lease_ttl
        self.text_bytes = int(text_bytes)
        self.auto_cleanup = temporary if auto_cleanup is None else auto_cleanup
        if shared_init and not (self.spec.is_local and self._all_raw and chunks is None
                                and cache == "host"):
            raise ValueError(
                f"shared_init=True needs a local, uncompressed store, which every process "
                f"memory-maps; {self.spec.redacted()} (codec {codec!r}, chunks {chunks!r}, "
                f"cache {cache!r}) is not one. Give each writer process its own storage and read "
                "them together as a zstore.StorageEnsemble, or write through one zstore.ray actor "
                "(docs/scaling.md)")
        self._setup_runtime()
        if existsok and not temporary:
            self._adopt_existing()

    def _adopt_existing(self) -> None:
        """``existsok``: a buffer of this class, capacity and ndim already at the URL is
        attached now, as :func:`zstore.open` attaches it, so its length, rows and cursor
        are there before the first write and a writer continues after them. Adopted only
        at the first write (as anything else still is: no buffer, another capacity, a
        store zstore cannot open, which that write creates or refuses, naming why), a
        writer started at row 0, over the stored rows."""
        try:
            found = existing_buffer(self.spec)
        except ZStoreError:
            return
        if found is None:
            return
        meta = found[1]
        if (meta.storage_class, meta.max_size, meta.ndim) != \
                (LazyMemmapStorage.__name__, self.max_size, self.ndim) or meta.read_only:
            return
        self._attach_stored(*found)

    def _setup_runtime(self) -> None:
        run_deferred()  # memory:// stores of collected storages: a safe point to delete them
        self._table: Table | None = None
        self._group = None
        self._meta: StoreMeta | None = None
        self._pid = os.getpid()
        self._start_clock()
        self._committed = (0, -1)  # (length, last cursor) as last committed or opened
        self._committed_here = False  # whether this process committed (close then publishes)
        self._nodes_tried = False  # whether this attachment fetched the nodes' metadata
        self._cleaned = False
        self._closed = False  # close() ended it: reads and writes raise (reopen the store)
        self._finalizer = temporary_store(self.spec) if self.auto_cleanup else None
        self._open_lease(self.spec, self.lease_ttl)
        # the lease that fences the table's chunk stores: this storage's own, or the lease of
        # the container it is part of (CompressedListStorage's inner tables take none)
        self._store_lease = self._lease
        track(self)

    # -- opening --------------------------------------------------------------------------
    @classmethod
    def _from_store(cls, spec: StoreSpec, group, meta: StoreMeta, *, cache_bytes: int,
                    cache: str, device: Any = None, autocommit_seconds: float = 5.0,
                    lease_ttl: float | None = DEFAULT_TTL, store_lease: Any = None,
                    tail_log: bool | None = None):
        """Reopen a committed buffer (used by :func:`zstore.open`); ``store_lease``: see
        :meth:`_with_store_lease`."""
        self = cls.__new__(cls)
        tier = cache_tier(cache, device)
        TensorStorage.__init__(self, None, meta.max_size, device=tier.device, ndim=meta.ndim)
        self.consolidated = False
        self.spec = spec
        self.scratch_dir = spec.url
        self.existsok = True
        self.codec, self.key_codecs = meta.codec, dict(meta.key_codecs)
        self.chunks = {path: chunk for path, (chunk, _) in meta.layout.items()}
        self.shards = {path: shard or chunk for path, (chunk, shard) in meta.layout.items()}
        self.cache_bytes = byte_budget(cache_bytes)
        self.cache = tier.name
        self.autocommit_seconds = autocommit_seconds
        self.tail_log = spec.is_remote if tail_log is None else bool(tail_log)
        self.lease_ttl = lease_ttl
        self.text_bytes = TEXT_BYTES
        self.auto_cleanup = False
        self._setup_runtime()
        if store_lease is not None:
            self._store_lease = store_lease
        self._attach(group, meta)
        return self

    def _forget_uncommitted(self) -> None:
        """In a forked child (:mod:`.lifecycle`): fall back to what the parent last committed,
        unless the counters are shared (:mod:`.sharing`): then the child writes with the group."""
        if not self._counts.shared:
            self._len_value, self._last_cursor_value = self._committed
        self._uncommitted = False
        # the parent's lock, maybe held at the fork by a thread that is not here (its
        # background commit, a writer thread): the child's first read waited for good (the
        # table, and its locks, the child's first use of it rebuilds: ``table``)
        self._commit_lock = threading.RLock()

    def _with_store_lease(self, lease: Any) -> "LazyMemmapStorage":
        """Fence this storage's chunk stores with a container's lease (for a storage that
        takes none itself): each store renews it as it starts and is refused once the
        lease is lost or past its ttl. Only before the first write opens the table."""
        if self._table is not None:
            raise RuntimeError("a storage's store lease is set before its table is opened")
        self._store_lease = lease
        self._inner_table = True
        return self

    def _attach(self, group, meta: StoreMeta) -> None:
        """Bind to an opened group: restore counters (unless they are shared with the
        processes writing it, :mod:`.sharing`, which know better) and open the table."""
        if not (self.spec.read_only or meta.read_only):
            refuse_newer_fields(meta.unknown, self.spec.redacted())
        self._group = group
        self._nodes_tried = False
        self._meta = meta
        self._schema = meta.schema
        self.max_size = meta.max_size
        if not self._counts.shared:
            self._len_value = meta.length
            self._last_cursor_value = meta.last_cursor
        self._committed = (meta.length, meta.last_cursor)
        self.initialized = True
        if meta.read_only and not self.spec.read_only:  # a sealed dataset: refuse writes up front
            self.spec = self.spec.as_read_only(sealed=True)
        read_only = self.spec.read_only
        if MmapTable.supported(self.spec.is_local, meta.all_raw, meta.rows, meta.layout) \
                and self.cache == "host":
            self._table = MmapTable(self.spec.url, group, meta.schema.leaves, meta.rows,
                                    meta.high_water, read_only=read_only)
        else:
            self._table = ChunkedTable(group, meta.schema.leaves, meta.rows, meta.layout,
                                       meta.high_water, read_only=read_only,
                                       cache_bytes=self.cache_bytes, cache_tier=self.cache,
                                       where=self.spec.redacted(),
                                       lease=self._store_lease, tail=meta.tail,
                                       tail_log=self.tail_log, all_stored=meta.all_chunks_stored)

    @property
    def table(self) -> Table:
        """The column set (reopened transparently after a fork)."""
        if self._pid != os.getpid():
            # a forked child (counters already reset by _forget_uncommitted): the
            # parent's cache and file handles are not ours; reopen what is committed
            self._pid = os.getpid()
            self._attach(*open_group(self.spec))
        if self._table is None:
            raise self._closed_error()
        return self._table

    def _closed_error(self) -> RuntimeError:
        if self._cleaned:
            return RuntimeError(f"this storage of {self.spec.redacted()} was deleted by "
                                "cleanup(); build a new storage to write there again")
        return RuntimeError(f"this storage of {self.spec.redacted()} was closed; reopen it "
                            "with zstore.open(url)")

    # -- the single-writer lease (storages/leasing.py) -------------------------------------
    def _hold_lease(self) -> bool:
        if self._closed:  # every write takes the lease first: none after close()
            raise self._closed_error()
        return super()._hold_lease()

    def _refuses_writes(self) -> bool:
        return self._meta is not None and self._meta.read_only

    def _has_commit(self) -> bool:
        return self._meta is not None

    def _reload_committed(self) -> None:
        self._attach(*open_group(self.spec))

    def _fence(self) -> None:
        """Rewrite ``zarr.json`` naming this writer: a former holder's commit now fails."""
        if self._lease is not None and not self._meta.read_only:
            commit(self._group, self._meta, self._lease)

    def _hold_lease_in_group(self) -> None:
        """``_hold_lease`` of a storage whose store processes share (:mod:`zstore.sharing`),
        put in its place by :meth:`_use_shared_counters`: a process writes its rows into the
        shared maps without the lease, and the group's commits are made by whichever process
        holds it (:meth:`_flush`). The store is created under the lease (``shared_init``: by
        the first process to write)."""
        if self._meta is None or self._lease is None or self._lease.held:
            LeasedWriter._hold_lease(self)
            if self._lease is not None and self._lease.held:
                self._counts.holder = os.getpid()
            return
        holder = self._gone_holder()
        if holder:
            raise LeaseError(
                f"{self.spec.redacted()}: the process that held this store's lease for the "
                f"processes writing it together (pid {holder}) has exited, so rows written "
                "here would never be committed, and another writer may own the store now: "
                "stop this process; a new run resumes the store with zstore.open(url)")

    def _gone_holder(self) -> int:
        """The pid of the process that held the lease for the processes sharing the store
        and has exited without releasing it (0 if none did)."""
        holder = self._counts.holder
        return holder if holder and not runs_here(holder) else 0

    def _release_lease(self) -> None:
        """As :meth:`LeasedWriter._release_lease`; the processes sharing the store learn
        that the lease is free (one of them takes it to commit)."""
        counts = self._counts
        if counts.shared and counts.holder == os.getpid():
            counts.holder = 0
        super()._release_lease()

    def _hold_lease_handed(self) -> None:
        """``_hold_lease`` of a storage a writer handed to this process where processes
        cannot share its rows (put in its place by ``__setstate__``): a refusal says why."""
        try:
            LeasedWriter._hold_lease(self)
        except LeaseError as exc:
            raise LeaseError(
                f"{exc} This storage was handed to this process by the process writing it: "
                "processes write one buffer together only on a local, uncompressed store, which "
                f"they all memory-map; {self.spec.redacted()} is read here as committed. Give "
                "each writer process its own storage under one URL prefix and read them as a "
                "zstore.StorageEnsemble, or write through one zstore.ray actor "
                "(docs/scaling.md)") from None

    def _take_free_lease(self) -> bool:
        """A process sharing the store commits only as its lease holder: whether it holds the
        lease now, taking it if no process does. What is committed is read from the shared
        counters, not reloaded from the store."""
        if self._lease is None or self._lease.held:
            return True
        if self._gone_holder():
            return False  # the group's holder is gone: its rows are no longer the group's
        try:
            if self._lease.ensure():
                self._lease.read_metadata()  # the version this commit replaces
        except LeaseError:
            return False  # another process of the group holds it: it commits the rows
        self._counts.holder = os.getpid()
        return True

    def _create_shared_rows(self, example: Any, text_bytes: int) -> None:
        """``shared_init``: the first process to write creates the store (and holds its lease)."""
        self._allocate(example, text_bytes)  # committed as created: the others open it

    def _open_shared_rows(self, example: Any) -> None:
        """``shared_init``: another process created the store; map it here, without the lease."""
        self._attach(*open_group(self.spec))

    def _allocate(self, example: Any, text_bytes: int = 0) -> None:
        self.spec.require_writable("create a buffer")
        self._refuse_non_tensors(example)
        self._refuse_taken(existing_buffer(self.spec))  # before the lease: a refusal writes
        held = self._lease is not None and self._lease.active  # nothing there (a sealed dataset)
        self._hold_lease()
        try:
            self._create(example, text_bytes)
        except BaseException:
            if not held:  # a refused creation leaves no lease object among others' files
                self._release_lease()
            raise

    def _create(self, example: Any, text_bytes: int) -> None:
        """:meth:`_allocate`'s work once the lease is held: adopt the buffer another
        creation made first, or create the group for ``example``'s schema."""
        schema = Schema.from_example(example, self.ndim, max(self.text_bytes, text_bytes))
        if is_tensorclass(example):
            schema.tensorclass = type(example)
        refuse_keys_of_a_new_buffer(  # (a container's inner table is never sealed)
            [leaf.path for leaf in schema.leaves] + list(schema.empty),
            sealable=not self._inner_table, remote=self.spec.is_remote)
        found = existing_buffer(self.spec)  # (again: another creation may have come first)
        if found is not None:
            self._refuse_taken(found)
            self._adopt(schema)
            return
        for name, given in (("chunks", self.chunks), ("shards", self.shards),
                            ("codec", self.key_codecs)):
            unknown = sorted(set(given) - set(schema.by_path)) if isinstance(given, Mapping) else []
            if unknown:
                raise MissingKeyError(f"{name} names key(s) {unknown} the data does not have "
                                      f"(keys: {sorted(schema.by_path)})")
        rows = self._rows_for(example)
        layout = choose_layout(schema.leaves, rows, chunks=self.chunks, shards=self.shards,
                               mmap=self.spec.is_local and self._all_raw,
                               object_store=self.spec.is_object_store)
        meta = StoreMeta(type(self).__name__, self.max_size, self.ndim, rows, schema, self.codec,
                         layout, key_codecs=dict(self.key_codecs))
        if problems := meta.problems():  # (a store no reader would open: refused unwritten)
            raise ValueError(
                f"{self.spec.redacted()}: cannot create a buffer of capacity {self.max_size} "
                f"for these rows: {'; '.join(problems)}; nothing was written. Choose a smaller "
                f"capacity (a key holds at most 2**48 elements, docs/format.md)")
        with shielded():  # a Ctrl-C waits until this storage knows the group it created
            self._attach(create_group(self.spec, meta, self._lease), meta)

    def _refuse_non_tensors(self, data: Any) -> None:
        """A non-tensor value other than strings (an object...) cannot be stored (it would
        have to be pickled), nor a lazy stack of TensorDicts of different shapes into a
        buffer whose items are no such stacks (a column has one shape): refuse the write."""
        ragged = ragged_keys(data) if self._meta is not None and self._meta.schema.stack is None \
            else []  # a first write decides: items that are lazy stacks are stored as such
        if ragged:
            raise self._ragged_error(ragged)
        keys = non_text_keys(data)
        if keys:
            raise SchemaError(
                f"key(s) {keys} of this {type(data).__name__} hold non-tensor values other than "
                f"strings, which {type(self).__name__} cannot store in {self.spec.redacted()} "
                "(nothing is pickled): nothing was written. Store them as tensors (e.g. an index "
                "into a vocabulary), or use LazyTensorStorage (in RAM), which keeps them as "
                "TorchRL does")

    def _ragged_error(self, ragged: list[str]) -> SchemaError:
        """The refusal of a lazy stack whose keys ``ragged`` differ between its members."""
        return SchemaError(
            f"key(s) {ragged} of this lazy stack differ in shape (or exist in some stacked "
            f"TensorDicts only): {type(self).__name__} keeps one shape per key, so "
            f"{self.spec.redacted()} cannot store it: nothing was written. Use "
            "LazyTensorStorage (in RAM), which keeps the lazy stack as TorchRL does, pad "
            "the items to one shape, or give each stacked TensorDict a storage of its own")

    def _refuse_ragged_rows(self, cursor: Any, data: Any) -> None:
        """Refuse a batch stacked lazily along its rows whose rows differ in shape before the
        first write makes the store from its first row (which the write then would not fit)."""
        if not is_int(cursor) and isinstance(data, LazyStackedTensorDict) \
                and data.stack_dim == 0 and ragged_keys(data):
            raise self._ragged_error(ragged_keys(data))

    @property
    def _all_raw(self) -> bool:
        return self.codec.is_raw and all(spec.is_raw for spec in self.key_codecs.values())

    def _refuse_taken(self, found: tuple[Any, StoreMeta] | None) -> None:
        """Refuse creating a buffer where ``found`` (:func:`existing_buffer`) is one this
        storage may not adopt: any without ``existsok``, a sealed dataset at all."""
        if found is None:
            return
        stored, where = found[1], self.spec.redacted()
        if self.existsok and stored.sealed:
            raise sealed_dataset("write", where)
        if not self.existsok:
            raise StoreExistsError(
                f"The file {where} already exists: it holds a "
                + (f"sealed dataset, which no storage writes. Read it with zstore.open_dataset(url),"
                   f" or copy it with `zstore convert {where} DST --no-seal` to write the copy."
                   if stored.sealed else
                   f"zstore buffer ({stored.storage_class}, {stored.length} cells). Pass "
                   "existsok=True to adopt it, or reopen it with zstore.open(url)."))

    def _adopt(self, schema: Schema) -> None:
        if self._lease is not None:
            self._lease.read_metadata()
        group, meta = open_group(self.spec)
        if meta.max_size != self.max_size:
            raise SchemaError(
                f"cannot adopt {self.spec.redacted()}: it holds a buffer of {meta.max_size} "
                f"cells, this storage has max_size={self.max_size}: nothing was written. Pass "
                f"max_size={meta.max_size}, reopen it with zstore.open(url), or use another URL")
        if meta.ndim != self.ndim or meta.schema.lane_shape != schema.lane_shape:
            raise SchemaError(
                f"cannot adopt {self.spec.redacted()}: it was written with ndim={meta.ndim} "
                f"and lanes {list(meta.schema.lane_shape)}, this storage has ndim={self.ndim} "
                f"and the data lanes {list(schema.lane_shape)}")
        if meta.schema.leaves != schema.leaves or meta.schema.kind != schema.kind:
            raise SchemaError(
                f"cannot adopt {self.spec.redacted()}: its keys/dtypes/shapes "
                f"{[leaf.to_json() for leaf in meta.schema.leaves]} differ from the data's "
                f"{[leaf.to_json() for leaf in schema.leaves]}")
        meta.schema.tensorclass = schema.tensorclass
        self._attach_stored(group, meta)
        self._fence()

    def _attach_stored(self, group, meta: StoreMeta) -> None:
        """Attach an adopted buffer: its codecs and layout are what its rows are written with."""
        self.codec, self.key_codecs = meta.codec, dict(meta.key_codecs)
        self._attach(group, meta)

    def dumps(self, path: Any) -> Any:
        """Checkpoint to ``path`` and return the checkpointer's
        :class:`checkpoint.DumpResult`; onto this storage's own store it is a ``flush()``
        (a commit, not a checkpoint: returns ``None``)."""
        if StoreSpec.parse(path, self.spec.storage_options).url == self.spec.url:
            self.flush()
            return None
        return super().dumps(path)

    save = dump = dumps

    def loads(self, path: Any) -> None:
        """Adopt the buffer at ``path`` when it is this storage's own store; else use the checkpointer."""
        target = StoreSpec.parse(path, self.spec.storage_options)
        if target.url == self.spec.url:
            if not self.initialized:
                group, meta = open_group(self.spec)
                self._attach(group, meta)
            self._bump_mutation_revision()
            return
        super().loads(path)

    load = loads

    # -- package-internal: the checkpoint contract (checkpoint_contract.py) ---------------
    def checkpoint_export(self) -> TensorExport:
        """The rows and counters a dump reads: the table's columns, read on demand."""
        table = self.table
        return TensorExport(self._schema, self._meta.rows, self._last_cursor_value,
                            max(table.high_water, 0),
                            lambda lo, hi: table.read(torch.arange(lo, hi)),
                            in_place=self._maps_writable)

    def checkpoint_restored(self, length: int, last_cursor: int, loaded: int) -> None:
        """As :meth:`TensorStorage.checkpoint_restored`, then committed."""
        super().checkpoint_restored(length, last_cursor, loaded)
        self.flush()

    @property
    def checkpoint_meta(self) -> StoreMeta | None:
        """The committed :class:`~zstore.layout.StoreMeta`; ``None`` before the arrays exist."""
        return self._meta

    # -- the hooks ------------------------------------------------------------------------
    def _container_shape(self) -> tuple[int, ...]:
        return (self._meta.rows, *self._schema.lane_shape)

    @property
    def _maps_writable(self) -> bool:
        """Whether a slice is read as views of the chunk files, as TorchRL's memmap does: a
        writable memory-mapped buffer whose writer holds the lease (or takes none), or that
        processes share (:mod:`.sharing`), so that in-place writes into the views are this
        writer's. Elsewhere every read is a copy."""
        table = self.table
        return (isinstance(table, MmapTable) and not table.read_only
                and (self._holds_lease or self._counts.shared))

    @property
    def _storage(self) -> Any:
        """The whole buffer (every row), as TorchRL's ``storage._storage``: views of the
        chunk files where slices are views (:attr:`_maps_writable`), else a
        :class:`StoredRows` that reads only what it is indexed by. ``None`` before the
        first write."""
        if not self.initialized:
            return None
        if self._table is not None and self._maps_writable:
            rows = self._meta.rows
            return self._build(self.table.views(slice(0, rows)), (rows,), self._schema.lane_shape)
        return StoredRows(self)

    @_storage.setter
    def _storage(self, value: Any) -> None:
        if value is not None:  # TensorStorage.__init__ sets None: the rows live in the store
            raise AttributeError(
                f"the rows of a {type(self).__name__} live in its store and cannot be replaced; "
                "write them with storage.set(index, data, set_cursor=False)")

    def _read(self, index: Any) -> Any:
        if is_key(index):  # as TorchRL's reads it: that key of every row written
            return self._read(slice(None))[index]
        n = self._len_along_dim0
        if isinstance(index, slice) and self._maps_writable:
            start, stop, step = index.indices(n)
            if step > 0:
                return self._build(self.table.views(slice(start, stop, step)),
                                   (len(range(start, stop, step)),), self._schema.lane_shape)
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.ndim > 1:
            index = index.nonzero(as_tuple=True)  # a [rows, *lanes] mask selects cells
        if isinstance(index, tuple):
            index = tuple(as_index_tensor(i) for i in index)
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if rest and len(rest) == self.ndim - 1:  # row and lane tensors pair up, broadcast as torch's
            first, rest = broadcast_tensor_index(first, rest)
        try:
            rows, lead, squeeze = rows_of(first, n)
        except IndexError as exc:  # torch's words, and the store's
            raise IndexError(f"{exc} (reading {self.spec.redacted()})") from None
        if lead is None:
            lead = (len(rows),)
        lanes = self._schema.lane_shape
        table = self.table
        if (rest and len(rest) == self.ndim - 1 and not squeeze and isinstance(first, torch.Tensor)
                and all(isinstance(r, torch.Tensor) and r.shape == lead for r in rest)):
            stacked = torch.stack([r.reshape(-1).to("cpu", torch.int64) for r in rest])
            for dim, (r, size) in enumerate(zip(stacked, lanes)):
                if r.numel() and (int(r.max()) >= size or int(r.min()) < -size):
                    raise IndexError(f"index {int(r.max())} is out of bounds for dimension "
                                     f"{dim + 1} with size {size}")
            stacked = torch.remainder(stacked, torch.tensor(lanes).unsqueeze(1))
            columns = table.read(rows, stacked)
            return self._build(columns, lead, ())
        columns = table.read(rows)
        if squeeze:
            out = self._build({p: c[0] for p, c in columns.items()}, (), lanes)
        else:
            out = self._build(columns, lead, lanes)
        if rest:  # a pytree is indexed leaf by leaf (its dicts take no slices)
            sel = (slice(None),) * (0 if squeeze else len(lead)) + tuple(rest)
            out = map_leaves(out, lambda x: x[sel])
        return out

    def _build(self, columns: dict[str, torch.Tensor], lead: tuple[int, ...],
               lanes: tuple[int, ...]) -> Any:
        if len(lead) > 1:
            columns = {p: c.reshape(*lead, *c.shape[1:]) for p, c in columns.items()}
        return self._schema.build(columns, (*lead, *lanes), self.device)

    def _index_dims(self) -> int | None:
        schema = self._schema if self.initialized else None
        if schema is None or schema.kind == "pytree" and len({len(leaf.shape)
                                                               for leaf in schema.leaves}) > 1:
            return None  # (nothing stored; or leaves of other dims, each indexed as it is)
        if schema.kind == "tensor" or schema.kind == "pytree":
            return 1 + len(schema.leaves[0].shape)
        return 1 + len(schema.lane_shape) + len(schema.item_batch)

    def _set_last_cursor(self, cursor: Any) -> None:
        super()._set_last_cursor(cursor)
        if self._last_cursor_value < -1 or (self._last_cursor_value == -1 and is_negative(cursor)
                                            and not isinstance(cursor, slice)):
            self._last_cursor_value %= self._meta.rows  # a negative index counts from the end
            # (a slice's is resolved already: -1 means it was empty)

    def get(self, index: Any) -> Any:
        with self._commit_lock:  # a background commit and a read do not share the table
            if self._cleaned:  # not "non-initialized": say what ended it
                raise self._closed_error()
            return super().get(index)

    def _write(self, cursor: Any, data: Any) -> None:
        """The write of ``TensorStorage.set`` (whose lock :meth:`set` holds: this re-enters
        it) and of callers that hold none (``load_state_dict``, conditional patches)."""
        with self._commit_lock:
            self._write_locked(cursor, data)

    def _write_locked(self, cursor: Any, data: Any) -> None:
        self.spec.require_writable("write")
        self._hold_lease()
        table = self.table
        if isinstance(cursor, tuple):
            self._write_cells(cursor, data)
            return
        if is_int(cursor):  # add(): the hot path, no tensor round trip
            row = int(cursor)
            if not -self._meta.rows <= row < self._meta.rows:
                raise IndexError(f"index {row} is out of bounds for dimension 0 with size "
                                 f"{self._meta.rows}")
            table.write_row(row % self._meta.rows, self._columns(row, (), data, 0))
            self._claim_writes()
            self._mark_dirty()
            return
        if not isinstance(cursor, (slice, range)):
            probe = cursor if isinstance(cursor, torch.Tensor) else torch.as_tensor(cursor)
            if probe.dtype == torch.bool and probe.ndim > 1:  # a [rows, *lanes] mask: cells
                self._write_cells(probe.nonzero(as_tuple=True), data)
                return
        rows, shape, _ = rows_of(cursor, self._meta.rows)
        if rows.numel() == 0:
            return
        self._refuse_non_tensors(data)
        lead = 1 if shape is None else len(shape)
        columns = self._columns(rows, shape, data, lead)
        if lead != 1:
            columns = {p: c.reshape(-1, *c.shape[lead:]) for p, c in columns.items()}
        if next(iter(columns.values())).shape[0] != len(rows):
            raise SchemaError(f"{len(rows)} rows addressed but data holds "
                              f"{next(iter(columns.values())).shape[0]}")
        table.write(rows, columns)
        self._claim_writes()
        self._mark_dirty()

    def _columns(self, rows: torch.Tensor | int, shape: tuple[int, ...] | None, data: Any,
                 lead: int) -> dict[str, torch.Tensor]:
        """The columns of ``data`` to write at ``rows`` (the rows the cursor names, of the
        cursor's ``shape``; ``None`` for a slice). A refusal names the store: its keys,
        dtypes and shapes were fixed by its first write, maybe by an earlier run."""
        try:
            return self._kept_columns(rows, shape, data, lead)
        except (SchemaError, MissingKeyError) as exc:
            raise type(exc)(f"{self.spec.redacted()}: {exc}") from None

    def _kept_columns(self, rows: torch.Tensor | int, shape: tuple[int, ...] | None, data: Any,
                      lead: int) -> dict[str, torch.Tensor]:
        """:meth:`_columns`. A TensorDict lacking some of the buffer's keys keeps their
        stored values where every row was written before, as TorchRL's in-place update does
        (``rb[i] = td`` without the ``"index"`` key a ``TensorDictReplayBuffer`` adds); rows
        never written need every key."""
        try:
            return self._schema.columns(data, lead)
        except MissingKeyError as exc:
            if not exc.lacking:  # a key the buffer does not have
                raise
            rows = torch.as_tensor(rows) % self._meta.rows
            unwritten = rows[rows >= (self._len_along_dim0 or 0)]
            if unwritten.numel():
                raise MissingKeyError(
                    f"{exc}: row(s) {unwritten.unique()[:5].tolist()} were never written, and "
                    "new rows need every key (rows already written keep the keys an update "
                    "leaves out)") from None
            # the kept values are those of the rows written: read by row, not by the cursor,
            # which a read resolves against the length (a negative index, a mask over every
            # row), not against the capacity as the write does
            current = self._read(rows.reshape(shape) if shape is not None else rows.reshape(-1))
            current = current._tensordict if is_tensorclass(current) else current
            current.update(data._tensordict if is_tensorclass(data) else data)
            return self._schema.columns(current, lead)

    def _write_cells(self, cursor: tuple, data: Any) -> None:
        """Write the cells a tuple index (rows, then lanes) names: their rows are read,
        updated as torch indexes (the block indexed as the storage would be) and written."""
        first = cursor[0]
        rows, lead, squeeze = rows_of(first, self._meta.rows)
        if isinstance(first, (slice, range)):  # distinct rows: the block's own, as a slice
            urows, local_index = rows, slice(None)  # (a tensor would pair with the lanes')
        else:
            urows = torch.unique(rows)
            local = torch.searchsorted(urows, rows)
            local_index = int(local[0]) if squeeze else local.reshape(lead if lead else (len(rows),))
        block = self._build(self.table.read(urows), (len(urows),), self._schema.lane_shape)
        block[(local_index, *cursor[1:])] = data
        self._write(urows, block)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        self.spec.require_writable("write")
        # add()'s row takes no other acquisition; _counts.lock is held only where processes
        # share the store (.sharing)
        with self._commit_lock, self._counts.lock:
            if type(cursor) is int and self.ndim == 1 and self.initialized \
                    and not isinstance(data, list):
                self._set_row(cursor, data, set_cursor)
            else:
                if not self.initialized:
                    self._refuse_ragged_rows(cursor, data)
                super().set(cursor, data, set_cursor=set_cursor)
            # CommitClock._commit_due, inlined: one comparison with a precomputed deadline
            if self._uncommitted and _monotonic() >= self._commit_deadline:
                self.flush()

    def _set_row(self, row: int, data: Any, set_cursor: bool) -> None:
        """``TensorStorage.set`` of one ``int`` row of an initialised 1-D buffer (add()'s
        hot path), the lock held: the same steps without the generic dispatch."""
        self._write_locked(row, data)
        self._mark_rows(row)
        counts = self._counts  # (its fields, not the properties: the hot path)
        if set_cursor:
            if row >= 0:  # _set_last_cursor of a row in bounds (_write_locked checked them)
                self._last_cursor = counts.last_cursor = row
                count_rows(counts, 1, row + 1, self.max_size)
            else:  # (a row counted from the end: as TensorStorage.set, it reaches nothing)
                self._set_last_cursor(row)
                count_rows(counts, 1, 0, self.max_size)
        counts.revision += 1  # _bump_mutation_revision

    def _committable(self) -> bool:
        return self._table is not None

    def flush(self) -> None:
        """Store every written row, then commit the length and cursor (one metadata write)."""
        with self._commit_lock:
            self._flush()

    def _flush(self, consolidate: bool = False) -> None:
        if not self.initialized or self.spec.read_only or self._table is None \
                or self._meta.read_only:
            return
        counts = self._counts
        with counts.lock:  # processes sharing the store (.sharing): no write while committing
            if counts.shared and not self._take_free_lease():
                self._mark_clean()  # the process holding the lease commits the group's rows
                return
            if self._lease is not None:
                if not self._has_uncommitted() and (not self._holds_lease
                                                    or self._lease.superseded):
                    return  # nothing of this storage's to commit (it may have lost the
                    # lease, or another storage of this process have written since)
                self._lease.renew()  # a writer that lost the lease stops before storing anything
            self.table.flush(consolidate)
            meta = self._meta
            meta.length = self._len_value
            meta.last_cursor = self._last_cursor_value if self._last_cursor_value < meta.rows else -1
            meta.high_water = max(self.table.high_water, counts.high_water)
            meta.tail = self.table.tail_record()
            self._carry_nodes()
            commit(self._group, meta, self._lease, self.spec.redacted())
            counts.dirty_since = 0
        self._committed_here = True
        self.table.committed()
        self._committed = (meta.length, meta.last_cursor)
        self._mark_clean()

    def _mark_group_dirty(self) -> None:
        """``_mark_dirty`` of a storage whose counters processes share (:mod:`zstore.sharing`),
        which :meth:`_use_shared_counters` puts in its place: it also tells the process that
        commits for the group."""
        counts = self._counts
        counts.high_water = max(counts.high_water, self._table.high_water)
        stamp_dirty(counts)
        autocommit.CommitClock._mark_dirty(self)

    def _use_shared_counters(self, counts: Any) -> None:
        """As :meth:`TensorStorage._use_shared_counters`; the write path then also tells the
        process that commits for the group."""
        super()._use_shared_counters(counts)
        if self._lease is not None and self._lease.held:  # the others watch that it runs
            counts.holder = os.getpid()
        # (instance attributes: the unshared write path keeps one call each)
        self._mark_dirty = self._mark_group_dirty
        self._hold_lease = self._hold_lease_in_group

    def _has_uncommitted(self) -> bool:
        return self._uncommitted or bool(self._counts.dirty_since)

    def _commit_due_at(self) -> float | None:
        """As :meth:`CommitClock._commit_due_at`, and, in the process that holds the lease of
        a store processes share, when the group's oldest uncommitted row is due, or, while
        the group writes nothing, when the lease is due for renewal (the others write
        without it; a stale lease would let another writer in). The background thread
        looks again at least every :data:`~zstore.autocommit.MAX_TICK`."""
        due = super()._commit_due_at()
        if not self._commits_for_a_group:
            return due
        stamp = dirty_at(self._counts)
        at = (time.monotonic() + max(0.0, self._lease.renewal_due_in()) if stamp is None
              else stamp + self.autocommit_seconds)
        return at if due is None else min(due, at)

    def _commit_if_idle(self) -> bool:
        """As :meth:`CommitClock._commit_if_idle`; for a group that wrote nothing since the
        last commit, the lease is renewed instead, once half its ttl is gone."""
        if not self._commits_for_a_group or self._has_uncommitted():
            return super()._commit_if_idle()
        if not self._commit_lock.acquire(blocking=False):
            return False
        try:
            self._lease.keep_alive()
        finally:
            self._commit_lock.release()
        return True

    @property
    def _commits_for_a_group(self) -> bool:
        """Whether this process holds the lease of a store processes share (:mod:`.sharing`)."""
        return (self._counts.shared and self._committable() and self._lease is not None
                and self._lease.held)

    def seal(self) -> int:
        """Publish this buffer as a read-only dataset; returns its number of episodes.

        Flushes, stores the episode index computed from the TED done flags,
        consolidates the metadata and commits ``sealed``/``read_only`` last.
        The storage is read-only afterwards; reopen it with
        :func:`zstore.open_dataset`. See :mod:`zstore.storages.sealing`.
        """
        return seal_storage(self)

    def close(self) -> None:
        """Flush and release the table; the storage can be reopened with :func:`zstore.open`.
        A writer that lost the store to another (:class:`LeaseError`) is closed all the same,
        its uncommitted rows dropped, and the error raised."""
        lost = None
        with self._commit_lock, self._counts.lock:  # the lease goes with the last commit
            if self._table is not None and not self._cleaned:
                try:  # a superseded writer's log segments are the new writer's to consolidate
                    if self._has_uncommitted() or (self._table.tail_record() and not (
                            self._lease is not None and self._lease.superseded)):
                        # closed, the store holds no log segments (format.md §6)
                        self._flush(consolidate=True)
                except LeaseError as exc:
                    lost = exc
                if lost is None and self._publishes_nodes_at_close:
                    self._publish_nodes()
                self._table.close()
            self._table = None
            self._closed = True
            self.initialized = False if self._meta is None else self.initialized
            self._release_lease()
        untrack(self)
        if lost is not None:
            raise lost

    def _commit_at_exit(self) -> None:
        """As :meth:`CommitClock._commit_at_exit`; a process of a group that shares the store
        (:mod:`zstore.sharing`) also gives the lease back, in the same step as its last
        commit (as :meth:`close` does). A process of the group that writes after it then
        finds the lease free and commits its rows itself: while the lease is held, it leaves
        them to the holder, which here commits no more."""
        if not self._counts.shared:
            self.flush()
            return
        with self._commit_lock, self._counts.lock:
            self._flush()
            self._release_lease()

    def _carry_nodes(self) -> None:
        """Make the commits of a remote writer carry a copy of its nodes' metadata
        (format.md §6), so that a reader of the buffer, live or closed, opens it with one
        request: fetched once per opening of the store (one round trip, at its first
        commit). When it cannot be read, the commits go without it, as before."""
        if self._nodes_tried or not self._publishes_nodes:
            return
        self._nodes_tried = True
        nodes = nodes_metadata(self._group, self._meta)
        if nodes is not None:
            self._group = carrying_nodes(self._group, nodes)

    def _publish_nodes(self) -> None:
        """The closing commit with the nodes' metadata, for a writer whose commits went
        without it (format.md §6). The rows are already committed: a failure here only costs
        readers a round trip, so it is reported and the close goes on (the lease is released,
        the table closed)."""
        self._nodes_tried = False
        self._carry_nodes()
        if self._group.metadata.consolidated_metadata is None:
            return
        try:
            with self._commit_lock:
                commit(self._group, self._meta, self._lease, self.spec.redacted())
        except (OSError, ZStoreError) as exc:
            warnings.warn(f"closing {self.spec.redacted()}: its rows are committed, but the copy "
                          f"of its arrays' metadata was not written ({type(exc).__name__}: {exc}); "
                          "readers open it in two round trips", RuntimeWarning, stacklevel=3)

    @property
    def _publishes_nodes(self) -> bool:
        """Whether this storage's commits carry its nodes' metadata: a writer of a remote
        store (a local or ``memory://`` open saves no round trip with it)."""
        return (not self.spec.read_only and self.spec.is_remote and self._meta is not None
                and not self._meta.read_only)

    @property
    def _publishes_nodes_at_close(self) -> bool:
        """Whether :meth:`close` commits once more, with the nodes' metadata: the commits of
        this writer, which still holds the store, went without it."""
        return (self._committed_here and self._publishes_nodes and self._holds_lease
                and self._group.metadata.consolidated_metadata is None)

    def _empty(self) -> None:
        self.spec.require_writable("empty the buffer")
        if self.initialized:
            self._hold_lease()
        super()._empty()
        if self.initialized:
            self.flush()

    def cleanup(self) -> bool:
        """Delete the store and everything in it; ``False`` if already done. Idempotent.
        The storage is then ended (TorchRL's is "no longer usable"): it holds no rows, and
        a read or write raises naming the way on (a new storage at the URL)."""
        if self._cleaned:
            return False
        self.spec.require_writable("delete the store")
        self._cleaned = self._closed = True
        self._len_value = 0
        self._release_lease()
        if self._table is not None:
            self._table.close()
            self._table = None
        untrack(self)
        if self._finalizer is not None:
            self._finalizer.detach()
        if not self.spec.exists():
            return False
        self.spec.delete()
        self.initialized = False
        return True

    @property
    def _auto_cleanup(self) -> bool:
        """TorchRL's name of :attr:`auto_cleanup`."""
        return self.auto_cleanup

    @property
    def _cleaned_up(self) -> bool:
        """TorchRL's name: whether :meth:`cleanup` has deleted the store."""
        return self._cleaned

    # -- introspection --------------------------------------------------------------------
    @property
    def cache_stats(self) -> CacheStats | None:
        """Hit / miss / byte counters of the hot-chunk cache (None for memory-mapped buffers)."""
        return self.table.cache_stats if self.initialized else None

    def prefetch(self, index: Any, background: bool = False):
        """Get rows ``index`` ready ahead of a read: their chunks are loaded into the cache,
        or, for a memory-mapped buffer, their pages are asked of the disk (``MADV_WILLNEED``).

        With ``background=True`` (e.g. the next batch's indices, drawn early)
        the load overlaps with the caller's work; a ``Future`` is returned.
        """
        future = None
        if self.initialized:
            rows, _, _ = rows_of(index, self._len_along_dim0)
            future = self.table.prefetch(rows, background=background)
        if background and future is None:  # nothing to load: the storage is empty
            future = Future()
            future.set_result(None)
        return future

    @property
    def nbytes(self) -> int:
        """Bytes the buffer occupies in its store (written rows are stored first)."""
        if not self.initialized:
            return 0
        if not (self.spec.read_only or self._meta.read_only):
            self.table.flush()
        return self.spec.stored_bytes(ignore=(LEASE_NAME,))

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the filled rows, uncompressed."""
        return self._len_along_dim0 * self._schema.row_bytes if self.initialized else 0

    def _container_for_state(self) -> Any:
        if not self.initialized:
            return None
        if self._schema.kind == "pytree":
            raise TypeError("Objects of type <class 'dict'> are not supported by "
                            "LazyTensorStorage.state_dict. If you are trying to serialize a PyTree, "
                            "the storage.dumps/loads is preferred.")
        columns = self.table.read(torch.arange(self._meta.rows))
        return self._build(columns, (self._meta.rows,), self._schema.lane_shape)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spec.require_writable("load a state dict")
        if self.initialized:
            self._hold_lease()
        saved = state_dict["_storage"]
        if isinstance(saved, torch.Tensor):
            data = saved
        elif isinstance(saved, dict) or is_tensor_collection(saved):
            from tensordict import TensorDict

            data = saved if is_tensor_collection(saved) else \
                TensorDict().load_state_dict(saved, strict=False)
        else:
            raise TypeError(f"Objects of type {type(saved)} are not supported by "
                            f"{type(self).__name__}.load_state_dict")
        if state_dict.get("initialized") and data is not None and len(data):
            if not self.initialized:
                self._init(data[0], widest(data))
            n = min(len(data), self._meta.rows)
            self._write(torch.arange(n), data[:n])
            self._mark_rows(slice(0, n))
        self._len_value = int(state_dict["_len"])
        self._bump_mutation_revision()
        if self.initialized:
            self.flush()

    # -- pickling: a spec, never live objects ---------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        self._refuse_sharing_uninitialized()
        if self._uncommitted:
            self.flush()
        shared = {}
        if get_spawning_popen() is not None:
            shared = self._spawn_state()
        return {**shared,
            "spec": self.spec.to_json(), "max_size": self.max_size, "ndim": self.ndim,
            "device": str(self.device), "existsok": self.existsok, "codec": self.codec.to_json(),
            "key_codecs": {path: spec.to_json() for path, spec in self.key_codecs.items()},
            "chunks": self.chunks, "shards": self.shards, "cache_bytes": self.cache_bytes,
            "cache": self.cache, "autocommit_seconds": self.autocommit_seconds,
            "lease_ttl": self.lease_ttl, "tail_log": self.tail_log,
            "text_bytes": self.text_bytes, "initialized": self.initialized, "len": self._len_value,
            "last_cursor": self._last_cursor_value, "revision": self._revision,
            "pid": os.getpid(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        spec = StoreSpec.from_json(state["spec"])
        if spec.is_memory and state.get("pid", os.getpid()) != os.getpid():
            raise RuntimeError(  # its copy would write a store of its own, lost to the other
                f"Cannot unpickle the {type(self).__name__} at {spec.redacted()} in another "
                f"process (it was pickled in process {state['pid']}; a Ray actor or task, say): "
                "memory:// stores live inside one process. Put the buffer on a local path or "
                "in a bucket")
        if state["initialized"]:
            group, meta = open_group(spec)
            other = type(self)._from_store(spec, group, meta, cache_bytes=state["cache_bytes"],
                                           cache=state["cache"], device=state["device"],
                                           autocommit_seconds=state["autocommit_seconds"],
                                           lease_ttl=state.get("lease_ttl", DEFAULT_TTL),
                                           tail_log=state.get("tail_log"))
        else:
            other = type(self)(state["max_size"], scratch_dir=spec.url,
                               storage_options=spec.storage_options, device=state["device"],
                               ndim=state["ndim"], existsok=state["existsok"],
                               codec={"default": state["codec"], **state.get("key_codecs", {})},
                               chunks=state["chunks"], shards=state["shards"],
                               cache_bytes=state["cache_bytes"], cache=state["cache"],
                               read_only=spec.read_only, auto_cleanup=False,
                               autocommit_seconds=state["autocommit_seconds"],
                               tail_log=state.get("tail_log"),
                               lease_ttl=state.get("lease_ttl", DEFAULT_TTL),
                               text_bytes=state.get("text_bytes", TEXT_BYTES))
        self.__dict__.update(other.__dict__)
        # (a copy of a temporary store, here, keeps it until the last of them is collected)
        self._finalizer = shared_temporary_store(spec)
        if other._lease_finalizer is not None:
            other._lease_finalizer.detach()
            self._lease_finalizer = weakref.finalize(self, self._lease.release_later)
        self.auto_cleanup = False
        if state.get("handed_by_writer"):
            self._hold_lease = self._hold_lease_handed
        if "counts" in state:  # shared with the process that pickled it (.sharing)
            self._use_shared_counters(state["counts"])
            self._rendezvous = state["rendezvous"]
            if state.get("row_rev") is not None:
                self._row_rev, self._revisions_shared = state["row_rev"], True
        else:
            self._len_value = state["len"]
            self._last_cursor_value = state["last_cursor"]
            self._revision = state["revision"]
        track(self)
        untrack(other)

    def _spawn_state(self) -> dict[str, Any]:
        """What a process that multiprocessing starts is handed besides the spec: the shared
        counters where processes can share the rows; else whether its writer handed it."""
        if self.spec.is_memory:
            raise RuntimeError(
                f"Cannot share a {type(self).__name__} at {self.spec.redacted()} with another "
                "process: memory:// stores live inside one process. Put the buffer on a local "
                "path (processes then write it together) or in a bucket (they read it)")
        if self._shares_rows:
            self._share_with_processes()
            return {"counts": self._counts, "rendezvous": self._rendezvous,
                    "row_rev": self._row_rev if self._revisions_shared else None}
        return {"handed_by_writer": self._lease is not None and self._lease.held}

    @property
    def _shares_rows(self) -> bool:
        """Whether processes can share this storage's rows: a ``shared_init`` storage, or a
        writable one whose chunk files are memory-mapped (elsewhere a process that unpickles
        it opens the store on its own, as a reader: a write there needs the lease)."""
        if not self.initialized:
            return self._rendezvous is not None
        return isinstance(self._table, MmapTable) and not self._table.read_only

    def _share_with_processes(self) -> None:
        """Pickled for a process that multiprocessing starts: the counters move into shared
        memory (:mod:`.sharing`), and the lease holder watches them for rows to commit."""
        if self.initialized and not self._counts.shared:
            self._hold_lease()  # the group writes as this writer: LeaseError if another is
        TensorStorage._share_with_processes(self)
        if self._lease is not None and self._lease.held:
            autocommit.schedule(self)

    # -- display ------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Fill, cursor, store URL (redacted), cache, and per key: shape, dtype, codec, bytes.

        Stored bytes are listed only on local and ``memory://`` stores: sizing an
        object store means listing it (``nbytes`` does that on request).
        """
        found = dataclasses.replace(super().summary(), spec=self.spec)
        if self._cleaned:  # (no rows: the base summary, which says nothing of it)
            found = dataclasses.replace(found, facts=(*found.facts, (
                "state", "deleted by cleanup() (build a new storage to write there again)")))
        return found

    def _summary_details(self, base: Summary) -> dict[str, Any]:
        listed = sizes_listed(self.spec)
        if listed and self._table is not None and not (self.spec.read_only or self._meta.read_only):
            self._table.flush()  # written rows count as stored
        filled = self._len_along_dim0
        lanes = len(self._schema.lane_shape)
        texts = self._schema.texts  # strings, stored as uint8 cells of UTF-8 (zstore.text)
        rows = tuple(
            KeyRow("(tensor)" if self._schema.kind == "tensor" else leaf.path,
                   leaf.shape[lanes:-1] if leaf.path in texts else leaf.shape[lanes:],
                   text_dtype(leaf.shape[-1]) if leaf.path in texts else dtype_name(leaf.dtype),
                   codec=str(self.key_codecs.get(leaf.path, self.codec)),
                   stored_bytes=stored_bytes_under(self.spec, leaf.path) if listed else None,
                   raw_bytes=filled * leaf.row_bytes)
            for leaf in self._schema.leaves)
        facts = self._summary_facts()
        if self.spec.read_only or self._meta.read_only:
            facts += (("mode", "read-only"),)
        if self._table is None:
            facts += (("state", "closed (reopen with zstore.open(url))"),)
        else:
            facts += unlisted_sizes_fact(self.spec)
        return {"rows": rows, "facts": facts,
                "stored_bytes": self.spec.stored_bytes(ignore=(LEASE_NAME,)) if listed else None,
                "raw_bytes": filled * self._schema.row_bytes, "episodes": base.episodes,
                "cache_tier": self.cache if self._table is not None else None,
                "cache_budget": self.cache_bytes,
                "cache_stats": self.cache_stats if self._table is not None else None}

    def _summary_facts(self) -> tuple[tuple[str, str], ...]:
        return (("shape", str(list(self._total_shape))),) + \
            ((("ndim", str(self.ndim)),) if self.ndim > 1 else ())
