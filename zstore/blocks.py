"""One group of columns that share a chunk length: their cache, block I/O and write-back.

A :class:`BlockGroup` owns the keys of a buffer whose Zarr chunks hold the same
number of rows (``R``) and whose shards hold the same number of chunks
(``k``). Its row *blocks* (chunks along dim 0) are cached in one
:class:`~zstore.cache.ChunkCache`; a read is one vectorised slot lookup plus
one ``index_select`` per key; a write lands in the cached slots, which stay
*dirty* until the block's write unit (a chunk, or a whole shard) is stored —
when its last row is written, when its slot is needed, or on ``flush``.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Mapping

import numpy as np
import torch
import zarr
from zarr.core.sync import sync

from . import _faults
from .cache import ChunkCache
from .chunkio import MAX_IN_FLIGHT, ColumnReader, Throttle
from .dtypes import compute_dtype, from_numpy, from_storage, storage_numpy_dtype, to_storage
from .errors import CorruptChunkError
from .layout import Leaf
from .retry import with_retries
from .writeback import WriteBehind


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
                 lock: threading.RLock, where: str, read_only: bool = False, lease: Any = None):
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
        self.store = arrays[leaves[0].path].store
        self.writes = WriteBehind(where, keepalive=None if lease is None else lease.keep_alive)
        fs = getattr(self.store, "fs", None)
        self.remote = fs is not None and "memory" not in fs.protocol
        arrays = {leaf.path: arrays[leaf.path] for leaf in leaves}
        self.arrays = {path: array._async_array for path, array in arrays.items()}
        self.readers = {path: ColumnReader.for_array(array, where) for path, array in arrays.items()}
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

    def _fetch(self, blocks: list[int]) -> dict[str, list[np.ndarray | None]]:
        """Decoded ``blocks`` of every key, all requests in flight at once (None: never stored).

        Uploads in flight land first (read what was written, never what was there
        before). On a remote store, and for a reader, a payload that fails to
        decode is fetched again (:mod:`zstore.retry`): a damaged transfer, or a
        shard the writer replaced between the reader's index and data requests,
        is not a corrupt object. A reader re-reads shard indexes on every fetch.
        """
        self.writes.drain()
        if self.keep_indexes and not self.remote:  # a local writer owns its store
            return self._fetch_once(blocks)
        return with_retries(lambda: self._fetch_once(blocks), (CorruptChunkError,))

    def _fetch_once(self, blocks: list[int]) -> dict[str, list[np.ndarray | None]]:
        async def column(leaf, limit):
            reader = self.readers[leaf.path]
            if reader is not None:
                return await reader.read(self.store, blocks, limit)
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
            if isinstance(result, CorruptChunkError):
                raise result
            if isinstance(result, BaseException):
                raise CorruptChunkError(
                    f"cannot read chunks {blocks[:8]}{'...' if len(blocks) > 8 else ''} of key "
                    f"{leaf.path!r} in {self.where}: {type(result).__name__}: {result}") from result
            out[leaf.path] = result
        stats = self.cache.stats
        stats.loads += len(blocks)
        stats.loaded_bytes += len(blocks) * self.cache.block_bytes
        stats.requests += throttle.requests
        stats.fetched_bytes += throttle.bytes
        stats.peak_in_flight = max(stats.peak_in_flight, throttle.peak)
        return out

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
        self.writes.submit(run, nbytes, frozenset(start // (self.R * self.k) for start, _ in spans))

    # -- filling the cache ----------------------------------------------------------------
    def _copy_in(self, leaf: Leaf, slot: int, array: np.ndarray | None) -> None:
        if self.host is not None:
            target = self.host[leaf.path][slot]
            if array is None:
                target.fill(0)
            else:
                np.copyto(target[: len(array)], array)
        elif array is None:
            self.cache.slabs[leaf.path][slot].zero_()
        else:
            self.cache.slabs[leaf.path][slot, : len(array)].copy_(from_numpy(array, leaf.dtype))

    def _load(self, blocks: torch.Tensor, protect: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Give ``blocks`` slots; those flagged in ``keep`` get their stored rows (or zeros)."""
        if len(blocks) > self.cache.clean_capacity() - len(protect):
            self._persist(self.cache.dirty_blocks())
        slots = self.cache.assign(blocks, protect)
        stored = keep & (blocks * self.R < self.high_water)
        for slot in slots[keep & ~stored].tolist():  # new blocks read or partly written: zeros
            for leaf in self.leaves:
                self._copy_in(leaf, slot, None)
        wanted = blocks[stored].tolist()
        if wanted:
            try:
                fetched = self._fetch(wanted)
            except BaseException:
                self.cache.invalidate(blocks)  # the slots hold nothing of these blocks
                raise
            for leaf in self.leaves:
                for slot, array in zip(slots[stored].tolist(), fetched[leaf.path]):
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
                value = flat.index_select(0, pos)
            out[leaf.path] = from_storage(value, leaf.dtype)
        return out

    def _read_in_rounds(self, rows, lanes, ublocks, inverse) -> dict[str, torch.Tensor]:
        """A read touching more blocks than the cache holds, done a cacheful at a time."""
        self._persist(self.cache.dirty_blocks())
        step = max(1, self.cache.n_slots)
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
        if len(blocks) > self.cache.n_slots - self.cache.n_dirty:
            self._persist(self.cache.dirty_blocks())
            if len(blocks) > self.cache.n_slots:
                return None
        slots = self.cache.slot_of[blocks]
        miss = slots < 0
        if bool(miss.any()):
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
        self.cache.last_use[slot] = self.cache._tick
        self.high_water = max(self.high_water, row + 1)
        shard_rows = self.R * self.k
        if row == min((row // shard_rows + 1) * shard_rows, self.rows) - 1:
            self._store_completed(torch.tensor([row]))

    def _store_completed(self, urows: torch.Tensor) -> None:
        """Store the write units (chunks or shards) whose last row is in ``urows``."""
        shard_rows = self.R * self.k
        ends = torch.clamp((torch.div(urows, shard_rows, rounding_mode="floor") + 1) * shard_rows,
                           max=self.rows) - 1
        done = torch.unique(torch.div(urows[urows == ends], self.R, rounding_mode="floor"))
        if len(done):
            self._persist(done)

    def _write_in_rounds(self, urows, last, values, ublocks, inverse) -> None:
        step = max(1, self.cache.n_slots // 2)
        for start in range(0, len(ublocks), step):
            idx = torch.nonzero((inverse >= start) & (inverse < start + step)).squeeze(1)
            self.write(urows[idx], last[idx], values)
        self._persist(self.cache.dirty_blocks())

    def _block_rows(self, leaf: Leaf, block: int, slot: int, fetched, where) -> np.ndarray:
        """Rows of ``block`` for a shard write: cached, read back, or zeros."""
        if slot >= 0:
            if self.host is not None:
                return self.host[leaf.path][slot]
            return self.cache.slabs[leaf.path][slot].cpu().numpy().view(storage_numpy_dtype(leaf.dtype))
        if block in where and fetched[leaf.path][where[block]] is not None:
            return fetched[leaf.path][where[block]][: self.R]
        return np.zeros((self.R, *leaf.shape), dtype=storage_numpy_dtype(leaf.dtype))

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

    def flush(self) -> None:
        """Store every dirty block and wait until every write has landed."""
        self._persist(self.cache.dirty_blocks())
        self.writes.drain()
        _faults.crash_point("store.after")
