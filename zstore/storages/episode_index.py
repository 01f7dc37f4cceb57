"""The episode index of a dataset: computed from TED done flags, stored as Zarr arrays.

An episode is a maximal run of consecutive steps of one lane that ends where
``("next", "done")`` is set (or, without it, ``("next", "terminated") |
("next", "truncated")``; both rules live in :mod:`zstore.episodes`, as does
the ring order below). The last written step of every lane closes the
episode in progress: if none of its flags is set, the episode is *open*
(``terminated`` and ``truncated`` both false).

* Steps are taken in chronological order: a full ring buffer that wrapped
  starts at its oldest row, ``(last_cursor + 1) % rows``, so its first episode
  may begin mid-trajectory, and an episode may run past the last row and
  continue at row 0: its rows are ``(start + arange(length)) % rows``, and
  ``stop = start + length`` can exceed ``rows``.
* ``ndim > 1`` buffers (``[time, *lanes]``): each lane is its own time series;
  episodes are listed lane after lane (as TorchRL's TED2Flat does) and carry
  their flat ``lane`` index. Every filled row counts as filled in every lane.

The index lives in the sub-group :data:`INDEX_PATH`; each array has the
buffer's leading shape ``[rows, *lanes]`` (episode ``i`` at flat position
``i``, zeros after the last episode), so ``TensorDict.from_zarr`` and other
readers still see one batch size across the group. The count is in the
``zstore`` block, ``extra["episodes"]["count"]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import zarr
from tensordict import TensorDict

from .. import episodes as _ted
from ..dtypes import from_numpy
from ..episodes import (flags_of, key_path, lane_episode_bounds, ring_order, ring_rows,
                        segment_sums)
from ..errors import CorruptChunkError
from ..group import TENSORDICT_ATTR, new_group
from ..layout import EPISODE_INDEX_NAME, StoreMeta, dimension_names
from ..row_objects import REBUILD_INDEX, require_index_stored

#: Sub-group of the dataset group holding the episode index.
INDEX_PATH = EPISODE_INDEX_NAME
#: The index's columns (``lane`` only for ``ndim > 1``).
FIELDS = ("start", "stop", "length", "return", "terminated", "truncated")
#: Zarr paths of the TED keys read (see :mod:`zstore.episodes`).
DONE_KEY, TERMINATED_KEY, TRUNCATED_KEY, REWARD_KEY = map(key_path, (
    _ted.DONE_KEY, _ted.TERMINATED_KEY, _ted.TRUNCATED_KEY, _ted.REWARD_KEY))
#: Rows per chunk of the index arrays (only chunks holding episodes are stored).
_INDEX_CHUNK = 1 << 16


def chronological_rows(meta: StoreMeta, length: int, last_cursor: int) -> torch.Tensor:
    """Filled rows, oldest first (a wrapped ring starts after its last cursor)."""
    return ring_order(length, meta.max_size, last_cursor,
                      lanes=math.prod(meta.schema.lane_shape))


def _column(group: zarr.Group, meta: StoreMeta, path: str, order: torch.Tensor,
            lanes: int) -> torch.Tensor | None:
    """Column ``path`` as ``[lanes, steps, -1]`` in chronological order (None if absent)."""
    leaf = meta.schema.by_path.get(path)
    if leaf is None:
        return None
    stop = int(order.max()) + 1 if len(order) else 0
    values = from_numpy(np.asarray(group[path][:stop]), leaf.dtype)[order]
    return values.reshape(len(order), lanes, -1).transpose(0, 1)


def compute_index(group: zarr.Group, meta: StoreMeta, length: int,
                  last_cursor: int) -> TensorDict:
    """The episode index of a committed buffer holding at least one row (see the module
    docstring; :func:`~zstore.storages.sealing.seal_storage` refuses an empty one)."""
    lanes = math.prod(meta.schema.lane_shape)
    order = chronological_rows(meta, length, last_cursor)
    steps = len(order)
    term = _column(group, meta, TERMINATED_KEY, order, lanes)
    trunc = _column(group, meta, TRUNCATED_KEY, order, lanes)
    read = {TERMINATED_KEY: term, TRUNCATED_KEY: trunc}

    def column(key: tuple[str, ...]) -> torch.Tensor | None:
        path = key_path(key)
        return read[path] if path in read else _column(group, meta, path, order, lanes)

    done = flags_of(column, _ted.DONE_KEY, lead=2)  # [lanes, steps]
    if done is None:
        done = torch.zeros(lanes, steps, dtype=torch.bool)
    lane, t_start, t_stop = lane_episode_bounds(done, partial=True)  # lane-major
    t_end = t_stop - 1
    length_ = t_stop - t_start
    reward = _column(group, meta, REWARD_KEY, order, lanes)
    if reward is None:
        ret = torch.full((len(lane),), float("nan"), dtype=torch.float64)
    else:
        flat = reward.reshape(lanes * steps, -1)  # [lanes, steps, reward elements], lane-major
        feature = meta.schema.by_path[REWARD_KEY].shape[len(meta.schema.lane_shape):]
        ret = segment_sums(flat, lane * steps + t_start, length_).reshape(len(lane), *feature)

    def at_end(values: torch.Tensor) -> torch.Tensor:
        return values.any(-1)[lane, t_end]

    truncated = at_end(trunc) if trunc is not None else torch.zeros(len(lane), dtype=torch.bool)
    if term is not None:
        terminated = at_end(term)
    else:  # a done step that was not truncated ended the episode for good
        terminated = done[lane, t_end] & ~truncated
    start = order[t_start] if steps else t_start
    index = TensorDict({
        "start": start, "stop": start + length_, "length": length_, "return": ret,
        "terminated": terminated, "truncated": truncated,
    }, batch_size=[len(lane)])
    if meta.ndim > 1:
        index["lane"] = lane
    return index


def write_index(group: zarr.Group, meta: StoreMeta, index: TensorDict, codec) -> None:
    """Store ``index`` under :data:`INDEX_PATH` (arrays shaped ``[rows, *lanes, ...]``)."""
    lanes = math.prod(meta.schema.lane_shape)
    lead = (meta.rows, *meta.schema.lane_shape)
    sub = new_group(group, {TENSORDICT_ATTR: {"batch_size": list(lead), "version": 1}},
                    overwrite=True, path=INDEX_PATH)
    n = len(index)
    used_rows = -(-n // lanes)
    for name, value in index.items():
        feature = tuple(value.shape[1:])
        values = value.numpy()
        array = sub.create_array(
            name, shape=(*lead, *feature), dtype=values.dtype,
            chunks=(max(1, min(meta.rows, _INDEX_CHUNK // lanes)), *lead[1:], *feature),
            compressors=codec.compressors(values.dtype.itemsize),
            fill_value=np.zeros((), dtype=values.dtype).item(), overwrite=True,
            dimension_names=dimension_names(f"{INDEX_PATH}/{name}", len(lead) + len(feature),
                                            len(lead), prefix="episode_"))
        if used_rows:  # only the chunks holding episodes are stored, all-zero ones too
            padded = np.zeros((used_rows * lanes, *feature), dtype=values.dtype)
            padded[:n] = values
            array.with_config({"write_empty_chunks": True})[:used_rows] = \
                padded.reshape(used_rows, *lead[1:], *feature)


def read_index(group: zarr.Group, meta: StoreMeta, where: str) -> TensorDict:
    """The episode index stored by :func:`write_index` (count from the ``zstore`` block),
    checked (:func:`_check_index`): :class:`~zstore.errors.CorruptChunkError` naming
    ``where`` for an index that lost a chunk or does not decode."""
    n = int(meta.extra.get("episodes", {}).get("count", 0))
    lanes = math.prod(meta.schema.lane_shape)
    used_rows = -(-n // lanes)
    sub = group[INDEX_PATH]
    names = (*FIELDS, *(("lane",) if meta.ndim > 1 else ()))
    if meta.all_chunks_stored:
        require_index_stored([sub[name] for name in names], used_rows, where)
    out: dict[str, Any] = {}
    for name in names:
        array = sub[name]
        try:
            values = np.asarray(array[:used_rows]) if used_rows else \
                np.zeros((0, *array.shape[meta.ndim:]), dtype=array.dtype)
        except Exception as exc:  # noqa: BLE001 - zarr's checksum and decode errors alike
            raise CorruptChunkError(
                f"{where}: the episode index array {INDEX_PATH}/{name} cannot be read "
                f"({type(exc).__name__}: {exc}). {REBUILD_INDEX}") from None
        values = values.reshape(used_rows * lanes, *array.shape[meta.ndim:])[:n]
        out[name] = torch.from_numpy(np.ascontiguousarray(values))
    index = TensorDict(out, batch_size=[n])
    _check_index(index, meta, where)
    return index


def _check_index(index: TensorDict, meta: StoreMeta, where: str) -> None:
    """Refuse an index that contradicts itself or the buffer: Zarr reads a lost chunk of it
    as zeros, and an episode of 0 steps, or lengths that do not add up to the filled
    steps, would be served as episodes."""
    lanes = math.prod(meta.schema.lane_shape)
    steps = ring_rows(meta.length, meta.max_size, meta.last_cursor, lanes=lanes) * lanes
    start, stop, length = index["start"], index["stop"], index["length"]
    problems = []
    if len(index) and int(length.min()) < 1:
        problems.append(f"{int((length < 1).sum())} of {len(index)} episodes have no step")
    if not torch.equal(stop, start + length):
        problems.append("stop != start + length")
    if len(index) and not (0 <= int(start.min()) and int(start.max()) < meta.rows):
        problems.append(f"starts outside rows 0..{meta.rows - 1}")
    if int(length.sum()) != steps:
        problems.append(f"the lengths add up to {int(length.sum())} steps, the dataset holds {steps}")
    if "lane" in index.keys() and len(index) and not 0 <= int(index["lane"].min()) <= \
            int(index["lane"].max()) < lanes:
        problems.append(f"lanes outside 0..{lanes - 1}")
    if problems:
        raise CorruptChunkError(f"{where}: the episode index in {INDEX_PATH}/ is damaged ("
                                + "; ".join(problems) + f"). {REBUILD_INDEX}")
