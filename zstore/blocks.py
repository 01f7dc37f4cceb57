"""One group of columns that share a chunk length: their cache, block I/O and write-back.

A :class:`BlockGroup` owns the keys of a buffer whose Zarr chunks hold the same
number of rows (``R``) and whose shards hold the same number of chunks
(``k``). Its row *blocks* (chunks along dim 0) are cached in one
:class:`~zstore.cache.ChunkCache`; a read is one vectorised slot lookup plus
one ``index_select`` per key; a write lands in the cached slots, which stay
*dirty* until the block's write unit (a chunk, or a whole shard) is stored —
when its last row is written, or on ``flush`` — or until its slot is needed: its
rows are then logged (:mod:`zstore.tail`), or its unit stored.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Mapping

import numpy as np
import torch
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore

from . import _faults
from ._pages import gather_rows
from .cache import ChunkCache
from .chunkio import MAX_IN_FLIGHT, PARALLEL_BYTES, ColumnReader, Throttle
from .credentials import request_error
from .dtypes import compute_dtype, from_numpy, from_storage, storage_numpy_dtype, to_storage
from .errors import CorruptChunkError, ZStoreError
from .layout import Leaf
from .retry import with_retries
from .tail import Segment, decode, encode, group_id, segment_key
from .writeback import WriteBehind

#: Most log segments one write unit collects before a commit stores the unit whole.
MAX_UNIT_SEGMENTS = 64


def _ravel(lanes: torch.Tensor, lane_shape) -> torch.Tensor:
    """Flat lane index of ``[n_lane_dims, n]`` lane coordinates."""
    flat = torch.zeros(lanes.shape[1], dtype=torch.int64)
    for dim, size in enumerate(lane_shape):
        flat = flat * size + lanes[dim]
    return flat


def gather_cells(source: torch.Tensor, rows: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """``source[rows[i], *lanes[:, i]]`` for a ``[rows, *lane_dims, *features]`` tensor."""
    n_dims = lanes.shape[0] if lanes.ndim > 1 else 1
    lane_shape = source.shape[1:1 + n_dims]
    n_lanes = math.prod(lane_shape)
    lane_flat = lanes if lanes.ndim == 1 else _ravel(lanes, lane_shape)
    cells = source.reshape(source.shape[0] * n_lanes, *source.shape[1 + n_dims:])
    return cells.index_select(0, rows * n_lanes + lane_flat.to(source.device))


class BlockGroup:
    """Keys sharing a chunk length ``chunk_rows`` and a shard length ``shard_rows``."""

    def __init__(self, arrays: Mapping[str, zarr.Array], leaves: tuple[Leaf, ...], rows: int,
                 chunk_rows: int,
                 shard_rows: int | None, high_water: int, *, cache_bytes: int, cache_tier: str,
                 lock: threading.RLock, where: str, read_only: bool = False, lease: Any = None,
                 tail_log: bool = False, segments: list[Segment] = (), listed: Any = None,
                 all_stored: bool = False):
        self.leaves = leaves
        # the writer's lease (zstore.lease): renewed as stores start, and checked again as each
        # one runs, however late: a writer stalled past its ttl stores nothing more
        self.lease = lease
        self.rows = rows
        self.R = chunk_rows
        self.k = (shard_rows or chunk_rows) // chunk_rows
        self.high_water = high_water
        self.where = where
        self.lock = lock
        self.n_blocks = -(-rows // chunk_rows)
        self.unit_rows = self.R * self.k
        self.store = arrays[leaves[0].path].store
        # the tail log (zstore.tail): segments the next commit lists, in order; rows written
        # since their block was last stored or logged ({block: [lo, hi)}); segments dropped
        # since the last commit (deleted once it no longer lists them); decoded segments read
        self.tail_log = tail_log  # commits log partly written units (else store them whole)
        self.id = group_id(chunk_rows, self.unit_rows)
        self.segments: list[Segment] = list(segments)
        self.unlogged: dict[int, list[int]] = {}
        self.superseded: list[Segment] = []
        self._segment_rows: dict[int, list[np.ndarray]] = {}
        self._next_seq = max((seg.seq for seg in self.segments), default=-1) + 1
        # the block the newest write ended in: its unit (a filling buffer's tail) keeps its
        # dirty slots while the others make room (see _make_room)
        self.last_written: int | None = None
        # () -> the segments of this group the store's commit lists now (a reader whose
        # segment was deleted under it asks whether the unit was stored whole since)
        self._listed = listed
        self.writes = WriteBehind(where, keepalive=None if lease is None else lease.keep_alive)
        fs = getattr(self.store, "fs", None)  # FsspecStore's; LocalStore and ObjectStore have none
        self.remote = ("memory" not in fs.protocol if fs is not None
                       else not isinstance(self.store, LocalStore))
        arrays = {leaf.path: arrays[leaf.path] for leaf in leaves}
        self.arrays = {path: array._async_array for path, array in arrays.items()}
        self.readers = {path: ColumnReader.for_array(array, where) for path, array in arrays.items()}
        for reader in self.readers.values():  # a missing object of a sealed dataset raises
            if reader is not None:
                reader.all_stored = all_stored
        # a writer owns its store and may keep shard indexes; a reader must not: the
        # writer may rewrite a shard (and move its chunks) at any time
        self.keep_indexes = not read_only
        self.cache = ChunkCache(
            self.n_blocks, chunk_rows,
            {leaf.path: (compute_dtype(leaf.dtype), leaf.shape) for leaf in leaves},
            cache_bytes, cache_tier)
        self.device = self.cache.tier.device
        self.pinned = self.cache.tier.name == "pinned"
        # NumPy views of host slabs: bulk copies go through memcpy, not torch kernels
        self.host = {leaf.path: self.cache.slabs[leaf.path].numpy().view(storage_numpy_dtype(leaf.dtype))
                     for leaf in leaves} if self.device.type == "cpu" else None

    # -- store I/O ----------------------------------------------------------------------
    def _span(self, block: int) -> tuple[int, int]:
        start = block * self.R
        return start, min(start + self.R, self.rows)

    def _fetch(self, blocks: list[int], into: dict[str, list[np.ndarray]] | None = None
               ) -> dict[str, list[np.ndarray | None]]:
        """Decoded ``blocks`` of every key, all requests in flight at once (None: never stored).

        ``into[path][i]``: a host cache slot block ``i`` of key ``path`` may be decoded
        straight into (see :meth:`ColumnReader.read`).

        Uploads in flight land first (read what was written, never what was there
        before). On a remote store, and for a reader, a payload that fails to
        decode is fetched again (:mod:`zstore.retry`): a damaged transfer, or a
        shard the writer replaced between the reader's index and data requests,
        is not a corrupt object. A reader re-reads shard indexes on every fetch.
        """
        self.writes.drain()

        def fetched() -> dict[str, list[np.ndarray | None]] | None:
            out = self._fetch_once(blocks, into)
            return out if self._overlay(blocks, out) else None  # (None: segments dropped)

        for _ in range(3):
            if self.keep_indexes and not self.remote:  # a local writer owns its store
                out = fetched()
            else:  # (a damaged segment is fetched again too; a failed request where the
                # store's client retries none, HTTP's, as well)
                out = with_retries(fetched, (CorruptChunkError,) if getattr(
                    self.store, "client_retries", True) else (CorruptChunkError, ConnectionError))
            if out is not None:
                return out
        raise CorruptChunkError(f"the log segments of {self.where} keep changing under this "
                                "reader: reopen it")

    # -- the tail log ---------------------------------------------------------------------
    def _overlay(self, blocks: list[int], out: dict[str, list[np.ndarray | None]]) -> bool:
        """Lay the committed segments over fetched ``blocks``, in order (False: refetch).

        A segment the writer deleted since this group read its list is no longer
        listed: its unit was stored whole, so the blocks are fetched again.
        """
        if not self.segments:
            return True
        spans = [self._span(block) for block in blocks]
        needed = [seg for seg in self.segments
                  if any(seg.first < hi and seg.stop > lo for lo, hi in spans)]
        if not self._read_segments(needed):
            return False
        for i, (lo, hi) in enumerate(spans):
            for seg in needed:
                if seg.stop <= lo or seg.first >= hi:
                    continue
                rows = self._segment_rows[seg.seq]
                a, z = max(lo, seg.first), min(hi, seg.stop)
                for leaf, part in zip(self.leaves, rows):
                    array = out[leaf.path][i]
                    if array is None:
                        array = np.zeros((hi - lo, *leaf.shape), dtype=storage_numpy_dtype(leaf.dtype))
                    elif len(array) < hi - lo:
                        array = np.concatenate([array, np.zeros((hi - lo - len(array), *leaf.shape),
                                                                dtype=array.dtype)])
                    elif not array.flags.writeable:
                        array = array.copy()
                    array[a - lo: z - lo] = part[a - seg.first: z - seg.first]
                    out[leaf.path][i] = array
        return True

    def _read_error(self, error: BaseException, what: str) -> BaseException:
        """The error to raise for ``error``, met doing ``what`` (named in it): zstore's own as
        they are; the server or the credentials (the data is not at fault) as a
        ``ConnectionError`` / ``PermissionError``; a body damaged in transfer, or one that
        failed to decode, as :class:`CorruptChunkError` (fetched again by :meth:`fetch`)."""
        if isinstance(error, ZStoreError):  # a corrupt chunk, a store gone: said already
            return error
        failure = request_error(error, self.where, what, "the data is not at fault: read again "
                                "later", remote=self.remote, refetched=True)
        if failure is None:
            failure = CorruptChunkError(f"{what}: {type(error).__name__}: {error}")
            failure.__cause__ = error
        return failure

    def _read_segments(self, segments: list[Segment]) -> bool:
        """Decode each of ``segments`` not read yet into ``_segment_rows`` (False: one was
        dropped from the commit since this group listed it).

        The segments are fetched concurrently and counted in :attr:`cache.stats`
        (``requests``, ``fetched_bytes``) like the blocks' objects.
        """
        missing = [seg for seg in segments if seg.seq not in self._segment_rows]
        if not missing:
            return True
        keys = [segment_key(self.id, seg.seq) for seg in missing]
        throttle = Throttle(MAX_IN_FLIGHT)

        async def get(key: str) -> bytes | None:
            async with throttle.slot():
                data = await self.store.get(key, default_buffer_prototype())
            if data is None:
                return None
            data = data.to_bytes()
            throttle.bytes += len(data)
            return data

        async def run():
            return await asyncio.gather(*[get(key) for key in keys], return_exceptions=True)

        results = sync(run())
        self._count_fetches(throttle)
        for seg, key, data in zip(missing, keys, results):
            if isinstance(data, BaseException):
                raise self._read_error(data, f"cannot read log segment {key} of {self.where}")
            if data is None:
                listed = None if self._listed is None else self._listed()
                if listed is not None and seg not in listed:
                    self.segments = listed
                    return False
                raise CorruptChunkError(f"log segment {key} of {self.where} is listed by its "
                                        "commit but missing from the store")
            self._segment_rows[seg.seq] = decode(
                data, [(storage_numpy_dtype(leaf.dtype), leaf.shape) for leaf in self.leaves],
                seg.stop - seg.first, f"{key} of {self.where}")
        return True

    def _unit_segments(self, unit: int) -> list[Segment]:
        return [seg for seg in self.segments if seg.first // self.unit_rows == unit]

    def _note_written(self, block: int, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` of ``block`` were written: the next commit logs or stores them
        (tracked only with ``tail_log``)."""
        span = self.unlogged.get(block)
        if span is None:
            self.unlogged[block] = [lo, hi]
        else:
            span[0], span[1] = min(span[0], lo), max(span[1], hi)

    def _log_tail(self, blocks: torch.Tensor) -> torch.Tensor:
        """Log the unstored rows of dirty ``blocks`` whose unit is cheaper to log than to store.

        Returns the blocks whose units must be stored whole: a unit whose log
        would outgrow the unit itself, or that has ``MAX_UNIT_SEGMENTS`` already.
        Logged blocks stay dirty (a commit keeps them cached until their unit
        completes and is stored once; :meth:`_make_room` cleans them).
        """
        by_unit: dict[int, list[int]] = {}
        for block in blocks.tolist():
            by_unit.setdefault(block // self.k, []).append(block)
        store = []
        for unit, members in by_unit.items():
            spans = [self.unlogged[b] for b in members if b in self.unlogged]
            if not spans:
                continue  # logged already, stored when the unit completes
            start, stop = unit * self.unit_rows, min((unit + 1) * self.unit_rows, self.rows)
            logged = self._unit_segments(unit)
            new = [list(span) for span in sorted(spans)]
            merged = [new[0]]
            for span in new[1:]:  # adjacent blocks' spans become one segment
                if span[0] == merged[-1][1]:
                    merged[-1][1] = span[1]
                else:
                    merged.append(span)
            total = sum(seg.stop - seg.first for seg in logged) + sum(b - a for a, b in merged)
            if len(logged) + len(merged) > MAX_UNIT_SEGMENTS or total > stop - start:
                store.extend(members)
                continue
            for first, last in merged:  # a refused upload raises here: the rows stay unlogged
                self._write_segment(first, last)
            for b in members:
                self.unlogged.pop(b, None)
        return torch.tensor(store, dtype=torch.int64)

    def _write_segment(self, first: int, stop: int) -> None:
        """Start storing rows ``[first, stop)`` (all cached) as the next segment."""
        columns = []
        for leaf in self.leaves:
            parts = []
            for block in range(first // self.R, (stop - 1) // self.R + 1):
                lo = block * self.R
                rows = self._block_rows(leaf, block, int(self.cache.slot_of[block]), {}, {})
                parts.append(rows[max(first, lo) - lo: min(stop, lo + self.R) - lo])
            columns.append(np.concatenate(parts))  # a copy: stored while the slots change
        seg = Segment(first, stop, self._next_seq)
        self._next_seq += 1
        data = encode(columns)
        key = segment_key(self.id, seg.seq)
        async def put() -> None:
            try:
                if self.lease is not None:
                    self.lease.ensure_fresh()
                await self.store.set(key, default_buffer_prototype().buffer.from_bytes(data))
            except Exception as exc:
                raise OSError(f"cannot write log segment {key} (rows {first}..{stop - 1}) to "
                              f"{self.where}: {type(exc).__name__}: {exc}") from exc
            _faults.crash_point("store.segment")

        self.writes.submit(put, len(data), frozenset({("segment", seg.seq)}))
        self.segments.append(seg)  # listed by the next commit, which waits for this upload

    def committed(self) -> None:
        """The commit listing :attr:`segments` landed: delete the segments it dropped."""
        dropped, self.superseded = self.superseded, []
        if not dropped:
            return

        async def delete() -> None:
            await asyncio.gather(*[self.store.delete(segment_key(self.id, seg.seq))
                                   for seg in dropped], return_exceptions=True)

        sync(delete())  # a failure leaves an unlisted object: garbage, never read

    def _fetch_once(self, blocks: list[int], into: dict[str, list[np.ndarray]] | None = None
                    ) -> dict[str, list[np.ndarray | None]]:
        # decoding on the shared pool pays a thread hand-off per chunk: only for larger reads
        # of chunks whose decode costs more than that (ColumnReader.worth_a_thread)
        pooled = {path: reader for path, reader in self.readers.items()
                  if reader is not None and reader.worth_a_thread(into is not None)}
        parallel = (len(blocks) * len(pooled) > 1
                    and len(blocks) * sum(r.block_nbytes for r in pooled.values()) >= PARALLEL_BYTES)

        async def column(leaf, limit):
            reader = self.readers[leaf.path]
            if reader is not None:
                return await reader.read(self.store, blocks, limit,
                                         None if into is None else into[leaf.path],
                                         parallel and leaf.path in pooled)
            return await asyncio.gather(*[self.arrays[leaf.path].getitem(slice(*self._span(b)))
                                          for b in blocks])

        throttle = Throttle(MAX_IN_FLIGHT)
        if not self.keep_indexes:
            for reader in self.readers.values():
                if reader is not None:
                    reader.indexes.clear()

        async def run():
            return await asyncio.gather(*[column(leaf, throttle) for leaf in self.leaves],
                                        return_exceptions=True)

        out = {}
        for leaf, result in zip(self.leaves, sync(run())):
            if isinstance(result, BaseException):
                raise self._read_error(result, f"cannot read chunks {blocks[:8]}"
                                       f"{'...' if len(blocks) > 8 else ''} of key "
                                       f"{leaf.path!r} in {self.where}")
            out[leaf.path] = result
        stats = self.cache.stats
        stats.loads += len(blocks)
        stats.loaded_bytes += len(blocks) * self.cache.block_bytes
        self._count_fetches(throttle)
        return out

    def _count_fetches(self, throttle: Throttle) -> None:
        """Add what went through ``throttle`` (requests, bytes, most in flight) to the stats."""
        stats = self.cache.stats
        stats.requests += throttle.requests
        stats.fetched_bytes += throttle.bytes
        stats.peak_in_flight = max(stats.peak_in_flight, throttle.peak)

    def _store(self, spans: list[tuple[int, int]], data: dict[str, list[np.ndarray]]) -> None:
        """Start storing ``data[path][i]`` at rows ``spans[i]`` (write-behind; see ``flush``).

        ``data`` must not alias the cache: the caller goes on writing slots meanwhile.
        """
        async def put(path: str, i: int) -> None:
            try:
                if self.lease is not None:
                    self.lease.ensure_fresh()
                await self.arrays[path].setitem(slice(*spans[i]), data[path][i])
            except Exception as exc:
                raise OSError(f"cannot write rows {spans[i]} of key {path!r} to {self.where}: "
                              f"{type(exc).__name__}: {exc}") from exc
            _faults.crash_point("store.unit")

        async def run() -> None:
            results = await asyncio.gather(
                *[put(leaf.path, i) for leaf in self.leaves for i in range(len(spans))],
                return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise failures[0]

        _faults.crash_point("store.before")
        for reader in self.readers.values():
            if reader is not None:
                reader.forget([start // self.R for start, _ in spans])
        nbytes = sum(array.nbytes for arrays in data.values() for array in arrays)
        self.writes.submit(run, nbytes, frozenset(start // self.unit_rows for start, _ in spans))

    # -- filling the cache ----------------------------------------------------------------
    def _copy_in(self, leaf: Leaf, slot: int, array: np.ndarray | None) -> None:
        if self.host is not None:
            target = self.host[leaf.path][slot]
            if array is None:
                target.fill(0)
            elif not np.may_share_memory(target, array):  # (else decoded into the slot)
                np.copyto(target[: len(array)], array)
        elif array is None:
            self.cache.slabs[leaf.path][slot].zero_()
        else:
            self.cache.slabs[leaf.path][slot, : len(array)].copy_(from_numpy(array, leaf.dtype))

    def _load(self, blocks: torch.Tensor, protect: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Give ``blocks`` slots; those flagged in ``keep`` get their stored rows (or zeros)."""
        clean_protected = len(protect) - int(self.cache.dirty[protect].sum()) if len(protect) else 0
        if len(blocks) > self.cache.clean_capacity() - clean_protected:
            self._make_room(len(blocks), protect)
        slots = self.cache.assign(blocks, protect)
        stored = keep & (blocks * self.R < self.high_water)
        for slot in slots[keep & ~stored].tolist():  # new blocks read or partly written: zeros
            for leaf in self.leaves:
                self._copy_in(leaf, slot, None)
        wanted = blocks[stored].tolist()
        if wanted:
            targets = slots[stored].tolist()
            into = None if self.host is None else \
                {leaf.path: [self.host[leaf.path][slot] for slot in targets] for leaf in self.leaves}
            try:
                fetched = self._fetch(wanted, into)
            except BaseException:
                self.cache.invalidate(blocks)  # the slots hold nothing of these blocks
                raise
            for leaf in self.leaves:
                for slot, array in zip(targets, fetched[leaf.path]):
                    self._copy_in(leaf, slot, array)
        return slots

    def slots_for_read(self, blocks: torch.Tensor) -> torch.Tensor:
        """Slots of the unique ``blocks``, loading the missing ones."""
        slots = self.cache.slot_of[blocks]
        miss = slots < 0
        n_miss = int(miss.sum())
        if n_miss:
            slots[miss] = self._load(blocks[miss], slots[~miss], torch.ones(n_miss, dtype=torch.bool))
        self.cache.touch(slots)
        return slots

    # -- reads ----------------------------------------------------------------------------
    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Rows (or cells) of this group's keys; ``rows`` is a CPU int64 tensor."""
        blocks = torch.div(rows, self.R, rounding_mode="floor")
        slots = self.cache.slot_of[blocks]
        n_miss = int((slots < 0).sum())
        if n_miss:
            ublocks, inverse = torch.unique(blocks, return_inverse=True)
            if len(ublocks) > self.cache.n_slots - self.cache.n_dirty:
                return self._read_in_rounds(rows, lanes, ublocks, inverse)
            slots = self.slots_for_read(ublocks)[inverse]
        else:
            self.cache.touch(slots)
        self.cache.stats.hits += len(rows) - n_miss  # rows: served from a cached block ...
        self.cache.stats.misses += n_miss  # ... or from one that had to be loaded
        pos = (slots * self.R + (rows - blocks * self.R)).to(self.device, non_blocking=True)
        out = {}
        for leaf in self.leaves:
            flat = self.cache.flat[leaf.path]
            if lanes is not None:
                value = gather_cells(flat, pos, lanes)
            elif self.pinned:  # gather straight into page-locked memory: async copies to a GPU
                value = torch.empty((len(pos), *flat.shape[1:]), dtype=flat.dtype, pin_memory=True)
                torch.index_select(flat, 0, pos, out=value)
            else:
                value = gather_rows(flat, pos)
            out[leaf.path] = from_storage(value, leaf.dtype)
        return out

    def _read_in_rounds(self, rows, lanes, ublocks, inverse) -> dict[str, torch.Tensor]:
        """A read touching more blocks than the clean slots, done a slab-full at a time.

        At least half the slots (or one per block read) are cleaned first; the
        tail's dirty blocks stay cached when the others leave that many.
        """
        self._make_room(min(len(ublocks), max(1, self.cache.n_slots // 2)))
        step = self.cache.clean_capacity()
        parts: dict[str, list] = {leaf.path: [] for leaf in self.leaves}
        order = []
        for start in range(0, len(ublocks), step):
            idx = torch.nonzero((inverse >= start) & (inverse < start + step)).squeeze(1)
            for path, value in self.read(rows[idx], None if lanes is None else lanes[..., idx]).items():
                parts[path].append(value)
            order.append(idx)
        perm = torch.empty(len(rows), dtype=torch.int64)
        perm[torch.cat(order)] = torch.arange(len(rows))
        return {path: torch.cat(chunks).index_select(0, perm.to(chunks[0].device))
                for path, chunks in parts.items()}

    def prefetch(self, rows: torch.Tensor) -> None:
        """Load the blocks of ``rows`` (as many as fit next to the dirty ones)."""
        blocks = torch.unique(torch.div(rows, self.R, rounding_mode="floor"))
        blocks = blocks[: self.cache.clean_capacity()]
        if len(blocks):
            self.slots_for_read(blocks)

    # -- writes ---------------------------------------------------------------------------
    def _slots_for_write(self, blocks: torch.Tensor, written: torch.Tensor) -> torch.Tensor | None:
        """Slots for unique ``blocks`` about to get ``written[i]`` rows each.

        A block only partly overwritten is first filled with its stored rows.
        None when the blocks outnumber the cache's slots (write in rounds).
        """
        if len(blocks) > self.cache.n_slots:
            return None
        slots = self.cache.slot_of[blocks]
        miss = slots < 0
        if bool(miss.any()):  # (_load makes room)
            spans = torch.clamp(self.rows - blocks[miss] * self.R, max=self.R)
            slots[miss] = self._load(blocks[miss], slots[~miss], written[miss] < spans)
        self.cache.touch(slots)
        return slots

    def write(self, urows: torch.Tensor, last: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        """Write ``values[path][last[i]]`` to unique sorted row ``urows[i]``."""
        blocks = torch.div(urows, self.R, rounding_mode="floor")
        ublocks, inverse, counts = torch.unique(blocks, return_inverse=True, return_counts=True)
        slots = self._slots_for_write(ublocks, counts)
        if slots is None:
            self._write_in_rounds(urows, last, values, ublocks, inverse)
            return
        pos = (slots[inverse] * self.R + (urows - blocks * self.R)).to(self.device)
        for leaf in self.leaves:
            value = values[leaf.path]
            value = to_storage(value).index_select(0, last.to(value.device))
            self.cache.flat[leaf.path].index_copy_(0, pos, value.to(self.device))
        self.cache.mark_dirty(slots)
        if self.tail_log:
            ends = torch.cumsum(counts, 0)  # urows is sorted: each block's rows are one run
            for block, lo, hi in zip(ublocks.tolist(), urows[ends - counts].tolist(),
                                     (urows[ends - 1] + 1).tolist()):
                self._note_written(block, lo, hi)
        self.last_written = int(blocks[torch.argmax(last)])  # the row written last
        self.high_water = max(self.high_water, int(urows[-1]) + 1)
        self._store_completed(urows)

    def write_span(self, first: int, values: Mapping[str, torch.Tensor]) -> None:
        """Write ``values[path][i]`` to row ``first + i`` (an extend): slice copies per block."""
        n = len(next(iter(values.values())))
        stop = first + n
        first_block, last_block = first // self.R, (stop - 1) // self.R
        blocks = torch.arange(first_block, last_block + 1)
        written = (torch.clamp((blocks + 1) * self.R, max=stop)
                   - torch.clamp(blocks * self.R, min=first))
        slots = self._slots_for_write(blocks, written)
        if slots is None:
            rows = torch.arange(first, stop)
            self._write_in_rounds(rows, torch.arange(n), values, blocks,
                                  torch.div(rows, self.R, rounding_mode="floor") - first_block)
            return
        for leaf in self.leaves:
            value = to_storage(values[leaf.path]).to(self.device)
            slab = self.cache.slabs[leaf.path]
            for block, slot in zip(range(first_block, last_block + 1), slots.tolist()):
                lo, hi = max(first, block * self.R), min(stop, (block + 1) * self.R)
                slab[slot, lo - block * self.R: hi - block * self.R].copy_(value[lo - first: hi - first])
        self.cache.mark_dirty(slots)
        if self.tail_log:
            for block in range(first_block, last_block + 1):
                self._note_written(block, max(first, block * self.R), min(stop, (block + 1) * self.R))
        self.last_written = last_block
        self.high_water = max(self.high_water, stop)
        self._store_completed(torch.arange(first, stop))

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> None:
        """One-row write (``add``): no sorting, one copy per key."""
        block = row // self.R
        slot = int(self.cache.slot_of[block])
        if slot < 0:
            one = torch.tensor([block])
            span = min(self.R, self.rows - block * self.R)
            slot = int(self._load(one, one[:0], torch.tensor([span > 1]))[0])
        offset = row - block * self.R
        for leaf in self.leaves:
            self.cache.slabs[leaf.path][slot, offset].copy_(to_storage(values[leaf.path]))
        if not self.cache.dirty[slot]:
            self.cache.mark_dirty(torch.tensor([slot]))
        if self.tail_log:
            self._note_written(block, row, row + 1)
        self.cache.last_use[slot] = self.cache._tick
        self.last_written = block
        self.high_water = max(self.high_water, row + 1)
        if row == min((row // self.unit_rows + 1) * self.unit_rows, self.rows) - 1:
            self._store_completed(torch.tensor([row]))

    def _store_completed(self, urows: torch.Tensor) -> None:
        """Store the write units (chunks or shards) whose last row is in ``urows``."""
        ends = torch.clamp((torch.div(urows, self.unit_rows, rounding_mode="floor") + 1)
                           * self.unit_rows, max=self.rows) - 1
        done = torch.unique(torch.div(urows[urows == ends], self.R, rounding_mode="floor"))
        if len(done):
            self._persist(done)

    def _write_in_rounds(self, urows, last, values, ublocks, inverse) -> None:
        step = max(1, self.cache.n_slots // 2)
        for start in range(0, len(ublocks), step):
            idx = torch.nonzero((inverse >= start) & (inverse < start + step)).squeeze(1)
            self.write(urows[idx], last[idx], values)

    def _block_rows(self, leaf: Leaf, block: int, slot: int, fetched, where) -> np.ndarray:
        """Rows of ``block`` for a shard write: cached, read back, or zeros."""
        if slot >= 0:
            if self.host is not None:
                return self.host[leaf.path][slot]
            return self.cache.slabs[leaf.path][slot].cpu().numpy().view(storage_numpy_dtype(leaf.dtype))
        if block in where and fetched[leaf.path][where[block]] is not None:
            return fetched[leaf.path][where[block]][: self.R]
        return np.zeros((self.R, *leaf.shape), dtype=storage_numpy_dtype(leaf.dtype))

    def _make_room(self, need: int, protect: torch.Tensor | None = None) -> None:
        """Clean dirty slots until ``need`` slots besides ``protect`` can take other blocks.

        The dirty blocks of the unit written last (a filling buffer's tail) stay
        dirty if the others leave room: storing a partly written unit rewrites
        it whole. Each block cleaned has its unstored rows logged (``tail_log``;
        its unit is stored whole only when its log would outgrow it, see
        :meth:`_log_tail`), or its unit stored whole. A logged block read
        again is fetched like any other: the unit's segments lie over it.
        """
        dirty = self.cache.dirty_blocks()
        if self.last_written is not None:
            tail = torch.div(dirty, self.k, rounding_mode="floor") == self.last_written // self.k
            held = self.cache.slot_of[dirty[tail]]
            if protect is not None:
                held = torch.unique(torch.cat([held, protect]))
            if self.cache.n_slots - len(held) >= need:
                dirty = dirty[~tail]
        if self.tail_log:
            self._persist(self._log_tail(dirty))
            self.cache.mark_clean(self.cache.slot_of[dirty])
        else:
            self._persist(dirty)

    def _persist(self, blocks: torch.Tensor) -> None:
        """Encode and store the write units containing ``blocks``; their slots become clean.

        A shard is written whole: members not in the cache are read back from
        the store (or are zeros when never stored) without taking slots.
        """
        if not len(blocks):
            return
        shards = torch.unique(torch.div(blocks, self.k, rounding_mode="floor")).tolist()
        members = {s: list(range(s * self.k, min((s + 1) * self.k, self.n_blocks))) for s in shards}
        absent = [b for s in shards for b in members[s]
                  if int(self.cache.slot_of[b]) < 0 and b * self.R < self.high_water]
        fetched = self._fetch(absent) if absent else {}
        where = {block: i for i, block in enumerate(absent)}
        spans, data, stored = [], {leaf.path: [] for leaf in self.leaves}, []
        for shard in shards:
            start, stop = shard * self.k * self.R, min((shard + 1) * self.k * self.R, self.rows)
            spans.append((start, stop))
            slots = self.cache.slot_of[torch.tensor(members[shard])]
            for leaf in self.leaves:
                parts = [self._block_rows(leaf, block, slot, fetched, where)
                         for block, slot in zip(members[shard], slots.tolist())]
                rows = np.concatenate(parts)  # a copy: stored while the slots change
                data[leaf.path].append(rows[: stop - start])
            stored.append(slots[slots >= 0])
        self._store(spans, data)
        self.cache.mark_clean(torch.cat(stored))
        for shard in shards:
            for block in members[shard]:
                self.unlogged.pop(block, None)
        if self.segments:  # a unit stored whole holds its segments' rows
            stored_units = set(shards)
            dropped = [seg for seg in self.segments if seg.first // self.unit_rows in stored_units]
            if dropped:
                self.segments = [seg for seg in self.segments if seg not in dropped]
                self.superseded.extend(dropped)
                for seg in dropped:
                    self._segment_rows.pop(seg.seq, None)

    def flush(self, consolidate: bool = False) -> None:
        """Make every written row durable and wait until every write has landed.

        Units that are complete, or whose log would outgrow them, are stored
        whole; the other written rows become log segments (:mod:`zstore.tail`).
        ``consolidate`` stores every unit with written rows or segments whole,
        so the store holds no segments once committed (readable by zarr alone).
        """
        dirty = self.cache.dirty_blocks()
        if consolidate:
            logged = {seg.first // self.unit_rows for seg in self.segments}
            units = {int(b) // self.k for b in dirty.tolist()} | logged
            blocks = [b for u in sorted(units)
                      for b in range(u * self.k, min((u + 1) * self.k, self.n_blocks))]
            self._persist(torch.tensor(blocks, dtype=torch.int64))
        elif self.tail_log:
            self._persist(self._log_tail(dirty))
        else:
            self._persist(dirty)
        self.writes.drain()
        _faults.crash_point("store.after")
