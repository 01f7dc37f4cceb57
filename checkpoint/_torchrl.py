"""Reading checkpoints written by TorchRL (migration), without unpickling anything.

* TensorStorageCheckpointer / Flat / Nested directories: ``storage_metadata.json``
  plus a tensordict memmap directory — JSON ``meta.json`` per level and headerless
  ``.memmap`` files, read with NumPy. Non-tensor entries are read from their JSON;
  anything stored as a pickle is refused.
* H5StorageCheckpointer files: the ``traj_<i>`` groups concatenated per key.

Flat, Nested and H5 data are converted back to TED as TorchRL's Flat2TED does
(:func:`checkpoint._ted.from_torchrl`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from zstore.dtypes import storage_numpy_dtype, torch_dtype_from_name
from zstore.layout import SINGLE_TENSOR_KEY
from zstore.storages.tensor import lead_shape

from ._buffer import as_torch
from ._dest import CheckpointError, Destination
from ._state import restore
from ._ted import from_torchrl

_COMPACT_KEYS = ("shift", "is_full", "_storage_shape")


def _dtype(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or not name.startswith("torch."):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return torch_dtype_from_name(name[len("torch."):])


class _Reader:
    """Files below a TorchRL checkpoint directory (any fsspec location)."""

    def __init__(self, dest: Destination):
        self.dest = dest

    def json(self, rel: str) -> Any:
        value = self.dest.read_json(rel)
        if value is None:
            raise CheckpointError(f"{self.dest.redacted()}: {rel} is missing")
        return value

    def array(self, rel: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` in the headerless file ``rel`` (none is read
        for an empty tensor: TorchRL writes no file for it)."""
        np_dtype = storage_numpy_dtype(dtype)
        numel = math.prod(shape)
        if numel == 0:
            return as_torch(np.empty(shape, dtype=np_dtype), dtype)
        path = self.dest.path_of(rel)
        try:
            if self.dest.spec.is_local:
                raw = np.fromfile(path, dtype=np_dtype)
            else:
                raw = np.frombuffer(self.dest.fs.cat_file(path), dtype=np_dtype).copy()
        except FileNotFoundError:
            raise CheckpointError(f"{self.dest.redacted()}: {rel} is missing") from None
        if raw.size < numel:
            raise CheckpointError(f"{self.dest.redacted()}: {rel} holds {raw.size} values, "
                                  f"its meta.json says shape {shape}")
        return as_torch(raw[:numel].reshape(shape), dtype)

    def memmap_dir(self, rel: str, leaves: dict, others: dict, prefix: tuple[str, ...]) -> list[int]:
        """Read a tensordict memmap directory into ``leaves`` / ``others``; its batch shape."""
        meta = self.json(f"{rel}/meta.json" if rel else "meta.json")
        where = f"{self.dest.redacted()}/{rel}"
        base = f"{rel}/" if rel else ""
        for key, entry in meta.items():
            if key in ("shape", "device", "_type") or not isinstance(entry, dict):
                continue
            kind = entry.get("type")
            if kind == "TensorDict":
                self.memmap_dir(f"{base}{key}", leaves, others, (*prefix, key))
            elif kind == "NonTensorData":
                data = self.json(f"{base}{key}/meta.json")
                if "data" not in data:
                    raise CheckpointError(f"{where}: non-tensor entry {key!r} is stored as a "
                                          "pickle, which zstore never loads")
                others[(*prefix, key)] = data["data"]
            elif "dtype" in entry and "shape" in entry:
                dtype = _dtype(entry["dtype"], where)
                if entry.get("is_nested"):
                    shapes = self.array(f"{base}{key}.shape.memmap", torch.int64,
                                        [int(entry["shape"][0]), int(entry["shape"][1])])
                    rows = int(shapes[:, 0].sum()) if len(shapes) else 0
                    trail = [int(s) for s in shapes[0, 1:]] if len(shapes) else []
                    leaves[(*prefix, key)] = self.array(f"{base}{key}.memmap", dtype, [rows, *trail])
                else:
                    leaves[(*prefix, key)] = self.array(f"{base}{key}.memmap", dtype,
                                                        [int(s) for s in entry["shape"]])
            else:
                raise CheckpointError(f"{where}: entry {key!r} of type {kind or entry.get('_type')!r} "
                                      "cannot be read without unpickling; zstore refuses it")
        return [int(s) for s in meta.get("shape", [])]


def is_torchrl_dir(dest: Destination) -> bool:
    """Whether ``dest`` looks like a TorchRL TensorStorageCheckpointer directory."""
    return dest.read_json("storage_metadata.json") is not None


def load_torchrl_dir(storage: Any, dest: Destination) -> None:
    """Fill ``storage`` from a TorchRL TensorStorage/Flat/Nested checkpoint directory."""
    reader = _Reader(dest)
    where = dest.redacted()
    meta = reader.json("storage_metadata.json")
    length = int(meta.get("len", 0))
    if meta.get("is_pytree"):
        if not storage.initialized:
            raise RuntimeError("Cannot fill a non-initialized pytree-based TensorStorage "
                               f"from {where}: create it first (TorchRL's rule)")
        columns = {}
        for dotted, entry in meta["metadata"].items():
            path = dotted.replace(".", "/")
            columns[path] = reader.array(f"{path}.memmap", _dtype(entry["dtype"], where),
                                         [int(s) for s in entry["shape"]])
        schema = storage.checkpoint_export().schema
        rows = next(iter(columns.values())).shape[0]
        unknown = sorted(set(columns) - set(schema.by_path))
        if unknown:
            raise CheckpointError(f"{where}: keys {unknown} are not in the storage")
        data = schema.build(columns, (rows, *schema.lane_shape))
        _fill(storage, data, rows, length, -1, where)
        return
    leaves: dict = {}
    others: dict = {}
    shape = reader.memmap_dir("", leaves, others, ())
    if all((k,) in others for k in _COMPACT_KEYS):
        storage_shape = [int(s) for s in others[("_storage_shape",)]]
        shift, is_full = int(others[("shift",)]), bool(others[("is_full",)])
        data = from_torchrl(leaves, shift=shift, is_full=is_full, storage_shape=storage_shape)
        cursor = (shift - 1) % storage_shape[0] if shift else -1
    else:
        if others:
            raise CheckpointError(f"{where}: non-tensor entries {sorted(others)} are not part of "
                                  "a storage checkpoint")
        if set(leaves) == {(SINGLE_TENSOR_KEY,)}:
            data = leaves[(SINGLE_TENSOR_KEY,)]
        else:
            data = TensorDict(batch_size=shape)
            for key, value in leaves.items():
                data.set(key, value)
        cursor = -1
    _fill(storage, data, None, length, cursor, where)


def _fill(storage: Any, data: Any, rows: int | None, length: int, cursor: int, where: str) -> None:
    """Write TorchRL's full-capacity ``data`` into ``storage`` with its counters (TorchRL
    does not save the write cursor: a partial buffer's is its last filled row)."""
    lead = lead_shape(data, storage.ndim)
    rows = lead[0] if rows is None else rows
    lanes = math.prod(lead[1:])
    if cursor < 0 and length < rows * lanes:
        cursor = -(-length // max(1, lanes)) - 1
    restore(storage, data, {"rows": rows, "max_size": rows * lanes, "length": length,
                            "last_cursor": cursor}, None, where)


def load_torchrl_h5(storage: Any, h5file: Any, where: str) -> None:
    """Fill ``storage`` from an open TorchRL H5StorageCheckpointer file."""
    try:
        length = int(h5file["_len"][()])
        storage_shape = [int(s) for s in h5file["_storage_shape"][()]]
        shift, is_full = int(h5file["shift"][()]), bool(h5file["is_full"][()])
    except KeyError as exc:
        raise CheckpointError(f"{where} is not a TorchRL H5 checkpoint (missing {exc})") from None
    names = sorted(k for k in h5file if k.startswith("traj"))
    parts: dict[tuple[str, ...], list[np.ndarray]] = {}
    for name in names:
        _collect_h5(h5file[name], (), parts)
    flat = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
    data = from_torchrl(flat, shift=shift, is_full=is_full, storage_shape=storage_shape)
    cursor = (shift - 1) % storage_shape[0] if shift else -1
    _fill(storage, data, None, length, cursor, where)


def _collect_h5(group: Any, prefix: tuple[str, ...], parts: dict) -> None:
    for key, node in group.items():
        if hasattr(node, "shape"):
            parts.setdefault((*prefix, key), []).append(node[()])
        else:
            _collect_h5(node, (*prefix, key), parts)
