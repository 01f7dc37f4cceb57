"""``ReplayBuffer.update_if_present`` over zstore.torchrl storages, call for call against
TorchRL's ``LazyTensorStorage`` with the same generation-tracking writer."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import zstore

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

CAPACITY = 6


def records(n: int, start: int = 0) -> TensorDict:
    """``n`` records numbered from ``start``: an observation, a nested key and a version."""
    step = torch.arange(start, start + n)
    return TensorDict({"obs": step.float().unsqueeze(-1).expand(n, 3).clone(),
                       ("nested", "x"): -step.float().unsqueeze(-1).expand(n, 2).clone(),
                       "v": torch.full((n,), 5, dtype=torch.int64)}, batch_size=[n])


def buffer(storage):
    return T.TensorDictReplayBuffer(storage=storage, batch_size=4,
                                    writer=T.RoundRobinWriter(track_generations=True))


class Twins:
    """TorchRL's buffer and zstore's (``kind``), driven by the same calls."""

    def __init__(self, kind: str, location, ndim: int = 1):
        self.url = location.new() if kind == "LazyMemmapStorage" else None
        if self.url:
            ours = zt.LazyMemmapStorage(CAPACITY, scratch_dir=self.url, ndim=ndim,
                                        storage_options=location.options)
        else:
            ours = zt.LazyTensorStorage(CAPACITY, ndim=ndim)
        self.theirs = buffer(T.LazyTensorStorage(CAPACITY, ndim=ndim))
        self.ours = buffer(ours)

    def extend(self, data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``data`` to both; its ``(index, generation)`` handles."""
        index = self.theirs.extend(data.clone())
        assert torch.equal(self.ours.extend(data.clone()), index)
        return index, self.theirs.writer.generations_of(index)

    def update(self, **kwargs):
        """Both buffers' ``update_if_present(**kwargs)``, equal field by field (or the same
        exception), then the same rows; TorchRL's result or exception."""
        want, got = (_outcome(rb, kwargs) for rb in (self.theirs, self.ours))
        if isinstance(want, Exception):
            assert type(got) is type(want), got
        else:
            assert torch.equal(got.updated, want.updated)
            assert (got.version_rejected is None) == (want.version_rejected is None)
            if want.version_rejected is not None:
                assert torch.equal(got.version_rejected, want.version_rejected)
            assert (got.updated_count, got.stale_count) == (want.updated_count, want.stale_count)
        self.assert_same_rows()
        return want

    def assert_same_rows(self) -> None:
        assert len(self.ours) == len(self.theirs)
        assert_equal(self.ours.storage[:], self.theirs.storage[:])


def _outcome(rb, kwargs):
    """``rb.update_if_present(**kwargs)``, or the error it raised."""
    try:
        return rb.update_if_present(**kwargs)
    except (KeyError, ValueError, RuntimeError) as exc:
        return exc


def assert_equal(got: TensorDict, want: TensorDict) -> None:
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert torch.equal(got.get(key), want.get(key)), key


KINDS = pytest.mark.parametrize("kind", ["LazyMemmapStorage", "LazyTensorStorage"])


@pytest.fixture
def twins(location):
    """``twins(kind, ndim=1)``: a new :class:`Twins`; zstore's stores are closed after the test."""
    made = []

    def make(kind: str, ndim: int = 1) -> Twins:
        made.append(Twins(kind, location, ndim))
        return made[-1]

    yield make
    for pair in made:
        if pair.url:
            pair.ours.storage.close()


@KINDS
def test_dict_and_tensordict_patches(kind, twins):
    twins = twins(kind)
    index, generation = twins.extend(records(4))
    assert twins.update(index=index, generation=generation,
                        patch={"obs": torch.ones(4, 3)}).updated_count == 4
    twins.update(index=index[:2], generation=generation[:2],
                 patch={("nested", "x"): torch.full((2, 2), 7.0)})
    twins.update(index=index[1:], generation=generation[1:],
                 patch=TensorDict({"obs": torch.full((3, 3), 2.0),
                                   "nested": {"x": torch.full((3, 2), 3.0)}}, batch_size=[3]))


@KINDS
def test_sampled_handles_and_submitted_updates(kind, twins):
    twins = twins(kind)
    twins.extend(records(5))
    torch.manual_seed(0)
    sample = twins.theirs.sample()
    kwargs = dict(index=sample["index"], generation=sample["index_generation"],
                  patch={"obs": torch.full((4, 3), 9.0)})
    assert torch.equal(twins.ours.submit_update_if_present(**kwargs).result().updated,
                       twins.theirs.submit_update_if_present(**kwargs).result().updated)
    twins.assert_same_rows()


@KINDS
def test_stale_handles_after_the_ring_wraps(kind, twins):
    twins = twins(kind)
    index, generation = twins.extend(records(CAPACITY))
    twins.extend(records(2, start=100))  # rewrites slots 0 and 1
    result = twins.update(index=index, generation=generation,
                          patch={"obs": torch.full((CAPACITY, 3), -1.0)})
    assert result.stale_count == 2 and not result.updated[:2].any()


@KINDS
def test_never_written_slots_are_stale(kind, twins):
    twins = twins(kind)
    twins.extend(records(3))
    result = twins.update(index=torch.tensor([1, 3, 5]), generation=torch.tensor([0, 0, 0]),
                          patch={"obs": torch.full((3, 3), 4.0)})
    assert result.updated.tolist() == [True, False, False]


@KINDS
@pytest.mark.parametrize("require_newer", [True, False])
def test_version_key(kind, twins, require_newer):
    twins = twins(kind)
    index, generation = twins.extend(records(4))
    result = twins.update(index=index, generation=generation, patch={"obs": torch.ones(4, 3)},
                          version_key="v", version=torch.tensor([4, 5, 6, 7]),
                          require_newer=require_newer)
    assert result.version_rejected.tolist() == [True, require_newer, False, False]
    twins.update(index=index, generation=generation, patch={"obs": torch.zeros(4, 3)},
                 version_key="v", version=6, require_newer=require_newer)


@KINDS
def test_duplicates_in_one_call(kind, twins):
    twins = twins(kind)
    index, generation = twins.extend(records(4))
    rows = torch.tensor([2, 0, 2, 2])
    patch = {"obs": torch.arange(12.0).reshape(4, 3)}
    result = twins.update(index=index[rows], generation=generation[rows], patch=patch,
                          version_key="v", version=torch.tensor([8, 6, 9, 9]))
    assert result.updated.tolist() == [False, True, False, True]
    twins.update(index=index[rows], generation=generation[rows], patch=patch)


@KINDS
@pytest.mark.parametrize("patch", [
    {"obs": torch.ones(2, 3), "v": torch.ones(2, dtype=torch.int32)},
    {"obs": torch.ones(2, 3), ("nested", "x"): torch.ones(2, 3)},
    {"obs": torch.ones(2, 3), "missing": torch.ones(2)},
], ids=["dtype", "shape", "key"])
def test_a_validation_failure_leaves_the_storage_untouched(kind, twins, patch):
    twins = twins(kind)
    index, generation = twins.extend(records(2))
    failure = twins.update(index=index, generation=generation, patch=patch)
    assert isinstance(failure, (KeyError, ValueError))
    assert torch.equal(twins.ours.storage.get(torch.arange(2)).get("obs"), records(2)["obs"])


@KINDS
def test_cells_of_a_two_dim_storage(kind, twins):
    twins = twins(kind, ndim=2)
    twins.extend(TensorDict({"obs": torch.arange(18.0).reshape(3, 2, 3),
                             "v": torch.zeros(3, 2, dtype=torch.int64)}, batch_size=[3, 2]))
    torch.manual_seed(0)
    sample = twins.theirs.sample()
    handles = dict(index=sample["index"], generation=sample["index_generation"])
    twins.update(**handles, patch={"obs": torch.full((4, 3), -1.0)})
    twins.update(**handles, patch={"obs": torch.full((4, 3), -2.0)}, version_key="v",
                 version=torch.tensor([1, 0, 2, -1]), require_newer=True)


def test_patched_rows_persist(twins, location):
    twins = twins("LazyMemmapStorage")
    index, generation = twins.extend(records(CAPACITY))
    twins.extend(records(1, start=50))
    twins.update(index=index, generation=generation,
                 patch=TensorDict({"obs": torch.full((CAPACITY, 3), 3.0)}, batch_size=[CAPACITY]),
                 version_key="v", version=torch.arange(CAPACITY))
    twins.ours.storage.flush()
    reopened = zstore.open(twins.url, location.options, mode="r")
    assert_equal(reopened.get(torch.arange(CAPACITY)),
                 twins.theirs.storage.get(torch.arange(CAPACITY)))
