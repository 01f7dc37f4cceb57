"""H5StorageCheckpointer: TED storages as one HDF5 file, locally or at any fsspec URL.

Format 2 (SPEC §3.7) is TorchRL's own layout, so TorchRL's
``H5StorageCheckpointer().loads`` reads it (see :mod:`checkpoint._h5form`): the
opaque scalars ``_len``, ``_storage_shape``, ``is_full``, ``shift``, one group
``traj_<i>`` per segment and one zero-padding group per lane of a partial buffer
(never written: HDF5 stores nothing for it). The root group ``zstore`` holds what
TorchRL's layout loses, and the root attribute ``zstore_checkpoint`` (JSON) the
write cursor, counters, schema and layout metadata; zstore reads both back
exactly. Every dataset carries a ``torch_dtype`` attribute. Format 1 (zstore's
own segments, before TorchRL could read them) and TorchRL's files are read too.
The file is written to a temporary name and renamed (locally), or uploaded in
one PUT (object stores), so a crash never leaves a half-written file in place of
a good one; the next dump of that file deletes what a killed one left (in the
destination, or in the temporary directory for an object store). A remote file is
downloaded to the temporary directory before HDF5 reads it (:func:`_downloaded`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from zstore.dtypes import torch_dtype_from_name, torch_dtype_name
from zstore.extras import import_h5py
from zstore.layout import Schema
from zstore.processes import process_tag, tag_gone_here
from zstore.store import StoreSpec

from ._base import _Configured
from ._buffer import as_numpy, as_torch
from ._chunks import DAMAGED
from ._dest import GEN_PREFIX, CheckpointError, Destination, as_spec, fault_point
from ._h5form import GROUP, H5Form, decode, encode
from ._result import DumpResult
from ._state import TensorState, restore, shift_of
from ._ted import DEFAULT_DONE_KEYS, META, expand
from ._torchrl import load_torchrl_h5

ATTR = "zstore_checkpoint"
#: The format this checkpointer writes (1: before TorchRL could load the files).
FORMAT = 2


#: The suffix of a dump's temporary file, ``.<name>.<process tag>.<random>.partial``.
_PARTIAL = ".partial"


def _remove_stale_partials(folder: str, name: str) -> None:
    """Delete the temporary files of dumps of ``name`` in ``folder`` whose process is gone
    (killed mid-dump): each is as large as the checkpoint. Those of a dump still running, of
    another machine, or that this user may not delete, are kept."""
    prefix = f".{name}."
    for path in Path(folder).glob(f"{glob.escape(prefix)}*{_PARTIAL}"):
        tag = path.name[len(prefix):-len(_PARTIAL)].rsplit(".", 1)[0]
        if tag_gone_here(tag):
            with contextlib.suppress(OSError):
                path.unlink()


def _scratch_file(folder: str, name: str) -> str:
    """A new temporary file for ``name`` in ``folder`` (``.<name>.<process tag>.<random>
    .partial``), after deleting those that killed processes left there."""
    _remove_stale_partials(folder, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.{process_tag()}.", suffix=_PARTIAL, dir=folder)
    os.close(fd)
    return tmp


@contextlib.contextmanager
def _downloaded(dest: Destination, name: str):
    """The path of a local copy of the remote file ``name``, deleted on exit.

    HDF5 is never handed an fsspec file object: h5py holds its global lock while it reads
    one, and fsspec serves the read on its event-loop thread, where a garbage collection
    that frees an h5py object waits for that lock: loads deadlocked, now and then in the
    test suite and every time in some scripts. A download also reads one consistent version
    of the object.
    """
    tmp = _scratch_file(tempfile.gettempdir(), name)
    try:
        dest.fs.get_file(dest.path_of(name), tmp)
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


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

    def _check_directory(self, dest: Destination) -> None:
        """Refuse a directory destination holding anything but this checkpointer's file:
        a zstore checkpoint left there would stay current for every other checkpointer
        (``TensorStorageCheckpointer().loads`` would load it, not the new file)."""
        dest.check_writable(allowed=(self.checkpoint_file,))
        if dest.read_commit() is not None or any(
                name.startswith(GEN_PREFIX) for name in dest.children()):
            raise CheckpointError(
                f"{dest.redacted()} holds a zstore checkpoint of another checkpointer; an "
                f"{type(self).__name__} file written next to it would not replace it. Dump to "
                "another directory (or to a path ending in .h5), or delete that checkpoint first")

    def dumps(self, storage: Any, path: Any) -> DumpResult:
        h5py = import_h5py()

        start = time.perf_counter()
        dest, name = self._file(path)
        dest.spec.require_writable("write a checkpoint")
        dest.spec.check_parent()  # a missing bucket: named before anything is encoded
        if name == self.checkpoint_file:
            self._check_directory(dest)
        state = TensorState.of(storage)
        data = state.data(0, state.rows if state.is_full else state.high)
        if not isinstance(data, TensorDict) and not hasattr(data, "batch_size"):
            raise ValueError("Only tensor collections are supported.")
        form = encode(data, rows=state.rows, shift=shift_of(state), is_full=state.is_full,
                      done_keys=self.done_keys, reward_keys=self.reward_keys, **self.hook_kwargs)
        record = {"format_version": FORMAT, "length": state.length,
                  "last_cursor": state.last_cursor, "max_size": state.max_size,
                  "rows": state.rows, "ndim": state.ndim, "schema": state.schema.to_json(),
                  "h5": form.info}
        local_dir = dest.url if dest.spec.is_local else None
        if local_dir:
            Path(local_dir).mkdir(parents=True, exist_ok=True)
        tmp = _scratch_file(local_dir or tempfile.gettempdir(), name)  # an object store's: uploaded
        try:
            with h5py.File(tmp, "w") as f:
                f.attrs[ATTR] = json.dumps(record)
                for key, value in (("_len", state.length), ("is_full", state.is_full),
                                   ("shift", form.torchrl_shift),
                                   ("_storage_shape", [state.rows, *state.lanes])):
                    array = np.asarray(value)  # TorchRL's non-tensor entries: opaque scalars
                    f.create_dataset(key, data=array.astype(h5py.opaque_dtype(array.dtype)))
                self._write_groups(f, form)
                extras = f.create_group(GROUP)
                self._write(extras, "segments", form.segments)
                for key, value in form.extras.items():
                    self._write(extras, key, value)
            written = os.path.getsize(tmp)
            fault_point("commit")
            if dest.spec.is_local:
                os.replace(tmp, os.path.join(local_dir, name))
            else:
                dest.fs.put_file(tmp, dest.path_of(name))
            fault_point("committed")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return DumpResult(url=dest.child(name).redacted(), checkpointer=type(self).__name__,
                          generation=None, incremental=False, bytes_written=written,
                          length=state.length, seconds=time.perf_counter() - start)

    def _write(self, group: Any, key: str, value: torch.Tensor) -> None:
        array = as_numpy(value, value.dtype)
        kwargs = self.h5_kwargs if array.ndim and len(array) else {}
        group.create_dataset(key, data=array, **kwargs).attrs["torch_dtype"] = \
            torch_dtype_name(value.dtype)

    def _write_groups(self, f: Any, form: H5Form) -> None:
        """One ``traj_<i>`` group per row of ``form.segments``; padding left unwritten."""
        arrays = {k: as_numpy(v, v.dtype) for k, v in form.columns.items()}
        dtypes = {k: torch_dtype_name(v.dtype) for k, v in form.columns.items()}
        expanded = set(form.info["expanded"])
        offsets = dict.fromkeys(arrays, 0)
        table = form.segments.tolist()
        width = len(str(max(len(table) - 1, 0)))
        for i, (steps, extra, written) in enumerate(table):
            group = f.create_group(f"traj_{i:0{width}d}")
            for key, array in arrays.items():
                size = steps + extra if key in expanded else steps
                if written:
                    lo = offsets[key]
                    offsets[key] = lo + size
                    ds = group.create_dataset(key, data=array[lo:lo + size], **self.h5_kwargs)
                else:  # zeros for TorchRL: HDF5 allocates nothing for a dataset never written
                    ds = group.create_dataset(key, shape=(size, *array.shape[1:]),
                                              dtype=array.dtype, **self.h5_kwargs)
                ds.attrs["torch_dtype"] = dtypes[key]
            fault_point("write")

    def loads(self, storage: Any, path: Any) -> None:
        h5py = import_h5py()

        dest, name = self._file(path)
        where = f"{dest.url}/{name}"
        with contextlib.ExitStack() as stack:
            try:  # always through HDF5's own driver: a remote file is downloaded first
                source = dest.path_of(name) if dest.spec.is_local else stack.enter_context(
                    _downloaded(dest, name))
                f = stack.enter_context(h5py.File(source, "r"))
            except FileNotFoundError:
                record = dest.read_commit()
                other = f"; {dest.redacted()} holds a {record.get('checkpointer')} checkpoint: " \
                    "load it with that checkpointer" if record else ""
                raise CheckpointError(f"no H5 checkpoint at {where}{other}") from None
            except OSError as exc:
                raise CheckpointError(f"{where} is not a readable HDF5 file ({exc})") from None
            if ATTR not in f.attrs:
                load_torchrl_h5(storage, f, where)
                return
            record = json.loads(f.attrs[ATTR])
            version = record.get("format_version")
            if version not in (1, FORMAT):
                raise CheckpointError(f"{where}: H5 checkpoint format {version!r} is not readable "
                                      f"by this zstore (reads 1 and {FORMAT})")
            data = _read(f, record, where) if version == FORMAT else _read_v1(f, record)
        restore(storage, data, record, Schema.from_json(record["schema"]), where)


def _datasets(group: Any) -> dict[str, Any]:
    """The datasets below ``group``, by path."""
    found: dict[str, Any] = {}

    def visit(path: str, node: Any) -> None:  # returning a value would stop the visit
        if hasattr(node, "shape"):
            found[path] = node

    group.visititems(visit)
    return found


def _concat(nodes: list[Any], like: Any) -> torch.Tensor:
    """Datasets (rows of the dtype of ``like``) read straight into one tensor."""
    buf = np.empty((sum(ds.shape[0] for ds in nodes), *like.shape[1:]), dtype=like.dtype)
    pos = 0
    for ds in nodes:
        size = ds.shape[0]
        if size:
            ds.read_direct(buf, dest_sel=np.s_[pos:pos + size])
        pos += size
    return as_torch(buf, torch_dtype_from_name(str(like.attrs["torch_dtype"])))


def _read(f: Any, record: Mapping[str, Any], where: str) -> TensorDict:
    """The TED rows of a zstore H5 file: written groups and the ``zstore`` group."""
    names = sorted(k for k in f if k.startswith("traj_"))
    if GROUP not in f or "segments" not in f[GROUP]:
        raise CheckpointError(f"{where}: the {GROUP!r} group of the checkpoint is missing")
    extras = {p: _concat([ds], ds) for p, ds in _datasets(f[GROUP]).items()}
    segments = extras.pop("segments")
    if len(segments) != len(names):
        raise CheckpointError(f"{where}: {len(names)} traj groups, {len(segments)} listed "
                              f"in {GROUP}/segments")
    held = {name: set(_datasets(f[name])) for name in names}
    every = set().union(*held.values())
    for name in names:  # a file cut or edited: name what is gone, not h5py's KeyError
        if held[name] != every:
            raise CheckpointError(f"{where}: {name} lacks {sorted(every - held[name])}, which "
                                  f"other traj groups hold: {DAMAGED}")
    written = [f[n] for n, row in zip(names, segments.tolist()) if row[2]]
    columns = {p: _concat([g[p] for g in written], ds)
               for p, ds in (_datasets(f[names[0]]).items() if names else ())}
    return decode(columns, segments, extras, record["h5"])


def _read_v1(f: Any, record: Mapping[str, Any]) -> TensorDict:
    """Format 1 (zstore's own segments, no padding, no ``zstore`` group) -> TED rows."""
    info = record["ted"]
    groups = [f[k] for k in sorted(k for k in f if k.startswith("traj_"))]
    paths = _datasets(groups[0]) if groups else {}
    out = TensorDict(batch_size=[])
    for p, ds in paths.items():
        out.set(tuple(p.split("/")), _concat([g[p] for g in groups], ds))
    expanded = set(info["expanded"])
    plain = next((p for p in paths if p not in expanded), None)
    ends = []
    for g in groups:
        size = g[plain].shape[0] if plain is not None else g[next(iter(paths))].shape[0] - 1
        mask = torch.zeros(size, dtype=torch.bool)
        if size:
            mask[-1] = True
        ends.append(mask)
    meta = TensorDict(end=torch.cat(ends) if ends else torch.zeros(0, dtype=torch.bool),
                      batch_size=[])
    meta.set_non_tensor("info", info)
    out.set(META, meta)
    return expand(out)
