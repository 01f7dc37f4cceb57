"""Ring order, done keys and episode boundaries: the one place they are computed.

Plots (:mod:`zstore.plots`), the slice sampler (:mod:`zstore.samplers`) and the
dataset's episode index (:mod:`zstore.storages.episode_index`) all read a buffer the
same way. This module needs only torch; it imports nothing from the storages,
the dataset package or the plots.

* **Ring order** (:func:`ring_order`): a buffer's filled rows oldest first. A
  full ring with a known cursor starts at the row after the one written last,
  ``(last_cursor + 1) % rows``; any other buffer is read in index order.
* **Done keys** (:func:`as_key`, :func:`done_keys`): a key is a tuple of names
  (``("next", "done")``) or a string, split at ``/`` (``"next/done"`` is the
  same key; ``"done"`` is the root key ``("done",)``, not ``("next", "done")``).
  The end of a step is its done key where the data has it, otherwise its
  sibling ``terminated`` and/or ``truncated`` keys, or'ed.
* **Episodes** (:func:`episode_bounds`, :func:`lane_episode_bounds`): in ring
  order, an episode ends at a done step; with ``partial`` the last step closes
  the episode in progress as well.

>>> ring_order(5, 5, 1)
tensor([2, 3, 4, 0, 1])
>>> episode_bounds(torch.tensor([False, True, False, False, True, False]))
(tensor([0, 2]), tensor([2, 5]))
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: TorchRL's TED keys of a step's end flags and reward.
DONE_KEY: tuple[str, ...] = ("next", "done")
TERMINATED_KEY: tuple[str, ...] = ("next", "terminated")
TRUNCATED_KEY: tuple[str, ...] = ("next", "truncated")
REWARD_KEY: tuple[str, ...] = ("next", "reward")


def ring_order(length: int, capacity: int | None, last_cursor: int | None, *,
               lanes: int = 1) -> torch.Tensor:
    """Row indices of a buffer's filled rows, oldest first (int64).

    Args:
        length: cells written (``rows * lanes`` when every row is filled).
        capacity: cells the buffer holds (``None``: unbounded, never full).
        last_cursor: the row written last (``None`` or negative: unknown).
        lanes: cells per row (``ndim > 1`` buffers), 1 otherwise.

    A full buffer (``length >= capacity``) with a known cursor is a wrapped ring:
    its ``ceil(capacity / lanes)`` rows start after ``last_cursor``. Otherwise the
    ``ceil(length / lanes)`` filled rows are returned in index order.
    """
    rows = ring_rows(length, capacity, last_cursor, lanes=lanes)
    if _wrapped(length, capacity, last_cursor):
        return (torch.arange(rows) + int(last_cursor) + 1) % rows
    return torch.arange(rows)


def ring_rows(length: int, capacity: int | None, last_cursor: int | None, *,
              lanes: int = 1) -> int:
    """How many rows :func:`ring_order` returns (the buffer's filled rows), without them."""
    cells = capacity if _wrapped(length, capacity, last_cursor) else length
    return -(-int(cells) // lanes)


def _wrapped(length: int, capacity: int | None, last_cursor: int | None) -> bool:
    """Whether a buffer is a full ring with a known cursor (its oldest row follows it)."""
    return capacity is not None and length >= capacity and last_cursor is not None \
        and int(last_cursor) >= 0


def as_key(key: str | tuple[str, ...]) -> tuple[str, ...]:
    """The nested-key form of ``key``: ``"next/done"`` and ``("next", "done")`` give
    ``("next", "done")``; a plain name is a root key (``"done"`` -> ``("done",)``)."""
    if isinstance(key, str):
        return tuple(key.split("/"))
    parts = tuple(key)
    if not parts or not all(isinstance(p, str) for p in parts):
        raise TypeError(f"a key is a string or a non-empty tuple of strings, got {key!r}")
    return parts


def key_path(key: str | tuple[str, ...]) -> str:
    """The ``/``-joined path of ``key`` (its Zarr path): ``("next", "done")`` -> ``"next/done"``."""
    return "/".join(as_key(key))


def done_keys(has: Callable[[tuple[str, ...]], bool],
              key: str | tuple[str, ...] = DONE_KEY) -> tuple[tuple[str, ...], ...]:
    """The keys whose or'ed flags end a step: ``(key,)`` when ``has(key)``, else those of
    its siblings ``terminated`` and ``truncated`` that ``has`` accepts (``()`` if none).

    ``has`` is called with nested keys (:func:`as_key`); ``key`` may be given in
    either form. ``("next", "done")`` falls back to ``("next", "terminated")`` and
    ``("next", "truncated")``.
    """
    key = as_key(key)
    if has(key):
        return (key,)
    return tuple(k for k in ((*key[:-1], "terminated"), (*key[:-1], "truncated"))
                 if k != key and has(k))


def ends_from_ids(ids: torch.Tensor) -> torch.Tensor:
    """End flags of a time-ordered ``[T]`` run of trajectory ids: a step ends its
    trajectory where the next step's id differs; the last step is an end."""
    ends = torch.ones(ids.shape[0], dtype=torch.bool)
    if ids.shape[0] > 1:
        ends[:-1] = ids[1:] != ids[:-1]
    return ends


def lane_episode_bounds(done: torch.Tensor, *, partial: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lane, start, stop)`` of the episodes of ``[lanes, T]`` done flags, each lane
    oldest first; ``stop`` is exclusive, episodes are listed lane after lane.

    An episode ends at a done step; ``partial`` also closes the unfinished episode
    after a lane's last done step (at ``T``). A lane without steps has no episodes.
    """
    ends = done.bool().clone()
    if partial and ends.shape[-1]:
        ends[:, -1] = True
    lane, last = torch.nonzero(ends, as_tuple=True)  # lane-major, time ascending
    stop = last + 1
    start = torch.zeros_like(stop)
    if len(stop) > 1:
        same = lane[1:] == lane[:-1]
        start[1:] = torch.where(same, stop[:-1], 0)
    return lane, start, stop


def episode_bounds(done: torch.Tensor, *, partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, stop)`` rows (``stop`` exclusive) of the episodes in a time-ordered run of
    done flags: each episode ends at a done row.

    Args:
        done: ``[T]`` flags of one environment, oldest first (trailing dims of
            ``[T, ...]`` flags are or'ed).
        partial: also return the unfinished episode after the last done flag.
    """
    flat = done.reshape(done.shape[0], -1).any(-1) if done.ndim > 1 else done.bool()
    _, start, stop = lane_episode_bounds(flat.unsqueeze(0), partial=partial)
    return start, stop


def segment_sums(values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Float64 sums of ``values[s:s + n]`` (along dim 0) for each ``s, n`` of ``starts``,
    ``lengths``, each summed on its own: a NaN, an inf or a huge value stays in its segment,
    where a difference of running sums carried it into every later one."""
    ids = torch.repeat_interleave(torch.arange(len(starts)), lengths)
    firsts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    rows = torch.repeat_interleave(starts, lengths) + torch.arange(len(ids)) - firsts
    flat = values.to(torch.float64).reshape(len(values), -1)
    sums = torch.zeros(len(starts), flat.shape[1], dtype=torch.float64).index_add_(0, ids, flat[rows])
    return sums.reshape(len(starts), *values.shape[1:])


def flags_of(get: Callable[[tuple[str, ...]], Any], key: str | tuple[str, ...] = DONE_KEY,
             *, lead: int = 1) -> torch.Tensor | None:
    """The end flag of every step, or'ed over the :func:`done_keys` of ``key`` and over
    feature dims: ``get(k)`` returns a tensor (its first ``lead`` dims are steps) or
    ``None`` when absent. ``None`` when no end key is present."""
    values: dict[tuple[str, ...], Any] = {}

    def has(k: tuple[str, ...]) -> bool:
        values[k] = get(k)
        return isinstance(values[k], torch.Tensor)

    keys = done_keys(has, key)
    if not keys:
        return None
    flags = [values[k].reshape(*values[k].shape[:lead], -1).any(-1) for k in keys]
    return flags[0] if len(flags) == 1 else torch.stack(flags).any(0)
