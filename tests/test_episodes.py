"""zstore.episodes: ring order, done-key resolution and episode bounds against a
plain-Python reference model of a ring buffer."""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from zstore import episodes, plots
from zstore.episodes import (DONE_KEY, as_key, done_keys, ends_from_ids, episode_bounds,
                             flags_of, key_path, lane_episode_bounds, ring_order)


class Ring:
    """A plain-Python ring buffer: writes steps at a cursor, remembers what it overwrote."""

    def __init__(self, capacity: int):
        self.capacity, self.rows, self.cursor, self.last = capacity, [], 0, None

    def write(self, item) -> None:
        if len(self.rows) < self.capacity:
            self.rows.append(item)
        else:
            self.rows[self.cursor] = item
        self.last, self.cursor = self.cursor, (self.cursor + 1) % self.capacity

    def oldest_first(self) -> list[int]:
        """Row indices, oldest first (what was written earliest and is still stored)."""
        n = len(self.rows)
        if n < self.capacity:
            return list(range(n))
        return [(self.last + 1 + i) % n for i in range(n)]


def reference_bounds(done: list[bool], partial: bool) -> list[tuple[int, int]]:
    """(start, stop) of each run ending at a done step (and the unfinished tail)."""
    out, start = [], 0
    for t, d in enumerate(done):
        if d:
            out.append((start, t + 1))
            start = t + 1
    if partial and start < len(done):
        out.append((start, len(done)))
    return out


@pytest.mark.parametrize("capacity,writes", [(1, 3), (5, 0), (5, 3), (5, 5), (5, 7), (5, 12), (8, 19)])
def test_ring_order_matches_the_reference(capacity, writes):
    ring = Ring(capacity)
    for step in range(writes):
        ring.write(step)
    order = ring_order(len(ring.rows), capacity, ring.last)
    assert order.dtype == torch.int64
    assert order.tolist() == ring.oldest_first()
    assert [ring.rows[i] for i in order.tolist()] == sorted(ring.rows)  # steps in time order


def test_ring_order_unknown_cursor_and_lanes():
    assert ring_order(4, 4, None).tolist() == [0, 1, 2, 3]  # a list storage keeps no cursor
    assert ring_order(4, 4, -1).tolist() == [0, 1, 2, 3]
    assert ring_order(3, None, 2).tolist() == [0, 1, 2]     # unbounded: never full
    assert ring_order(3, 4, 2).tolist() == [0, 1, 2]        # not full: index order
    # [rows=3, lanes=2]: cells counted, rows returned
    assert ring_order(6, 6, 0, lanes=2).tolist() == [1, 2, 0]
    assert ring_order(3, 6, 1, lanes=2).tolist() == [0, 1]
    assert ring_order(0, 6, None, lanes=2).tolist() == []


def test_key_forms():
    assert as_key(("next", "done")) == as_key("next/done") == ("next", "done")
    assert as_key("done") == ("done",)  # a plain name is a root key, never ("next", "done")
    assert key_path(("next", "done")) == key_path("next/done") == "next/done"
    with pytest.raises(TypeError):
        as_key(())
    with pytest.raises(TypeError):
        as_key(("next", 1))


@pytest.mark.parametrize("key", [("next", "done"), "next/done"])
def test_done_keys_fall_back_to_terminated_and_truncated(key):
    def having(*present):
        return lambda k: k in {as_key(p) for p in present}

    assert done_keys(having("next/done", "next/truncated"), key) == (DONE_KEY,)
    assert done_keys(having("next/terminated", "next/truncated"), key) == \
        (("next", "terminated"), ("next", "truncated"))
    assert done_keys(having("next/truncated"), key) == (("next", "truncated"),)
    assert done_keys(having("done"), key) == ()
    assert done_keys(having("done", "terminated"), "done") == (("done",),)
    assert done_keys(having("terminated"), "done") == (("terminated",),)


def test_flags_of_ors_keys_and_feature_dims():
    term = torch.tensor([[False], [True], [False], [False]])
    trunc = torch.tensor([[False], [False], [False], [True]])
    td = TensorDict({"next": {"terminated": term, "truncated": trunc}}, batch_size=[4])
    for key in (("next", "done"), "next/done"):
        assert flags_of(lambda k: td.get(k, None), key).tolist() == [False, True, False, True]
    td["next", "done"] = torch.zeros(4, 1, dtype=torch.bool)  # done wins when present
    assert flags_of(lambda k: td.get(k, None)).tolist() == [False] * 4
    assert flags_of(lambda k: None) is None
    lanes = TensorDict({"next": {"done": torch.tensor([[[True], [False]], [[False], [False]]])}},
                       batch_size=[2, 2])
    assert flags_of(lambda k: lanes.get(k, None), lead=2).tolist() == [[True, False], [False, False]]


def test_episode_bounds_match_the_reference():
    rng = random.Random(0)
    for _ in range(200):
        done = [rng.random() < 0.3 for _ in range(rng.randrange(0, 12))]
        for partial in (False, True):
            start, stop = episode_bounds(torch.tensor(done, dtype=torch.bool), partial=partial)
            assert list(zip(start.tolist(), stop.tolist())) == reference_bounds(done, partial)
    start, stop = episode_bounds(torch.tensor([[False], [True], [False]]), partial=True)
    assert (start.tolist(), stop.tolist()) == ([0, 2], [2, 3])
    assert plots.episode_bounds is episodes.episode_bounds  # one implementation


def test_lane_episode_bounds_are_lane_major():
    rng = random.Random(1)
    for _ in range(50):
        lanes, steps = rng.randrange(1, 4), rng.randrange(0, 9)
        done = [[rng.random() < 0.3 for _ in range(steps)] for _ in range(lanes)]
        for partial in (False, True):
            lane, start, stop = lane_episode_bounds(
                torch.tensor(done, dtype=torch.bool).reshape(lanes, steps), partial=partial)
            expected = [(i, a, b) for i, flags in enumerate(done)
                        for a, b in reference_bounds(flags, partial)]
            assert list(zip(lane.tolist(), start.tolist(), stop.tolist())) == expected


def test_ends_from_ids():
    assert ends_from_ids(torch.tensor([3, 3, 5, 5, 5, 3])).tolist() == \
        [False, True, False, False, True, True]
    assert ends_from_ids(torch.tensor([7])).tolist() == [True]
    assert ends_from_ids(torch.zeros(0, dtype=torch.int64)).tolist() == []


@pytest.mark.parametrize("capacity,writes", [(7, 5), (7, 7), (7, 11), (7, 30), (16, 45)])
@pytest.mark.parametrize("form", ["done", "terminated/truncated"])
def test_episodes_across_the_ring_seam(capacity, writes, form):
    """Episodes of a wrapped ring, read in ring order, are the reference's episodes,
    including the one that runs past the last row into row 0 and the truncated one
    whose first steps were overwritten."""
    rng = random.Random(capacity * 100 + writes)
    ring = Ring(capacity)
    episode, history = 0, []  # history: (episode id, terminated, truncated) per step
    for _ in range(writes):
        term, trunc = rng.random() < 0.15, rng.random() < 0.1
        ring.write((episode, term, trunc))
        history.append((episode, term, trunc))
        episode += term or trunc
    order = ring_order(len(ring.rows), capacity, ring.last)
    rows = ring.rows
    done = torch.tensor([[t or u] for _, t, u in rows], dtype=torch.bool)
    term = torch.tensor([[t] for _, t, _ in rows], dtype=torch.bool)
    trunc = torch.tensor([[u] for _, _, u in rows], dtype=torch.bool)
    data = {("next", "done"): done} if form == "done" else \
        {("next", "terminated"): term, ("next", "truncated"): trunc}
    flags = flags_of(lambda k: data[k][order] if k in data else None)
    start, stop = episode_bounds(flags, partial=True)
    kept = history[-len(rows):] if rows else []  # what the ring still holds, oldest first
    expected: list[list[int]] = []
    for i, (ep, _, _) in enumerate(kept):
        if not expected or kept[i - 1][0] != ep:
            expected.append([])
        expected[-1].append(i)
    got = [list(range(a, b)) for a, b in zip(start.tolist(), stop.tolist())]
    assert got == expected
    # the stored rows of each episode, as ring indices (may wrap past the last row)
    for a, b in zip(start.tolist(), stop.tolist()):
        assert len({ring.rows[r][0] for r in order[a:b].tolist()}) == 1


# -- the users: plots, the slice sampler and the dataset index read through this module --------

def test_time_ordered_rotates_a_wrapped_two_dim_ring():
    import zstore

    storage = zstore.LazyTensorStorage(8, ndim=2)  # 4 rows x 2 lanes
    step = torch.arange(6.0).reshape(6, 1, 1) + torch.tensor([0.0, 100.0]).reshape(1, 2, 1)
    done = torch.zeros(6, 2, 1, dtype=torch.bool)
    td = TensorDict({("next", "reward"): step, ("next", "done"): done}, batch_size=[6, 2])
    storage.set(torch.arange(4), td[:4])
    storage.set(torch.arange(4, 6) % 4, td[4:])  # rows 0-1 overwritten: steps 2..5 remain
    ordered = plots.time_ordered(storage)
    assert ordered["next", "reward"][:, :, 0].T.tolist() == [[2, 3, 4, 5], [102, 103, 104, 105]]


@pytest.mark.parametrize("form", ["tuple", "path", "terminated/truncated"])
def test_slice_sampler_windows_stay_inside_episodes_across_the_seam(form):
    import zstore
    from zstore.samplers import SliceSampler

    steps, capacity = 23, 16
    episode = torch.tensor([i // 5 for i in range(steps)])           # episodes of 5 steps
    last = torch.tensor([i % 5 == 4 for i in range(steps)]).unsqueeze(-1)
    td = TensorDict({"episode": episode, "step": torch.arange(steps)}, batch_size=[steps])
    if form == "terminated/truncated":
        td["next", "terminated"] = last & (episode.unsqueeze(-1) % 2 == 0)
        td["next", "truncated"] = last & (episode.unsqueeze(-1) % 2 == 1)
    else:
        td["next", "done"] = last
    end_key = "next/done" if form == "path" else ("next", "done")
    rb = zstore.ReplayBuffer(storage=zstore.LazyTensorStorage(capacity),
                             sampler=SliceSampler(slice_len=3, end_key=end_key))
    rb.extend(td)  # wraps: rows 0..6 hold steps 16..22, the seam is inside episode 3
    seen, generator = set(), torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = rb.sample(30, generator=generator)
        for ep, step in zip(batch["episode"].reshape(10, 3).tolist(),
                            batch["step"].reshape(10, 3).tolist()):
            assert len(set(ep)) == 1                         # one episode per window
            assert step == list(range(step[0], step[0] + 3))  # consecutive steps, oldest first
            seen.add(ep[0])
    assert 3 in seen  # the episode stored across the ring seam (steps 15 and 16) is sampled
