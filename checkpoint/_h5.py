"""H5StorageCheckpointer: TED storages as one HDF5 file, locally or at any fsspec URL.

Layout (TorchRL's, SPEC §3.7): scalar ``_len``, ``_storage_shape``, ``is_full``,
``shift``, and one group ``traj_<i>`` per segment (compacted keys ``L + 1`` rows,
others ``L``; keys present only under ``"next"`` in a ``next`` sub-group). The
root attribute ``zstore_checkpoint`` (JSON) holds the write cursor and the
compact-form metadata. The file is written to a temporary name and renamed
(locally), or uploaded in one PUT (object stores), so a crash never leaves a
half-written file in place of a good one. TorchRL's own H5 files are read too.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from zstore.dtypes import torch_dtype_from_name, torch_dtype_name
from zstore.layout import Schema
from zstore.store import StoreSpec

from ._buffer import as_numpy, as_torch
from ._dest import CheckpointError, Destination, as_spec, fault_point
from ._state import TensorState, restore, shift_of
from ._ted import DEFAULT_DONE_KEYS, META, H5Split, TED2Nested, expand, info_of
from ._tensor import _Configured
from ._torchrl import load_torchrl_h5

ATTR = "zstore_checkpoint"


class H5StorageCheckpointer(_Configured):
    """TED storages as one HDF5 file (see the module docstring).

    Args:
        checkpoint_file: file name when the destination is a directory; a
            destination ending in ``.h5`` is the file itself.
        done_keys, reward_keys: as TorchRL's.
        h5_kwargs: dataset options for h5py (e.g. ``{"compression": "gzip"}``);
            applied to the data only, so compression works (TorchRL's fails).
    """

    def __init__(self, *, checkpoint_file: str = "checkpoint.h5",
                 done_keys: Iterable[Any] | None = None, reward_keys: Iterable[Any] | None = None,
                 h5_kwargs: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
                 storage_options: Mapping[str, Any] | None = None, progress: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(storage_options=storage_options, progress=progress)
        self.checkpoint_file = checkpoint_file
        self.h5_kwargs = dict(h5_kwargs or {})
        self.done_keys = DEFAULT_DONE_KEYS if done_keys is None else tuple(done_keys)
        self.reward_keys = ("reward",) if reward_keys is None else tuple(reward_keys)
        self.hook_kwargs = {k: v for k, v in kwargs.items() if k in ("done_key",)}

    def _file(self, path: Any) -> tuple[Destination, str]:
        spec = as_spec(path, self.storage_options)
        if spec.url.endswith(".h5"):
            parent, name = spec.url.rsplit("/", 1)
            return Destination(StoreSpec(parent, dict(spec.storage_options))), name
        return Destination(spec), self.checkpoint_file

    def dumps(self, storage: Any, path: Any) -> None:
        import h5py

        dest, name = self._file(path)
        dest.spec.require_writable("write a checkpoint")
        state = TensorState.of(storage)
        rows = state.rows if state.is_full else state.high
        data = state.data(0, rows)
        if not isinstance(data, TensorDict) and not hasattr(data, "batch_size"):
            raise ValueError("Only tensor collections are supported.")
        hook = TED2Nested(done_keys=self.done_keys, reward_keys=self.reward_keys, **self.hook_kwargs)
        hook.shift, hook.is_full = shift_of(state), state.is_full
        compact = hook(data)
        split = H5Split()(compact)
        info = info_of(compact)
        record = {"format_version": 1, "length": state.length, "last_cursor": state.last_cursor,
                  "max_size": state.max_size, "rows": state.rows, "ndim": state.ndim,
                  "schema": state.schema.to_json(), "ted": info}
        local_dir = dest.url if dest.spec.is_local else None
        if local_dir:
            Path(local_dir).mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".h5.partial", dir=local_dir)
        os.close(fd)
        try:
            with h5py.File(tmp, "w") as f:
                f.attrs[ATTR] = json.dumps(record)
                f.create_dataset("_len", data=np.int64(state.length))
                f.create_dataset("_storage_shape", data=np.asarray([state.rows, *state.lanes], np.int64))
                f.create_dataset("is_full", data=np.bool_(state.is_full))
                f.create_dataset("shift", data=np.int64(info["shift"]))
                for traj in split.keys():  # noqa: SIM118 - a TensorDict iterates rows
                    if traj == META:
                        continue
                    group = f.create_group(traj)
                    seg = split.get(traj)
                    for key in seg.keys(include_nested=True, leaves_only=True):
                        key = (key,) if isinstance(key, str) else tuple(key)
                        value = seg.get(key)
                        array = as_numpy(value, value.dtype)
                        kwargs = self.h5_kwargs if array.ndim and len(array) else {}
                        ds = group.create_dataset("/".join(key), data=array, **kwargs)
                        ds.attrs["torch_dtype"] = torch_dtype_name(value.dtype)
                    fault_point("write")
            fault_point("commit")
            if dest.spec.is_local:
                os.replace(tmp, os.path.join(local_dir, name))
            else:
                dest.fs.put_file(tmp, dest._path(name))
            fault_point("committed")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def loads(self, storage: Any, path: Any) -> None:
        import h5py

        dest, name = self._file(path)
        where = f"{dest.url}/{name}"
        with contextlib.ExitStack() as stack:
            try:  # local files through HDF5's own driver; others through an fsspec file
                source = dest._path(name) if dest.spec.is_local else stack.enter_context(
                    dest.fs.open(dest._path(name), "rb", block_size=16 << 20))
                f = stack.enter_context(h5py.File(source, "r"))
            except FileNotFoundError:
                raise CheckpointError(f"no H5 checkpoint at {where}") from None
            except OSError as exc:
                raise CheckpointError(f"{where} is not a readable HDF5 file ({exc})") from None
            if ATTR not in f.attrs:
                load_torchrl_h5(storage, f, where)
                return
            record = json.loads(f.attrs[ATTR])
            data = _read_mine(f, record)
        restore(storage, data, record, Schema.from_json(record["schema"]), where)


def _read_mine(f: Any, record: Mapping[str, Any]) -> TensorDict:
    """Concatenate the segments of a zstore H5 file straight into flat arrays, expand."""
    info = record["ted"]
    names = sorted(k for k in f if k.startswith("traj_"))
    paths: dict[str, Any] = {}

    def visit(path: str, node: Any) -> None:  # returning a value would stop the visit
        if hasattr(node, "shape"):
            paths[path] = node

    if names:
        f[names[0]].visititems(visit)
    out = TensorDict(batch_size=[])
    ends = []
    totals = {p: sum(f[n][p].shape[0] for n in names) for p in paths}
    expanded = set(info["expanded"])
    for p, first in paths.items():
        buf = np.empty((totals[p], *first.shape[1:]), dtype=first.dtype)
        pos = 0
        for n in names:
            ds = f[n][p]
            size = ds.shape[0]
            if size:
                ds.read_direct(buf, dest_sel=np.s_[pos:pos + size])
            pos += size
        dtype = torch_dtype_from_name(str(first.attrs["torch_dtype"]))
        out.set(tuple(p.split("/")), as_torch(buf, dtype))
    plain = next((p for p in paths if p not in expanded), None)
    for n in names:
        size = f[n][plain].shape[0] if plain is not None else f[n][next(iter(paths))].shape[0] - 1
        mask = torch.zeros(size, dtype=torch.bool)
        if size:
            mask[-1] = True
        ends.append(mask)
    meta = TensorDict(end=torch.cat(ends) if ends else torch.zeros(0, dtype=torch.bool),
                      batch_size=[])
    meta.set_non_tensor("info", info)
    out.set(META, meta)
    return expand(out)
