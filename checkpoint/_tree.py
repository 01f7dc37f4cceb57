"""The tree form: any TensorDict (e.g. a save hook's output) as a Zarr group.

Each tensor leaf is one Zarr array at its key's path (chunked along dim 0, about
1 MiB per chunk), with its torch dtype in the array's attributes (as in
format.md §4). Non-tensor entries (``NonTensorData``) and batch sizes are JSON
in the group's ``zstore_tree`` attribute; a non-JSON value is refused, never
pickled.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import torch
import zarr
from tensordict import NonTensorData, TensorDict, TensorDictBase, is_tensor_collection
from zarr.core.sync import sync

from zstore.codecs import TARGET_CHUNK_BYTES, CodecSpec
from zstore.dtypes import storage_numpy_dtype, torch_dtype_from_name, torch_dtype_name
from zstore.group import new_group, open_plain_group, put_attrs
from zstore.layout import dimension_names, key_to_path
from zstore.store import StoreSpec

from ._buffer import as_numpy, as_torch
from ._chunks import ALL_STORED, DAMAGED, require_stored, storing_every_chunk
from ._dest import CheckpointError, fault_point, progress_bar

TREE_ATTR = "zstore_tree"


def _walk(td: TensorDictBase, prefix: tuple[str, ...], tensors: dict, others: dict,
          batches: dict) -> None:
    batches["/".join(prefix)] = list(td.batch_size)
    for key in td.keys():  # noqa: SIM118 - a TensorDict iterates rows
        value = td.get(key)
        path = (*prefix, key)
        if isinstance(value, NonTensorData):
            others["/".join(path)] = value.data
        elif is_tensor_collection(value):
            _walk(value, path, tensors, others, batches)
        elif isinstance(value, torch.Tensor):
            tensors[key_to_path(path)] = value
        else:
            others["/".join(path)] = value


def write_tree(spec: StoreSpec, td: TensorDictBase, codec: CodecSpec, progress: bool) -> int:
    """Write ``td`` as a Zarr group at ``spec`` (which must not exist yet); return the bytes
    of its tensors."""
    if not is_tensor_collection(td):
        raise TypeError(f"save hooks must return a TensorDict, got {type(td).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    batches: dict[str, list[int]] = {}
    _walk(td, (), tensors, others, batches)
    try:
        json.dumps(others)
    except TypeError as exc:
        raise TypeError(f"non-tensor entries of a checkpoint must be JSON values ({exc}); "
                        "zstore never pickles into a store") from None
    group = new_group(spec.open(), {}, overwrite=True)
    jobs = []
    for path, value in tensors.items():
        np_dtype = storage_numpy_dtype(value.dtype)
        shape = tuple(value.shape)
        row = math.prod(shape[1:]) * np_dtype.itemsize if shape else np_dtype.itemsize
        chunks = (max(1, min(shape[0], TARGET_CHUNK_BYTES // max(1, row))), *shape[1:]) if shape else ()
        array = group.create_array(
            path, shape=shape, dtype=np_dtype, chunks=chunks if shape else "auto",
            compressors=codec.compressors(np_dtype.itemsize),
            fill_value=np.zeros((), dtype=np_dtype).item(),
            dimension_names=dimension_names(path, len(shape)),
            attributes={"zstore": {"torch_dtype": torch_dtype_name(value.dtype)}})
        jobs.append((path, storing_every_chunk(array._async_array), as_numpy(value, value.dtype)))
    total = sum(job[2].nbytes for job in jobs)
    with progress_bar(total, f"dumps {spec.shown_url}", progress) as bar:
        for path, array, value in jobs:
            sync(array.setitem(Ellipsis, value))
            fault_point("write")
            bar.update(value.nbytes)
    put_attrs(group, {TREE_ATTR: {"batch_sizes": batches, "non_tensor": others, ALL_STORED: True,
                                  "arrays": sorted(tensors)}})
    return total


def read_tree(spec: StoreSpec, progress: bool) -> TensorDict:
    """Inverse of :func:`write_tree`."""
    try:
        group = open_plain_group(spec.as_read_only().open())
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeNotFoundError):
        raise CheckpointError(f"{spec.redacted()}: the committed generation (or its "
                              f"zarr.json) is missing: {DAMAGED}") from None
    meta = dict(group.attrs.get(TREE_ATTR) or {})
    if "batch_sizes" not in meta:
        raise CheckpointError(f"{spec.redacted()} is not a zstore checkpoint generation")
    arrays: dict[str, zarr.Array] = {}
    _collect(group, "", arrays)
    missing = sorted(set(meta.pop("arrays", arrays)) - set(arrays))  # recorded since 2026-12-06
    if missing:
        raise CheckpointError(f"{spec.redacted()}: the array of key {missing[0]!r} "
                              f"({missing[0]}/zarr.json) is missing: {DAMAGED}")
    if meta.pop(ALL_STORED, False):
        require_stored(spec, {path: array._async_array for path, array in arrays.items()})
    total = sum(a.nbytes for a in arrays.values())

    async def run():
        return await asyncio.gather(*[a._async_array.getitem(Ellipsis) for a in arrays.values()])

    with progress_bar(total, f"loads {spec.shown_url}", progress) as bar:
        try:
            values = sync(run())
        except (ValueError, RuntimeError) as exc:  # a chunk that does not decode
            raise CheckpointError(f"{spec.redacted()}: a chunk does not decode "
                                  f"({type(exc).__name__}: {exc}): {DAMAGED}") from exc
        bar.update(total)
    batches = meta.pop("batch_sizes")
    td = TensorDict(batch_size=batches.get("", []))
    for prefix in sorted(batches, key=lambda p: p.count("/")):
        if prefix:
            td.set(tuple(prefix.split("/")), TensorDict(batch_size=batches[prefix]))
    for (path, array), value in zip(arrays.items(), values):
        dtype = torch_dtype_from_name(array.attrs["zstore"]["torch_dtype"])
        td.set(tuple(path.split("/")), as_torch(value, dtype))
    for path, value in meta.pop("non_tensor").items():
        td.set_non_tensor(tuple(path.split("/")), value)
    return td


def _collect(group: zarr.Group, prefix: str, out: dict[str, zarr.Array]) -> None:
    for name, node in group.members():
        path = f"{prefix}{name}"
        if isinstance(node, zarr.Array):
            out[path] = node
        else:
            _collect(node, f"{path}/", out)
