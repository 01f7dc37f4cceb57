"""libc's ``mmap``, ``munmap`` and ``madvise``, typed for ctypes (Linux; ``None`` elsewhere).

Shared by the paging advice of memory-mapped buffers (:mod:`zstore._pages`) and the
copy-on-write checkpoint loads (``checkpoint._mapped``).
"""

from __future__ import annotations

import ctypes
import sys


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


#: libc with ``madvise``, ``mmap`` and ``munmap`` typed (Linux), else None.
LIBC = _load_libc()
