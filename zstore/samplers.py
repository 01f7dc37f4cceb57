"""Samplers for :class:`zstore.ReplayBuffer`: which rows a batch reads.

A sampler turns a storage and a batch size into row indices; the buffer then
reads them with one ``storage.get``. Two are provided:

* :class:`RandomSampler` — uniform, with replacement (TorchRL's default).
* :class:`SliceSampler` — contiguous windows of ``slice_len`` steps that never
  cross a trajectory end, the write cursor of a ring buffer, or a change of
  trajectory id. A window is a run of consecutive rows, so it reads one or two
  chunks per key through the hot-chunk cache.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from tensordict import is_tensor_collection

from .episodes import DONE_KEY, as_key, ends_from_ids, flags_of, lane_episode_bounds, ring_order
from .storages import stack_items
from .storages.base import SCAN_ROWS


def _rows(value: Any, rows: int) -> Any:
    """``value`` as ``[rows, -1]`` (the end flags of each row), or ``value`` if not a tensor."""
    return value.reshape(rows, -1) if isinstance(value, torch.Tensor) else value


class Sampler:
    """Base class: ``sample`` picks row indices; ``mark_update`` hears about writes."""

    def sample(self, storage: Any, batch_size: int,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Row indices (int64) of a batch of ``batch_size`` rows."""
        raise NotImplementedError

    def mark_update(self, index: Any, data: Any, storage: Any, revision: int) -> None:
        """Called by the buffer after ``data`` was written at ``index``; ``revision`` is the
        storage's mutation revision before that write."""


def _newest_row(storage: Any) -> int | None:
    """The row ``storage`` wrote last (a zstore storage's, list storages' included; else
    TorchRL's ``_last_cursor_index``); ``None`` when unknown."""
    newest = getattr(storage, "_newest_row", None)
    return newest() if newest is not None else getattr(storage, "_last_cursor_index", None)


def _require_rows(storage: Any) -> int:
    n = len(storage)
    if n == 0:
        raise RuntimeError("Cannot sample from an empty storage.")
    return n


class RandomSampler(Sampler):
    """Uniform sampling with replacement: ``torch.randint(len(storage), (batch_size,))``.

    For ``ndim > 1`` storages, one index tensor per dim of ``storage.shape`` (the
    filled rows and every lane), as TorchRL's tensor storages draw them.

    >>> RandomSampler().sample(zstore.TensorStorage(torch.zeros(10)), 4).shape
    torch.Size([4])
    """

    def sample(self, storage: Any, batch_size: int,
               generator: torch.Generator | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        n = _require_rows(storage)
        if getattr(storage, "ndim", 1) == 1:
            return torch.randint(0, n, (batch_size,), generator=generator)
        return tuple(torch.randint(0, dim, (batch_size,), generator=generator)
                     for dim in storage.shape)

    def __repr__(self) -> str:
        return "RandomSampler()"


class SliceSampler(Sampler):
    """Contiguous windows of steps, each inside one trajectory.

    A trajectory ends at a row whose ``end_key`` is true (TorchRL's TED layout:
    ``("next", "done")``), or — with ``traj_key`` — wherever the trajectory id
    changes from one row to the next. The newest row is always an end, so no
    window runs from the newest row into the oldest one of a ring buffer.
    Sampling follows TorchRL's SliceSampler: trajectories at least ``slice_len``
    steps long are drawn uniformly, then a start uniformly within each.

    Args:
        num_slices: windows per batch (``slice_len = batch_size // num_slices``).
        slice_len: steps per window (``num_slices = batch_size // slice_len``).
            Give exactly one of the two.
        end_key: the key of the per-step end flag (``("next", "done")`` or
            ``"next/done"``; without it in the data, its ``terminated`` and
            ``truncated`` siblings, as :func:`zstore.episodes.done_keys` resolves it).
        traj_key: a per-step trajectory id; when given, ``end_key`` is not used.

    Returns ``num_slices * slice_len`` rows, window after window (reshape the
    batch to ``[num_slices, slice_len]`` to separate them). Trajectory ends are
    tracked from the buffer's writes; after any other change to the storage
    (or on first use of a reopened one) the key is scanned once, ``SCAN_ROWS``
    rows at a time.

    >>> sampler = SliceSampler(slice_len=8, traj_key="episode")  # doctest: +SKIP
    """

    def __init__(self, num_slices: int | None = None, slice_len: int | None = None, *,
                 end_key: str | tuple[str, ...] = DONE_KEY,
                 traj_key: str | tuple[str, ...] | None = None):
        if (num_slices is None) == (slice_len is None):
            raise TypeError("give exactly one of num_slices and slice_len, got "
                            f"num_slices={num_slices}, slice_len={slice_len}")
        for name, value in (("num_slices", num_slices), ("slice_len", slice_len)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_slices, self.slice_len = num_slices, slice_len
        self.end_key, self.traj_key = end_key, traj_key
        self._forget()

    def _forget(self) -> None:
        """Drop what was read of a storage (the next sample scans the one it is given)."""
        self._marks: torch.Tensor | None = None   # per row: end flag, or trajectory id
        self._source: Callable[[], Any] | None = None  # (a weak reference to) their storage
        self._revision: int | None = None         # and its revision they reflect
        self._spans: tuple[Any, ...] | None = None  # (key, order, starts, lengths)

    def _holds(self, storage: Any, revision: int) -> bool:
        """Whether the marks are those of ``storage`` at ``revision``: one sampler may serve
        several buffers (a train and an eval one), whose revisions count alike."""
        return self._marks is not None and self._revision == revision \
            and self._source is not None and self._source() is storage

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # a copy scans its storage afresh (no weak reference)
        state.update(_marks=None, _source=None, _revision=None, _spans=None)
        return state

    @property
    def _key(self) -> str | tuple[str, ...]:
        return self.end_key if self.traj_key is None else self.traj_key

    def _marks_of(self, data: Any, rows: int) -> torch.Tensor:
        if isinstance(data, (list, tuple)):  # items of a list storage, or a list written
            if not all(is_tensor_collection(x) for x in data):
                raise TypeError("SliceSampler reads its key from TensorDicts; this storage "
                                "holds other items")
            data = stack_items(list(data) if isinstance(data, tuple) else data)

        def get(key: tuple[str, ...]) -> Any:
            try:
                return data.get(key, None)
            except (KeyError, AttributeError, TypeError):
                return None

        if self.traj_key is None:  # the end key, or its terminated / truncated siblings
            value = flags_of(lambda k: _rows(get(k), rows), self.end_key)
        else:
            value = get(as_key(self.traj_key))
        if not isinstance(value, torch.Tensor):
            name = "traj_key" if self.traj_key is not None else "end_key"
            raise KeyError(f"SliceSampler's {name} {self._key!r} is not in the data "
                           f"(a {type(data).__name__})")
        if self.traj_key is None:
            return value.cpu()
        return value.reshape(rows, -1)[:, 0].cpu().to(torch.int64)

    def mark_update(self, index: Any, data: Any, storage: Any, revision: int) -> None:
        if not self._holds(storage, revision):
            return  # not up to date before this write: the next sample scans the storage
        index = torch.as_tensor(index).reshape(-1).cpu()
        try:
            marks = self._marks_of(data, len(index))
        except (KeyError, TypeError):  # rows without the key, stored all the same (a list
            self._forget()             # storage's): the next sample's scan says so
            return
        grow = int(index.max()) + 1 - self._marks.shape[0] if index.numel() else 0
        if grow > 0:  # the rows written so far, never the capacity (unbounded list storages)
            self._marks = torch.cat([self._marks, self._marks.new_zeros(grow)])
        self._marks[index] = marks
        self._revision = storage._mutation_revision

    def _scan(self, storage: Any, n: int) -> None:
        marks = [self._marks_of(storage.get(slice(lo, min(lo + SCAN_ROWS, n))),
                                min(SCAN_ROWS, n - lo)) for lo in range(0, n, SCAN_ROWS)]
        self._marks = torch.cat(marks)
        self._source, self._revision = weakref.ref(storage), storage._mutation_revision
        self._spans = None

    def _trajectories(self, storage: Any, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows in time order, and the start position and length of each trajectory in it."""
        if not self._holds(storage, storage._mutation_revision) or self._marks.shape[0] < n:
            self._scan(storage, n)
        last = _newest_row(storage)
        key = (self._revision, n, last)
        if self._spans is not None and self._spans[0] == key:
            return self._spans[1:]
        order = ring_order(n, storage.max_size, last)  # oldest row first
        marks = self._marks[order]
        ends = marks if self.traj_key is None else ends_from_ids(marks)
        _, starts, stops = lane_episode_bounds(ends.unsqueeze(0), partial=True)
        self._spans = (key, order, starts, stops - starts)
        return self._spans[1:]

    def sample(self, storage: Any, batch_size: int,
               generator: torch.Generator | None = None) -> torch.Tensor:
        n = _require_rows(storage)
        if getattr(storage, "ndim", 1) != 1:
            raise ValueError(f"SliceSampler samples 1-D storages; this one has ndim={storage.ndim}")
        per = self.num_slices or self.slice_len
        if batch_size % per:
            raise ValueError(f"batch_size {batch_size} is not a multiple of "
                             f"{'num_slices' if self.num_slices else 'slice_len'} {per}")
        num_slices = self.num_slices or batch_size // self.slice_len
        slice_len = self.slice_len or batch_size // self.num_slices
        order, starts, lengths = self._trajectories(storage, n)
        eligible = torch.nonzero(lengths >= slice_len).squeeze(-1)
        if not len(eligible):
            raise ValueError(f"no trajectory has {slice_len} steps or more (the longest of "
                             f"{len(lengths)} has {int(lengths.max())}); lower slice_len")
        picked = eligible[torch.randint(len(eligible), (num_slices,), generator=generator)]
        room = lengths[picked] - slice_len + 1
        offset = (torch.rand(num_slices, generator=generator) * room).long()
        position = (starts[picked] + offset).unsqueeze(-1) + torch.arange(slice_len)
        return order[position.reshape(-1)]

    def __repr__(self) -> str:
        size = f"num_slices={self.num_slices}" if self.num_slices else f"slice_len={self.slice_len}"
        key = f"traj_key={self.traj_key!r}" if self.traj_key is not None else f"end_key={self.end_key!r}"
        return f"SliceSampler({size}, {key})"
