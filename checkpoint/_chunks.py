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
from typing import Any

import numpy as np

from zstore.store import StoreSpec

from ._dest import fault_point


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
        for key, part in objects.items():
            os.makedirs(os.path.dirname(key), exist_ok=True)
            with open(key, "wb") as handle:
                handle.write(memoryview(part).cast("B"))
            fault_point("write")
    else:
        fs.pipe({key: part.tobytes() for key, part in objects.items()})
        for _ in objects:
            fault_point("write")


def read_raw(spec: StoreSpec, path: str, out: np.ndarray, lo: int, chunk_rows: int) -> None:
    """Fill ``out`` (rows ``lo, lo + 1, ...``; ``lo`` a chunk boundary) from raw chunk objects;
    chunks never stored read as zeros."""
    fs, root = spec.filesystem()
    ndim = out.ndim
    row_bytes = math.prod(out.shape[1:]) * out.dtype.itemsize
    first = lo // chunk_rows
    n_chunks = -(-len(out) // chunk_rows)
    keys = [f"{root.rstrip('/')}/{chunk_key(path, ndim, first + i)}" for i in range(n_chunks)]
    flat = out.reshape(len(out), -1).view(np.uint8).reshape(-1) if out.size else out
    if spec.is_local:
        for i, key in enumerate(keys):
            target = memoryview(flat[i * chunk_rows * row_bytes:(i + 1) * chunk_rows * row_bytes])
            try:
                with open(key, "rb", buffering=0) as handle:
                    handle.readinto(target)
            except FileNotFoundError:
                flat[i * chunk_rows * row_bytes:(i + 1) * chunk_rows * row_bytes] = 0
        return
    found: dict[str, Any] = fs.cat(keys, on_error="omit")
    for i, key in enumerate(keys):
        span = flat[i * chunk_rows * row_bytes:(i + 1) * chunk_rows * row_bytes]
        data = found.get(key)
        if data is None:
            span[:] = 0
        else:
            span[:] = np.frombuffer(data, dtype=np.uint8, count=len(span))
