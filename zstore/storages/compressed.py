"""CompressedListStorage on compressed, chunked Zarr arrays (SPEC §2.4, §9.13).

TorchRL compresses item by item in Python (zlib below Python 3.14) and loses
TensorDict batch sizes. Here items are rows of compressed Zarr arrays:

* keys whose shape never changes live in one *items table* — an inner
  :class:`~zstore.LazyMemmapStorage` with one column per key (chunked along the
  item index, so consecutive frames share a compressed chunk, and read through
  the hot-chunk cache with one ``index_select`` per key);
* a key whose shape changes from one item to the next (token lists, whole
  episodes) moves to a Zarr-native *ragged* layout: a ``values`` array of
  units (the item's trailing shape, or single elements) plus an ``index``
  table holding each item's ``start`` and ``shape`` — never pickles;
* custom ``compression_fn`` / ``decompression_fn`` (TorchRL's signatures) store
  each payload ragged too, with the item's shape beside it.

Store layout under the storage's URL (every array is plain Zarr v3)::

    zarr.json                  root group; its JSON ``zstore`` block (written by flush) reopens it
    items-<g>/                 LazyMemmapStorage group: fixed keys + __zstore__/batch/<node>
    ragged/<key>/index-<g>/    LazyMemmapStorage group: start, shape [, item_shape]
    ragged/<key>/values-<g>/   LazyMemmapStorage group: _-single-tensor-_ [capacity, *unit]

A writer only appends to the tables the last commit names: a key turning ragged, or a
compaction, writes a new generation ``<g>`` and *retires* the one it replaces, which is
deleted at the commit after the first that no longer names it (readers of the last commit
keep reading it); a writer's first commit deletes every table the root block does not name,
what an interrupted writer left (``docs/format.md`` §9).

The ragged layout is :mod:`zstore.storages.ragged`; the lease protocol
:mod:`zstore.storages.leasing`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
import uuid
import warnings
from typing import Any, Callable, Mapping

import numpy as np
import torch
from tensordict import (LazyStackedTensorDict, TensorDict, is_tensor_collection, is_tensorclass,
                        lazy_stack)
from tensordict._td import _StringOnlyDict
from zarr.errors import GroupNotFoundError, NodeNotFoundError

from .. import _faults, autocommit
from ..cache import DEFAULT_CACHE_BYTES, CacheStats, byte_budget, output_device
from ..codecs import CodecSpec, checked_rows_per, is_remote, parse_codecs
from ..display import KeyRow, Summary, dtype_name
from ..dtypes import torch_dtype_from_name, torch_dtype_name
from ..errors import (InvalidKeyError, MissingKeyError, NotAZStoreError, SchemaError,
                      StoreExistsError, ZStoreError)
from ..group import ZSTORE_ATTR, open_group, open_plain_group, put_attrs
from ..format_version import refuse_newer_fields, unknown_fields
from ..lease import DEFAULT_TTL, LEASE_NAME, refuse_while_held
from ..layout import (FORMAT_VERSION, SINGLE_TENSOR_KEY, _flat_leaves, check_format_version,
                      json_int, key_to_path, path_to_key)
from ..signals import shielded
from ..store import StoreSpec, run_deferred
from .base import ClosedByWith, CompressionRatio, sizes_listed, stored_bytes_under, unlisted_sizes_fact
from .leasing import LeasedWriter
from .list import (ListStorage, _as_int, _flagged, _is_mask, _positions, checked_positions,
                   refuse_unpaired)
from .lifecycle import delete_store, temporary_store, track
from .memmap import LazyMemmapStorage
from .ragged import RaggedKey
from .torchrl_state import state_items

_BATCH = "__zstore__/batch"
_ROOT = ".root"
_PIECE = 4096  # rows copied at a time when a table is rebuilt
_ITEMS_TABLE = re.compile(r"items-\d+")
_RAGGED_TABLE = re.compile(r"index|(index|values)-\d+")  # a ragged key's, below its path


#: the fields of the root ``zstore`` block (``_block``) this version reads (a checkpoint
#: generation's too)
BLOCK_FIELDS = frozenset({"format_version", "storage_class", "max_size", "length", "newest",
                           "kind", "class_name", "custom_codec", "compression_level", "codec",
                           "codecs", "chunks", "dtypes", "fixed", "nodes", "items", "ragged",
                           "created"})


def _malformed(where: str, kind: str, exc: Exception) -> NotAZStoreError:
    """The refusal of storage class ``kind``'s root block that fails ``exc`` (a missing
    field: its ``KeyError``)."""
    detail = repr(exc) if isinstance(exc, KeyError) else str(exc)
    return NotAZStoreError(f"{where}: malformed {kind} block ({detail})")


def _count(value: Any, field: str, low: int, high: float = math.inf) -> int:
    """``value``, a recorded count, checked to be an int in ``[low, high]``."""
    if not low <= json_int(value, field) <= high:
        raise ValueError(f"{field} {value!r} is not an int from {low} to {high}")
    return value


def _check_block(block: Mapping[str, Any], max_size: int) -> None:
    """Refuse a root block whose counts or key paths no storage writes (``ValueError``
    naming the field): a path that escapes the store, a length past the capacity..."""
    _count(block["length"], "length", 0, max_size)
    if block.get("newest") is not None:
        _count(block["newest"], "newest", 0, max_size - 1)
    if block["items"] is not None:
        _count(block["items"], "items", 0)
    for field in ("dtypes", "fixed", "nodes", "ragged"):
        for path in block[field]:
            try:
                path_to_key(path)
            except InvalidKeyError as exc:
                raise ValueError(f"{field} names {path!r}: {exc}") from None
    keys, fixed, ragged = set(block["dtypes"]), set(block["fixed"]), set(block["ragged"])
    if keys != fixed | ragged or fixed & ragged:
        raise ValueError(f"the keys of dtypes {sorted(keys)} are not those of fixed "
                         f"{sorted(fixed)} and ragged {sorted(ragged)}, each in one")
    if fixed and block["items"] is None and block["length"]:
        raise ValueError(f"items is null while {block['length']} items have the keys {sorted(fixed)}")
    for node in block["nodes"]:  # (the root, an item's own batch, lies above every key)
        if node != _ROOT and not any(path.startswith(node + "/") for path in keys):
            raise ValueError(f"nodes names {node!r}, above none of the keys {sorted(keys)}")
    for path, record in block["ragged"].items():
        unit = record["unit"]
        if not isinstance(unit, list) or not all(type(u) is int and u >= 0 for u in unit):
            raise ValueError(f"ragged {path!r}: unit {unit!r} is not a list of sizes")
        _count(record["ndim"], f"ragged {path!r}: ndim", len(unit))
        _count(record["used"], f"ragged {path!r}: used", 0)


def _kind_of(data: Any) -> str:
    """What an item is to the storage: ``"tensor"`` or ``"tensordict"`` (a tensorclass too)."""
    return "tensor" if isinstance(data, torch.Tensor) else "tensordict"


def _batch_column(node: str) -> str:
    """Column holding the batch dims of TensorDict node ``node`` (one path part, no nesting)."""
    return f"{_BATCH}/{node.replace('/', '.')}"


def _key_name(path: str) -> str:
    """How a refusal names key ``path``: ``key ('a', 'b')``."""
    return f"key {tuple(path.split('/'))!r}"


class ItemList(list):
    """The list of items ``CompressedListStorage.get`` returns for several indices.

    When the items share their shapes, ``batch`` holds them already stacked (the
    rows the items are views of); :func:`stack_items` then costs nothing.
    """

    batch: Any = None


def stack_items(items: list) -> Any:
    """Collate a list of items (ReplayBuffer's job): the pre-stacked batch when there is one.

    Otherwise tensors are stacked and TensorDicts lazily stacked, as TorchRL's
    collate for ``CompressedListStorage`` does.
    """
    batch = getattr(items, "batch", None)
    if batch is not None:
        return batch
    if items and all(isinstance(x, torch.Tensor) for x in items):
        try:
            return torch.stack(items)
        except RuntimeError:
            return items
    return lazy_stack(list(items))


def _key_difference(expected: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    """``lacks [keys] and adds [keys]``: how the keys of ``got`` differ from ``expected``'s."""
    missing, extra = set(expected) - set(got), set(got) - set(expected)
    return " and ".join(f"{word} {sorted(keys)}" for word, keys in (("lacks", missing),
                                                                    ("adds", extra)) if keys)


def _items_differ(data: Any) -> bool:
    """Whether ``data`` is a lazy stack along dim 0 whose TensorDicts differ in keys or
    shapes: its keys are those all of them share, so a write of it as one batch would
    drop the others (or fail on a shape)."""
    if not isinstance(data, LazyStackedTensorDict) or data.stack_dim != 0:
        return False
    layouts = [{key: getattr(value, "shape", None)
                for key, value in item.items(include_nested=True, leaves_only=True)}
               for item in data.tensordicts]
    return any(layout != layouts[0] for layout in layouts[1:])


def _tree(leaves: Mapping[str, Any]) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
    tree: dict = {}
    for path, value in leaves.items():
        node = tree
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


_TD_NEW = TensorDict.__new__


def _new_td(source: dict, batch_size: torch.Size, device: torch.device | None) -> TensorDict:
    """``TensorDict._new_unsafe(source, batch_size, device, nested=False)`` without its
    per-call checks (a few µs each, the bulk of splitting a batch into items)."""
    td = _TD_NEW(TensorDict)
    td._tensordict = source if type(source) is _StringOnlyDict else _StringOnlyDict(source)
    td._batch_size = batch_size
    td._device = device
    td._td_dim_names = None
    return td


def _item_shaped(value: Any, shape: tuple[int, ...]) -> Any:
    """What a custom ``decompression_fn`` returned, in the item's recorded ``shape`` (the
    payload is stored flat, so a function that only casts returns it flat); left as it is
    when the sizes differ (the function built its own shape)."""
    if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(shape) \
            and value.numel() == math.prod(shape):
        return value.reshape(shape)
    return value


def _leftover_tables(fs, root: str, keep: set[str]) -> list[str]:
    """The inner tables below ``root`` (an fsspec path) that ``keep`` does not name, as
    paths below it: ``items-<g>``, and each ragged key's ``index``, ``index-<g>`` and
    ``values-<g>`` under ``ragged/<key>/`` (other names are never touched)."""
    above = {k.rsplit("/", i)[0] for k in keep for i in range(1, k.count("/") + 1)}
    found: list[str] = []

    def walk(rel: str) -> None:
        try:
            entries = fs.ls(f"{root}/{rel}" if rel else root, detail=True)
        except FileNotFoundError:
            return
        for entry in entries:
            if entry["type"] != "directory":
                continue
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            path = f"{rel}/{name}" if rel else name
            if path in keep:
                continue
            if path in above:
                walk(path)  # the way to a kept table
            elif not rel:  # the storage's own directory
                if _ITEMS_TABLE.fullmatch(name):
                    found.append(path)
                elif name == "ragged":
                    walk(path)
            elif rel != "ragged" and _RAGGED_TABLE.fullmatch(name):
                found.append(path)
            else:
                walk(path)  # a key's directory

    walk("")
    return found


def _open_root(spec: StoreSpec):
    return open_plain_group(spec.open(), "r" if spec.read_only else "r+")


def _root_block(spec: StoreSpec) -> dict[str, Any] | None:
    """The ``zstore`` block of a committed CompressedListStorage at ``spec``, else ``None``."""
    block = _any_root_block(spec)
    if isinstance(block, Mapping) and block.get("storage_class") == "CompressedListStorage":
        return dict(block)
    return None


def _any_root_block(spec: StoreSpec) -> Any:
    """The root group's ``zstore`` attribute at ``spec``: ``None`` when it has other
    attributes only, :data:`_NO_GROUP` where there is no root group or one with no
    attributes (what a first commit killed before writing its block leaves)."""
    if not spec.exists():
        return _NO_GROUP
    try:
        attrs = _open_root(spec).attrs.asdict()
    except (GroupNotFoundError, NodeNotFoundError, FileNotFoundError):
        return _NO_GROUP
    return attrs.get(ZSTORE_ATTR) if attrs else _NO_GROUP


_NO_GROUP = object()


def _refuse_taken_location(spec: StoreSpec, leased: bool) -> None:
    """Refuse to create a storage where something else lives: a committed store of any
    kind, a Zarr group of another tool, or other files, or (``leased``: for a storage that
    takes the write lease) items whose live writer, in this process too, has not committed
    them yet. What a creation killed before its first commit leaves (inner tables, the
    lease) is taken over."""
    from ..conditional import PROBE_PREFIX

    where = spec.redacted()
    block = _any_root_block(spec)
    if isinstance(block, Mapping):
        what = block.get("storage_class")
        hint = ("reopen it with zstore.open(url), or choose another location"
                if what == "CompressedListStorage" else "choose another location")
        raise StoreExistsError(f"{where} already holds a zstore {what or 'store'}; {hint}")
    if block is not _NO_GROUP:
        raise NotAZStoreError(f"{where} already holds a Zarr group that is not a zstore buffer "
                              "(a checkpoint, or another tool's data); choose an empty location")
    fs, root = spec.filesystem()
    try:
        names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(root, detail=False)]
    except (FileNotFoundError, NotADirectoryError):
        names = []
    foreign = [name for name in names if not (
        _ITEMS_TABLE.fullmatch(name) or name in ("ragged", "zarr.json", LEASE_NAME)
        or name.startswith(PROBE_PREFIX))]
    if foreign:
        raise NotAZStoreError(
            f"{where} is not empty and holds no zstore buffer (it holds {sorted(foreign)[:3]}); "
            "choose an empty location (zstore never writes among other files)")
    written = [name for name in names if _ITEMS_TABLE.fullmatch(name) or name == "ragged"]
    if leased and written and LEASE_NAME in names:  # a live writer's items, not committed yet
        refuse_while_held(spec)


class CompressedListStorage(autocommit.CommitClock, LeasedWriter, ClosedByWith, CompressionRatio,
                            ListStorage):
    """TorchRL's CompressedListStorage on compressed, chunked Zarr arrays at any URL.

    Items (tensors, TensorDicts — nested, with their batch sizes — or
    tensorclasses) are rows of compressed Zarr arrays; a key whose shape varies
    between items is stored ragged (values + offsets). Reads gather a whole batch
    at once through the hot-chunk cache.

    Args:
        max_size: capacity in items (required).
        compression_fn, decompression_fn: TorchRL's custom codec pair
            (``compression_fn(tensor) -> uint8 tensor``,
            ``decompression_fn(payload, metadata) -> tensor``); payloads are stored
            ragged, item by item. Default: Zarr codecs, whole chunks at a time.
        compression_level: zstd level of the default codec.
        device: where items are returned.
        scratch_dir: where the arrays live (a path or any fsspec URL). Default: a
            fresh ``memory://`` location owned by the storage, deleted with it.
        storage_options: fsspec options for ``scratch_dir``.
        codec: codec preset, or ``{key path: preset, "default": preset}``.
            Default ``"zstd:<compression_level>+crc32c"`` (the checksum makes a
            corrupted chunk raise :class:`~zstore.CorruptChunkError`).
        chunks: items per chunk (an int or ``{key path: rows}``; default about
            1 MiB of each key).
        cache_bytes: byte budget of each table's hot-chunk cache (bytes, or "512MB", "4GiB").
        lease_ttl: the single-writer lease's ttl in seconds, taken at the first
            write (see :class:`~zstore.LazyMemmapStorage`); ``None``: no lease.
        autocommit_seconds: items are committed at most this long after they were
            written, as :class:`~zstore.LazyMemmapStorage`'s (a background commit
            when idle; also at interpreter exit and on SIGTERM).

    ``flush()`` commits; a storage at a URL then reopens with ``zstore.open(url)``
    and pickles as its spec (the copy shares the arrays). A ``memory://`` storage
    pickles its compressed chunks, unpickled into a fresh location of its own.

    >>> s = CompressedListStorage(100)
    >>> s.set(0, TensorDict(obs=torch.zeros(3, 84, 84, dtype=torch.uint8), batch_size=[3]))
    >>> s.get(0).batch_size
    torch.Size([3])
    """

    _default_checkpointer = "CompressedListStorageCheckpointer"

    def __init__(self, max_size: int, *, compression_fn: Callable | None = None,
                 decompression_fn: Callable | None = None, compression_level: int = 3,
                 device: Any = "cpu", compilable: bool = False, scratch_dir: Any = None,
                 storage_options: Mapping[str, Any] | None = None, codec: Any = "default",
                 chunks: int | Mapping[str, int] | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, lease_ttl: float | None = DEFAULT_TTL,
                 autocommit_seconds: float = 5.0):
        output_device(device)  # (refused before anything is written)
        super().__init__(max_size, compilable=compilable, device=device)
        owned = scratch_dir is None
        if owned:
            scratch_dir = f"memory://zstore-compressed/{uuid.uuid4().hex}"
        self._configure(StoreSpec.parse(scratch_dir, storage_options), owned, compression_fn,
                        decompression_fn, compression_level, codec, chunks, cache_bytes, lease_ttl,
                        autocommit_seconds)
        if not owned:
            _refuse_taken_location(self.spec, leased=lease_ttl is not None)
        self._reset()

    def _configure(self, spec: StoreSpec, owned: bool, compression_fn: Callable | None,
                   decompression_fn: Callable | None, compression_level: int, codec: Any,
                   chunks: Any, cache_bytes: int, lease_ttl: float | None = DEFAULT_TTL,
                   autocommit_seconds: float = 5.0) -> None:
        self.compression_level = compression_level
        self.autocommit_seconds = autocommit_seconds
        self._start_clock()
        if (compression_fn is None) != (decompression_fn is None):
            raise ValueError("pass both compression_fn and decompression_fn, or neither")
        self.compression_fn, self.decompression_fn = compression_fn, decompression_fn
        self.custom = compression_fn is not None
        preset = f"zstd:{compression_level}+crc32c"
        if codec == "default" or (isinstance(codec, Mapping) and "default" not in codec):
            try:  # (the level is used: checked, naming the argument, not the preset)
                parse_codecs(preset, remote=False)
            except ValueError as exc:
                raise ValueError(f"compression_level={compression_level!r}: "
                                 f"{str(exc).replace(f'in {preset!r} ', '')}") from None
            codec = preset if codec == "default" else {"default": preset, **codec}
        self.default_codec, self.key_codecs = parse_codecs(codec, remote=is_remote(spec))
        self.spec = spec
        self.scratch_dir = spec.url
        self.chunks = checked_rows_per("chunks", chunks)
        self.cache_bytes = byte_budget(cache_bytes)
        self._owned = owned
        self._root = None  # the root Zarr group, once committed
        self._pid = os.getpid()  # the process that opened _root
        self._named: set[str] = set()  # the inner tables the last commit names (below spec)
        self._retiring: list[LazyMemmapStorage] = []  # replaced since the last commit, named there
        self._retired: list[LazyMemmapStorage] = []  # the last commit stopped naming them
        self._swept = False  # whether this writer's commits deleted the leftovers of others
        self.checkpoint_marks: dict[str, Any] = {}  # destination URL -> its last dump
        run_deferred()  # memory:// stores of collected storages: a safe point to delete them
        self._finalizer = temporary_store(spec) if owned else None
        self.lease_ttl = lease_ttl
        self._open_lease(spec, lease_ttl)
        self._committed_block: Mapping[str, Any] | None = None  # what a forked child falls back to
        track(self)  # (closed at exit: its lease released; reset in a forked child)

    def _reset(self) -> None:
        self._mark_clean()
        self._len = 0
        self._newest = None
        self._kind: str | None = None          # "tensor" | "tensordict"
        self._tensorclass: type | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._fixed: dict[str, tuple[int, ...]] = {}   # key path -> item shape
        self._ragged: dict[str, RaggedKey] = {}
        self._nodes: dict[str, int] = {}                # TensorDict node -> batch ndim (> 0)
        self._table: LazyMemmapStorage | None = None
        self._table_gen = 0

    # -- plumbing ---------------------------------------------------------------------------
    def codec_of(self, path: str) -> CodecSpec:
        """The codec preset of key ``path``."""
        return self.key_codecs.get(path, self.default_codec)

    def inner_table(self, name: str, capacity: int, codec: Any,
                    chunks: Any = None) -> LazyMemmapStorage:
        """A new inner LazyMemmapStorage at ``<url>/<name>``, fenced by this storage's lease
        (called by its writer, as it writes). No commit names that location: what an
        interrupted writer left there is deleted first."""
        spec = StoreSpec.parse(f"{self.spec.url}/{name}", self.spec.storage_options)
        if spec.exists():
            spec.delete()
        return LazyMemmapStorage(capacity, scratch_dir=spec.url,
                                 storage_options=self.spec.storage_options, codec=codec,
                                 chunks=chunks, cache_bytes=self.cache_bytes, auto_cleanup=False,
                                 lease_ttl=None)._with_store_lease(self._lease)

    def reopened_inner_table(self, name: str) -> LazyMemmapStorage:
        """The committed inner LazyMemmapStorage ``<url>/<name>``, fenced by this storage's lease."""
        spec = StoreSpec.parse(f"{self.spec.url}/{name}", self.spec.storage_options,
                               self.spec.read_only)
        group, meta = open_group(spec)
        return LazyMemmapStorage._from_store(spec, group, meta, cache_bytes=self.cache_bytes,
                                             cache="host", lease_ttl=None,
                                             store_lease=self._lease)

    def _new_table(self) -> LazyMemmapStorage | None:
        columns = {p: True for p in self._fixed}
        columns.update({_batch_column(node): True for node in self._nodes})
        if not columns:
            return None
        self._table_gen += 1
        chunks = self.chunks
        return self.inner_table(
            f"items-{self._table_gen}", self.max_size,
            {"default": self.default_codec,
             **{p: c for p, c in self.key_codecs.items() if p in self._fixed}},
            {p: c for p, c in chunks.items() if p in self._fixed}
            if isinstance(chunks, Mapping) else chunks)

    def retire(self, *tables: LazyMemmapStorage | None) -> None:
        """Delete inner tables this storage no longer uses: at once if no commit names them,
        else at the commit after the first one that does not (readers of the last commit
        keep reading them until then)."""
        for table in tables:
            if table is None:
                continue
            if self._relative(table) in self._named:
                self._retiring.append(table)
            else:
                table.cleanup()

    def _relative(self, table: LazyMemmapStorage) -> str:
        """Where inner ``table`` lives, below this storage's URL."""
        return table.spec.url[len(self.spec.url.rstrip("/")) + 1:]

    def _delete_retired(self) -> None:
        """Delete every retired table now."""
        doomed = self._retired + self._retiring
        self._retired, self._retiring = [], []
        for table in doomed:
            table.cleanup()

    def _collect_garbage(self) -> None:
        """After a commit: delete the tables the commit before stopped naming, keep those
        this one stops naming until the next, and at this writer's first commit delete every
        other table the root block does not name (an interrupted writer's, format.md §9)."""
        doomed, self._retired, self._retiring = self._retired, self._retiring, []
        for table in doomed:
            table.cleanup()
        if not self._swept:
            self._swept = True
            fs, root = self.spec.filesystem()
            fs.invalidate_cache()  # listings cached before this writer's writes and deletes
            keep = self._named | {self._relative(t) for t in self._retired}
            for path in _leftover_tables(fs, root.rstrip("/"), keep):
                delete_store(StoreSpec.parse(f"{self.spec.url}/{path}", self.spec.storage_options))

    # -- the single-writer lease (storages/leasing.py): the root's; the inner tables take
    # none, it fences their chunk stores
    def _has_commit(self) -> bool:
        return self._root is not None

    def _forget_uncommitted(self) -> None:
        """In a forked child (:mod:`.lifecycle`): the length the parent last committed, its
        items reopened at the child's first use (:meth:`_take_committed_after_fork`), and a
        fresh commit lock (the parent's, held at the fork by a background commit, is never
        released here)."""
        self._commit_lock = threading.RLock()
        self._mark_clean()
        self._len = 0 if self._committed_block is None else self._committed_block["length"]

    def _take_committed_after_fork(self) -> None:
        """In a forked child's first use: the state its parent last committed, never the
        parent's uncommitted items (their chunks are not in the store) or its fsspec."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._retiring, self._retired, self._swept = [], [], False  # (the parent's to delete)
        if self._committed_block is None:
            self._root = None
            self._reset()
        else:
            self._root = _open_root(self.spec)
            self._restore(self._committed_block)

    def _hold_lease(self) -> bool:
        self._take_committed_after_fork()  # (every write starts here: a forked child's,
        return super()._hold_lease()        # without a lease too, from what was committed)

    def _reload_committed(self) -> None:
        block = _root_block(self.spec)
        if block is not None:
            self._root = _open_root(self.spec)
            self._pid = os.getpid()
            # what this writer retired may be named again: the next commit's sweep decides
            self._retiring, self._retired, self._swept = [], [], False
            self._restore(block)

    def _fence(self) -> None:
        self._commit()

    # -- items <-> columns ------------------------------------------------------------------
    def _flatten(self, data: Any, lead: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
        """``({key path: tensor}, {node: batch dims after lead})`` of an item or a batch."""
        if isinstance(data, torch.Tensor):
            return {SINGLE_TENSOR_KEY: data}, {}
        if not is_tensor_collection(data):
            raise TypeError(self._refusal(f"got a {type(data).__name__}, where it stores "
                                          "tensors, TensorDicts and tensorclasses"))
        td = data._tensordict if is_tensorclass(data) else data
        if _items_differ(td):
            raise SchemaError(self._refusal("it is a lazy stack of TensorDicts that differ in "
                                            "keys or shapes, which one item cannot hold"))
        leaves = _flat_leaves(td)
        for path, value in leaves.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(self._refusal(f"{_key_name(path)} holds a {type(value).__name__} "
                                              "(a string or another non-tensor value), where it "
                                              "stores tensors only"))
        for key in td.keys(include_nested=True, leaves_only=True):  # "a/b" would read as a, b
            key_to_path(key)
        nodes = {_ROOT: tuple(td.batch_size[lead:])}
        for key in td.keys(include_nested=True):
            sub = td.get(key)
            if is_tensor_collection(sub):
                path = key if isinstance(key, str) else "/".join(key)
                if path == _ROOT:  # (the item's own entry)
                    raise InvalidKeyError(f"{type(self).__name__} cannot store {_key_name(path)}: "
                                          "a nested TensorDict of that name would share its batch "
                                          "dims' entry with the item's own; rename the key")
                nodes[path] = tuple(sub.batch_size[lead:])
        return leaves, {node: b for node, b in nodes.items() if b}

    def _first(self, leaves: dict[str, torch.Tensor], nodes: dict[str, tuple], data: Any,
               lead: int) -> None:
        self._refuse_own_column_names(leaves, nodes)
        self._kind = _kind_of(data)
        self._tensorclass = type(data) if is_tensorclass(data) else None
        unknown = sorted(set(self.key_codecs) - set(leaves))
        if unknown:
            raise MissingKeyError(f"codec names key(s) {unknown} the data does not have "
                                  f"(keys: {sorted(leaves)})")
        self._dtypes = {p: v.dtype for p, v in leaves.items()}
        self._nodes = {node: len(b) for node, b in nodes.items()}
        if self.custom:
            for path, value in leaves.items():
                self._ragged[path] = None  # created with the first payload
        else:
            self._fixed = {p: tuple(v.shape[lead:]) for p, v in leaves.items()}
        self._table = self._new_table()

    def _refuse_own_column_names(self, leaves: Mapping[str, torch.Tensor],
                             nodes: Mapping[str, tuple]) -> None:
        """Refuse a first item whose keys would share a name with the columns this storage
        keeps of its own: its nested TensorDicts' batch dims, under ``__zstore__/batch``."""
        own = _BATCH.split("/")[0]
        taken = next((path for path in leaves if path.split("/")[0] == own), None)
        if taken is not None:
            raise InvalidKeyError(f"{type(self).__name__} cannot store {_key_name(taken)}: the "
                                  f"top-level key {own!r} holds columns of its own (the batch "
                                  "dims of nested TensorDicts); rename the key")
        columns: dict[str, str] = {}
        for node in nodes:
            other = columns.setdefault(_batch_column(node), node)
            if other != node:
                raise InvalidKeyError(
                    f"{type(self).__name__} cannot store the nested TensorDicts "
                    f"{_key_name(other)} and {_key_name(node)}: both have batch dims of their "
                    "own, which it would keep in one column; rename one of them")

    def _column_name(self, path: str) -> str:
        """How a refusal names the stored items' column ``path``: ``key ('a', 'b')``, or
        ``the item tensor``."""
        return "the item tensor" if self._kind == "tensor" else _key_name(path)

    def _refusal(self, what: str) -> str:
        """The message refusing an item: ``what`` differs, and the way out."""
        return (f"{type(self).__name__} cannot store this data: {what}. Its items must be tensors "
                "or TensorDicts (or tensorclasses) of tensors, with the keys, dtypes and numbers "
                "of dims of the first item (shapes may vary); TorchRL's keeps any item as it is. "
                "Store such items in a zstore.ListStorage or LazyStackStorage instead")

    def _check(self, leaves: dict[str, torch.Tensor], nodes: dict[str, tuple], lead: int,
               kind: str) -> None:
        if (kind == "tensor") != (self._kind == "tensor"):
            got = "a tensor" if kind == "tensor" else "a TensorDict"
            raise SchemaError(self._refusal(f"it is {got}, and the first item was not"))
        if set(leaves) != set(self._dtypes):
            raise MissingKeyError(self._refusal(f"it {_key_difference(self._dtypes, leaves)}, "
                                                "next to the first item's keys"))
        for path, value in leaves.items():
            if value.dtype != self._dtypes[path]:
                raise SchemaError(self._refusal(f"{self._column_name(path)} has dtype "
                                                f"{value.dtype}, the first item's "
                                                f"{self._dtypes[path]}"))
        if {n: len(b) for n, b in nodes.items()} != self._nodes:
            raise SchemaError(self._refusal(f"its batch dims {nodes} differ in number from the "
                                            f"first item's {self._nodes} (TensorDict node -> "
                                            "batch ndim)"))
        item_dims = {path: len(shape) for path, shape in self._fixed.items()}
        if not self.custom:
            item_dims.update({path: rg.ndim for path, rg in self._ragged.items() if rg is not None})
        for path, ndim in item_dims.items():
            if leaves[path].ndim - lead != ndim:
                raise SchemaError(self._refusal(f"{self._column_name(path)} has "
                                                f"{leaves[path].ndim - lead} "
                                                f"dims, the first item's {ndim}"))
        for path, shape in list(self._fixed.items()):
            value = leaves[path]
            if tuple(value.shape[lead:]) != shape:
                self._make_ragged(path, tuple(value.shape[lead + 1:]) == shape[1:])

    def _make_ragged(self, path: str, keep_trailing: bool) -> None:
        """Move key ``path`` from the items table to the ragged layout (a one-off copy)."""
        shape = self._fixed.pop(path)
        n = self._len
        old = self._table
        ragged = RaggedKey(self, path, self._dtypes[path], shape[1:] if keep_trailing else (),
                         len(shape), None)
        self._ragged[path] = ragged
        self._table = self._new_table()
        ragged.new_generation(max(64, 2 * n * math.prod(shape) // max(1, ragged.unit_numel)))
        for start in range(0, n, _PIECE):
            rows = torch.arange(start, min(n, start + _PIECE))
            columns = old.table.read(rows)
            ragged.write(rows, list(columns.pop(path)))
            if self._table is not None:
                self._table.set(rows, self._table_td(columns, len(rows)))
        self.retire(old)

    def _keep_left_out(self, rows: torch.Tensor, leaves: dict[str, torch.Tensor]) -> None:
        """Fill ``leaves`` (``[n, ...]`` each) with the stored values of the keys an update of
        items already written leaves out, as the tensor storages keep them (``rb[i] = td``
        without the ``"index"`` key a ``TensorDictReplayBuffer`` adds); items never
        written, or an update bringing a key of its own, are left to :meth:`_check`."""
        missing = set(self._dtypes) - set(leaves)
        if not missing or not leaves or set(leaves) - set(self._dtypes) or self._kind == "tensor" \
                or int(rows.max()) >= self._len:
            return
        stored = [self._flatten(self._get_locked(int(row)), 0)[0] for row in rows]
        try:
            kept = {path: torch.stack([item[path] for item in stored]) for path in missing}
        except RuntimeError:  # their shapes differ between the items: one batch cannot hold them
            return
        leaves.update({path: value.to(next(iter(leaves.values())).device)
                       for path, value in kept.items()})

    def _table_td(self, columns: Mapping[str, torch.Tensor], n: int) -> TensorDict:
        return TensorDict({tuple(p.split("/")): v for p, v in columns.items()}, batch_size=[n])

    def _write_batch(self, rows: torch.Tensor, data: Any, lead: int, update: bool = False) -> None:
        """Write a batch (``lead == 1``) or one item (``lead == 0``) at ``rows``; ``update``:
        an update in place, whose items keep the keys they leave out. A writer's items
        replace the items they overwrite whole, so they must bring every key. A first
        write that fails leaves the storage as it was: empty, its layout not yet chosen."""
        data = self._move(data)
        leaves, nodes = self._flatten(data, lead)
        if lead == 0:
            leaves = {p: v.unsqueeze(0) for p, v in leaves.items()}
        if self._kind is not None:
            if update:
                self._keep_left_out(rows, leaves)
            self._check(leaves, nodes, 1, _kind_of(data))
            self._write_columns(rows, leaves, nodes)
            return
        try:
            self._first(leaves, nodes, data, 1)
            self._write_columns(rows, leaves, nodes)
        except BaseException:
            self.retire(*self.checkpoint_tables().values())
            self._reset()
            raise

    def _write_columns(self, rows: torch.Tensor, leaves: dict[str, torch.Tensor],
                       nodes: dict[str, tuple]) -> None:
        """Write checked ``leaves`` (``[n, ...]`` each) and batch dims ``nodes`` at ``rows``."""
        n = len(rows)
        columns = {p: leaves[p] for p in self._fixed}
        for node, batch in nodes.items():
            columns[_batch_column(node)] = torch.tensor(batch, dtype=torch.int64).expand(n, -1)
        for path in self._ragged:
            items = list(leaves[path].unbind(0))
            shapes = None
            if self.custom:
                shapes = [tuple(t.shape) for t in items]
                items = [self.compression_fn(t).reshape(-1) for t in items]
            ragged = self._ragged[path]
            if ragged is None:
                ragged = self._ragged[path] = RaggedKey(self, path, items[0].dtype, (), 1,
                                                      leaves[path].ndim - 1)
            ragged.write(rows, items, shapes)
        if self._table is not None:
            self._table.set(rows, self._table_td(columns, n))

    # -- reads --------------------------------------------------------------------------------
    def _read(self, rows: torch.Tensor) -> ItemList:
        n = len(rows)
        columns = self._table.table.read(rows) if self._table is not None else {}
        node_batches = {node: columns.pop(_batch_column(node)) for node in self._nodes}
        device = self._out_device()
        if device is not None:
            columns = {p: c.to(device) for p, c in columns.items()}
        same = all(bool((b == b[:1]).all()) for b in node_batches.values())
        if not self._ragged and same:
            nodes = {node: tuple(b[0].tolist()) if n else () for node, b in node_batches.items()}
            out = ItemList(self._split(columns, nodes, n, device))
            out.batch = self._assemble(columns, nodes, (n,), device)
            return out
        ragged = {}
        for path, rg in self._ragged.items():
            values, item_shapes = rg.read(rows)
            if self.custom:
                values = [_item_shaped(self.decompression_fn(v, {
                    "type": "tensor", "shape": torch.Size(s), "dtype": self._dtypes[path],
                    "device": torch.device("cpu")}), s) for v, s in zip(values, item_shapes)]
            ragged[path] = [v.to(device) for v in values] if device is not None else values
        out = ItemList()
        for k in range(n):
            item = {p: c[k] for p, c in columns.items()}
            item.update({p: v[k] for p, v in ragged.items()})
            out.append(self._assemble(item, {node: tuple(b[k].tolist())
                                             for node, b in node_batches.items()}, (), device))
        return out

    def _out_device(self) -> torch.device | None:
        """Where items are returned (indexed, as TensorDict records it); ``None``: as stored."""
        if self.device in (None, "auto"):
            return None
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _split(self, columns: Mapping[str, torch.Tensor], nodes: Mapping[str, tuple], n: int,
               device: torch.device | None) -> list:
        """The ``n`` items of a batch of columns, as views: one ``unbind`` per column.

        Same result as ``batch.unbind(0)``, without TensorDict's per-item overhead.
        """
        if self._kind == "tensor":
            return list(columns[SINGLE_TENSOR_KEY].unbind(0)) if n else []
        if not n:
            return []
        tree = _tree(columns)

        def items(node: dict, prefix: str) -> list[TensorDict]:
            keys = list(node)
            parts = [items(v, f"{prefix}{k}/") if isinstance(v, dict) else v.unbind(0)
                     for k, v in node.items()]
            batch = torch.Size(nodes.get(prefix.rstrip("/") or _ROOT, ()))
            return [_new_td(_StringOnlyDict(zip(keys, values)), batch, device)
                    for values in zip(*parts)]

        out = items(tree, "")
        if self._tensorclass is not None:
            return [self._tensorclass.from_tensordict(td) for td in out]
        return out

    def _assemble(self, leaves: Mapping[str, torch.Tensor], nodes: Mapping[str, tuple],
                  lead: tuple[int, ...], device: torch.device | None) -> Any:
        """One item (``lead == ()``) or a batch from its leaves, already on ``device``."""
        if self._kind == "tensor":
            return leaves[SINGLE_TENSOR_KEY]

        def make(node: dict, prefix: str) -> TensorDict:
            source = {k: make(v, f"{prefix}{k}/") if isinstance(v, dict) else v
                      for k, v in node.items()}
            batch = nodes.get(prefix.rstrip("/") or _ROOT, ())
            return _new_td(source, torch.Size((*lead, *batch)), device)

        td = make(_tree(leaves), "")
        if self._tensorclass is not None:
            return self._tensorclass.from_tensordict(td)
        return td

    def _rows(self, index: Any) -> torch.Tensor:
        """The item rows a list, range, tensor, array or boolean mask ``index`` names (1-D
        and of integers, as a list storage takes them; a mask names the items it flags)."""
        rows = torch.tensor(_positions(index, self._len), dtype=torch.int64)
        if rows.numel():
            bad = (rows >= self._len) | (rows < -self._len)
            if bool(bad.any()):
                raise IndexError(f"Index {int(rows[bad][0])} out of bounds or not set")
            rows = torch.remainder(rows, self._len)
        return rows

    # -- the contract ---------------------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        with self._commit_lock:
            self._take_committed_after_fork()
            newest = self._newest
            self._set_locked(cursor, data, update=not set_cursor)
            if not set_cursor:
                self._newest = newest  # an update in place: the newest item stays
            if self._commit_due():
                self.flush()

    def _set_locked(self, cursor: Any, data: Any, update: bool = False) -> None:
        """Write ``data`` at ``cursor``; ``update``: an update in place (``storage[i] = x``),
        whose items keep the stored values of keys they leave out (:meth:`_keep_left_out`)."""
        index = _as_int(cursor)
        if index is not None:
            self._write_positions([index], data, single=True, update=update)
        elif isinstance(cursor, slice):
            positions = list(range(*cursor.indices(self._len)))
            if positions and (isinstance(data, torch.Tensor) and not data.ndim
                              or is_tensor_collection(data) and not data.batch_size):
                raise TypeError(
                    f"set({cursor}) writes {len(positions)} item(s): pass a list of them, or a "
                    f"batch whose first dim holds them; got one item ({type(data).__name__} "
                    "without a batch dim). To write one item, index it with an int")
            items = [] if not positions else data if isinstance(data, (list, tuple)) else \
                [data[i] for i in range(min(len(positions), len(data)))]
            items = list(items)[:len(positions)]
            self._refuse_mixed(items)
            for position, item in zip(positions, items):
                self._write_positions([position], item, single=True, bump=False, update=update)
            self._bump_mutation_revision()
        else:
            if not isinstance(data, (list, tuple, torch.Tensor, range, set, np.ndarray)) \
                    and not is_tensor_collection(data):
                raise TypeError(
                    f"Cannot extend a {type(self)} with data of type {type(data)}. Provide a list, "
                    "tuple, set, range, np.ndarray, tensor or tensordict subclass instead.")
            if _is_mask(cursor):
                cursor = _flagged(cursor, self._len)
            elif isinstance(cursor, (torch.Tensor, np.ndarray)):
                cursor = cursor.reshape(-1).tolist()
            cursor = list(cursor)
            if _items_differ(data):  # as TorchRL stores them: item by item, each whole
                data = list(data.unbind(0))
            if isinstance(data, torch.Tensor) or is_tensor_collection(data):
                refuse_unpaired(cursor, data)
                self._write_positions(cursor, data, single=False, update=update)
            else:
                items = list(data)
                refuse_unpaired(cursor, items)
                self._refuse_mixed(items)
                checked_positions(cursor, self._len, self.max_size)  # (all, before the first)
                for position, item in zip(cursor, items):
                    self._write_positions([position], item, single=True, update=update)

    def _refuse_mixed(self, items: list) -> None:
        """Refuse, before any of them is written, items that differ from the first in their
        keys, dtypes, numbers of dims or batch dims: each is checked against the stored
        items as it is written, so the first alone meets that check unwritten (a refusal
        half-way through an extend left the items before it written)."""
        first = None
        for position, item in enumerate(items):
            try:
                leaves, nodes = self._flatten(item, 0)
            except (TypeError, SchemaError) as exc:  # not tensors: refused here, not at its turn
                if position == 0:
                    raise
                raise type(exc)(f"item {position} of this write: {exc} (nothing was "
                                "written)") from None
            layout = ({p: v.dtype for p, v in leaves.items()},
                      {p: v.ndim for p, v in leaves.items()} if not self.custom else {},
                      {n: len(b) for n, b in nodes.items()}, _kind_of(item))
            if first is None:
                first = layout
            elif layout[3] != first[3]:
                raise SchemaError(self._refusal(
                    f"item {position} of this write is a {layout[3]}, item 0 a {first[3]} "
                    "(nothing was written)"))
            elif set(layout[0]) != set(first[0]):
                raise MissingKeyError(self._refusal(
                    f"item {position} of this write {_key_difference(first[0], layout[0])}, "
                    "next to item 0's keys (nothing was written)"))
            elif layout != first:
                raise SchemaError(self._refusal(
                    f"item {position} of this write differs from item 0 in dtypes, numbers of "
                    "dims or batch dims (nothing was written)"))

    def _write_positions(self, positions: list, data: Any, single: bool, bump: bool = True,
                         update: bool = False) -> None:
        """Check cursors as ListStorage does, then write (``update``: as :meth:`_set_locked`);
        one revision per element."""
        if not self.spec.read_only:
            self._hold_lease()
        checked = checked_positions(positions, self._len, self.max_size)
        if not checked:
            return
        self.spec.require_writable("write")
        self._write_batch(torch.tensor(checked), data, 0 if single else 1, update)
        self._newest = checked[-1]
        self._len = max(self._len, max(checked) + 1)  # (appends come one past the end)
        self._claim_writes()
        self._mark_dirty()
        if bump:
            self._revision += len(checked)

    def get(self, index: Any) -> Any:
        with self._commit_lock:  # a background commit and a read do not share the tables
            self._take_committed_after_fork()
            return self._get_locked(index)

    def _get_locked(self, index: Any) -> Any:
        if isinstance(index, tuple):
            if len(index) != 1:
                raise RuntimeError(f"{type(self).__name__} can only be indexed with one-length tuples.")
            index = index[0]
        as_int = _as_int(index)
        if as_int is not None:
            if not -self._len <= as_int < self._len:
                raise IndexError(f"Index {as_int} out of bounds or not set")
            return self._read(torch.tensor([as_int % self._len]))[0]
        if isinstance(index, slice):
            positions = range(*index.indices(self._len))  # a negative step too, as a list's
            return self._read(torch.arange(positions.start, positions.stop, positions.step)
                              if positions else torch.empty(0, dtype=torch.int64))
        return self._read(self._rows(index))

    def __len__(self) -> int:
        return self._len

    def _empty(self) -> None:
        self.spec.require_writable("empty the storage")
        self._hold_lease()
        written = self._committable()  # items or a commit: the store must say it is empty
        self.retire(*self.checkpoint_tables().values())
        self._reset()
        self._bump_mutation_revision()
        if written:  # (items never committed left only the lease: no store to reopen)
            self._commit()
        self._delete_retired()  # generations start again at 1: none may outlive this commit

    def _drop_arrays(self) -> None:
        """Delete every inner table now, those in use and those retired."""
        self._retiring += self.checkpoint_tables().values()
        self._delete_retired()

    # -- package-internal: the checkpoint contract (checkpoint_contract.py) ---------------
    def checkpoint_tables(self) -> dict[str, LazyMemmapStorage]:
        """The inner tables (the items table, each ragged key's index and values) by their
        path below this storage's URL."""
        parts = [self._table] if self._table is not None else []
        for ragged in self._ragged.values():
            if ragged is not None:
                parts += [p for p in (ragged.index, ragged.values) if p is not None]
        base = self.spec.url.rstrip("/") + "/"
        return {self._relative(p): p for p in parts if p.spec.url.startswith(base)}

    def checkpoint_replace(self, fill: Callable[[], None]) -> None:
        """As this location's one writer: drop every array, let ``fill()`` write new objects
        (a checkpoint's) to the location, then adopt them and commit."""
        self.spec.require_writable("load a checkpoint")
        self._hold_lease()  # a load rewrites the storage's location: as its one writer
        with shielded():  # (interrupted in between: a length whose items were deleted)
            self._drop_arrays()
            self._reset()
        fill()
        self._root = _open_root(self.spec)
        self._restore(_root_block(self.spec))
        if self._lease is not None:
            self._lease.read_metadata()  # the copied zarr.json is the version to replace
        self._swept = False  # the copy may hold tables its root block does not name
        self._commit()  # the root block now names this writer (a former one cannot commit)

    checkpoint_block = staticmethod(_root_block)

    def cleanup(self) -> None:
        """Delete every array of this storage and its metadata (the storage is then empty)."""
        self.spec.require_writable("delete the store")
        self._release_lease()
        self._drop_arrays()
        self._reset()
        self._bump_mutation_revision()
        self._root, self._committed_block = None, None
        if self._finalizer is not None:
            self._finalizer.detach()
        delete_store(self.spec)

    def flush(self) -> None:
        """Store every written chunk, then commit the root metadata (what ``zstore.open``,
        other processes and ``nbytes`` see)."""
        with self._commit_lock:
            self._take_committed_after_fork()
            self._flush()

    def _committable(self) -> bool:
        return self._kind is not None or self._root is not None

    def _flush(self) -> None:
        if self.spec.read_only:
            return
        if self._lease is not None:
            if not self._holds_lease or not self._uncommitted and self._lease.superseded:
                return  # this storage wrote nothing, or lost the lease (another storage of
                # this process may have written since: nothing of this one's to commit)
            self._lease.renew()
        if self._table is not None:
            self._table.flush()
        for ragged in self._ragged.values():
            if ragged is not None:
                ragged.flush()
        if self._committable():
            self._commit()
        self._mark_clean()

    def close(self) -> None:
        """Commit what this storage wrote and release its write lease (it stays usable)."""
        with self._commit_lock:  # one step: a write of another thread in between was lost
            self._take_committed_after_fork()  # (its next write took the lease, reloading
            # the commit); nothing new and no table left to delete: no commit again
            if self._uncommitted or self._retiring or self._retired or not self._swept:
                self._flush()
            if self._lease is not None:
                self._lease.release()

    # -- persistence: a JSON block in the root group; never pickles into the store -------------
    def _block(self) -> dict[str, Any]:
        """The root ``zstore`` block: what reopening needs (format.md §9)."""
        from .. import __version__

        return {
            "format_version": FORMAT_VERSION, "storage_class": type(self).__name__,
            "max_size": self.max_size, "length": self._len, "newest": self._newest,
            "kind": self._kind,
            "class_name": None if self._tensorclass is None else
            f"{self._tensorclass.__module__}.{self._tensorclass.__qualname__}",
            "custom_codec": self.custom, "compression_level": self.compression_level,
            "codec": self.default_codec.to_json(),
            "codecs": {p: c.to_json() for p, c in self.key_codecs.items()},
            "chunks": dict(self.chunks) if isinstance(self.chunks, Mapping) else self.chunks,
            "dtypes": {p: torch_dtype_name(d) for p, d in self._dtypes.items()},
            "fixed": {p: list(s) for p, s in self._fixed.items()},
            "nodes": dict(self._nodes),
            "items": self._table_gen if self._table is not None else None,
            "ragged": {p: r.to_json() for p, r in self._ragged.items() if r is not None},
            "created": {"zstore_version": __version__},
        }

    def _commit(self) -> None:
        self._take_committed_after_fork()
        if self._root is None:
            self._root = open_plain_group(self.spec.open(), "a")
        _faults.crash_point("commit.before")
        block = self._block()
        put_attrs(self._root, {**self._root.attrs.asdict(), ZSTORE_ATTR: block},
                  self._lease)  # (other attributes, a user's, are kept)
        self._committed_block = block
        _faults.crash_point("commit.after")
        self._named = set(self.checkpoint_tables())
        self._collect_garbage()

    def _restore(self, block: Mapping[str, Any]) -> None:
        """Adopt the state recorded in a root block (arrays reopened, nothing read yet)."""
        where = self.spec.redacted()
        if not self.spec.read_only:
            refuse_newer_fields(unknown_fields(block, BLOCK_FIELDS), where)
        try:
            self._reset()
            self._named = set()
            if block["kind"] is None:
                return
            _check_block(block, self.max_size)
            self._len = int(block["length"])
            newest = block.get("newest")  # absent from stores written before it was recorded
            self._newest = None if newest is None else int(newest)
            self._kind = "tensor" if block["kind"] == "tensor" else "tensordict"
            self._dtypes = {p: torch_dtype_from_name(d) for p, d in block["dtypes"].items()}
            self._fixed = {p: tuple(int(x) for x in s) for p, s in block["fixed"].items()}
            self._nodes = {n: int(d) for n, d in block["nodes"].items()}
            if block["items"] is not None:
                self._table_gen = int(block["items"])
                self._table = self.reopened_inner_table(f"items-{self._table_gen}")
            self._ragged = {p: RaggedKey.reopen(self, p, r) for p, r in block["ragged"].items()}
            self._named = set(self.checkpoint_tables())
            self._committed_block = block
        except BaseException as exc:  # an interruption (Ctrl-C) too: no length without items
            self._reset()
            self._named = set()
            if not isinstance(exc, (KeyError, TypeError, ValueError, AttributeError)) or (
                    isinstance(exc, ZStoreError) and where in str(exc)):  # (wrong JSON types)
                raise
            raise _malformed(where, type(self).__name__, exc) from None

    @classmethod
    def _from_group(cls, spec: StoreSpec, group, block: Mapping[str, Any], *,
                    cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host", device: Any = None,
                    compression_fn: Callable | None = None,
                    decompression_fn: Callable | None = None,
                    lease_ttl: float | None = DEFAULT_TTL,
                    autocommit_seconds: float = 5.0) -> "CompressedListStorage":
        """Reopen a committed storage (used by :func:`zstore.open` and unpickling)."""
        check_format_version(block, spec.redacted())
        if cache != "host":
            raise ValueError(f"{cls.__name__} caches chunks on the host only (cache={cache!r})")
        if block.get("custom_codec") and compression_fn is None:
            raise NotAZStoreError(
                f"{spec.redacted()} was written with a custom compression_fn / decompression_fn, "
                "which are not stored; unpickle the storage object instead of zstore.open(url)")
        output_device(device)
        self = cls.__new__(cls)
        try:  # (a block of another storage class, edited to name this one, fails here)
            ListStorage.__init__(self, _count(block["max_size"], "max_size", 1),
                                 device="cpu" if device is None else device)
            codec = {"default": block["codec"], **block.get("codecs", {})}
            self._configure(spec, False, compression_fn, decompression_fn,
                            int(block.get("compression_level", 3)), codec, block.get("chunks"),
                            cache_bytes, lease_ttl, autocommit_seconds)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # (wrong JSON types)
            raise _malformed(spec.redacted(), cls.__name__, exc) from None
        self._root = group
        self._restore(block)
        return self

    def __getstate__(self) -> dict[str, Any]:
        """A URL storage pickles as its spec (the copy reopens the same arrays, after a
        flush); a ``memory://`` one as its stored chunks, copied into a fresh location."""
        self.flush()
        state = {"max_size": self.max_size, "device": None if self.device is None else str(self.device),
                 "compression_fn": self.compression_fn, "decompression_fn": self.decompression_fn,
                 "compression_level": self.compression_level,
                 "codec": {"default": self.default_codec.to_json(),
                           **{p: c.to_json() for p, c in self.key_codecs.items()}},
                 "chunks": self.chunks, "cache_bytes": self.cache_bytes, "revision": self._revision,
                 "lease_ttl": self.lease_ttl, "autocommit_seconds": self.autocommit_seconds}
        if self.spec.is_memory:
            fs, root = self.spec.filesystem()
            keys = self.spec.objects() if self._root is not None else {}
            state["files"] = {key: fs.cat_file(f"{root}/{key}") for key in keys
                              if key != LEASE_NAME}
        else:
            state["spec"] = self.spec.to_json()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "files" in state:
            spec = StoreSpec.parse(f"memory://zstore-compressed/{uuid.uuid4().hex}")
            fs, root = spec.filesystem()
            for name, data in state["files"].items():
                fs.pipe_file(f"{root}/{name}", data)
            owned = True
        else:
            spec, owned = StoreSpec.from_json(state["spec"]), False
        ListStorage.__init__(self, state["max_size"], device=state["device"])
        self._configure(spec, owned, state["compression_fn"], state["decompression_fn"],
                        state["compression_level"], state["codec"], state["chunks"],
                        state["cache_bytes"], state.get("lease_ttl", DEFAULT_TTL),
                        state.get("autocommit_seconds", 5.0))
        block = _root_block(spec)
        if block is None:
            self._reset()
        else:
            check_format_version(block, spec.redacted())
            self._root = _open_root(spec)
            self._restore(block)
        self._revision = state["revision"]

    def state_dict(self) -> dict[str, Any]:
        """``{"_storage": [items]}``: decoded items (tensors / TensorDicts)."""
        items = self.get(slice(None)) if self._len else []
        return {"_storage": [x.clone() for x in items]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace the content with the items of :meth:`state_dict`, or of the one TorchRL's
        ``CompressedListStorage`` writes (its compressed items are decoded)."""
        items = state_items(state_dict)
        items = [TensorDict(item, batch_size=[]) if isinstance(item, dict) else item
                 for item in items]
        self._refuse_mixed(items)  # before the content goes
        self._empty()
        for item in items:
            self._write_positions([self._len], item, single=True, bump=False)
        self._bump_mutation_revision()

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes stored (every object under the storage's URL, after a flush)."""
        if self._kind is None:
            return 0
        self.flush()
        return self.spec.stored_bytes(ignore=(LEASE_NAME,))

    @property
    def raw_nbytes(self) -> int:
        """Bytes the items take uncompressed."""
        return sum(self._raw_bytes_of(path) for path in self._dtypes)

    def _raw_bytes_of(self, path: str) -> int:
        """Bytes key ``path`` takes uncompressed over all items."""
        if path in self._fixed:
            return self._len * math.prod(self._fixed[path]) * self._dtypes[path].itemsize
        ragged = self._ragged.get(path)
        if ragged is None or not self._len:
            return 0
        index = ragged.index.table.read(torch.arange(self._len))
        shapes = index["item_shape" if self.custom else "shape"]
        nd = ragged.item_ndim if self.custom else ragged.ndim
        return int(shapes[:, :nd].prod(-1).sum()) * self._dtypes[path].itemsize

    def bytes(self) -> int:
        """Stored bytes, as TorchRL's ``bytes()`` (warns and returns 0 when empty)."""
        if not self._len:
            warnings.warn("Compressed storage is empty, returning 0 bytes.")
            return 0
        return self.nbytes

    @property
    def cache_stats(self) -> CacheStats:
        """Hot-chunk cache counters summed over the storage's tables."""
        total = CacheStats()
        parts = [self._table] + [p for r in self._ragged.values() if r is not None
                                 for p in (r.index, r.values)]
        for part in parts:
            stats = part.cache_stats if part is not None and part.initialized else None
            if stats is not None:
                for name in vars(total):
                    setattr(total, name, getattr(total, name) + getattr(stats, name))
        return total

    def summary(self) -> Summary:
        """Fill, store URL (redacted), cache and, per key, shape (or ``ragged``), dtype, codec, bytes.

        Stored bytes are listed only on local and ``memory://`` stores.
        """
        base = dataclasses.replace(super().summary(), spec=self.spec)
        if self._kind is None:
            return base
        listed = sizes_listed(self.spec)
        if listed:
            self.flush()
        codec = "custom compression_fn" if self.custom else None
        rows = []
        for path, dtype in self._dtypes.items():
            ragged = path in self._ragged
            where = f"ragged/{path}" if ragged else f"items-{self._table_gen}/{path}"
            shape = "ragged" if ragged else self._fixed[path]
            rows.append(KeyRow("(tensor)" if self._kind == "tensor" else path, shape,
                               dtype_name(dtype), codec=codec or str(self.codec_of(path)),
                               stored_bytes=stored_bytes_under(self.spec, where) if listed else None,
                               raw_bytes=self._raw_bytes_of(path)))
        return dataclasses.replace(
            base, rows=tuple(rows), facts=unlisted_sizes_fact(self.spec), stored_bytes=self.spec.stored_bytes(ignore=(LEASE_NAME,)) if listed else None,
            raw_bytes=sum(row.raw_bytes for row in rows), cache_tier="host", cache_budget=self.cache_bytes,
            cache_stats=self.cache_stats)
