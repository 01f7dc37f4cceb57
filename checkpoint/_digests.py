"""Chunk digests: how an incremental dump notices rows changed in place.

A storage stamps the rows its writes go through with write revisions, and an
incremental dump carries over the chunks none of whose rows was stamped since.
Rows can also change where no revision sees it: TorchRL code writes into the
in-RAM container's tensors (``storage._storage["obs"][3] = x``, ``.mul_()``), or
into the views of a memory-mapped buffer's chunk files. So for such storages a
chunk is carried over only when, in addition, the crc32c of its rows as they are
now equals that of the chunk in the previous generation: remembered from the
dump or load that made it, or else read from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import google_crc32c
import numpy as np

#: {key path: {chunk index: crc32c of the chunk's rows}}
Digests = dict[str, dict[int, int]]


def digest(rows: np.ndarray) -> int:
    """The crc32c of an array's bytes (C order)."""
    return google_crc32c.value(np.ascontiguousarray(rows).view(np.uint8).reshape(-1))


def chunk_digests(read: Callable[[int, int], Mapping[str, np.ndarray]],
                  wanted: Mapping[str, tuple[int, set[int]]], rows: int, window: int) -> Digests:
    """The digests of the chunks ``wanted`` (``{path: (chunk rows, chunk indices)}``) of
    rows ``[0, rows)``, which ``read(lo, hi)`` returns as ``{path: array}``; a window of
    rows (a multiple of every chunk length) at a time, windows without one skipped."""
    out: Digests = {path: {} for path in wanted}
    end = min(rows, max(((max(indices) + 1) * chunk for chunk, indices in wanted.values()
                         if indices), default=0))  # rows past the last chunk wanted are not read
    for lo in range(0, end, window):
        hi = min(lo + window, end)
        here = {path: [i for i in range(lo // chunk, -(-hi // chunk)) if i in indices]
                for path, (chunk, indices) in wanted.items()}
        if not any(here.values()):
            continue
        columns = read(lo, hi)
        for path, indices in here.items():
            chunk = wanted[path][0]
            for i in indices:
                out[path][i] = digest(columns[path][i * chunk - lo:(i + 1) * chunk - lo])
    return out
