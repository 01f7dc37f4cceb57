"""The buffer form of a tensor-storage checkpoint: a generation that is a zstore buffer.

Each generation is a complete zstore buffer (format.md), so
``zstore.open(f"{dest}/{generation}")`` and plain zarr read it. Only rows that
hold data are written; chunks are whole (never read back and patched).
Incremental dumps: the storage stamps every written row with a write revision,
and remembers, per destination, which generation it last wrote or read there and
at which revision. A chunk none of whose rows changed since is carried over from
the previous generation as an object copy (a hard link locally, a server-side
copy on object stores); the others are encoded and written.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zarr
from zarr.core.sync import sync

from zstore.codecs import CodecSpec
from zstore.dtypes import (
    from_numpy,
    from_storage,
    storage_numpy_dtype,
    to_numpy,
    to_storage,
)
from zstore.group import commit, create_group, open_group, open_zarr_group
from zstore.layout import StoreMeta

from ._chunks import chunk_key, read_raw, write_raw
from ._dest import CheckpointError, Destination, fault_point, progress_bar
from ._state import TensorState, finish, prepare, write_rows

#: Bytes per chunk of a key on object stores: few objects (few requests to write, carry
#: over, list and delete), while 1% of new rows still rewrites only a few percent of the bytes.
CHUNK_BYTES = 4 << 20
#: ... and on local disk, where an object costs a file and a hard link, not a request:
#: smaller chunks make incremental dumps write half the bytes, in steadier time.
LOCAL_CHUNK_BYTES = 1 << 20
#: Longest chunk of a narrow key (rows): keeps carried-over chunks fine-grained.
MAX_CHUNK_ROWS = 1 << 18


def checkpoint_layout(schema, rows: int, chunks: int | None,
                      chunk_bytes: int = CHUNK_BYTES) -> dict[str, tuple[int, None]]:
    """Rows per chunk of every key: a power of two near ``chunk_bytes`` of that key (or
    ``chunks``)."""
    layout = {}
    for leaf in schema.leaves:
        if chunks is not None:
            size = int(chunks)
        else:
            size = 1 << max(0, int(math.log2(max(1, chunk_bytes // max(1, leaf.row_bytes)))))
            size = min(size, MAX_CHUNK_ROWS)
        layout[leaf.path] = (max(1, min(size, rows)), None)
    return layout


def as_numpy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A tensor of ``dtype`` as the NumPy array of its Zarr dtype (bit views, no conversion)."""
    return to_numpy(to_storage(tensor.detach().to("cpu")).contiguous(), dtype)


def as_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_numpy`."""
    return from_storage(from_numpy(np.ascontiguousarray(array), dtype), dtype)


def _changed_chunks(changed: torch.Tensor | None, chunk: int, n: int) -> torch.Tensor:
    """Bool per chunk of the first ``n`` chunks: whether it holds one of the ``changed``
    rows (int64 row indices; None: everything changed)."""
    if changed is None:
        return torch.ones(n, dtype=torch.bool)
    mask = torch.zeros(n, dtype=torch.bool)
    blocks = torch.div(changed, chunk, rounding_mode="floor")
    mask[blocks[blocks < n]] = True
    return mask


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of True in a bool vector."""
    out, start = [], None
    for i, flag in enumerate(mask.tolist() + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def dump_buffer(storage: Any, dest: Destination, *, codec: CodecSpec, chunks: int | None,
                progress: bool, checkpointer: str) -> dict[str, Any]:
    """Write a new buffer generation of ``storage`` at ``dest``; return the commit record."""
    revision = getattr(storage, "_write_rev", 0)  # rows written after this are dumped next time
    state = TensorState.of(storage)
    layout = checkpoint_layout(state.schema, state.rows, chunks,
                               LOCAL_CHUNK_BYTES if dest.spec.is_local else CHUNK_BYTES)
    previous = dest.read_commit()
    base = _incremental_base(storage, dest, previous, state, layout if chunks else None, codec)
    if base is not None:
        layout = base[2]  # the previous generation's chunking, so its chunks carry over
    gen = dest.new_generation()
    meta = StoreMeta("LazyMemmapStorage", state.max_size, state.ndim, state.rows, state.schema,
                     codec, layout)
    gen_spec = dest.child(gen)
    group = None if base is None else _carry_metadata(dest, base[0], gen, state.schema)
    if group is None:  # a first dump, or the previous generation lacks metadata: write everything
        if base is not None:
            base, gen = None, dest.new_generation()  # the partial one goes after the commit
            gen_spec = dest.child(gen)
        group = create_group(gen_spec, meta)
    arrays = {} if codec.is_raw else \
        {leaf.path: group[leaf.path]._async_array for leaf in state.schema.leaves}
    row_rev = getattr(storage, "_row_rev", None)
    changed = None if base is None or row_rev is None else \
        torch.nonzero(row_rev > base[1]).reshape(-1)
    plan = {}  # path -> (chunk rows, changed mask over the chunks holding data)
    for leaf in state.schema.leaves:
        chunk = layout[leaf.path][0]
        plan[leaf.path] = (chunk, _changed_chunks(changed, chunk, -(-state.high // chunk)))
    window = max(chunk for chunk, _ in plan.values())
    total = sum(int(mask.sum()) * chunk * state.schema.by_path[p].row_bytes
                for p, (chunk, mask) in plan.items())
    written = 0
    with progress_bar(total, f"dumps {dest.url}", progress) as bar:
        for lo in range(0, state.high, window):
            hi = min(lo + window, state.rows)
            jobs, copies = [], []
            columns = None
            for leaf in state.schema.leaves:
                chunk, mask = plan[leaf.path]
                first = lo // chunk
                local = mask[first: -(-min(hi, state.high) // chunk)]
                for a, b in _runs(local):
                    if columns is None:
                        columns = state.read(lo, hi)
                    start, stop = (first + a) * chunk, min((first + b) * chunk, state.rows)
                    value = as_numpy(columns[leaf.path][start - lo: stop - lo], leaf.dtype)
                    written += value.nbytes
                    if codec.is_raw:
                        write_raw(gen_spec, leaf.path, value, first + a, chunk)
                        bar.update(value.nbytes)
                    else:
                        jobs.append((arrays[leaf.path], start, stop, value))
                for i in torch.nonzero(~local).reshape(-1).tolist():
                    key = chunk_key(leaf.path, 1 + len(leaf.shape), first + i)
                    copies.append((f"{base[0]}/{key}", f"{gen}/{key}"))
            _write_all(jobs)
            dest.copy_objects(copies)
            bar.update(sum(job[3].nbytes for job in jobs))
    meta.length, meta.last_cursor, meta.high_water = state.length, state.last_cursor, state.high
    commit(group, meta)
    return {"checkpointer": checkpointer, "form": "buffer", "generation": gen,
            "length": state.length, "last_cursor": state.last_cursor, "max_size": state.max_size,
            "rows": state.rows, "ndim": state.ndim, "incremental": base is not None,
            "bytes_written": written, "revision": revision}


def _carry_metadata(dest: Destination, old: str, gen: str, schema) -> zarr.Group | None:
    """Generation ``gen``'s Zarr metadata carried over from generation ``old`` (same keys,
    layout and codec): every node's ``zarr.json`` linked / copied server-side, the root's
    copied (the commit rewrites it). None when ``old`` lacks one of them."""
    nodes = {f"{leaf.path}/zarr.json" for leaf in schema.leaves}
    nodes |= {f"{sub}/zarr.json" for sub in schema.group_paths}
    copied = dest.copy_objects((f"{old}/{node}", f"{gen}/{node}") for node in sorted(nodes))
    copied += dest.copy_objects([(f"{old}/zarr.json", f"{gen}/zarr.json")], link=False)
    if copied != len(nodes) + 1:
        return None
    return open_zarr_group(dest.child(gen))


def _write_all(jobs: list) -> None:
    async def run():
        return await asyncio.gather(*[array.setitem(slice(start, stop), value)
                                      for array, start, stop, value in jobs],
                                    return_exceptions=True)

    for job, result in zip(jobs, sync(run())):
        if isinstance(result, BaseException):
            raise OSError(f"cannot write rows {job[1]}:{job[2]} of a checkpoint: {result}") from result
        fault_point("write")


def _incremental_base(storage, dest: Destination, previous, state: TensorState, layout,
                      codec: CodecSpec) -> tuple[str, int, dict] | None:
    """(previous generation, revision, its layout) when ``storage`` can dump incrementally
    onto it; ``layout`` None accepts the previous generation's chunking."""
    marks = getattr(storage, "_ckpt_marks", None) or {}
    mark = marks.get(dest.url)
    if previous is None or mark is None or previous.get("form") != "buffer" \
            or previous.get("generation") != mark[0]:
        return None
    try:
        _, old = open_group(dest.child(mark[0]).as_read_only())
    except Exception:  # noqa: BLE001 - an unreadable previous generation: write everything
        return None
    if (old.rows != state.rows or old.schema.leaves != state.schema.leaves
            or (layout is not None and old.layout != layout) or old.codec != codec or old.key_codecs):
        return None
    return mark[0], mark[1], old.layout


def load_buffer(storage: Any, dest: Destination, record: Mapping[str, Any] | None,
                progress: bool) -> None:
    """Fill ``storage`` from a buffer generation (or from a plain zstore buffer at ``dest``)."""
    spec = dest.spec if record is None else dest.child(str(record["generation"]))
    group, meta = open_group(spec.as_read_only())
    schema, lanes = meta.schema, tuple(meta.schema.lane_shape)
    high = max(meta.high_water, -(-meta.length // max(1, math.prod(lanes))) if meta.length < meta.max_size
               else meta.rows)
    high = min(high, meta.rows)
    arrays = {leaf.path: group[leaf.path]._async_array for leaf in schema.leaves}
    raw = meta.all_raw and all(shard is None for _, shard in meta.layout.values())

    def read(lo: int, hi: int) -> dict[str, torch.Tensor]:
        if not raw:
            return _read(arrays, schema, lo, hi)
        values = {leaf.path: np.empty((hi - lo, *leaf.shape), dtype=storage_numpy_dtype(leaf.dtype))
                  for leaf in schema.leaves}
        read_raw(spec, [(path, value, lo, meta.layout[path][0]) for path, value in values.items()])
        return {leaf.path: as_torch(values[leaf.path], leaf.dtype) for leaf in schema.leaves}

    window = max(chunk for chunk, _ in meta.layout.values())
    first = read(0, 1)
    prepare(storage, schema.build({p: c[0] for p, c in first.items()}, lanes), schema, meta.rows,
            meta.max_size, dest.redacted())
    with progress_bar(high * schema.row_bytes, f"loads {dest.url}", progress) as bar:
        targets = _in_memory_columns(storage, schema) if raw else None
        if targets is not None:  # straight into the container's memory
            read_raw(spec, [(path, target[:high], 0, meta.layout[path][0])
                            for path, target in targets.items()])
            bar.update(high * schema.row_bytes)
        else:
            for lo in range(0, high, window):
                hi = min(lo + window, high)
                write_rows(storage, lo, schema.build(read(lo, hi), (hi - lo, *lanes)))
                bar.update((hi - lo) * schema.row_bytes)
    mark = None if record is None else (dest.url, str(record["generation"]))
    finish(storage, meta.length, meta.last_cursor, high, mark)


def _in_memory_columns(storage: Any, schema) -> dict[str, np.ndarray] | None:
    """NumPy views of an in-RAM CPU container's columns (None for other storages)."""
    if hasattr(storage, "_schema") or not storage.initialized:
        return None
    columns = schema.columns(storage._storage, 1)
    if any(c.device.type != "cpu" or not c.is_contiguous() for c in columns.values()):
        return None
    return {leaf.path: to_storage(columns[leaf.path]).numpy().view(storage_numpy_dtype(leaf.dtype))
            for leaf in schema.leaves}


def _read(arrays, schema, lo: int, hi: int) -> dict[str, torch.Tensor]:
    async def run():
        return await asyncio.gather(*[arrays[leaf.path].getitem(slice(lo, hi))
                                      for leaf in schema.leaves], return_exceptions=True)

    out = {}
    for leaf, result in zip(schema.leaves, sync(run())):
        if isinstance(result, BaseException):
            raise CheckpointError(f"cannot read rows {lo}:{hi} of key {leaf.path!r}: {result}") \
                from result
        out[leaf.path] = as_torch(result, leaf.dtype)
    return out
