"""A buffer's columns on a Zarr group: block reads through the cache, write-back, mmap.

Two implementations share one small interface (``read``, ``write``, ``flush``,
``prefetch``):

* :class:`ChunkedTable` — any store, any codec. Row blocks (Zarr chunks along
  dim 0) are fetched concurrently, decoded once into the :class:`ChunkCache`,
  and gathered with ``index_select``. Writes land in the cache's slots and are
  encoded and stored once per block (per shard when sharded).
* :class:`MmapTable` — local, uncompressed, one chunk per column: the chunk
  files are memory-mapped and read/written in place, as TorchRL's memmap does.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import zarr
from zarr.core.sync import sync

from .cache import DEFAULT_CACHE_BYTES, CacheStats, ChunkCache
from .chunkio import MAX_IN_FLIGHT, ColumnReader
from .dtypes import compute_dtype, from_numpy, from_storage, to_numpy, to_storage
from .errors import CorruptChunkError, ReadOnlyError
from .layout import Leaf


def _positions_of_last(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique rows and, for each, the position of its last occurrence (last write wins)."""
    uniq, inverse = torch.unique(rows, return_inverse=True)
    if len(uniq) == len(rows):
        order = torch.empty_like(inverse)
        order[inverse] = torch.arange(len(rows))
        return uniq, order
    last = torch.full((len(uniq),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(len(rows)), reduce="amax")
    return uniq, last


class Table:
    """Interface of a buffer's column set (see module docstring)."""

    leaves: tuple[Leaf, ...]
    rows: int
    high_water: int
    read_only: bool

    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Rows (or, with ``lanes``, single cells of rows) of every column, as ``{path: tensor}``."""
        raise NotImplementedError

    def write(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> bool:
        """Write ``values[path][i]`` to row ``rows[i]``; True when blocks were stored eagerly."""
        raise NotImplementedError

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> bool:
        """Write one row (``values[path]`` without a leading dim); as :meth:`write`."""
        raise NotImplementedError

    def flush(self) -> None:
        """Store every pending block (data only; the caller commits metadata after)."""

    def prefetch(self, rows: torch.Tensor, background: bool = False) -> Future | None:
        """Load the blocks holding ``rows`` into the cache ahead of a read.

        With ``background=True`` the load runs on a worker thread and a Future is
        returned; reads meanwhile wait only for the blocks they need.
        """
        return None

    @property
    def cache_stats(self) -> CacheStats | None:
        """Cache counters, or None for tables without a cache."""
        return None

    def close(self) -> None:
        """Release resources (maps, cache)."""

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError("cannot write: this buffer is opened read-only")

    def _leaf_rows(self, leaf: Leaf) -> tuple[int, ...]:
        return (self.rows, *leaf.shape)


class ChunkedTable(Table):
    """Columns read and written by row blocks through a :class:`ChunkCache`."""

    def __init__(self, group: zarr.Group, leaves: tuple[Leaf, ...], rows: int, chunk_rows: int,
                 shard_rows: int | None, high_water: int, *, read_only: bool,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, cache_tier: str = "host",
                 where: str = ""):
        self.leaves = leaves
        self.rows = rows
        self.R = chunk_rows
        self.k = (shard_rows or chunk_rows) // chunk_rows
        self.high_water = high_water
        self.read_only = read_only
        self.where = where
        self.n_blocks = -(-rows // chunk_rows)
        self.store = group.store
        arrays = {leaf.path: group[leaf.path] for leaf in leaves}
        self.arrays = {path: array._async_array for path, array in arrays.items()}
        self.readers = {path: ColumnReader.for_array(array, where) for path, array in arrays.items()}
        self.cache = ChunkCache(
            self.n_blocks, chunk_rows,
            {leaf.path: (compute_dtype(leaf.dtype), leaf.shape) for leaf in leaves},
            cache_bytes, cache_tier)
        self.device = self.cache.tier.device
        self.lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats

    # -- I/O --------------------------------------------------------------------------
    def _block_span(self, block: int) -> tuple[int, int]:
        start = block * self.R
        return start, min(start + self.R, self.rows)

    def _fetch(self, blocks: list[int]) -> dict[str, list[np.ndarray | None]]:
        """Read and decode ``blocks`` of every column, all requests in flight at once.

        Returns, per column, one array per block (``None`` for a block never stored).
        """
        async def column(leaf, limit):
            reader = self.readers[leaf.path]
            if reader is not None:
                return await reader.read(self.store, blocks, limit)
            return await asyncio.gather(*[self.arrays[leaf.path].getitem(slice(*self._block_span(b)))
                                          for b in blocks])

        async def run():
            limit = asyncio.Semaphore(MAX_IN_FLIGHT)
            return await asyncio.gather(*[column(leaf, limit) for leaf in self.leaves],
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
        self.cache.stats.loads += len(blocks)
        self.cache.stats.loaded_bytes += len(blocks) * self.cache.block_bytes
        return out

    def _store_blocks(self, spans: list[tuple[int, int]], data: dict[str, list[np.ndarray]]) -> None:
        jobs = [(leaf.path, i) for leaf in self.leaves for i in range(len(spans))]

        async def run():
            return await asyncio.gather(
                *[self.arrays[path].setitem(slice(*spans[i]), data[path][i]) for path, i in jobs],
                return_exceptions=True)

        results = sync(run())
        for reader in self.readers.values():
            if reader is not None:
                reader.forget([start // self.R for start, _ in spans])
        for (path, i), result in zip(jobs, results):
            if isinstance(result, BaseException):
                raise OSError(f"cannot write rows {spans[i]} of key {path!r} to {self.where}: "
                              f"{type(result).__name__}: {result}") from result

    # -- cache filling ----------------------------------------------------------------
    def _load(self, blocks: torch.Tensor, protect: torch.Tensor, fetch: torch.Tensor) -> torch.Tensor:
        """Assign slots to ``blocks`` and fill them (``fetch``: which to read from the store)."""
        if len(blocks) > self.cache.clean_capacity() - len(protect):
            self._persist(self.cache.dirty_blocks())
        slots = self.cache.assign(blocks, protect)
        stored = fetch & (blocks * self.R < self.high_water)
        fresh = slots[~stored]
        if len(fresh):
            for slab in self.cache.slabs.values():
                slab[fresh] = 0
        wanted = blocks[stored].tolist()
        if wanted:
            fetched = self._fetch(wanted)
            slot_list = slots[stored].tolist()
            for leaf in self.leaves:
                slab = self.cache.slabs[leaf.path]
                for slot, array in zip(slot_list, fetched[leaf.path]):
                    if array is None:
                        slab[slot] = 0
                    else:
                        slab[slot, : len(array)].copy_(from_numpy(array, leaf.dtype))
        return slots

    def _slots_for_read(self, blocks: torch.Tensor) -> torch.Tensor:
        """Slots of the unique ``blocks``, loading the missing ones."""
        slots = self.cache.slot_of[blocks]
        miss = slots < 0
        if bool(miss.any()):
            self.cache.stats.misses += int(miss.sum())
            slots[miss] = self._load(blocks[miss], slots[~miss], torch.ones(int(miss.sum()), dtype=torch.bool))
        self.cache.stats.hits += int((~miss).sum())
        self.cache.touch(slots)
        return slots

    # -- public API ---------------------------------------------------------------------
    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = rows.to("cpu", torch.int64)
        with self.lock:
            blocks = torch.div(rows, self.R, rounding_mode="floor")
            slots = self.cache.slot_of[blocks]
            if bool((slots < 0).any()):
                ublocks, inverse = torch.unique(blocks, return_inverse=True)
                if len(ublocks) > self.cache.n_slots - self.cache.n_dirty:
                    return self._read_in_rounds(rows, lanes, ublocks, inverse)
                slots = self._slots_for_read(ublocks)[inverse]
            else:
                self.cache.stats.hits += len(rows)
                self.cache.touch(slots)
            return self._gather(slots * self.R + (rows - blocks * self.R), lanes)

    def _gather(self, pos: torch.Tensor, lanes: torch.Tensor | None) -> dict[str, torch.Tensor]:
        pos = pos.to(self.device, non_blocking=True)
        out = {}
        for leaf in self.leaves:
            flat = self.cache.flat[leaf.path]
            if lanes is None:
                value = flat.index_select(0, pos)
            else:
                n_lanes = math.prod(flat.shape[1:1 + lanes.shape[0]]) if lanes.ndim > 1 else flat.shape[1]
                cells = flat.reshape(flat.shape[0] * n_lanes, *flat.shape[1 + (lanes.shape[0] if lanes.ndim > 1 else 1):])
                lane_flat = lanes if lanes.ndim == 1 else _ravel(lanes, flat.shape[1:1 + lanes.shape[0]])
                value = cells.index_select(0, pos * n_lanes + lane_flat.to(self.device))
            out[leaf.path] = from_storage(value, leaf.dtype)
        return out

    def _read_in_rounds(self, rows, lanes, ublocks, inverse) -> dict[str, torch.Tensor]:
        self._persist(self.cache.dirty_blocks())
        step = max(1, self.cache.n_slots - self.cache.n_dirty)
        parts: dict[str, list] = {leaf.path: [] for leaf in self.leaves}
        order = []
        for start in range(0, len(ublocks), step):
            mask = (inverse >= start) & (inverse < start + step)
            idx = torch.nonzero(mask).squeeze(1)
            sub = self.read(rows[idx], None if lanes is None else lanes[..., idx])
            for path, value in sub.items():
                parts[path].append(value)
            order.append(idx)
        perm = torch.empty(len(rows), dtype=torch.int64)
        perm[torch.cat(order)] = torch.arange(len(rows))
        return {path: torch.cat(chunks).index_select(0, perm.to(chunks[0].device))
                for path, chunks in parts.items()}

    def prefetch(self, rows: torch.Tensor, background: bool = False) -> Future | None:
        rows = rows.to("cpu", torch.int64).reshape(-1)
        if background:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="zstore-prefetch")
            return self._executor.submit(self._prefetch, rows)
        self._prefetch(rows)
        return None

    def _prefetch(self, rows: torch.Tensor) -> None:
        with self.lock:
            blocks = torch.unique(torch.div(rows, self.R, rounding_mode="floor"))
            blocks = blocks[: max(0, self.cache.clean_capacity() - 1)]
            if len(blocks):
                self._slots_for_read(blocks)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def write(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> bool:
        self._check_writable()
        rows = rows.to("cpu", torch.int64)
        with self.lock:
            urows, last = _positions_of_last(rows)
            blocks = torch.div(urows, self.R, rounding_mode="floor")
            ublocks, inverse, counts = torch.unique(blocks, return_inverse=True, return_counts=True)
            if len(ublocks) > self.cache.n_slots - self.cache.n_dirty:
                self._persist(self.cache.dirty_blocks())
                if len(ublocks) > self.cache.n_slots:
                    return self._write_in_rounds(urows, last, values, ublocks, inverse)
            slots = self.cache.slot_of[ublocks]
            miss = slots < 0
            if bool(miss.any()):
                spans = torch.clamp(self.rows - ublocks[miss] * self.R, max=self.R)
                partial = counts[miss] < spans
                slots[miss] = self._load(ublocks[miss], slots[~miss], partial)
            self.cache.touch(slots)
            pos = (slots[inverse] * self.R + (urows - blocks * self.R)).to(self.device)
            for leaf in self.leaves:
                value = to_storage(values[leaf.path]).index_select(0, last.to(values[leaf.path].device))
                self.cache.flat[leaf.path].index_copy_(0, pos, value.to(self.device))
            self.cache.mark_dirty(slots)
            self.high_water = max(self.high_water, int(urows[-1]) + 1)
            return self._store_completed(urows)

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> bool:
        self._check_writable()
        with self.lock:
            return self._write_row(row, values)

    def _write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> bool:
        """One-row write (``add``): no sorting, one copy per column."""
        block = row // self.R
        slot = int(self.cache.slot_of[block])
        if slot < 0:
            if self.cache.clean_capacity() < 1:
                self._persist(self.cache.dirty_blocks())
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
            return self._store_completed(torch.tensor([row]))
        return False

    def _store_completed(self, urows: torch.Tensor) -> bool:
        """Store the write blocks whose last row is in ``urows``; True when any was stored.

        Other dirty blocks wait for ``flush`` (or for their slots to be needed).
        """
        shard_rows = self.R * self.k
        ends = torch.clamp((torch.div(urows, shard_rows, rounding_mode="floor") + 1) * shard_rows,
                           max=self.rows) - 1
        done = torch.unique(torch.div(urows[urows == ends], self.R, rounding_mode="floor"))
        if len(done):
            self._persist(done)
            return True
        return False

    def _write_in_rounds(self, urows, last, values, ublocks, inverse) -> bool:
        step = max(1, self.cache.n_slots // 2)
        for start in range(0, len(ublocks), step):
            idx = torch.nonzero((inverse >= start) & (inverse < start + step)).squeeze(1)
            sel = last[idx]
            self.write(urows[idx], {p: v.index_select(0, sel.to(v.device)) for p, v in values.items()})
        self._persist(self.cache.dirty_blocks())
        return True

    def _persist(self, blocks: torch.Tensor) -> None:
        """Encode and store the write blocks (shards) containing ``blocks``; clear their dirt.

        A shard is written whole: members not in the cache are read from the
        store (or are zeros when never stored) without taking cache slots.
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
                slab = self.cache.slabs[leaf.path]
                parts = []
                for block, slot in zip(members[shard], slots.tolist()):
                    if slot >= 0:
                        parts.append(slab[slot].cpu())
                    elif block in where and fetched[leaf.path][where[block]] is not None:
                        parts.append(from_numpy(fetched[leaf.path][where[block]], leaf.dtype)[: self.R])
                    else:
                        parts.append(torch.zeros_like(slab[0], device="cpu"))
                rows = torch.cat(parts)[: stop - start]
                data[leaf.path].append(to_numpy(rows, leaf.dtype))
            stored.append(slots[slots >= 0])
        self._store_blocks(spans, data)
        self.cache.mark_clean(torch.cat(stored))

    def flush(self) -> None:
        with self.lock:
            self._persist(self.cache.dirty_blocks())

    def invalidate(self) -> None:
        """Drop clean cached blocks (after another writer changed the store)."""
        with self.lock:
            self.cache.invalidate()


def _ravel(lanes: torch.Tensor, lane_shape) -> torch.Tensor:
    flat = torch.zeros(lanes.shape[1], dtype=torch.int64)
    for dim, size in enumerate(lane_shape):
        flat = flat * size + lanes[dim]
    return flat


class MmapTable(Table):
    """Local, uncompressed, single-chunk columns: chunk files memory-mapped in place."""

    def __init__(self, root: str, group: zarr.Group, leaves: tuple[Leaf, ...], rows: int,
                 high_water: int, *, read_only: bool):
        self.leaves = leaves
        self.rows = rows
        self.high_water = high_water
        self.read_only = read_only
        self.maps: dict[str, torch.Tensor] = {}
        for leaf in leaves:
            shape = self._leaf_rows(leaf)
            dtype = compute_dtype(leaf.dtype)
            numel = math.prod(shape)
            chunk = Path(root, leaf.path, "c", *(["0"] * len(shape)))
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            if not chunk.exists() or chunk.stat().st_size != nbytes:
                if read_only:
                    if chunk.exists():
                        raise CorruptChunkError(
                            f"chunk file {chunk} of key {leaf.path!r} has {chunk.stat().st_size} "
                            f"bytes, expected {nbytes}")
                    self.maps[leaf.path] = torch.zeros(shape, dtype=dtype)
                    continue
                chunk.parent.mkdir(parents=True, exist_ok=True)
                with open(chunk, "ab") as handle:
                    handle.truncate(nbytes)
            if numel == 0:
                self.maps[leaf.path] = torch.empty(shape, dtype=dtype)
                continue
            mapped = torch.from_file(str(chunk), shared=not read_only, size=numel, dtype=dtype)
            self.maps[leaf.path] = mapped.view(shape)
        self.files = {leaf.path: Path(root, leaf.path, "c", *(["0"] * len(self._leaf_rows(leaf))))
                      for leaf in leaves}

    @staticmethod
    def supported(is_local: bool, raw: bool, chunk_rows: int, rows: int, shard_rows) -> bool:
        """Whether a column set can be memory-mapped (local, raw, one chunk, little-endian)."""
        return is_local and raw and chunk_rows == rows and shard_rows is None and sys.byteorder == "little"

    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = rows.to("cpu", torch.int64)
        out = {}
        for leaf in self.leaves:
            mapped = self.maps[leaf.path]
            if lanes is None:
                value = mapped.index_select(0, rows)
            else:
                lane_shape = mapped.shape[1:1 + (lanes.shape[0] if lanes.ndim > 1 else 1)]
                n_lanes = math.prod(lane_shape)
                lane_flat = lanes if lanes.ndim == 1 else _ravel(lanes, lane_shape)
                cells = mapped.view(mapped.shape[0] * n_lanes, *mapped.shape[1 + len(lane_shape):])
                value = cells.index_select(0, rows * n_lanes + lane_flat)
            out[leaf.path] = from_storage(value, leaf.dtype)
        return out

    def write(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> bool:
        self._check_writable()
        rows = rows.to("cpu", torch.int64)
        urows, last = _positions_of_last(rows)
        for leaf in self.leaves:
            value = to_storage(values[leaf.path])
            if len(urows) != len(rows):
                value = value.index_select(0, last.to(value.device))
                self.maps[leaf.path].index_copy_(0, urows, value.cpu())
            else:
                self.maps[leaf.path].index_copy_(0, rows, value.cpu())
        self.high_water = max(self.high_water, int(urows[-1]) + 1)
        return False

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> bool:
        self._check_writable()
        for leaf in self.leaves:
            self.maps[leaf.path][row].copy_(to_storage(values[leaf.path]))
        self.high_water = max(self.high_water, row + 1)
        return False

    def flush(self) -> None:
        if self.read_only:
            return
        for path in self.files.values():
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def close(self) -> None:
        self.maps.clear()
