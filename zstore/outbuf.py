"""Recycled output buffers for gathered batches.

A sampled batch is gathered into new memory, and memory the process has not
touched before costs a page fault (and zeroing) per 4 KiB page: for a batch of
256 Atari transitions (14 MB), more time than the gather itself. The C
allocator hands large blocks back to the kernel on ``free``, so a training loop
that samples, learns and drops the batch pays those faults on every sample.

:class:`OutputPool` keeps the storage of recent large outputs and reuses one
once nothing but the pool refers to it: every tensor or view of a batch the
caller still holds keeps its storage's use count above one, so a buffer is
never handed out while any part of an earlier batch that lives in it is
reachable. Pinned and GPU outputs are never pooled (an asynchronous copy may
still be reading them after the last reference is dropped).
"""

from __future__ import annotations

import math
import threading

import torch

#: Outputs smaller than this come from ``torch.empty``: the allocator reuses small blocks.
MIN_POOLED_BYTES = 1 << 20
#: Idle buffers kept per pool: a few batches of a few keys, in rotation.
MAX_BUFFERS = 8

_use_count = getattr(torch._C, "_storage_Use_Count", None)


class OutputPool:
    """CPU buffers for gathered outputs, reused once their last batch is unreachable."""

    def __init__(self, max_buffers: int = MAX_BUFFERS) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[torch.UntypedStorage] = []  # least recently handed out first
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (for tests and statistics)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``, in recycled memory
        where a free buffer of exactly its size exists."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if _use_count is None or nbytes < MIN_POOLED_BYTES:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            for i, storage in enumerate(self._buffers):
                if storage.nbytes() == nbytes and _use_count(storage._cdata) == 1:
                    del self._buffers[i]
                    self._buffers.append(storage)
                    self.reused += 1
                    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
            out = torch.empty(shape, dtype=dtype)
            if len(self._buffers) >= self.max_buffers:
                idle = [i for i, s in enumerate(self._buffers) if _use_count(s._cdata) == 1]
                if not idle:
                    return out  # every pooled buffer is in use: this one stays unpooled
                del self._buffers[idle[0]]  # the least recently handed out idle buffer
            self._buffers.append(out.untyped_storage())
            return out

    def clear(self) -> None:
        """Forget every pooled buffer (memory is freed as their batches go)."""
        with self._lock:
            self._buffers.clear()


def gather(source: torch.Tensor, index: torch.Tensor, pool: OutputPool | None) -> torch.Tensor:
    """``source.index_select(0, index)``, into a pooled buffer when ``source`` is on the
    CPU and a pool is given."""
    if pool is None or source.device.type != "cpu":
        return source.index_select(0, index)
    out = pool.empty((len(index), *source.shape[1:]), source.dtype)
    return torch.index_select(source, 0, index, out=out)
