"""Raw chunk objects written and read directly (uncompressed, unsharded arrays).

For a raw Zarr v3 array a chunk object is the C-order bytes of its rows, padded
to the full chunk length. Writing and reading those objects directly — one file
write / ``readinto`` per chunk locally, one batched ``pipe`` / ``cat`` on other
stores — skips zarr's per-call overhead and, on load, copies straight into the
destination's memory. Compressed or sharded arrays go through zarr instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from zstore.store import StoreSpec

from ._dest import fault_point

#: Threads copying local chunk files: reads and writes release the GIL, and the page-cache
#: copies of a single thread leave memory bandwidth unused.
LOCAL_THREADS = 4


def _each(fn: Callable[[Any], None], items: Sequence[Any]) -> None:
    """``fn(item)`` for every item, on :data:`LOCAL_THREADS` threads when there are several."""
    if len(items) < 2:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(min(LOCAL_THREADS, len(items)), thread_name_prefix="zstore-ckpt-io") as pool:
        for _ in pool.map(fn, items):
            pass


def chunk_key(path: str, ndim: int, index: int) -> str:
    """The object key of chunk ``index`` of the array at ``path`` (default encoding, '/')."""
    return f"{path}/c/{index}" + "/0" * (ndim - 1)


def write_raw(spec: StoreSpec, path: str, value: np.ndarray, first_chunk: int, chunk_rows: int) -> None:
    """Store ``value`` (rows of whole chunks from ``first_chunk``) as raw chunk objects."""
    fs, root = spec.filesystem()
    row_shape = value.shape[1:]
    n_chunks = -(-len(value) // chunk_rows)
    objects = {}
    for i in range(n_chunks):
        part = value[i * chunk_rows:(i + 1) * chunk_rows]
        if len(part) < chunk_rows:  # the array's last chunk: padded to full size
            padded = np.zeros((chunk_rows, *row_shape), dtype=value.dtype)
            padded[: len(part)] = part
            part = padded
        key = f"{root.rstrip('/')}/{chunk_key(path, 1 + len(row_shape), first_chunk + i)}"
        objects[key] = np.ascontiguousarray(part)
    if spec.is_local:
        for directory in {os.path.dirname(key) for key in objects}:
            os.makedirs(directory, exist_ok=True)

        def store(item: tuple[str, np.ndarray]) -> None:
            with open(item[0], "wb") as handle:
                handle.write(memoryview(item[1]).cast("B"))
            fault_point("write")

        _each(store, list(objects.items()))
    else:
        fs.pipe({key: part.tobytes() for key, part in objects.items()})
        for _ in objects:
            fault_point("write")


def read_raw(spec: StoreSpec, targets: Sequence[tuple[str, np.ndarray, int, int]]) -> None:
    """Fill arrays from raw chunk objects: each target is ``(path, out, lo, chunk_rows)``,
    ``out`` receiving rows ``lo, lo + 1, ...`` (``lo`` a chunk boundary) of the array at
    ``path``. Chunks never stored read as zeros."""
    fs, root = spec.filesystem()
    spans: list[tuple[str, np.ndarray]] = []  # (object key, the bytes of out it fills)
    for path, out, lo, chunk_rows in targets:
        chunk_bytes = chunk_rows * math.prod(out.shape[1:]) * out.dtype.itemsize
        flat = out.reshape(len(out), -1).view(np.uint8).reshape(-1) if out.size else out
        for i in range(-(-len(out) // chunk_rows)):
            key = f"{root.rstrip('/')}/{chunk_key(path, out.ndim, lo // chunk_rows + i)}"
            spans.append((key, flat[i * chunk_bytes:(i + 1) * chunk_bytes]))
    if spec.is_local:
        def load(item: tuple[str, np.ndarray]) -> None:
            try:
                with open(item[0], "rb", buffering=0) as handle:
                    handle.readinto(memoryview(item[1]))
            except FileNotFoundError:
                item[1][:] = 0

        _each(load, spans)
        return
    found: dict[str, Any] = fs.cat([key for key, _ in spans], on_error="omit")
    for key, span in spans:
        data = found.get(key)
        if data is None:
            span[:] = 0
        else:
            span[:] = np.frombuffer(data, dtype=np.uint8, count=len(span))
