"""The buffer form of a tensor-storage checkpoint: a generation that is a zstore buffer.

Each generation is a complete zstore buffer (format.md), so
``zstore.open(f"{dest}/{generation}")`` and plain zarr read it. Only rows that
hold data are written; chunks are whole (never read back and patched).
Incremental dumps: the storage stamps every written row with a write revision,
and remembers, per destination, which generation it last wrote or read there and
at which revision. A chunk none of whose rows changed since is carried over from
the previous generation as an object copy (a hard link locally, a server-side
copy on object stores); the others are encoded and written. Where rows can
change in place unseen by the revisions (an in-RAM container, a local memmap's
views), a chunk is carried over only if its digest is unchanged too (:mod:`._digests`).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch
import zarr
from tensordict import TensorDict
from zarr.core.group import AsyncGroup, GroupMetadata
from zarr.core.sync import sync
from zarr.storage import StorePath

from zstore.codecs import CodecSpec
from zstore.dtypes import (
    from_numpy,
    from_storage,
    storage_numpy_dtype,
    to_numpy,
    to_storage,
)
from zstore.errors import MissingKeyError, NotAZStoreError, StoreNotFoundError
from zstore.group import commit, create_group, open_group
from zstore.layout import Schema, StoreMeta
from zstore.row_objects import KEY_SEPARATORS, chunk_key, key_separator
from zstore.storages.checkpoint_contract import TensorCheckpointable
from zstore.store import StoreSpec

from . import _mapped
from ._digests import Digests, chunk_digests, digest
from ._chunks import (
    ALL_STORED,
    DAMAGED,
    read_raw,
    require_stored,
    storing_every_chunk,
    write_raw,
)
from ._dest import CheckpointError, Destination, fault_point, progress_bar, refuse_newer_generation
from ._state import TensorState, changed_rows, finish, prepare

#: Bytes per chunk of a key on object stores: few objects (few requests to write, carry
#: over, list and delete), while 1% of new rows still rewrites only a few percent of the bytes.
CHUNK_BYTES = 4 << 20
#: ... and on local disk, where an object costs a file and a hard link, not a request:
#: smaller chunks make incremental dumps write half the bytes, in steadier time.
LOCAL_CHUNK_BYTES = 1 << 20
#: Longest chunk of a narrow key (rows): keeps carried-over chunks fine-grained.
MAX_CHUNK_ROWS = 1 << 18
#: Rows are copied a window of about this many bytes (whole chunks of every key) at a time:
#: enough chunks per window to keep the I/O threads busy, a bounded copy of a memmap's rows.
WINDOW_BYTES = 64 << 20
#: Chunk-key separator of new generations: all chunks of an array in one directory, so a
#: chunk carried over locally is one hard link, without a directory per chunk to create.
KEY_SEPARATOR = "."


def checkpoint_layout(schema, rows: int, chunks: int | None,
                      chunk_bytes: int = CHUNK_BYTES) -> dict[str, tuple[int, None]]:
    """Rows per chunk of every key: a power of two near ``chunk_bytes`` of that key (or
    ``chunks``)."""
    layout = {}
    for leaf in schema.leaves:
        if chunks is not None:
            size = int(chunks)
        else:
            size = 1 << max(0, int(math.log2(max(1, chunk_bytes // max(1, leaf.row_bytes)))))
            size = min(size, MAX_CHUNK_ROWS)
        layout[leaf.path] = (max(1, min(size, rows)), None)
    return layout


def as_numpy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A tensor of ``dtype`` as the NumPy array of its Zarr dtype (bit views, no conversion)."""
    return to_numpy(to_storage(tensor.detach().to("cpu")).contiguous(), dtype)


def as_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_numpy`."""
    return from_storage(from_numpy(np.ascontiguousarray(array), dtype), dtype)


def _window(chunks: list[int], row_bytes: int) -> int:
    """Rows per window: a multiple of every key's chunk length (so windows start on chunk
    boundaries; zstore's own chunk lengths are powers of two), about :data:`WINDOW_BYTES`."""
    unit = math.lcm(*chunks)
    return unit * max(1, WINDOW_BYTES // max(1, unit * row_bytes))


def _changed_chunks(changed: np.ndarray | None, chunk: int, n: int) -> np.ndarray:
    """Bool per chunk of the first ``n`` chunks: whether it holds one of the ``changed``
    rows (int64 row indices; None: everything changed)."""
    if changed is None:
        return np.ones(n, dtype=bool)
    mask = np.zeros(n, dtype=bool)
    blocks = changed // chunk
    mask[blocks[blocks < n]] = True
    return mask


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of True in a bool vector."""
    out, start = [], None
    for i, flag in enumerate(mask.tolist() + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def dump_buffer(storage: TensorCheckpointable, dest: Destination, *, codec: CodecSpec,
                chunks: int | None, progress: bool, checkpointer: str) -> dict[str, Any]:
    """Write a new buffer generation of ``storage`` at ``dest``; return the commit record."""
    revision = storage.checkpoint_revision  # rows written after this are dumped next time
    state = TensorState.of(storage)
    layout = checkpoint_layout(state.schema, state.rows, chunks,
                               LOCAL_CHUNK_BYTES if dest.spec.is_local else CHUNK_BYTES)
    previous = dest.read_commit()
    base = _incremental_base(storage, dest, previous, state, layout if chunks else None, codec)
    separator = KEY_SEPARATOR
    if base is not None:  # the previous generation's chunking and keys, so its chunks carry over
        layout, separator = base.layout, base.separator
    gen = dest.new_generation()
    meta = StoreMeta("LazyMemmapStorage", state.max_size, state.ndim, state.rows, state.schema,
                     codec, layout)
    gen_spec = dest.child(gen)
    group = None if base is None else _carry_metadata(dest, base, gen, state.schema)
    if group is None:  # a first dump, or the previous generation lacks metadata: write everything
        if base is not None:
            base, gen = None, dest.new_generation()  # the partial one goes after the commit
            gen_spec, separator = dest.child(gen), KEY_SEPARATOR
        group = create_group(gen_spec, meta, key_separator=separator)
    arrays = {} if codec.is_raw else {leaf.path: storing_every_chunk(group[leaf.path]._async_array)
                                      for leaf in state.schema.leaves}
    changed = None if base is None else changed_rows(storage.checkpoint_revisions, base.revision)
    plan = {}  # path -> (chunk rows, changed mask over the chunks holding data)
    for leaf in state.schema.leaves:
        chunk = layout[leaf.path][0]
        plan[leaf.path] = (chunk, _changed_chunks(changed, chunk, -(-state.high // chunk)))
    window = _window([chunk for chunk, _ in plan.values()], state.schema.row_bytes)
    # the new generation's digests, kept only where rows can change unseen by the revisions
    digests: Digests | None = {leaf.path: {} for leaf in state.schema.leaves} \
        if state.in_place else None
    if base is not None and state.in_place:  # rows written in place carry no revision
        _add_changed_in_place(state, dest, base, plan, window, digests)
    total = sum(int(mask.sum()) * chunk * state.schema.by_path[p].row_bytes
                for p, (chunk, mask) in plan.items())
    copies = []  # chunks carried over from the base generation: (its key, the new key)
    for leaf in state.schema.leaves if base is not None else ():
        for i in np.flatnonzero(~plan[leaf.path][1]).tolist():
            key = chunk_key(leaf.path, 1 + len(leaf.shape), i, separator)
            copies.append((f"{base.generation}/{key}", f"{gen}/{key}"))
    writer = _ChunkWriter(gen_spec, separator, codec.is_raw, arrays, digests)
    with progress_bar(total, f"dumps {dest.url}", progress) as bar, \
            ThreadPoolExecutor(1, thread_name_prefix="zstore-ckpt-carry") as carrier:
        carried = carrier.submit(dest.copy_objects, copies)  # links / copies while this writes
        written = writer.write(state, plan, window, bar)
        if carried.result() < len(copies):  # the base lacks chunks: write them from the rows
            written += writer.write(state, writer.missing(state.schema, plan), window, bar)
    meta.length, meta.last_cursor, meta.high_water = state.length, state.last_cursor, state.high
    commit(group, meta)
    _remember(dest.url, gen, meta, group, digests)
    return {"checkpointer": checkpointer, "form": "buffer", "generation": gen,
            "length": state.length, "last_cursor": state.last_cursor, "max_size": state.max_size,
            "rows": state.rows, "ndim": state.ndim, "incremental": base is not None,
            "bytes_written": written, "revision": revision, "key_separator": separator,
            ALL_STORED: True}


class _ChunkWriter(NamedTuple):
    """Where a dump writes chunks: the new generation, its chunk-key separator, (for
    compressed codecs; raw chunks are written as objects) its zarr arrays, and the
    digests of the chunks written, filled as they are (None: none are kept)."""

    spec: StoreSpec
    separator: str
    raw: bool
    arrays: dict[str, Any]
    digests: Digests | None

    def write(self, state: TensorState, plan: dict[str, tuple[int, np.ndarray]], window: int,
              bar: Any) -> int:
        """Write the chunks ``plan`` marks (``{path: (chunk rows, bool per chunk)}``) from
        the storage's rows, a window of rows at a time; return the bytes written."""
        written = 0
        for lo in range(0, state.high, window):
            hi = min(lo + window, state.rows)
            jobs, pieces = [], []
            columns = None
            for leaf in state.schema.leaves:
                chunk, mask = plan[leaf.path]
                first = lo // chunk
                local = mask[first: -(-min(hi, state.high) // chunk)]
                for a, b in _runs(local):
                    if columns is None:
                        columns = state.read(lo, hi)
                    start, stop = (first + a) * chunk, min((first + b) * chunk, state.rows)
                    value = as_numpy(columns[leaf.path][start - lo: stop - lo], leaf.dtype)
                    written += value.nbytes
                    for i in range(a, b) if self.digests is not None else ():
                        self.digests[leaf.path][first + i] = digest(
                            value[(i - a) * chunk:(i - a + 1) * chunk])
                    if self.raw:
                        pieces.append((leaf.path, value, first + a, chunk))
                    else:
                        jobs.append((self.arrays[leaf.path], start, stop, value))
            write_raw(self.spec, pieces, self.separator)
            _write_all(jobs)
            bar.update(sum(job[3].nbytes for job in jobs) + sum(p[1].nbytes for p in pieces))
        return written

    def missing(self, schema, plan: dict[str, tuple[int, np.ndarray]]
                ) -> dict[str, tuple[int, np.ndarray]]:
        """The plan of the chunks ``plan`` covers that the generation does not hold (one
        listing): those the previous generation lacked, so none was carried over."""
        stored = self.spec.objects()
        lost = {}
        for leaf in schema.leaves:
            chunk, mask = plan[leaf.path]
            keys = (chunk_key(leaf.path, 1 + len(leaf.shape), i, self.separator)
                    for i in range(len(mask)))
            lost[leaf.path] = (chunk, np.array([key not in stored for key in keys], dtype=bool))
        return lost


class _Base(NamedTuple):
    """The generation an incremental dump carries chunks over from."""

    generation: str
    revision: int  # the storage's write revision it holds: rows written later changed
    layout: dict
    separator: str  # of its chunk keys
    root: dict  # its root group's Zarr metadata


#: (destination URL, generation) -> (its ``zstore`` block, its root group's metadata, the
#: digests of those of its chunks this process wrote or checked) for the last generations
#: this process wrote or read: the next incremental dump onto one need not read it again
#: (a generation never changes once written).
_KNOWN: OrderedDict[tuple[str, str], tuple[StoreMeta, dict, Digests]] = OrderedDict()
_KNOWN_MAX = 32


def _remember(url: str, generation: str, meta: StoreMeta, group: zarr.Group,
              digests: Digests | None = None) -> None:
    _KNOWN[(url, generation)] = (meta, group.metadata.to_dict(), digests or {})
    while len(_KNOWN) > _KNOWN_MAX:
        _KNOWN.popitem(last=False)


def _carry_metadata(dest: Destination, base: _Base, gen: str, schema) -> zarr.Group | None:
    """Generation ``gen``'s Zarr metadata carried over from ``base`` (same keys, layout and
    codec): every array's and sub-group's ``zarr.json`` linked / copied server-side, and the
    root group (its ``zarr.json`` is the commit) opened from the base's, unwritten. None
    when ``base`` lacks one of them."""
    nodes = {f"{leaf.path}/zarr.json" for leaf in schema.leaves}
    nodes |= {f"{sub}/zarr.json" for sub in schema.group_paths}
    if dest.copy_objects((f"{base.generation}/{node}", f"{gen}/{node}") for node in sorted(nodes)) \
            != len(nodes):
        return None
    return zarr.Group(AsyncGroup(GroupMetadata.from_dict(base.root), StorePath(dest.child(gen).open())))


def _add_changed_in_place(state: TensorState, dest: Destination, base: _Base,
                          plan: dict[str, tuple[int, np.ndarray]], window: int,
                          digests: Digests) -> None:
    """Mark for writing in ``plan`` the chunks it would carry over from ``base`` whose rows
    differ from the base's (changed in place, unseen by the write revisions); put the
    digests of those still carried over in ``digests``. The base's digests are the ones
    remembered, else read from it (a chunk it cannot give is written)."""
    carried = {path: (chunk, set(np.flatnonzero(~mask).tolist()))
               for path, (chunk, mask) in plan.items()}
    now = chunk_digests(_arrays_reader(state.read, state.schema), carried, state.rows, window)
    known = _KNOWN.get((dest.url, base.generation), (None, None, {}))[2]
    before = {path: dict(known.get(path, {})) for path in carried}
    lacking = {path: (chunk, {i for i in indices if i not in before[path]})
               for path, (chunk, indices) in carried.items()}
    if any(indices for _, indices in lacking.values()):
        try:
            group, meta = open_group(dest.child(base.generation).as_read_only())
            reader = _GenerationReader.of(dest.child(base.generation), group, meta, True)
            for path, found in chunk_digests(_arrays_reader(reader.read, meta.schema),
                                             lacking, meta.rows, window).items():
                before[path].update(found)
        except (CheckpointError, OSError, NotAZStoreError, StoreNotFoundError, KeyError):
            pass  # those it lacks are written
    for path, (chunk, mask) in plan.items():
        for i in carried[path][1]:
            if before[path].get(i) == now[path][i]:
                digests[path][i] = now[path][i]
            else:
                mask[i] = True


def _arrays_reader(read: Callable[[int, int], dict[str, torch.Tensor]], schema: Schema
                   ) -> Callable[[int, int], dict[str, np.ndarray]]:
    """``read`` (rows ``[lo, hi)`` as ``{key path: tensor}``) returning the NumPy arrays of
    their Zarr dtypes, as a dump writes them."""
    leaves = schema.by_path
    return lambda lo, hi: {path: as_numpy(value, leaves[path].dtype)
                           for path, value in read(lo, hi).items()}


def _loaded_digests(storage: TensorCheckpointable, meta: StoreMeta, high: int,
                    window: int) -> Digests | None:
    """The digests of the chunks of rows ``[0, high)`` of the generation ``storage`` was
    just filled from (its rows now), where rows can change in place: the next dump compares
    with them instead of reading the generation back (a download, from a bucket)."""
    state = TensorState.of(storage)
    if not state.in_place or not set(meta.layout) <= set(state.schema.by_path):
        return None
    wanted = {path: (chunk, set(range(-(-high // chunk))))
              for path, (chunk, _) in meta.layout.items()}
    return chunk_digests(_arrays_reader(state.read, state.schema), wanted, state.rows, window)


def _write_all(jobs: list) -> None:
    if not jobs:
        return

    async def run():
        return await asyncio.gather(*[array.setitem(slice(start, stop), value)
                                      for array, start, stop, value in jobs],
                                    return_exceptions=True)

    for job, result in zip(jobs, sync(run())):
        if isinstance(result, BaseException):
            raise OSError(f"cannot write rows {job[1]}:{job[2]} of a checkpoint: {result}") from result
        fault_point("write")


def _incremental_base(storage, dest: Destination, previous, state: TensorState, layout,
                      codec: CodecSpec) -> _Base | None:
    """The previous generation, when ``storage`` can dump incrementally onto it; ``layout``
    None accepts the previous generation's chunking."""
    mark = storage.checkpoint_marks.get(dest.url)
    if previous is None or mark is None or previous.get("form") != "buffer" \
            or previous.get("generation") != mark[0]:
        return None
    separator = previous.get("key_separator", "/")  # generations before the record said: "/"
    if separator not in KEY_SEPARATORS:
        return None
    known = _KNOWN.get((dest.url, mark[0]))
    if known is None:
        try:
            group, old = open_group(dest.child(mark[0]).as_read_only())
        except Exception:  # noqa: BLE001 - an unreadable previous generation: write everything
            return None
        known = old, group.metadata.to_dict(), {}
    old, root = known[:2]
    if (old.rows != state.rows or old.schema.leaves != state.schema.leaves
            or (layout is not None and old.layout != layout) or old.codec != codec or old.key_codecs):
        return None
    return _Base(mark[0], mark[1], old.layout, separator, root)


def load_buffer(storage: TensorCheckpointable, dest: Destination,
                record: Mapping[str, Any] | None, progress: bool) -> None:
    """Fill ``storage`` from a buffer generation (or from a plain zstore buffer at ``dest``)."""
    spec = dest.spec if record is None else dest.child(str(record["generation"]))
    try:
        group, meta = open_group(spec.as_read_only())
    except (StoreNotFoundError, NotAZStoreError):
        if record is None:
            raise
        raise CheckpointError(f"{spec.redacted()}: the committed generation (or its zarr.json) "
                              f"is missing: {DAMAGED}") from None
    if record is not None:
        _require_agreement(meta, record, spec)
        refuse_newer_generation(spec, meta.unknown)
    schema, lanes = meta.schema, tuple(meta.schema.lane_shape)
    high = _stored_rows(meta)
    all_stored = bool(record and record.get(ALL_STORED))
    reader = _GenerationReader.of(spec, group, meta, all_stored)
    raw, separator, read = reader.raw, reader.separator, reader.read
    window = _window([chunk for chunk, _ in meta.layout.values()], schema.row_bytes)
    first = read(0, 1)
    # a storage initialised before the load keeps its memory (others may hold it, shared
    # with another process): it is filled in place; a new one may take mapped files
    mappable = spec.is_local and not storage.initialized
    prepare(storage, schema.build({p: c[0] for p, c in first.items()}, lanes), schema, meta.rows,
            meta.max_size, dest.redacted())
    with progress_bar(high * schema.row_bytes, f"loads {dest.url}", progress) as bar:
        targets = _in_memory_columns(storage, schema) if raw else None
        if targets is not None:  # straight into the container's memory
            if mappable:  # chunk files mapped copy-on-write where they can be
                targets = _map_columns(storage, schema, spec, meta.layout, targets, high, separator,
                                       all_stored)
            read_raw(spec, [(path, target[:high], 0, meta.layout[path][0])
                            for path, target in targets.items()], separator, all_stored)
            bar.update(high * schema.row_bytes)
        else:
            for lo in range(0, high, window):
                hi = min(lo + window, high)
                storage.checkpoint_write(lo, schema.build(read(lo, hi), (hi - lo, *lanes)))
                bar.update((hi - lo) * schema.row_bytes)
    mark = None if record is None else (dest.url, str(record["generation"]))
    finish(storage, meta.length, meta.last_cursor, high, mark)
    if mark is not None:  # (a local generation is read back cheaply: its files may be mapped)
        _remember(*mark, meta, group, None if spec.is_local else
                  _loaded_digests(storage, meta, high, window))


def _require_agreement(meta: StoreMeta, record: Mapping[str, Any], spec: StoreSpec) -> None:
    """Raise :class:`CheckpointError` when a generation's length or cursor differs from those
    of the commit record naming it: a dump writes both from one state, so one was damaged."""
    differ = [f"{name} {value} (the commit record says {record[name]})"
              for name, value in (("length", meta.length), ("last_cursor", meta.last_cursor))
              if name in record and int(record[name]) != value]
    if differ:
        raise CheckpointError(f"{spec.redacted()}: the generation's {', '.join(differ)}: "
                              f"{DAMAGED}")


def _stored_rows(meta: StoreMeta) -> int:
    """Rows ``[0, n)`` of a generation that hold data."""
    lanes = max(1, math.prod(meta.schema.lane_shape))
    filled = -(-meta.length // lanes) if meta.length < meta.max_size else meta.rows
    return min(max(meta.high_water, filled), meta.rows)


class _GenerationReader(NamedTuple):
    """Reads rows of a buffer generation: raw chunk files straight into arrays where
    every key is raw and unsharded (one chunk-key separator), else through zarr."""

    spec: StoreSpec
    meta: StoreMeta
    arrays: dict[str, Any]
    separator: str | None
    raw: bool
    all_stored: bool

    @classmethod
    def of(cls, spec: StoreSpec, group: zarr.Group, meta: StoreMeta,
           all_stored: bool) -> "_GenerationReader":
        """The reader of generation ``group`` at ``spec``; ``all_stored``: it stores every
        chunk, so a missing one is damage (checked here for zarr's reads, as read for raw ones)."""
        arrays = _arrays_of(group, meta.schema, spec)
        separators = {key_separator(array.metadata.to_dict()) for array in arrays.values()}
        separator = separators.pop() if len(separators) == 1 else None
        raw = separator is not None and meta.all_raw \
            and all(shard is None for _, shard in meta.layout.values())
        if all_stored and not raw:  # raw chunks are checked as they are read
            require_stored(spec, arrays, _stored_rows(meta))
        return cls(spec, meta, arrays, separator, raw, all_stored)

    def read(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows ``[lo, hi)`` as ``{key path: tensor}``."""
        schema = self.meta.schema
        if not self.raw:
            return _read(self.arrays, schema, lo, hi, self.spec.redacted())
        values = {leaf.path: np.empty((hi - lo, *leaf.shape), dtype=storage_numpy_dtype(leaf.dtype))
                  for leaf in schema.leaves}
        read_raw(self.spec, [(path, value, lo, self.meta.layout[path][0])
                             for path, value in values.items()], self.separator, self.all_stored)
        return {leaf.path: as_torch(values[leaf.path], leaf.dtype) for leaf in schema.leaves}


def _map_columns(storage: Any, schema, spec, layout, targets: dict[str, np.ndarray], high: int,
                 separator: str, all_stored: bool) -> dict[str, np.ndarray]:
    """Replace the container's columns whose chunks can be mapped (:mod:`._mapped`) by
    copy-on-write mappings of the chunk files of rows ``[0, high)``; return the targets
    left to read. A TensorDict or single-tensor container only (others: all left)."""
    container = storage._storage
    if not (type(container) is TensorDict or isinstance(container, torch.Tensor)) \
            or getattr(storage, "consolidated", False):
        return targets
    root = spec.filesystem()[1].rstrip("/")
    mapped = {}
    for leaf in schema.leaves:
        target = targets[leaf.path]
        chunk_rows = layout[leaf.path][0]
        chunk_bytes = chunk_rows * (target.nbytes // max(1, len(target)))
        if not _mapped.supported(chunk_bytes):
            continue
        paths = [f"{root}/{chunk_key(leaf.path, target.ndim, i, separator)}"
                 for i in range(-(-high // chunk_rows))]
        try:
            column = _mapped.map_chunks(paths, chunk_bytes, target.nbytes, all_stored)
        except OSError:  # a filesystem without mmap: read this column instead
            continue
        mapped[leaf.path] = as_torch(column.view(target.dtype).reshape(target.shape), leaf.dtype)
    if not mapped:
        return targets
    if isinstance(container, torch.Tensor):
        storage._storage = mapped[schema.leaves[0].path]
    else:
        for leaf in schema.leaves:
            if leaf.path in mapped:
                container.set(leaf.key, mapped[leaf.path])
    return {path: target for path, target in targets.items() if path not in mapped}


def _arrays_of(group: zarr.Group, schema, spec) -> dict[str, Any]:
    """The generation's array of every key of ``schema``; a missing one (its ``zarr.json``
    gone) raises :class:`CheckpointError` naming it."""
    arrays = {}
    for leaf in schema.leaves:
        try:
            arrays[leaf.path] = group[leaf.path]._async_array
        except KeyError:
            raise CheckpointError(
                f"{spec.redacted()}: the array of key {leaf.path!r} ({leaf.path}/zarr.json) is "
                f"missing: {DAMAGED}") from None
    return arrays


def _in_memory_columns(storage: Any, schema) -> dict[str, np.ndarray] | None:
    """NumPy views of an in-RAM CPU container's columns (None for other storages, and for
    string leaves, which an in-RAM container keeps as strings)."""
    if not storage.initialized or schema.texts or storage.checkpoint_export().columns is None:
        return None
    try:
        columns = schema.columns(storage._storage, 1)  # checked against the checkpoint's schema
    except MissingKeyError:  # keys the checkpoint adds (prepare): written, hence created, below
        return None
    if any(c.device.type != "cpu" or not c.is_contiguous() for c in columns.values()):
        return None
    # detached: a column that requires grad is filled in place, as TorchRL's loads does
    return {leaf.path: to_storage(columns[leaf.path].detach()).numpy().view(
        storage_numpy_dtype(leaf.dtype)) for leaf in schema.leaves}


def _read(arrays, schema, lo: int, hi: int, where: str) -> dict[str, torch.Tensor]:
    """Rows ``[lo, hi)`` of every key through zarr; a failure names the checkpoint ``where``,
    the key and the rows, and a chunk that does not decode says the checkpoint is damaged."""
    async def run():
        return await asyncio.gather(*[arrays[leaf.path].getitem(slice(lo, hi))
                                      for leaf in schema.leaves], return_exceptions=True)

    out = {}
    for leaf, result in zip(schema.leaves, sync(run())):
        if isinstance(result, BaseException):
            damaged = "" if isinstance(result, OSError) else (
                "; the checkpoint is damaged (a chunk does not decode): load an intact copy")
            raise CheckpointError(f"{where}: cannot read rows {lo}:{hi} of key {leaf.path!r} "
                                  f"({type(result).__name__}: {result}){damaged}") from result
        out[leaf.path] = as_torch(result, leaf.dtype)
    return out
