"""Loading a local raw checkpoint by mapping its chunk files copy-on-write.

A column of an in-RAM storage is one address range: an anonymous private
mapping (zero pages) over which each stored chunk file is mapped
``MAP_PRIVATE | MAP_FIXED`` at its offset. Loading is then a few system calls
per chunk instead of a copy of every byte: pages come from the page cache when
first touched, and a write copies only the page it lands on (the file never
changes). Checkpoint generations are immutable — zstore never rewrites a chunk
file in place, and deleting a generation only unlinks files, which leaves
mapped pages intact — so the mapping stays valid for the storage's lifetime.

Linux only (``MAP_FIXED`` through libc); chunks must start on page boundaries.
Elsewhere, or for chunks that do not, the caller reads the files instead.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from zstore.libc import LIBC as _libc

from ._chunks import missing_chunk_error, short_chunk_error

_MAP_FIXED = 0x10  # Linux; not exported by the mmap module
_MAP_FAILED = ctypes.c_void_p(-1).value


def supported(chunk_bytes: int) -> bool:
    """Whether chunks of ``chunk_bytes`` can be mapped (Linux, page-aligned chunks)."""
    return _libc is not None and chunk_bytes > 0 and chunk_bytes % mmap.PAGESIZE == 0


class MappedColumn:
    """``nbytes`` of private memory: zero pages, with chunk files mapped copy-on-write over
    parts of it. ``numpy.asarray(column)`` views it (as ``uint8``) and keeps it alive; the
    range is unmapped when the last view goes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, nbytes)
        address = _libc.mmap(None, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if address in (None, _MAP_FAILED):
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot reserve {nbytes} bytes of memory: {os.strerror(errno)}")
        self.address = address
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def map_file(self, path: str, offset: int, length: int) -> None:
        """Map the first ``length`` bytes of file ``path`` at ``offset`` (page-aligned)."""
        if offset % mmap.PAGESIZE or offset + length > self.nbytes:
            raise ValueError(f"cannot map {length} bytes at offset {offset} of {self.nbytes}")
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < length:
                raise short_chunk_error(path, size, length)
            address = _libc.mmap(self.address + offset, length, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
            if address in (None, _MAP_FAILED):
                errno = ctypes.get_errno()
                raise OSError(errno, f"cannot map chunk file {path}: {os.strerror(errno)}")
        finally:
            os.close(fd)

    def __del__(self) -> None:
        if _libc is not None and getattr(self, "address", None):
            _libc.munmap(self.address, self.nbytes)
            self.address = None


def map_chunks(paths: list[str | None], chunk_bytes: int, nbytes: int,
               all_stored: bool = False) -> np.ndarray:
    """A ``uint8`` array of ``nbytes``: chunk ``i`` is file ``paths[i]`` (mapped
    copy-on-write), zeros where the path is None or the file does not exist (with
    ``all_stored``, a missing file raises: the writer stored every chunk)."""
    column = MappedColumn(nbytes)
    for i, path in enumerate(paths):
        offset = i * chunk_bytes
        if path is None or offset >= nbytes:
            continue
        try:
            column.map_file(path, offset, min(chunk_bytes, nbytes - offset))
        except FileNotFoundError:  # a chunk never stored: all zeros
            if all_stored:
                raise missing_chunk_error(path) from None
            continue
    return np.asarray(column)
