"""Background page population ahead of the write cursor of memory-mapped columns.

The first write to a page of a shared file mapping takes a page fault that
allocates the page and its filesystem blocks: writing fresh pages measured about
ten times slower than writing pages already mapped, and a buffer's first fill
writes nothing but fresh pages. A :class:`Prefaulter` asks the kernel to
populate the pages of the rows just ahead of the writer
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14 and later) on a background
thread, so the writer finds them mapped; on other systems it does nothing.
Populating changes no byte of the files: rows not yet written stay zeros.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping

import torch

#: ``madvise`` advice: fault in the range's pages writable, as a write would (Linux 5.14+).
MADV_POPULATE_WRITE = 23
#: Bytes (over all columns) of rows populated per step; two steps are kept ahead.
WINDOW_BYTES = 32 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _load_madvise()


class Prefaulter:
    """Keeps the pages of the rows ahead of the writer populated (see the module docstring).

    Args:
        maps: the memory-mapped columns, ``[rows, ...]`` each.
        rows: rows of every column.
        start: the first row not yet written (the buffer's high-water mark).
    """

    def __init__(self, maps: Mapping[str, torch.Tensor], rows: int, start: int):
        self._maps = maps
        self._rows = rows
        row_bytes = sum(column[0].nbytes for column in maps.values()) if rows else 0
        self._window = max(1, WINDOW_BYTES // max(1, row_bytes))
        self._frontier = start  # rows below it are populated (or written)
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self.enabled = _MADVISE is not None and bool(maps) and 0 <= start < rows

    def ahead_of(self, row: int) -> None:
        """``row`` was just written: start populating the next rows if the writer is
        within a window of what is populated (and no population is running)."""
        if not self.enabled or row + self._window < self._frontier:
            return
        if self._pending is not None and not self._pending.done():
            return
        lo = max(self._frontier, row + 1)
        hi = min(self._rows, lo + 2 * self._window)
        if lo >= hi:
            self.enabled = False  # the whole file is populated
            return
        self._frontier = hi
        if self._executor is None or self._pid != os.getpid():  # (a forked child: new thread)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="zstore-prefault")
            self._pid = os.getpid()
        self._pending = self._executor.submit(self._populate, lo, hi)

    def _populate(self, lo: int, hi: int) -> None:
        for column in self._maps.values():
            row_bytes = column[0].nbytes
            if not row_bytes:
                continue
            start = column.data_ptr() + lo * row_bytes
            first_page = start - start % PAGE
            length = column.data_ptr() + hi * row_bytes - first_page
            if _MADVISE(first_page, length, MADV_POPULATE_WRITE) != 0:
                self.enabled = False  # an older kernel (EINVAL) or no memory: stop trying
                return

    def close(self) -> None:
        """Wait for a running population (the mappings may be unmapped next) and stop."""
        self.enabled = False
        if self._executor is not None and self._pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor = self._pending = None
