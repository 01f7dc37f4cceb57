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
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from zstore.row_objects import (ALL_CHUNKS_STORED as ALL_STORED, chunk_key, key_separator,
                               row_object_keys)
from zstore.credentials import request_error
from zstore.store import StoreSpec

from ._dest import CheckpointError, fault_point

#: Threads copying local chunk files: reads and writes release the GIL, and the page-cache
#: copies of a single thread leave memory bandwidth unused.
LOCAL_THREADS = 4

#: What a missing object of a checkpoint means, and the fix (for error messages).
DAMAGED = "the checkpoint is damaged (copied in part, or a file was deleted); load an intact copy"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child the parent's pool threads do not exist: start a new pool there."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _each(fn: Callable[[Any], None], items: Sequence[Any]) -> None:
    """``fn(item)`` for every item, on :data:`LOCAL_THREADS` threads when there are several
    (one pool for the process: starting threads per call cost milliseconds per dump)."""
    global _pool
    if len(items) < 2:
        for item in items:
            fn(item)
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(LOCAL_THREADS, thread_name_prefix="zstore-ckpt-io")
    for _ in _pool.map(fn, items):
        pass


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat ``uint8`` view (never a copy: reads fill
    it), zero-size arrays included (e.g. rows of shape ``(0, 3)``: their chunks hold 0 bytes)."""
    if not array.flags.c_contiguous:
        raise ValueError("raw chunk I/O needs C-contiguous arrays")
    return array.reshape(-1).view(np.uint8)


def write_raw(spec: StoreSpec, pieces: Sequence[tuple[str, np.ndarray, int, int]],
              separator: str = "/") -> None:
    """Store raw chunk objects (keys using ``separator``), all pieces at once: each piece is
    ``(path, value, first_chunk, chunk_rows)``, ``value`` holding rows of whole chunks of the
    array at ``path`` from chunk ``first_chunk`` (the array's last chunk may be short: it is
    padded to full size)."""
    fs, root = spec.filesystem()
    objects = {}
    for path, value, first_chunk, chunk_rows in pieces:
        row_shape = value.shape[1:]
        for i in range(-(-len(value) // chunk_rows)):
            part = value[i * chunk_rows:(i + 1) * chunk_rows]
            if len(part) < chunk_rows:
                padded = np.zeros((chunk_rows, *row_shape), dtype=value.dtype)
                padded[: len(part)] = part
                part = padded
            key = chunk_key(path, 1 + len(row_shape), first_chunk + i, separator)
            objects[f"{root.rstrip('/')}/{key}"] = _as_bytes(np.ascontiguousarray(part))
    if not objects:
        return
    if spec.is_local:
        for directory in {os.path.dirname(key) for key in objects}:
            os.makedirs(directory, exist_ok=True)

        def store(item: tuple[str, np.ndarray]) -> None:
            with open(item[0], "wb") as handle:
                handle.write(item[1])
            fault_point("write")

        _each(store, list(objects.items()))
    else:
        fs.pipe({key: part.tobytes() for key, part in objects.items()})
        for _ in objects:
            fault_point("write")


def read_raw(spec: StoreSpec, targets: Sequence[tuple[str, np.ndarray, int, int]],
             separator: str = "/", all_stored: bool = False) -> None:
    """Fill arrays from raw chunk objects (keys using ``separator``): each target is
    ``(path, out, lo, chunk_rows)``, ``out`` receiving rows ``lo, lo + 1, ...`` (``lo`` a
    chunk boundary) of the array at ``path``. Chunks never stored read as zeros; with
    ``all_stored`` (the writer stored every chunk) a missing one is damage and raises."""
    fs, root = spec.filesystem()
    spans: list[tuple[str, np.ndarray]] = []  # (object key, the bytes of out it fills)
    for path, out, lo, chunk_rows in targets:
        chunk_bytes = chunk_rows * math.prod(out.shape[1:]) * out.dtype.itemsize
        flat = _as_bytes(out)
        for i in range(-(-len(out) // chunk_rows)):
            key = f"{root.rstrip('/')}/{chunk_key(path, out.ndim, lo // chunk_rows + i, separator)}"
            spans.append((key, flat[i * chunk_bytes:(i + 1) * chunk_bytes]))
    if spec.is_local:
        def load(item: tuple[str, np.ndarray]) -> None:
            try:
                with open(item[0], "rb", buffering=0) as handle:
                    got = handle.readinto(memoryview(item[1]))
            except FileNotFoundError:
                if all_stored:
                    raise missing_chunk_error(item[0]) from None
                item[1][:] = 0
                return
            if got != len(item[1]):
                raise short_chunk_error(item[0], got, len(item[1]))

        _each(load, spans)
        return
    for (key, span), data in zip(spans, _fetched(fs, [key for key, _ in spans], spec)):
        if data is None:
            if all_stored:
                raise missing_chunk_error(key)
            span[:] = 0
        elif len(data) < len(span):
            raise short_chunk_error(key, len(data), len(span))
        else:
            span[:] = np.frombuffer(data, dtype=np.uint8, count=len(span))


def _fetched(fs: Any, keys: list[str], spec: StoreSpec) -> list[bytes | None]:
    """The objects ``keys`` (``None``: missing), fetched at once. cat_ranges, not cat: cat
    expands glob characters, which a key's path may hold ("obs[0]"). A request that failed
    after the client's retries (a server error, a body damaged in transfer) raises naming
    the object and the checkpoint."""
    got = fs.cat_ranges(keys, None, None, on_error="return")
    for key, data in zip(keys, got):
        if isinstance(data, BaseException) and not isinstance(data, FileNotFoundError):
            raise request_error(data, spec.redacted(), f"cannot read {key} of the checkpoint at "
                                f"{spec.redacted()}", "load it again once the server answers",
                                remote=spec.is_remote) or data
    return [None if isinstance(data, FileNotFoundError) else data for data in got]


def short_chunk_error(key: str, got: int, expected: int) -> CheckpointError:
    """The error for a chunk object (or file) ``key`` shorter than the chunk it holds."""
    return CheckpointError(f"chunk object {key} holds {got} bytes, expected at least {expected}: "
                           "the checkpoint is damaged")


def missing_chunk_error(key: str) -> CheckpointError:
    """The error for chunk object (or file) ``key`` missing from a generation that stored
    every chunk of its rows (a partial copy of the checkpoint, or a deleted file)."""
    return CheckpointError(f"chunk object {key} is missing: {DAMAGED}")


def storing_every_chunk(array: Any) -> Any:
    """Zarr async ``array`` writing all-zero chunks too (zarr skips them by default), so that
    :func:`require_stored` can tell a missing chunk from a zero one."""
    return array.with_config({"write_empty_chunks": True})


def require_stored(spec: StoreSpec, arrays: Mapping[str, Any], rows: int | None = None) -> None:
    """Raise :func:`missing_chunk_error` unless every chunk object of ``arrays`` (``{path
    below spec: zarr async array}`` chunked along rows only; of rows ``[0, rows)`` when
    given) is stored at ``spec``: one listing, where zarr would read a missing chunk as zeros."""
    stored = spec.objects()
    for path, array in arrays.items():
        for key in _chunk_keys(path, array, rows):
            if key not in stored:
                raise missing_chunk_error(f"{spec.filesystem()[1].rstrip('/')}/{key}")


def _chunk_keys(path: str, array: Any, rows: int | None) -> list[str]:
    """The chunk objects of rows ``[0, rows)`` (all rows when None) of an array chunked along
    rows only."""
    shape = array.shape
    rows = (shape[0] if shape else 0) if rows is None else rows
    return row_object_keys(path, shape, key_separator(array.metadata.to_dict()), rows,
                           array.chunks[0] if shape else 1)

