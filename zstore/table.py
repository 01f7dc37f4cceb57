"""A buffer's columns on a Zarr group: block reads through the cache, write-back, mmap.

Two implementations share one small interface (``read``, ``write``, ``flush``,
``prefetch``):

* :class:`ChunkedTable` — any store, any codec. Keys are grouped by chunk
  layout into :class:`~zstore.blocks.BlockGroup` s: row blocks (Zarr chunks
  along dim 0) are fetched concurrently, decoded once into the hot-chunk
  cache and gathered with ``index_select``; writes land in the cache's slots
  and are encoded and stored once per write unit (a chunk, or a shard).
* :class:`MmapTable` — local, uncompressed, one chunk per column: the chunk
  files are memory-mapped and read/written in place, as TorchRL's memmap does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import math
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import zarr

from . import _faults
from .blocks import BlockGroup, gather_cells
from .cache import DEFAULT_CACHE_BYTES, CacheStats
from .dtypes import compute_dtype, from_storage, to_storage
from .errors import CorruptChunkError, ReadOnlyError, folder_not_writable
from ._pages import MADV_RANDOM, advise, disk_reads, gather_rows, prefetch_rows, scan
from ._pools import SharedPool
from .group import checked_arrays, listed_segments
from .layout import Leaf
from .row_objects import chunk_key, key_separator
from .tail import group_id

#: Reads of a table's other block groups while the caller reads its first (a few threads per
#: process: a group's read waits on the network, its decodes run on the decode pool).
GROUP_READERS = SharedPool("zstore-groups", lambda: 4)


def contiguous_start(rows: torch.Tensor) -> int | None:
    """The first row if ``rows`` is ``first, first + 1, ...`` (an extend without wrap), else None."""
    first = int(rows[0])
    if int(rows[-1]) - first != len(rows) - 1:
        return None
    if len(rows) > 2 and not bool((rows[1:] - rows[:-1] == 1).all()):
        return None
    return first


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
    _executor: ThreadPoolExecutor | None = None  # the prefetch thread, started on first use

    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Rows (or, with ``lanes``, single cells of rows) of every column, as ``{path: tensor}``."""
        raise NotImplementedError

    def write(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        """Write ``values[path][i]`` to row ``rows[i]`` (the last of duplicate rows wins)."""
        raise NotImplementedError

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> None:
        """Write one row (``values[path]`` without a leading dim); as :meth:`write`."""
        raise NotImplementedError

    def flush(self, consolidate: bool = False) -> None:
        """Store every pending block (data only; the caller commits metadata after).

        ``consolidate``: leave no log segment (see :meth:`ChunkedTable.flush`).
        """

    def tail_record(self) -> dict:
        """The log segments the next commit lists (``StoreMeta.tail``): none by default."""
        return {}

    def committed(self) -> None:
        """The caller's commit landed (a chunked table then deletes dropped segments)."""

    def prefetch(self, rows: torch.Tensor, background: bool = False) -> Future | None:
        """Get ``rows`` ready ahead of a read (:meth:`_prefetch` says how).

        With ``background=True`` it runs on a worker thread and a Future is
        returned; reads meanwhile wait only for the blocks they need.
        """
        rows = rows.to("cpu", torch.int64).reshape(-1)
        if not background:
            self._prefetch(rows)
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="zstore-prefetch")
        return self._executor.submit(self._prefetch, rows)

    def _prefetch(self, rows: torch.Tensor) -> None:
        """Get ``rows`` (flat int64 on the CPU) ready for a read: nothing by default."""

    def _stop_prefetching(self) -> None:
        """Wait for background prefetches, then release their thread (on close)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

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
    """Columns read and written by row blocks through the hot-chunk cache.

    Keys are grouped by their chunk layout (each key's chunk length is chosen
    from its own row size); each :class:`~zstore.blocks.BlockGroup` has its own
    slot table, and the cache budget is split between groups by row bytes.
    """

    def __init__(self, group: zarr.Group, leaves: tuple[Leaf, ...], rows: int,
                 layout: Mapping[str, tuple[int, int | None]], high_water: int, *,
                 read_only: bool, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 cache_tier: str = "host", where: str = "", lease: Any = None,
                 tail: Mapping[str, list] | None = None, tail_log: bool = False,
                 all_stored: bool = False):
        self.leaves = leaves
        self.rows = rows
        self.read_only = read_only
        self.lock = threading.RLock()
        by_layout: dict[tuple[int, int | None], list[Leaf]] = {}
        for leaf in leaves:
            by_layout.setdefault(tuple(layout[leaf.path]), []).append(leaf)
        total = sum(leaf.row_bytes for leaf in leaves) or 1
        arrays = checked_arrays(group, leaves, rows, layout, where)
        tail = dict(tail or {})

        def block_group(chunk_rows: int, shard_rows: int | None, members: list[Leaf]) -> BlockGroup:
            name = group_id(chunk_rows, shard_rows or chunk_rows)
            return BlockGroup(
                arrays, tuple(members), rows, chunk_rows, shard_rows, high_water,
                cache_bytes=cache_bytes * sum(m.row_bytes for m in members) // total,
                cache_tier=cache_tier, lock=self.lock, where=where, read_only=read_only,
                lease=lease, tail_log=tail_log, segments=tail.get(name, ()),
                listed=functools.partial(listed_segments, group, name), all_stored=all_stored)

        self.groups = [block_group(chunk_rows, shard_rows, members)
                       for (chunk_rows, shard_rows), members in by_layout.items()]
        self.device = self.groups[0].device

    @property
    def high_water(self) -> int:
        """One past the highest row written so far, over every block group."""
        return max(g.high_water for g in self.groups)

    @property
    def readers(self) -> dict:
        """Direct chunk reader of each key (None where zarr's reader is used)."""
        return {path: reader for g in self.groups for path, reader in g.readers.items()}

    @property
    def cache_stats(self) -> CacheStats:
        total = CacheStats()
        for g in self.groups:
            for field in dataclasses.fields(CacheStats):
                combine = max if field.name == "peak_in_flight" else int.__add__
                setattr(total, field.name, combine(getattr(total, field.name),
                                                   getattr(g.cache.stats, field.name)))
        return total

    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = rows.to("cpu", torch.int64)
        with self.lock:
            out: dict[str, torch.Tensor] = {}
            for part in self._each_group(lambda g: g.read(rows, lanes), self._cold(rows)):
                out.update(part)
            return out

    def _cold(self, rows: torch.Tensor) -> bool:
        """Whether a read of ``rows`` fetches blocks of the first group, when there are
        others to fetch alongside (host and pinned tiers: their slabs are in host memory)."""
        first = self.groups[0]
        return (len(self.groups) > 1 and first.host is not None
                and bool((first.cache.slot_of[torch.div(rows, first.R, rounding_mode="floor")]
                          < 0).any()))

    def _each_group(self, work: Callable[[BlockGroup], Any], concurrently: bool) -> list:
        """``work(g)`` for every block group, in order; with ``concurrently``, the first on
        the calling thread and the others on :data:`GROUP_READERS` meanwhile, so that the
        groups' fetches share one round trip. Every call has ended when this returns or
        raises (the first error, in group order)."""
        if not concurrently:
            return [work(g) for g in self.groups]
        futures: list[Future | None] = []
        for g in self.groups[1:]:
            try:
                futures.append(GROUP_READERS.get().submit(work, g))
            except RuntimeError:  # interpreter exit: the pool takes no more work
                futures.append(None)
        calls = [functools.partial(work, self.groups[0])] + [
            functools.partial(work, g) if future is None else future.result
            for g, future in zip(self.groups[1:], futures)]
        results, errors = [], []
        for call in calls:
            try:
                results.append(call())
            except BaseException as exc:  # noqa: BLE001 - raised below, once every call ended
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def write(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        self._check_writable()
        rows = rows.to("cpu", torch.int64)
        with self.lock:
            first = contiguous_start(rows)
            if first is not None:
                for g in self.groups:
                    g.write_span(first, values)
                return
            urows, last = _positions_of_last(rows)
            for g in self.groups:
                g.write(urows, last, values)

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> None:
        self._check_writable()
        with self.lock:
            for g in self.groups:
                g.write_row(row, values)

    def flush(self, consolidate: bool = False) -> None:
        """Store or log every written row (:meth:`BlockGroup.flush`); wait for the uploads."""
        with self.lock:
            for g in self.groups:
                g.flush(consolidate)

    def tail_record(self) -> dict:
        """Each block group's log segments (``StoreMeta.tail``)."""
        return {g.id: list(g.segments) for g in self.groups if g.segments}

    def committed(self) -> None:
        with self.lock:
            for g in self.groups:
                g.committed()

    def _prefetch(self, rows: torch.Tensor) -> None:
        """Load the blocks holding ``rows`` into the cache."""
        with self.lock:
            self._each_group(lambda g: g.prefetch(rows), self._cold(rows))

    def close(self) -> None:
        self._stop_prefetching()
        for g in self.groups:  # nothing may land after close (e.g. after a cleanup's delete)
            with contextlib.suppress(OSError):  # a failure was raised by flush already
                g.writes.drain()


#: Disk blocks a writer allocates ahead of its writes, per column (see MmapTable.reserve).
RESERVE_BYTES = 16 << 20


class MmapTable(Table):
    """Local, uncompressed, single-chunk columns: chunk files memory-mapped in place.

    The chunk files are sparse. Before rows that were never written are stored
    through the maps, their disk blocks are allocated (:meth:`reserve`, a few MiB
    ahead at a time): on a full disk that allocation raises ``OSError``, naming
    the key and file, where a store into an unbacked page of the map would kill
    the process with SIGBUS.
    """

    def __init__(self, root: str, group: zarr.Group, leaves: tuple[Leaf, ...], rows: int,
                 high_water: int, *, read_only: bool):
        self.leaves = leaves
        self.rows = rows
        self.high_water = high_water
        self.read_only = read_only
        self.maps: dict[str, torch.Tensor] = {}
        self.chunk_files: dict[str, Path] = {}
        # rows below it are known to have their disk blocks: none at open, for a file copied
        # sparse (cp --sparse, rsync -S) or left by an older zstore has holes anywhere
        self.reserved = 0
        self.reserve_rows = max(1, RESERVE_BYTES // max(1, *(leaf.row_bytes for leaf in leaves)))
        # A read-only buffer (an offline dataset, perhaps larger than RAM) is sampled at
        # random: its maps read no pages around a fault (zstore._pages). A writer's maps keep
        # the kernel's read-around, which fills fresh rows of the sparse files for less.
        self.cold = True  # whether the last random read waited for the disk (then: prefetch)
        arrays = checked_arrays(group, leaves, rows, dict.fromkeys(
            (leaf.path for leaf in leaves), (rows, None)), root, raw=True)
        for leaf in leaves:
            array = arrays[leaf.path]
            shape = self._leaf_rows(leaf)
            dtype = compute_dtype(leaf.dtype)
            numel = math.prod(shape)
            separator = key_separator(array.metadata.to_dict()) or "/"
            chunk = Path(root, chunk_key(leaf.path, len(shape), 0, separator))
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            exists = chunk.exists()
            size = chunk.stat().st_size if exists else 0
            self.chunk_files[leaf.path] = chunk
            # missing or 0 bytes: not created or never sized (killed in between), which only a
            # store without a committed row can hold; with one, the file was lost or cut
            if size not in (0, nbytes) or (size == 0 and nbytes and high_water):
                raise CorruptChunkError(
                    f"chunk file {chunk} of key {leaf.path!r} has {size} bytes, expected {nbytes}"
                    if exists else
                    f"chunk file {chunk} of key {leaf.path!r} is missing, while the store holds "
                    f"{high_water} written rows: it was deleted, or the store copied in part. "
                    "Copy the store again whole, or restore the file from a backup")
            if size == 0:
                if read_only:
                    self.maps[leaf.path] = torch.zeros(shape, dtype=dtype)
                    continue
                chunk.parent.mkdir(parents=True, exist_ok=True)
                with open(chunk, "ab") as handle:
                    handle.truncate(nbytes)
            if numel == 0:
                self.maps[leaf.path] = torch.empty(shape, dtype=dtype)
                continue
            if not read_only and not os.access(chunk, os.W_OK):
                raise folder_not_writable(root, str(chunk))
            mapped = torch.from_file(str(chunk), shared=not read_only, size=numel, dtype=dtype)
            if self.read_only:
                advise(mapped, MADV_RANDOM)
            self.maps[leaf.path] = mapped.view(shape)
        # add()'s hot path walks this plan: (key, dtype its values are viewed as, or None,
        # NumPy view of its map). Assigning a row through NumPy costs half what a torch view
        # plus copy_ does.
        self.row_plan = tuple(
            (leaf.path, compute_dtype(leaf.dtype) if compute_dtype(leaf.dtype) != leaf.dtype
             else None, self.maps[leaf.path].numpy()) for leaf in leaves)

    @staticmethod
    def supported(is_local: bool, raw: bool, rows: int,
                  layout: Mapping[str, tuple[int, int | None]]) -> bool:
        """Whether columns can be memory-mapped: local, raw, one chunk each, little-endian."""
        return (is_local and raw and sys.byteorder == "little"
                and all(tuple(chunks) == (rows, None) for chunks in layout.values()))

    def read(self, rows: torch.Tensor, lanes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = rows.to("cpu", torch.int64)
        first = contiguous_start(rows) if lanes is None and len(rows) > 1 else None
        reads_before = None
        if self.read_only and first is None and lanes is None:
            reads_before = disk_reads()
            if self.cold:  # the last read waited for the disk: ask for every page at once
                self._prefetch(rows)
        out = {}
        for leaf in self.leaves:
            mapped = self.maps[leaf.path]
            if lanes is not None:
                value = gather_cells(mapped, rows, lanes)
            elif first is not None and self.read_only:
                with scan(mapped[first:first + len(rows)]):
                    value = gather_rows(mapped, rows)
            else:
                value = gather_rows(mapped, rows)
            out[leaf.path] = from_storage(value, leaf.dtype)
        if reads_before is not None:
            self.cold = disk_reads() > reads_before
        return out

    def views(self, rows: slice) -> dict[str, torch.Tensor]:
        """Rows ``rows`` (a slice with a positive step) of every column as views of the maps,
        whose in-place writes land in the chunk files; their disk blocks are allocated first
        (:meth:`reserve`)."""
        self._check_writable()
        self.reserve(rows.stop)
        return {leaf.path: from_storage(self.maps[leaf.path][rows], leaf.dtype)
                for leaf in self.leaves}

    def reserve(self, end: int) -> None:
        """Allocate the chunk files' disk blocks of every row below ``end`` (and of
        :data:`RESERVE_BYTES` more of the widest column), unless already done. The
        first call also allocates the holes a reopened file may have below its high-water
        mark (where blocks are already allocated, ``posix_fallocate`` only checks).

        ``OSError`` (ENOSPC on a full disk) names the key and file; nothing is written
        then. A disk without room ahead still takes the rows up to ``end``. Where the
        filesystem cannot allocate ahead, glibc writes the blocks.
        """
        if end <= self.reserved or not hasattr(os, "posix_fallocate"):
            return
        ahead = min(self.rows, max(end, self.reserved + self.reserve_rows, self.high_water))
        try:
            self._allocate(ahead)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or ahead == end:
                raise
            self._allocate(end)

    def _allocate(self, stop: int) -> None:
        for leaf in self.leaves:
            if not leaf.row_bytes:
                continue
            chunk = self.chunk_files[leaf.path]
            try:
                with open(chunk, "r+b") as handle:
                    os.posix_fallocate(handle.fileno(), self.reserved * leaf.row_bytes,
                                       (stop - self.reserved) * leaf.row_bytes)
            except OSError as exc:
                raise OSError(exc.errno or errno.EIO,
                              f"cannot allocate rows {self.reserved}..{stop - 1} of key "
                              f"{leaf.path!r} in {chunk}: {exc.strerror}") from exc
        self.reserved = stop

    def write(self, rows: torch.Tensor, values: Mapping[str, torch.Tensor]) -> None:
        self._check_writable()
        rows = rows.to("cpu", torch.int64)
        first = contiguous_start(rows)
        if first is not None:
            self.reserve(first + len(rows))
            for leaf in self.leaves:
                self.maps[leaf.path][first:first + len(rows)].copy_(to_storage(values[leaf.path]))
                _faults.crash_point("mmap.write")
            self.high_water = max(self.high_water, first + len(rows))
            return
        urows, last = _positions_of_last(rows)
        self.reserve(int(urows[-1]) + 1)
        for leaf in self.leaves:
            value = to_storage(values[leaf.path])
            if len(urows) != len(rows):
                value = value.index_select(0, last.to(value.device))
                self.maps[leaf.path].index_copy_(0, urows, value.cpu())
            else:
                self.maps[leaf.path].index_copy_(0, rows, value.cpu())
            _faults.crash_point("mmap.write")
        self.high_water = max(self.high_water, int(urows[-1]) + 1)

    def write_row(self, row: int, values: Mapping[str, torch.Tensor]) -> None:
        self._check_writable()
        if row >= self.reserved:
            self.reserve(row + 1)
        for path, view_as, array in self.row_plan:
            value = values[path] if view_as is None else values[path].view(view_as)
            try:
                array[row] = value.numpy()
            except (TypeError, RuntimeError):  # on a GPU, needing grad, a conjugate view ...
                self.maps[path][row].copy_(value)
        self.high_water = max(self.high_water, row + 1)

    def flush(self, consolidate: bool = False) -> None:
        """Nothing to do: writes went straight into the shared page cache.

        A killed process loses nothing written; surviving an OS crash or power
        loss additionally needs ``os.sync()`` (zstore does not fsync).
        """

    def _prefetch(self, rows: torch.Tensor) -> None:
        """Ask for the pages of ``rows`` (``MADV_WILLNEED``): the disk reads what is not in
        the page cache while the caller goes on, and the read finds it there."""
        if len(rows):
            wanted = rows.numpy()
            for mapped in self.maps.values():
                prefetch_rows(mapped, wanted)

    def close(self) -> None:
        self._stop_prefetching()
        self.maps.clear()
        self.row_plan = ()
