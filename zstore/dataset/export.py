"""Export a dataset to HDF5, in the D4RL or the Minari layout (what the importers read).

Steps are written episode after episode, in the order of the episode index.
TED keys map back to the layout's names (``observation`` -> ``observations``,
``("next", "reward")`` -> ``rewards`` ...); the keys below a nested (dict)
observation or action go to an HDF5 group of that name
(``("observation", "pos")`` -> ``observations/pos``, and in D4RL
``("next", "observation", "pos")`` -> ``next_observations/pos``), as the
importers read them. ``("info", k)`` (D4RL) and ``("next", "info", k)``
(Minari) go to ``infos/k``, and so does the other of the two where the dataset
lacks the layout's own; any other key is written at its path
(``collector/traj_ids``; ``next/info/k`` beside a D4RL ``infos/k``), which the
importers read back at that path. Text leaves (``zstore.text``) are written as HDF5
UTF-8 strings, one per step, which the importers read back as text.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
from tensordict import NonTensorData

from ..extras import import_h5py
from ..group import refuse_inside_a_dataset
from ..progress import progress as progress_bar
from ..store import StoreSpec
from ..text import is_text, non_tensor_leaves, values_of
from .importers import ACTION, OBS

#: Steps read from the dataset per batch.
BATCH_ROWS = 1 << 16
_D4RL = {OBS: "observations", ACTION: "actions", f"next/{OBS}": "next_observations",
         "next/reward": "rewards", "next/terminated": "terminals", "next/truncated": "timeouts",
         "next/done": None}
_MINARI = {ACTION: "actions", "next/reward": "rewards", "next/terminated": "terminations",
           "next/truncated": "truncations", "next/done": None}


#: The info key prefix each layout's ``infos`` holds, and the other one.
_INFOS = {"d4rl": ("info/", "next/info/"), "minari": ("next/info/", "info/")}


def _name(path: str, names: dict[str, str | None], infos: tuple[str, str],
          paths: set[str]) -> str | None:
    """The HDF5 name of the TED key ``path`` of a dataset with the keys ``paths``;
    ``None``: not written (``done``)."""
    if path in names:
        return names[path]
    for key, name in names.items():  # a key below a nested observation or action
        if name is not None and path.startswith(key + "/"):
            return name + path[len(key):]
    own, other = infos
    if path.startswith(own):
        return "infos/" + path[len(own):]
    if path.startswith(other) and own + path[len(other):] not in paths:
        return "infos/" + path[len(other):]  # the layout's own info key is absent
    return path


def _names(layout: dict[str, str | None], paths: set[str]) -> dict[str, str | None]:
    """``layout``'s names for a dataset with the TED keys ``paths``: one that records only
    ``("next", "done")`` (no ``terminated``) has its episode ends written as the
    terminals, which the importers need (and read back as ``done``)."""
    if "next/terminated" in paths:
        return layout
    return {**layout, "next/done": layout["next/terminated"]}


def _h5_value(path: str, array: np.ndarray) -> np.ndarray:
    if path in ("next/reward", "next/terminated", "next/truncated", "next/done") \
            and array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]  # TED's [N, 1] back to the HDF5 layouts' [N]
    return array


def _cells_of(dataset) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows, lanes and episode lengths of every step, episode after episode."""
    index = dataset.episodes
    lengths = index["length"]
    owner = torch.repeat_interleave(torch.arange(len(index)), lengths)
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths)
    rows = index["start"][owner] + offsets
    lanes = index["lane"][owner] if dataset.ndim > 1 else None
    return rows, lanes, lengths


def export_h5(dataset, path: str | os.PathLike, *, layout: str = "d4rl",
              progress: bool | None = None) -> None:
    """Write ``dataset`` (a :class:`~zstore.Dataset`) to the HDF5 file ``path``.

    ``layout="d4rl"`` writes flat arrays; ``"minari"`` one ``episode_<i>`` group
    per episode with ``T + 1`` observations (the last is the episode's final
    ``("next", "observation")``). The file is written beside ``path`` and renamed to it
    once complete: a failed or killed export leaves ``path`` as it was.
    """
    if layout not in ("d4rl", "minari"):
        raise ValueError(f"layout must be 'd4rl' or 'minari', got {layout!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # (the error would name the partial file)
        raise FileNotFoundError(f"cannot export to {os.fspath(path)}: no such folder {folder}")
    refuse_inside_a_dataset(StoreSpec.parse(path), "export")
    rows, lanes, lengths = _cells_of(dataset)
    partial = f"{os.fspath(path)}.{os.getpid()}.partial"
    try:
        _write_h5(dataset, partial, layout, rows, lanes, lengths, progress)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


def _write_h5(dataset, path, layout: str, rows: torch.Tensor, lanes: torch.Tensor | None,
              lengths: torch.Tensor, progress: bool | None) -> None:
    h5py = import_h5py()

    total = len(rows)
    bar = progress_bar(total, f"export {layout}", enabled=progress, unit="rows", unit_scale=True, leave=False)
    with h5py.File(path, "w") as f:
        if layout == "d4rl":
            for start in range(0, total, BATCH_ROWS):
                stop = min(start + BATCH_ROWS, total)
                batch = dataset._cells(rows[start:stop], None if lanes is None else lanes[start:stop])
                _write_d4rl(f, batch, start, total)
                bar.update(stop - start)
        else:
            ends = torch.cumsum(lengths, 0)
            for i, end in enumerate(ends.tolist()):
                begin = end - int(lengths[i])
                steps = dataset._cells(rows[begin:end], None if lanes is None else lanes[begin:end])
                _write_minari(f.create_group(f"episode_{i}"), steps)
                bar.update(end - begin)
    bar.close()


def _leaves(batch) -> list[tuple[str, np.ndarray]]:
    """``(path, values)`` of every leaf of the steps ``batch``: a tensor's as an array, a
    text leaf's as an array of HDF5 UTF-8 strings (``None`` as the empty string, as a
    buffer stores it)."""
    h5py = import_h5py()

    found = [(key, value.numpy())
             for key, value in batch.items(include_nested=True, leaves_only=True)]
    for key, value in non_tensor_leaves(batch):
        if is_text(value):
            strings = values_of(value)
            if isinstance(value, NonTensorData):  # one string for every step
                strings = strings * batch.shape[0]
            found.append((key, np.array([text or "" for text in strings],
                                        dtype=h5py.string_dtype())))
    return [("/".join((key,) if isinstance(key, str) else key), array) for key, array in found]


def _write_d4rl(f, batch, start: int, total: int) -> None:
    leaves = _leaves(batch)
    paths = {path for path, _ in leaves}
    names = _names(_D4RL, paths)
    for path, value in leaves:
        name = _name(path, names, _INFOS["d4rl"], paths)
        if name is None:
            continue
        array = _h5_value(path, value)
        if name not in f:
            f.create_dataset(name, shape=(total, *array.shape[1:]), dtype=array.dtype)
        f[name][start:start + len(array)] = array


def _write_minari(group, steps) -> None:
    leaves = _leaves(steps)
    arrays = dict(leaves)
    names = _names(_MINARI, set(arrays))
    for path, value in leaves:
        if path == OBS or path.startswith(OBS + "/"):
            array = np.concatenate([value, arrays[f"next/{path}"][-1:]]).astype(value.dtype)
            group.create_dataset("observations" + path[len(OBS):], data=array)
            continue
        if path == f"next/{OBS}" or path.startswith(f"next/{OBS}/"):
            continue
        name = _name(path, names, _INFOS["minari"], set(arrays))
        if name is not None:
            group.create_dataset(name, data=_h5_value(path, value))
    if "truncations" not in group:  # the importer needs both flags: none was truncated
        group.create_dataset("truncations", data=np.zeros(steps.shape[0], dtype=bool))
