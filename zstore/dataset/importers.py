"""Import D4RL- and Minari-layout HDF5 files as sealed TED datasets.

Both produce TorchRL's TED keys: ``observation``, ``action``,
``("next", "observation")``, ``("next", "reward")`` (``[N, 1]``) and the
``[N, 1]`` bool flags ``("next", "done" | "terminated" | "truncated")``, with
``done = terminated | truncated``. The buffer is written at ``url`` in batches,
then sealed (:mod:`zstore.dataset.sealing`). Published data is checksummed by
default (``codec="zstd+crc32c"``).

* **D4RL**: one flat array per field over all steps: ``observations``,
  ``actions``, ``rewards``, ``terminals``, ``timeouts`` (optional),
  ``next_observations`` (optional), ``infos/*``. Dict spaces
  (``observations/<name>``, ``next_observations/<name>``, ``actions/<name>``
  groups) become nested keys. Without
  ``next_observations`` the next observation is the following row's
  observation and the last row is dropped, as TorchRL's D4RL loader and
  ``d4rl.qlearning_dataset`` do (at an episode end that is the next
  episode's first observation). ``infos/<k>`` become ``("info", k)``.
* **Minari**: one group per episode (``episode_<id>``, in id order) holding
  ``observations`` (``T + 1`` rows), ``actions``, ``rewards``,
  ``terminations``, ``truncations`` (``T`` rows) and ``infos``. Dict spaces
  (sub-groups) become nested keys. ``infos/<k>`` with ``T + 1`` rows (the
  reset info first) or ``T`` rows become ``("next", "info", k)`` for steps
  ``1..T``. An episode of 0 steps (its one observation, no transition) is skipped.

Arrays beside those fields with a row per step are imported at their paths (what
:func:`~zstore.dataset.export_h5` writes for keys no field holds); the others are left out
with a warning naming them. Big-endian arrays are read in the machine's byte order; a read
that fails on damaged bytes raises :class:`SourceFileError` naming the field and the file.

String fields (h5py variable- or fixed-length strings, e.g. ``infos/name``) become text
leaves (:mod:`zstore.text`), one string per row; the cell width is the longest string in
the file. Fields of other types torch cannot hold raise :class:`SchemaError` naming them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from ..conditional import PROBE_PREFIX
from ..errors import MissingKeyError, SchemaError, SourceFileError, StoreExistsError
from ..extras import import_h5py
from ..group import existing_buffer, refuse_inside_a_dataset
from ..lease import LEASE_NAME
from ..progress import progress as progress_bar
from ..storages import LazyMemmapStorage
from ..store import StoreSpec
from ..text import TEXT_BYTES
from .convert import discard_copy
from .open import SOURCE

#: Default codec of imported datasets: compressed and checksummed.
DEFAULT_CODEC = "zstd+crc32c"
#: Rows read from the HDF5 file and written per batch.
BATCH_ROWS = 1 << 16
OBS, ACTION = "observation", "action"


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor, in the machine's byte order (torch holds no other)."""
    array = np.asarray(array)
    if not array.dtype.isnative:  # HDF5 keeps the byte order it was written in (">f4")
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(array))


def _read(data, rows: Any, text: bool = False) -> np.ndarray:
    """Rows of an HDF5 dataset (strings decoded, with ``text``); a read the file's bytes
    fail (a damaged chunk: h5py names neither the field nor the file) raises
    :class:`SourceFileError` naming both."""
    try:
        return data.asstr()[rows] if text else data[rows]
    except OSError as exc:
        raise SourceFileError(
            f"cannot read field {data.name.lstrip('/')!r} of {data.file.filename} ({exc}): the "
            "file is damaged; pass a complete, undamaged copy of it") from exc


def _flag(array: np.ndarray) -> torch.Tensor:
    """A ``[n]`` flag array as TED's ``[n, 1]`` bool."""
    return _tensor(np.asarray(array).astype(bool).reshape(-1, 1))


def _is_text(data) -> bool:
    """Whether an HDF5 dataset holds strings (variable- or fixed-length)."""
    h5py = import_h5py()

    return h5py.check_string_dtype(data.dtype) is not None


def _column(data, rows: slice) -> torch.Tensor | NonTensorStack:
    """Rows of an HDF5 dataset: a tensor, or one string per row for a 1-d string dataset.
    SchemaError naming the field and the file for values zstore cannot store."""
    def field() -> str:  # for errors only: h5py makes a name and a file object per access
        return f"field {data.name.lstrip('/')!r} of {data.file.filename}"

    if _is_text(data):
        if data.ndim != 1:
            raise SchemaError(f"{field()} holds strings of shape {data.shape[1:]} per row; "
                              "zstore stores one string per row: flatten or drop the field")
        try:
            return NonTensorStack.from_list(list(_read(data, rows, text=True)))
        except UnicodeDecodeError as exc:
            raise SchemaError(f"{field()} holds strings that are not valid text ({exc}); "
                              "re-encode them as UTF-8 or drop the field") from None
    try:
        return _tensor(_read(data, rows))
    except TypeError as exc:
        raise SchemaError(f"{field()} holds {data.dtype} values, which zstore cannot store as "
                          f"a tensor ({exc}); convert the field to numbers or strings, or drop "
                          "it") from None


def _text_bytes(group, fields) -> int:
    """UTF-8 bytes of the longest string of the string datasets under ``fields`` of ``group``
    (0 without any)."""
    longest = 0
    for field in fields:
        for _, data in _members(group[field]) if field in group else []:
            if _is_text(data):
                longest = max(longest, _longest_text(data))
    return longest


def _longest_text(data) -> int:
    """Bytes of the longest string of an HDF5 string dataset (0 when empty)."""
    return max((len(value) for value in _read(data, ...).ravel()), default=0)


def _node(node: Any, rows: slice) -> Any:
    """Rows of an HDF5 dataset, or of every dataset in a group (nested dict)."""
    h5py = import_h5py()

    if isinstance(node, h5py.Dataset):
        return _column(node, rows)
    return {name: _node(child, rows) for name, child in node.items()}


def _ted(obs, action, next_obs, reward, terminated, truncated, n: int) -> TensorDict:
    td = TensorDict({OBS: obs, ACTION: action,
                     "next": {OBS: next_obs, "reward": _tensor(np.asarray(reward)).reshape(n, -1),
                              "terminated": terminated, "truncated": truncated,
                              "done": terminated | truncated}}, batch_size=[n])
    return td


class _Writer:
    """Writes TED batches into a new buffer at ``url``, then seals it."""

    def __init__(self, url, total: int, storage_options, codec, chunks, desc: str, progress,
                 text_bytes: int = 0, source: Mapping[str, Any] | None = None):
        if total < 1:
            raise SchemaError(f"nothing to import into {url}: the file holds no transitions")
        spec = StoreSpec.parse(url, storage_options)
        refuse_inside_a_dataset(spec, "import")
        if existing_buffer(spec) is not None:  # before anything (a lease file too) is written there
            raise StoreExistsError(
                f"cannot import into {spec.redacted()}: it already holds a zstore buffer or "
                "dataset (left unchanged); choose another destination, or delete it first")
        # committed only whole (by the seal): an import killed part way holds no row, so it is
        # never sealed and published truncated (sealing refuses 0 rows, naming the fix)
        # then all there is at the end is this import's (a lease or probe left by a killed
        # creation is taken over by this one, as create_group does)
        self.was_empty = spec.is_empty(ignore=(LEASE_NAME, PROBE_PREFIX))
        self.storage = LazyMemmapStorage(total, scratch_dir=url, storage_options=storage_options,
                                         codec=codec, chunks=chunks, auto_cleanup=False,
                                         text_bytes=text_bytes or TEXT_BYTES,
                                         autocommit_seconds=math.inf)
        self.position = self.shown = 0
        self.source = dict(source or {})
        self.bar = progress_bar(total, desc, enabled=progress, unit="rows", unit_scale=True, leave=False)

    def read(self, n: int) -> None:
        """Advance the progress bar by ``n`` rows read, to be written with a later batch (an
        import of many short episodes reads far longer than it writes)."""
        self.shown += n
        self.bar.update(n)

    def write(self, batch: TensorDict) -> None:
        n = batch.shape[0]
        self.storage.set(torch.arange(self.position, self.position + n), batch)
        self.position += n
        if self.position > self.shown:  # rows not shown as read
            self.bar.update(self.position - self.shown)
            self.shown = self.position

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """Seal after a complete import; delete what the import wrote after a failure or an
        interruption (Ctrl-C), the seal's included, so that running it again works."""
        self.bar.close()
        try:
            if kind is None:
                meta = self.storage._meta  # sealing commits it, the source's metadata with it
                meta.extra = {**meta.extra, SOURCE: self.source}
                self.storage.seal()
                self.storage.close()
                return
        except BaseException:
            self._discard()
            raise
        self._discard()

    def _discard(self) -> None:
        """Delete the buffer this import was writing, wherever it stopped (its creation
        included): only where the location was empty before it, and once this import took
        it (created the buffer, or holds its lease), so nothing else is lost: not another
        import's, running there, whose lease refused this one."""
        lease = self.storage._lease
        if self.was_empty and (self.storage.initialized or (lease is not None and lease.active
                                                            and lease.held)):
            discard_copy(self.storage)


#: Values of more elements than this are left out of a source's metadata (kept small: it
#: is part of the root ``zarr.json`` every open reads).
_SOURCE_VALUE_ELEMENTS = 256


def _jsonable(value: Any) -> Any:
    """``value`` (an HDF5 attribute or scalar dataset, a JSON value) as JSON, or None when
    it is too large or has no JSON form."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, np.ndarray):
        if value.size > _SOURCE_VALUE_ELEMENTS:
            return None
        value = [_jsonable(v) for v in value.reshape(-1).tolist()] if value.dtype.kind in "SOU" \
            else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return value


def _source(layout: str, file: str, attrs: Mapping[str, Any],
            more: Mapping[str, Any] = ()) -> dict[str, Any]:
    """A dataset's record of its source: the layout, the file's name, and its metadata (the
    file's attributes, then ``more``: D4RL's ``metadata/`` arrays, Minari's
    ``metadata.json``), values too large or without a JSON form left out."""
    metadata = {}
    for name, value in [*attrs.items(), *dict(more).items()]:
        kept = _jsonable(value)
        if kept is not None:
            metadata[str(name)] = kept
    return {"layout": layout, "file": os.path.basename(file), "metadata": metadata}


def _members(node) -> list[tuple[str, Any]]:
    """``(relative path, dataset)`` of an HDF5 dataset (``""``) or of every dataset below a group."""
    return [("", node)] if hasattr(node, "shape") else list(_datasets(node))


def _rows(file, name: str, where: str) -> int:
    """Rows of the field ``name``: a dataset, or a group (dict space) whose datasets all have
    that many rows (SchemaError naming the one that differs, or an empty group)."""
    members = _members(file[name])
    if not members:
        raise SchemaError(f"{where}: the group {name!r} holds no arrays")
    rows = _length(members[0][1], where)
    for sub, data in members[1:]:
        if _length(data, where) != rows:
            raise SchemaError(f"{where}: '{name}/{sub}' has {len(data)} rows, "
                              f"'{name}/{members[0][0]}' {rows}")
    return rows


def _length(data, where: str) -> int:
    """Rows of an HDF5 dataset; SchemaError for a scalar, which holds no value per row."""
    if not data.shape:
        raise SchemaError(f"{where}: {data.name.lstrip('/')!r} holds one value (a scalar), not "
                          "one per step: store it with a row per step, or drop it")
    return len(data)


def _require(file, names, where: str) -> None:
    missing = [name for name in names if name not in file]
    if missing:
        raise MissingKeyError(f"{where} lacks {missing} (has {sorted(file.keys())})")


def import_d4rl(h5_path: str | os.PathLike, url: str | os.PathLike,
                storage_options: Mapping[str, Any] | None = None, *, codec: Any = DEFAULT_CODEC,
                chunks: Any = None, progress: bool | None = None):
    """Import a D4RL-layout HDF5 file as a sealed dataset at ``url``; returns the opened Dataset."""
    h5py = import_h5py()

    from .open import open_dataset

    with h5py.File(source_file("d4rl", h5_path), "r") as f:
        where = f"D4RL file {os.fspath(h5_path)}"
        if _episode_names(f) and "observations" not in f:
            raise MissingKeyError(f"{where} holds Minari episode groups ({_episode_names(f)[0]} "
                                  "...), not D4RL's arrays: import it with import_minari "
                                  "(`zstore import minari FILE URL`)")
        _require(f, ("observations", "actions", "rewards", "terminals"), where)
        for name in ("rewards", "terminals", "timeouts"):
            if name in f and not isinstance(f[name], h5py.Dataset):
                raise SchemaError(f"{where}: {name!r} is a group; D4RL stores it as one array "
                                  "of a value per step")
        steps = _rows(f, "observations", where)
        for name in ("actions", "rewards", "terminals", "timeouts", "next_observations"):
            rows = _rows(f, name, where) if name in f else steps
            if rows != steps:
                raise SchemaError(f"{where}: {name!r} has {rows} rows, observations {steps}")
        has_next = "next_observations" in f
        if has_next:
            _require_same_layout({name: {path or "the array": layout for path, layout in
                                         _layout(f[name]).items()}
                                  for name in ("observations", "next_observations")}, where)
        total = steps if has_next else steps - 1
        infos = [name for name, _ in _datasets(f["infos"])] if "infos" in f else []
        for name in infos:
            if _length(f["infos"][name], where) != steps:
                raise SchemaError(f"{where}: 'infos/{name}' has {len(f['infos'][name])} rows, "
                                  f"observations {steps}")
        extras = _d4rl_extras(f, steps, infos, where)
        text_bytes = max(_text_bytes(f, ("observations", "actions", "next_observations", "infos")),
                         *(_longest_text(data) for _, data in extras if _is_text(data)), 0)
        more = {f"metadata/{name}": node[()] for name, node in _datasets(f["metadata"])
                if node.size <= _SOURCE_VALUE_ELEMENTS} \
            if isinstance(f.get("metadata"), h5py.Group) else {}
        source = _source("d4rl", os.fspath(h5_path), dict(f.attrs), more)
        with _Writer(url, total, storage_options, codec, chunks, "import d4rl", progress,
                     text_bytes, source) as sink:
            _copy_d4rl(f, sink, total, has_next, infos, extras)
    return open_dataset(url, storage_options)


#: The fields of a D4RL file the import reads by name (``metadata/``: the source's record).
_D4RL_FIELDS = ("observations", "actions", "rewards", "terminals", "timeouts",
                "next_observations", "infos", "metadata")
#: The TED keys a D4RL import writes (an array the file holds beside its fields must not be
#: stored at, above or below one of them).
_TED_PATHS = (OBS, ACTION, f"next/{OBS}", "next/reward", "next/terminated", "next/truncated",
              "next/done")


def _d4rl_extras(f, steps: int, infos: list[str], where: str) -> list[tuple[str, Any]]:
    """``(path, dataset)`` of the arrays a D4RL file holds beside its fields with a row per
    step (``qvel``, ``goals/xy``, or an export's ``next/info/k``): imported at their paths,
    as the exporter writes keys it has no field for. The others are left out with a
    warning naming them: values not one per step, or a path a TED key takes."""
    taken = (*_TED_PATHS, *(f"info/{name}" for name in infos))
    kept, uneven, clashing = [], [], []
    for name in f:
        if name in _D4RL_FIELDS:
            continue
        for sub, data in _members(f[name]):
            path = f"{name}/{sub}".rstrip("/")
            if _clashes(path, taken):
                clashing.append(path)
            elif not _per_step(data, steps):
                uneven.append(path)
            else:
                kept.append((path, data))
    for paths, why in ((uneven, f"they do not hold one value per step ({steps}) of a type "
                                "zstore stores (numbers, or one string per row)"),
                       (clashing, "a key the import writes takes their path; rename them")):
        if paths:
            warnings.warn(f"{where}: left out {paths[:8]}{' ...' if len(paths) > 8 else ''}, "
                          f"beside the D4RL fields: {why}", RuntimeWarning, stacklevel=3)
    return kept


def _per_step(data, steps: int) -> bool:
    """Whether an HDF5 dataset beside the fields holds one value per step (``steps`` rows)
    of a kind an import stores: numbers or booleans, or one string per row."""
    if not data.shape or data.shape[0] != steps:
        return False
    return data.ndim == 1 if _is_text(data) else data.dtype.kind in "biufc"


def _clashes(path: str, taken: tuple[str, ...]) -> bool:
    """Whether the key path ``path`` is one of ``taken``, or above or below one."""
    return any(path == key or key.startswith(path + "/") or path.startswith(key + "/")
               for key in taken)


def _copy_d4rl(f, sink: _Writer, total: int, has_next: bool, infos: list[str],
               extras: list[tuple[str, Any]]) -> None:
    for start in range(0, total, BATCH_ROWS):
        rows = slice(start, min(start + BATCH_ROWS, total))
        n = rows.stop - rows.start
        obs = _node(f["observations"], rows)
        next_obs = _node(f["next_observations"], rows) if has_next else \
            _node(f["observations"], slice(rows.start + 1, rows.stop + 1))
        timeouts = _read(f["timeouts"], rows) if "timeouts" in f else np.zeros(n, dtype=bool)
        batch = _ted(obs, _node(f["actions"], rows), next_obs, _read(f["rewards"], rows),
                     _flag(_read(f["terminals"], rows)), _flag(timeouts), n)
        for name in infos:
            batch[("info", *name.split("/"))] = _column(f["infos"][name], rows)
        for path, data in extras:
            batch[tuple(path.split("/"))] = _column(data, rows)
        sink.write(batch)


def _datasets(group, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(relative path, dataset)`` of every dataset below ``group``."""
    h5py = import_h5py()

    for name, node in group.items():
        if isinstance(node, h5py.Dataset):
            yield prefix + name, node
        else:
            yield from _datasets(node, f"{prefix}{name}/")


def _episode_names(f) -> list[str]:
    names = [name for name in f if re.fullmatch(r"episode_\d+", name)]
    return sorted(names, key=lambda name: int(name.rsplit("_", 1)[1]))


def _layout(node) -> dict[str, tuple]:
    """``{path below node: (per-row shape, dtype or "text")}`` of a dataset or a group's."""
    return {name: (data.shape[1:], "text" if _is_text(data) else data.dtype)
            for name, data in _members(node)}


#: The fields of a Minari episode group, in the order they are checked.
_MINARI_FIELDS = ("observations", "actions", "rewards", "terminations", "truncations", "infos")


def _split_extras(layout: dict[str, tuple]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """``layout`` (an episode's, from :func:`_minari_facts`) as the layout of Minari's fields
    and that of the arrays beside them (a row per step: what an export wrote for keys it had
    no field for)."""
    fields = {path: form for path, form in layout.items()
              if path.split("/")[0] in _MINARI_FIELDS}
    return fields, {path: form for path, form in layout.items() if path not in fields}


def _minari_facts(group, where: str) -> tuple[int, dict[str, tuple], int, list[str]]:
    """What an import must know of an episode group before anything is written, in one walk
    of it: its steps (the fields checked: present, with the rows they need), the layout of
    its arrays (``{field/path: (per-row shape, dtype or "text")}``: what every episode of a
    file must share to be stored as one dataset; arrays beside the fields with a row per step
    included, :func:`_split_extras`), the UTF-8 bytes of its longest string, and the paths
    of the arrays left out (beside the fields: not a value per step of a type stored, or at a
    TED key's path)."""
    h5py = import_h5py()

    _require(group, ("observations", "actions", "rewards", "terminations", "truncations"), where)
    steps = len(group["rewards"])
    expected = {"observations": (steps + 1,), "actions": (steps,), "terminations": (steps,),
                "truncations": (steps,), "infos": (steps, steps + 1)}
    layout, longest, left_out = {}, 0, []
    held = set(group)  # one listing: h5py's cost per lookup dominates short episodes
    for field in (*_MINARI_FIELDS, *sorted(held - set(_MINARI_FIELDS))):
        extra = field not in _MINARI_FIELDS
        for name, data in _members(group[field]) if field in held else []:
            path = f"{field}/{name}".rstrip("/")
            shape, dtype = data.shape, data.dtype
            if extra and (_clashes(path, (*_TED_PATHS, "next/info")) or not _per_step(data, steps)):
                left_out.append(path)
                continue
            rows = shape[0] if shape else len(data)  # a scalar: h5py's own error
            if field in expected and rows not in expected[field]:
                wanted = " or ".join(map(str, expected[field]))
                raise SchemaError(f"{where}: {path!r} has {rows} rows, expected {wanted}" + (
                    f" (rewards: {steps})" if field != "infos" else ""))
            text = h5py.check_string_dtype(dtype) is not None
            layout[path] = (shape[1:], "text" if text else dtype)
            if text and field not in ("rewards", "terminations", "truncations"):
                longest = max(longest, _longest_text(data))
    return steps, layout, longest, left_out


def _require_same_layout(layouts: dict[str, dict[str, tuple]], where: str) -> None:
    """SchemaError naming the first episode whose fields differ from the first episode's."""
    names = list(layouts)
    first = layouts[names[0]] if names else {}
    for name in names[1:]:
        layout = layouts[name]
        if layout != first:
            differ = sorted(set(first) ^ set(layout)) or \
                sorted(path for path in first if first[path] != layout[path])
            raise SchemaError(
                f"{where}: {name} differs from {names[0]} in {differ or 'its arrays'} (per-row "
                f"shapes and dtypes: {name} {_shown(layout, differ)}, {names[0]} "
                f"{_shown(first, differ)}); a dataset stores one layout per key: give them "
                "one, or import the parts of each layout apart")


def _shown(layout: dict[str, tuple], paths: list[str]) -> dict[str, Any]:
    return {path: (list(layout[path][0]), str(layout[path][1])) if path in layout else "absent"
            for path in paths}


def _minari_episode(group, extras: list[str]) -> TensorDict:
    """One (checked) Minari episode group as ``T`` TED transitions; the arrays at the paths
    ``extras`` (a row per step) at those key paths."""
    steps = len(group["rewards"])
    obs = _node(group["observations"], slice(None))

    def shift(value, lo: int, hi: int):  # a dict space's group, or one field's rows
        return {k: shift(v, lo, hi) for k, v in value.items()} if isinstance(value, dict) \
            else value[lo:hi]

    batch = _ted(shift(obs, 0, steps), _node(group["actions"], slice(None)),
                 shift(obs, 1, steps + 1), _read(group["rewards"], slice(None)),
                 _flag(_read(group["terminations"], slice(None))),
                 _flag(_read(group["truncations"], slice(None))), steps)
    if "infos" in group:
        for name, node in _datasets(group["infos"]):
            batch[("next", "info", *name.split("/"))] = _column(node, slice(len(node) - steps, None))
    for path in extras:
        batch[tuple(path.split("/"))] = _column(group[path], slice(None))
    return batch


def source_file(layout: str, file: str | os.PathLike) -> str:
    """The HDF5 file an import of ``layout`` (``"d4rl"`` or ``"minari"``) reads from
    ``file``. :class:`~zstore.errors.SourceFileError` for one that is missing, a directory
    (a Minari folder without its HDF5 file) or not HDF5, naming it and the fix (h5py's
    errors name neither)."""
    h5py = import_h5py()

    file = os.fspath(file)
    expected = ("the .hdf5 file of a D4RL dataset" if layout == "d4rl" else
                "a Minari dataset's folder or its main_data.hdf5")
    if not os.path.exists(file):
        raise SourceFileError(f"no such file: {file}; pass {expected}")
    path = minari_main_file(file) if layout == "minari" else file  # a folder without it: raises
    if os.path.isdir(path):
        raise SourceFileError(f"{file} is a directory, not an HDF5 file; pass {expected}")
    if not h5py.is_hdf5(path):
        raise SourceFileError(f"{path} is not an HDF5 file (no HDF5 signature); pass {expected}")
    try:
        h5py.File(path, "r").close()
    except OSError as exc:  # a truncated or damaged file
        raise SourceFileError(f"cannot read {path} as HDF5 ({exc}); pass a complete, undamaged "
                              f"copy of {expected}") from exc
    return path


def minari_main_file(path: str | os.PathLike) -> str:
    """The HDF5 file of a Minari dataset: ``path`` itself, or inside the folder Minari writes.

    Minari keeps a dataset as ``<dataset>/data/main_data.hdf5`` (with ``metadata.json``
    beside it); its Arrow backend writes no HDF5 file, which is refused with that reason.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        return path
    for candidate in (os.path.join(path, "data", "main_data.hdf5"),
                      os.path.join(path, "main_data.hdf5")):
        if os.path.isfile(candidate):
            return candidate
    data = os.path.join(path, "data") if os.path.isdir(os.path.join(path, "data")) else path
    found = sorted(os.listdir(data))
    raise MissingKeyError(
        f"the Minari dataset folder {path} holds no main_data.hdf5 (looked in {data}, found "
        f"{found[:8]}{' ...' if len(found) > 8 else ''}); zstore imports Minari's HDF5 backend: "
        "create the dataset with data_format='hdf5', or pass the .hdf5 file itself")


def _minari_metadata(h5_path: str) -> dict[str, Any]:
    """The ``metadata.json`` Minari writes beside ``main_data.hdf5`` (or, in older layouts,
    in the dataset folder above it) as a dict; ``{}`` when there is none or it is no JSON
    object."""
    folder = os.path.dirname(os.path.abspath(h5_path))
    for candidate in (folder, os.path.dirname(folder)):
        path = os.path.join(candidate, "metadata.json")
        if os.path.isfile(path):
            with contextlib.suppress(OSError, ValueError), open(path) as file:
                loaded = json.load(file)
                return loaded if isinstance(loaded, dict) else {}
    return {}


def import_minari(h5_path: str | os.PathLike, url: str | os.PathLike,
                  storage_options: Mapping[str, Any] | None = None, *,
                  codec: Any = DEFAULT_CODEC, chunks: Any = None, progress: bool | None = None):
    """Import a Minari-layout HDF5 file as a sealed dataset at ``url``; returns the opened Dataset.

    ``h5_path`` is the file, or the dataset folder Minari writes
    (``<dataset>/data/main_data.hdf5``).
    """
    h5py = import_h5py()

    from .open import open_dataset

    h5_path = source_file("minari", h5_path)
    with h5py.File(h5_path, "r") as f:
        names = _episode_names(f)
        where = f"Minari file {os.fspath(h5_path)}"
        if not names:
            hint = ("; it holds D4RL's flat arrays: import it with import_d4rl (`zstore import "
                    "d4rl FILE URL`)") if "observations" in f else ""
            raise MissingKeyError(f"{where} has no episode_<id> groups (has "
                                  f"{sorted(f.keys())}){hint}")
        facts = {name: _minari_facts(f[name], f"{where}, {name}")
                 for name in progress_bar(names, "check minari", enabled=progress,
                                          unit="episodes", leave=False)}
        steps = {name: fact[0] for name, fact in facts.items()}
        names = [name for name in names if steps[name]]  # a 0-step episode holds no transition
        split = {name: _split_extras(facts[name][1]) for name in names}
        _require_same_layout({name: fields for name, (fields, _) in split.items()}, where)
        text_bytes = max((facts[name][2] for name in names), default=0)
        # arrays beside the fields are imported where every episode holds them alike
        first = split[names[0]][1] if names else {}
        extras = [path for path, form in first.items()
                  if all(split[name][1].get(path) == form for name in names)]
        left_out = sorted({path for name in names for path in facts[name][3]}
                          | {path for name in names for path in split[name][1]} - set(extras))
        source = _source("minari", h5_path, dict(f.attrs), _minari_metadata(h5_path))
        with _Writer(url, sum(steps.values()), storage_options, codec, chunks, "import minari",
                     progress, text_bytes, source) as sink:
            pending: list[TensorDict] = []
            rows, unflagged = 0, []
            for i, name in enumerate(names):
                pending.append(_minari_episode(f[name], extras))
                last = pending[-1][-1]["next"]
                if not last["done"].any() and i < len(names) - 1:  # the group ends it: truncated
                    last["truncated"][:] = last["done"][:] = True
                    unflagged.append(name)
                rows += pending[-1].shape[0]
                sink.read(pending[-1].shape[0])
                if rows >= BATCH_ROWS or i == len(names) - 1:
                    sink.write(torch.cat(pending))
                    pending, rows = [], 0
    if left_out:
        warnings.warn(
            f"{where}: left out {left_out[:8]}{' ...' if len(left_out) > 8 else ''}, beside "
            "the Minari fields of its episodes: such arrays are imported at their paths only "
            "with one value per step of a type zstore stores, alike in every episode, and at a "
            "path no TED key takes", RuntimeWarning, stacklevel=2)
    if unflagged:
        warnings.warn(
            f"{where}: {len(unflagged)} episode(s) ({', '.join(unflagged[:5])}"
            f"{' ...' if len(unflagged) > 5 else ''}) end with neither a termination nor a "
            "truncation; their last step was imported as truncated, so each stays an episode "
            "of its own (Minari keeps one episode per group), not merged with the next (the "
            "file's last episode is kept open, as a recording stopped inside it)",
            RuntimeWarning, stacklevel=2)
    return open_dataset(url, storage_options)
