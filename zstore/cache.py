"""The hot-chunk cache: decoded row blocks held as torch tensors, LRU within a byte budget.

A buffer's columns share one *slot table*: slot ``s`` holds rows
``[b * R, (b + 1) * R)`` of **every** column for the block ``b`` it caches, in
one preallocated slab per column. A sample then costs one vectorised lookup and
one ``index_select`` per column, whatever the number of blocks it touches.

Where the slabs live is a small named strategy (a *tier*): ``"host"`` (RAM),
``"pinned"`` (page-locked RAM, for fast copies to a GPU) or ``"cuda"`` (GPU
memory; gathers then run on the GPU). Slots holding rows written but not yet
stored (*dirty* slots) are never evicted: the slab is also the write-back buffer.
Host slabs are backed by transparent huge pages where Linux allows it and they are
wanted (:data:`zstore._pages.HUGE_PAGES`: not where a memory balloon reports free pages
to a hypervisor): a cold cache then faults its memory in 2 MiB pages, not 4 KiB ones.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

import torch

from ._pages import host_empty

#: Default byte budget of a buffer's cache.
DEFAULT_CACHE_BYTES = 1 << 30


#: The units a ``cache_bytes`` string may name (``"512MB"``, ``"1 GiB"``): powers of 1000
#: with a ``B`` or none, powers of 1024 with ``i`` or ``iB``.
_SIZE_UNITS = {"": 1, "b": 1, **{p + s: (1000 if s in ("", "b") else 1024) ** (i + 1)
                                  for i, p in enumerate("kmgtp") for s in ("", "b", "i", "ib")}}


def byte_budget(cache_bytes: int | str) -> int:
    """``cache_bytes`` as an int: a number of bytes ``>= 0``, or a size such as ``"512MB"``
    or ``"4GiB"``; anything else is refused naming the argument."""
    try:
        if isinstance(cache_bytes, str):
            number, unit = re.fullmatch(r"\s*(.*?)\s*([a-zA-Z]*)\s*", cache_bytes).groups()
            scale = _SIZE_UNITS[unit.lower()]
            budget = int(number) * scale if number.isdigit() else int(float(number) * scale)
        else:
            budget = int(cache_bytes)
    except (KeyError, TypeError, ValueError, OverflowError):
        budget = -1
    if budget < 0 or isinstance(cache_bytes, bool):
        raise ValueError(f"cache_bytes={cache_bytes!r}: give a number of bytes >= 0 (0: no "
                         f"cache), e.g. 1 << 30, or a size such as '512MB' or '4GiB'")
    return budget


class CacheTier:
    """Where cached blocks live; chosen by name with :func:`cache_tier`."""

    name = "host"
    #: The type of device this tier returns samples on.
    device_type = "cpu"

    def __init__(self, device: torch.device | None = None):
        self.device = torch.device("cpu")

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` on this tier."""
        if self.device.type == "cpu":
            return host_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class PinnedTier(CacheTier):
    """Page-locked host memory: host-to-GPU copies of samples are asynchronous."""

    name = "pinned"

    def __init__(self, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'pinned' cache tier needs CUDA, which is not available here; "
                               "use cache='host'")
        super().__init__(device)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)


class CudaTier(CacheTier):
    """GPU memory: blocks are decoded once on the host, then gathered on the GPU."""

    name = "cuda"
    device_type = "cuda"

    def __init__(self, device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the 'cuda' cache tier needs CUDA, which is not available here; "
                               "use cache='host'")
        index = device.index if device is not None else None
        self.device = torch.device("cuda", index if index is not None else torch.cuda.current_device())


_TIERS = {"host": CacheTier, "pinned": PinnedTier, "cuda": CudaTier}


def cache_tier(name: str | CacheTier, device: torch.device | str | None = None) -> CacheTier:
    """Resolve a tier by name: ``"host"``, ``"pinned"`` or ``"cuda"``. ``device``: where
    samples are returned, ``None`` or ``"auto"`` for the tier's own (the CPU; the current GPU
    for ``"cuda"``); a device the tier cannot return samples on is refused, naming the fix."""
    if isinstance(name, CacheTier):
        return name
    try:
        kind = _TIERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown cache tier {name!r}; choose one of {sorted(_TIERS)}") from None
    wanted = _device(device)
    if wanted is not None and wanted.type != kind.device_type:
        raise ValueError(_mismatch(name, device, wanted))
    return kind(wanted)


def _device(device: torch.device | str | None) -> torch.device | None:
    """``device`` parsed (``None`` for ``None`` and ``"auto"``), refused naming it."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); pass 'cpu', "
                         "'cuda', 'cuda:N' or None") from None


def output_device(device: torch.device | str | None) -> torch.device | None:
    """``device``, where a storage returns items, parsed (``None`` for ``None`` and
    ``"auto"``); refused, naming it and the fix, when it is not a torch device or is a CUDA
    device where CUDA is not available."""
    wanted = _device(device)
    if wanted is not None and wanted.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} needs CUDA, which is not available here; "
                           "pass device='cpu'")
    return wanted


def _mismatch(name: str, device: object, wanted: torch.device) -> str:
    """Why the tier ``name`` cannot return samples on ``wanted`` (passed as ``device``), and
    the fix."""
    if name == "cuda":
        return (f"device={device!r} does not fit cache='cuda', which returns samples on a CUDA "
                "GPU: pass device='cuda' or 'cuda:N' (or leave it out), or cache='host' for "
                "samples on the CPU")
    fix = "pass device='cpu' (or leave it out)"
    if wanted.type == "cuda":
        fix += (", or cache='cuda' to cache the rows on the GPU and sample there"
                if torch.cuda.is_available() else " (CUDA is not available here)")
    else:
        fix += (f" and move samples with .to({str(wanted)!r}): zstore caches rows in host "
                "memory or on a CUDA GPU")
    return (f"device={device!r} does not fit cache={name!r}, which returns samples on the "
            f"CPU: {fix}")


@dataclasses.dataclass
class CacheStats:
    """Counters of a :class:`ChunkCache`.

    ``hits`` / ``misses`` count rows read (a row whose block was cached is a hit,
    one whose block had to be loaded a miss; prefetches count neither); ``loads`` and the byte counters
    count blocks (``loaded_bytes`` decoded, ``fetched_bytes`` as stored);
    ``requests`` counts store requests and ``peak_in_flight`` the most that
    were in flight at once.
    """

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    loaded_bytes: int = 0
    resident_bytes: int = 0
    capacity_bytes: int = 0
    requests: int = 0
    fetched_bytes: int = 0
    peak_in_flight: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of rows read that were served from the cache."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ChunkCache:
    """Slot table + per-column slabs for the row blocks of one buffer.

    Args:
        n_blocks: number of row blocks in the buffer.
        block_rows: rows per block (the Zarr chunk length along dim 0).
        columns: ``{path: (dtype, row_shape)}`` of the slabs to allocate.
        budget_bytes: upper bound of the slabs' size (at least one block is always held).
        tier: where slabs live.
    """

    def __init__(self, n_blocks: int, block_rows: int,
                 columns: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 budget_bytes: int = DEFAULT_CACHE_BYTES, tier: CacheTier | str = "host"):
        self.tier = cache_tier(tier)
        self.block_rows = block_rows
        self.block_bytes = block_rows * sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in columns.values())
        self.n_slots = int(min(n_blocks, max(1, budget_bytes // max(1, self.block_bytes))))
        self.slabs = {path: self.tier.allocate((self.n_slots, block_rows, *shape), dtype)
                      for path, (dtype, shape) in columns.items()}
        self.flat = {path: slab.view(self.n_slots * block_rows, *slab.shape[2:])
                     for path, slab in self.slabs.items()}
        self.slot_of = torch.full((n_blocks,), -1, dtype=torch.int64)
        self.block_of = torch.full((self.n_slots,), -1, dtype=torch.int64)
        self.last_use = torch.zeros(self.n_slots, dtype=torch.int64)
        self.dirty = torch.zeros(self.n_slots, dtype=torch.bool)
        self._used = 0  # slots handed out at least once (slots >= _used are free)
        self._n_dirty = 0
        self._tick = 0
        self.stats = CacheStats(capacity_bytes=self.n_slots * self.block_bytes)

    # -- lookups ------------------------------------------------------------------------
    def touch(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` as just used (LRU clock)."""
        self._tick += 1
        self.last_use[slots] = self._tick

    @property
    def n_dirty(self) -> int:
        """Number of slots holding rows not yet written to the store."""
        return self._n_dirty

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Pin unique ``slots`` as holding unstored rows."""
        self._n_dirty += int((~self.dirty[slots]).sum())
        self.dirty[slots] = True

    def mark_clean(self, slots: torch.Tensor) -> None:
        """Unique ``slots`` were stored: they may be evicted again."""
        self._n_dirty -= int(self.dirty[slots].sum())
        self.dirty[slots] = False

    def dirty_blocks(self) -> torch.Tensor:
        """Blocks whose slots are dirty, sorted."""
        return torch.sort(self.block_of[self.dirty]).values

    # -- slot management ----------------------------------------------------------------
    def assign(self, blocks: torch.Tensor, protect: torch.Tensor | None = None) -> torch.Tensor:
        """Give each block in ``blocks`` (not cached) a slot, evicting LRU clean slots.

        ``protect`` are slots that must not be evicted (the current request's).
        Raises ``MemoryError`` when not enough clean slots exist; callers flush
        dirty slots or split the request first.
        """
        need = len(blocks)
        out = torch.empty(need, dtype=torch.int64)
        fresh = min(need, self.n_slots - self._used)
        if fresh:
            out[:fresh] = torch.arange(self._used, self._used + fresh)
            self._used += fresh
        if need > fresh:
            candidates = self.last_use[: self._used].clone()
            candidates[self.dirty[: self._used]] = torch.iinfo(torch.int64).max
            if protect is not None and len(protect):
                candidates[protect[protect >= 0]] = torch.iinfo(torch.int64).max
            if fresh:
                candidates[out[:fresh]] = torch.iinfo(torch.int64).max
            k = need - fresh
            order = torch.topk(candidates, k, largest=False).indices
            if bool((candidates[order] == torch.iinfo(torch.int64).max).any()):
                raise MemoryError("cache has too few clean slots for this request")
            victims = self.block_of[order]
            valid = victims >= 0
            self.slot_of[victims[valid]] = -1
            n_evicted = int(valid.sum())
            self.stats.evictions += n_evicted
            self.stats.evicted_bytes += n_evicted * self.block_bytes
            out[fresh:] = order
        self.block_of[out] = blocks
        self.slot_of[blocks] = out
        self.touch(out)
        self.stats.resident_bytes = int((self.block_of >= 0).sum()) * self.block_bytes
        return out

    def clean_capacity(self) -> int:
        """Slots that can hold new blocks without flushing."""
        return self.n_slots - self.n_dirty

    def invalidate(self, blocks: torch.Tensor | None = None) -> None:
        """Forget cached copies of ``blocks`` (all blocks when ``None``); dirty ones are kept."""
        if blocks is None:
            keep = self.dirty.clone()
            gone = self.block_of[~keep & (self.block_of >= 0)]
        else:
            slots = self.slot_of[blocks]
            slots = slots[slots >= 0]
            slots = slots[~self.dirty[slots]]
            gone = self.block_of[slots]
        if len(gone):
            slots = self.slot_of[gone]
            self.slot_of[gone] = -1
            self.block_of[slots] = -1
            self.last_use[slots] = 0
        self.stats.resident_bytes = int((self.block_of >= 0).sum()) * self.block_bytes
