"""ListStorage / LazyStackStorage against SPEC §2.2 / §2.3 (and TorchRL where it behaves well)."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

import zstore
from zstore import CompressedListStorage, LazyStackStorage, ListStorage

torchrl_data = pytest.importorskip("torchrl.data")


def item(i: int, n: int = 2) -> TensorDict:
    return TensorDict(obs=torch.full((n,), float(i)), step=torch.tensor(i), batch_size=[])


# -- set / get --------------------------------------------------------------------------------

def test_default_capacity_is_int64_max():
    assert ListStorage().max_size == torch.iinfo(torch.int64).max
    assert LazyStackStorage().max_size == torch.iinfo(torch.int64).max


@pytest.mark.parametrize("cursor", [0, np.int64(0), torch.tensor(0), np.array(0)])
def test_int_like_cursors_append_then_overwrite(cursor):
    s = ListStorage(4)
    s.set(cursor, "first")
    s.set(cursor, "second")
    assert len(s) == 1 and s.get(0) == "second"


def test_items_are_stored_by_reference():
    s = ListStorage(4)
    x = torch.zeros(3)
    s.set(0, x)
    assert s.get(0) is x


def test_append_more_than_one_away():
    s = ListStorage(10)
    s.set(0, 1)
    with pytest.raises(RuntimeError, match="Cannot append data located more than one item away"):
        s.set(2, 3)
    assert len(s) == 1 and s._mutation_revision == 1


@pytest.mark.parametrize("cls,where", [(ListStorage, "in RAM"), (LazyStackStorage, "in RAM"),
                                       (CompressedListStorage, "in RAM"),
                                       (CompressedListStorage, "memory"),
                                       (CompressedListStorage, "local")], ids=str)
@pytest.mark.parametrize("cursor,items,error", [
    ([2, 7], 2, RuntimeError),        # the second lies past the first's append
    ([2, 3, 1, 9], 4, RuntimeError),
    ([1, 2], 3, ValueError),          # three items for two positions
    ([2, 3, 4], 2, ValueError),
    ([1, -9], 2, IndexError),
    ([2, 3, 4], 3, RuntimeError),     # past the capacity of 4
], ids=str)
def test_a_refused_write_of_several_items_writes_none(cls, where, cursor, items, error, tmp_path):
    """``set([2, 7], [a, b])`` of two stored items appended item 2, then refused 7, and said
    "the storage size is 3" (TorchRL's list storages do the same); zstore promises that a
    refused write changes nothing (docs/reliability.md): every position, and the number of
    items, is checked before the first is written."""
    url = {"in RAM": None, "memory": f"memory://zstore-tests/refused-{uuid.uuid4().hex}",
           "local": str(tmp_path / "cls")}[where]
    storage = cls(4) if url is None else cls(4, scratch_dir=url)
    storage.set(0, item(0))
    storage.set(1, item(1))
    with pytest.raises(error, match="nothing was written|out of bounds"):
        storage.set(cursor, [item(10 + i) for i in range(items)])
    assert len(storage) == 2
    assert [int(x["step"]) for x in storage.get([0, 1])] == [0, 1]
    storage.set([2, 3], [item(2), item(3)])
    assert [int(x["step"]) for x in storage.get(slice(None))] == [0, 1, 2, 3]


def test_capacity_limit():
    s = ListStorage(2)
    s.set([0, 1], [1, 2])
    with pytest.raises(RuntimeError, match="maximum capacity is 2"):
        s.set(2, 3)
    assert s.get(slice(None)) == [1, 2]


@pytest.mark.parametrize("cursor", [[0, 1, 2], range(3), torch.arange(3), np.arange(3)])
def test_iterable_cursor_writes_each_item(cursor):
    s = ListStorage(5)
    s.set(cursor, ["a", "b", "c"])
    assert s.get(slice(None)) == ["a", "b", "c"]
    assert s._mutation_revision == 3  # one bump per element (SPEC §1.6)


@pytest.mark.parametrize("data", [(1, 2), torch.tensor([1, 2]), np.array([1, 2]), range(1, 3)])
def test_iterable_cursor_accepts_sequences(data):
    s = ListStorage(5)
    s.set([0, 1], data)
    assert [int(x) for x in s.get([0, 1])] == [1, 2]


def test_iterable_cursor_with_tensordict_batch():
    s = ListStorage(5)
    s.set(torch.arange(3), TensorDict(obs=torch.arange(3.0), batch_size=[3]))
    assert s.get(2)["obs"].item() == 2.0


def test_iterable_cursor_bad_data_type():
    s = ListStorage(5)
    with pytest.raises(TypeError, match="Cannot extend a .* with data of type <class 'int'>"):
        s.set([0, 1], 7)
    assert len(s) == 0 and s._mutation_revision == 0


def test_iterable_cursor_length_mismatch():
    s = ListStorage(5)
    with pytest.raises(ValueError):
        s.set([0, 1, 2], [1, 2])


def test_slice_cursor_is_list_assignment():
    s = ListStorage(10)
    s.set(range(4), [0, 1, 2, 3])
    rev = s._mutation_revision
    s.set(slice(1, 3), ["x"])  # shrinks, like list slice assignment
    assert s.get(slice(None)) == [0, "x", 3]
    assert s._mutation_revision == rev + 1


def test_get_variants():
    s = ListStorage(10)
    s.set(range(5), [10, 11, 12, 13, 14])
    assert s.get(-1) == 14
    assert s.get(slice(1, 4, 2)) == [11, 13]
    assert s.get((2,)) == 12
    assert s.get([4, 0, 4]) == [14, 10, 14]
    assert s.get(torch.tensor([1, 3])) == [11, 13]
    assert s.get(np.array([0])) == [10]
    assert s[3] == 13
    assert list(s) == [10, 11, 12, 13, 14]
    with pytest.raises(IndexError):
        s.get(5)
    with pytest.raises(RuntimeError, match="one-length tuples"):
        s.get((0, 1))


def _steps(out) -> list[int]:
    """The ``step`` of each item a read returned (a list, or a lazy stack)."""
    return out["step"].tolist() if isinstance(out, LazyStackedTensorDict) else [x["step"].item() for x in out]


@pytest.mark.parametrize("kind", [ListStorage, LazyStackStorage, CompressedListStorage])
@pytest.mark.parametrize("as_mask", [torch.tensor, np.array, list], ids=["tensor", "ndarray", "list"])
def test_a_boolean_mask_reads_the_items_it_flags(kind, as_mask):
    """A mask was read as positions (True as 1, False as 0): [T, F, T, T] returned items
    1, 0, 1, 1. Reference: TorchRL's LazyTensorStorage holding the same items."""
    items = [item(i) for i in range(4)]
    ours, theirs = kind(6), torchrl_data.LazyTensorStorage(6)
    ours.set(range(4), items)
    theirs.set(torch.arange(4), torch.stack(items))
    flags = [True, False, True, True]
    assert _steps(ours.get(as_mask(flags))) == theirs.get(torch.tensor(flags))["step"].tolist() == [0, 2, 3]
    assert _steps(ours[as_mask(flags)]) == [0, 2, 3]


@pytest.mark.parametrize("kind", [ListStorage, LazyStackStorage, CompressedListStorage])
def test_a_boolean_mask_writes_the_items_it_flags(kind):
    """A mask was read as positions (False as 0, True as 1): writing one item per flagged
    position raised zip's "argument 2 is shorter", one item per flag overwrote items 0 and 1.
    Reference: a Python list, assigned at the flagged positions."""
    s, model = kind(6), [item(i) for i in range(4)]
    s.set(range(4), list(model))
    flags = torch.tensor([False, True, False, True])
    new = [item(10), item(30)]
    s.set(flags, new)
    for position, value in zip(flags.nonzero().flatten().tolist(), new):
        model[position] = value
    assert _steps(s.get(slice(None))) == _steps(model) == [0, 10, 2, 30]


def test_bad_indexes_are_named():
    """Out-of-range reads raised a bare "list index out of range", a 2-D index a TypeError
    about ``int()``, a mask of the wrong length read wrong items: each names what is wrong."""
    s = ListStorage(10)
    s.set(range(4), [item(i) for i in range(4)])
    for bad in (7, -5, [0, 7], torch.tensor([1, -5]), np.array([9])):
        with pytest.raises(IndexError, match=r"index (7|-5|9) is out of range: the storage holds 4 "
                                             r"items \(indices -4 to 3\)"):
            s.get(bad)
    with pytest.raises(IndexError, match="out of range: the storage is empty"):
        ListStorage(3).get(0)
    with pytest.raises(IndexError, match=r"1-D index, got one of shape \(2, 2\)"):
        s.get(torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(IndexError, match="boolean mask of 2 flags cannot index a storage of 4 items"):
        s.get(torch.tensor([True, False]))
    with pytest.raises(IndexError, match="boolean mask of 3 flags"):
        s.set(np.array([True, False, True]), [item(8), item(9)])
    assert _steps(s.get(slice(None))) == [0, 1, 2, 3]


def test_setitem_overwrites():
    s = ListStorage(3)
    s.set(0, "a")
    s[0] = "b"
    assert s.get(0) == "b" and len(s) == 1


def test_device_move():
    s = ListStorage(3, device="cpu")
    s.set(0, {"a": torch.ones(1)})
    assert s.get(0)["a"].device == torch.device("cpu")


# -- contains, empty, state dicts ---------------------------------------------------------------

def test_contains():
    s = ListStorage(10)
    s.set(range(3), [1, 2, 3])
    assert s.contains(0) and s.contains(2) and s.contains(-3)
    assert not s.contains(3) and not s.contains(-4)
    assert 1 in s
    got = s.contains(torch.tensor([[0, 3], [-1, -4]]))
    assert got.dtype == torch.bool
    assert got.tolist() == [[True, False], [True, False]]
    for bad in ("0", np.int64(0), 1.0):
        with pytest.raises(NotImplementedError, match="is not supported yet"):
            s.contains(bad)


def test_empty_bumps_revision():
    s = ListStorage(4)
    s.set(0, 1)
    s._empty()
    assert len(s) == 0 and s._mutation_revision == 2


def test_state_dict_round_trip_of_tensors_and_tensordicts():
    s = ListStorage(5)
    s.set([0, 1], [torch.arange(3), item(4)])
    sd = s.state_dict()
    other = ListStorage(5)
    other.load_state_dict(sd)
    assert torch.equal(other.get(0), torch.arange(3))
    assert other.get(0) is not s.get(0)  # cloned
    assert isinstance(other.get(1), TensorDict)
    assert other.get(1)["step"].item() == 4
    assert other._mutation_revision == 1


def test_state_dict_of_plain_objects_cannot_be_loaded():
    s = ListStorage(5)
    s.set(0, 3)
    assert s.state_dict() == {"_storage": [3]}
    with pytest.raises(TypeError, match="are not supported by ListStorage.load_state_dict"):
        ListStorage(5).load_state_dict(s.state_dict())


@pytest.mark.parametrize("method", ["dumps", "loads"])
def test_no_dumps_loads(tmp_path, method):
    s = ListStorage(3)
    with pytest.raises(NotImplementedError, match="doesn't support serialization"):
        getattr(s, method)(tmp_path)


def test_repr():
    s = ListStorage(3)
    assert "len=0, max_size=3" in repr(s) and "<empty>" in repr(s)
    s.set(0, "first")
    assert "first" in repr(s)


# -- differential run against TorchRL ---------------------------------------------------------------

def _apply(storage, op, args):
    try:
        if op == "get":
            out = storage.get(args)
            return ("ok", out if not isinstance(out, list) else list(out))
        if op == "contains":
            return ("ok", storage.contains(args))
        getattr(storage, op)(*args)
        return ("ok", None)
    except Exception as exc:  # noqa: BLE001 - the exception type is compared
        return ("err", type(exc))


@pytest.mark.parametrize("seed", range(4))
def test_random_ops_match_torchrl(seed):
    rng = random.Random(seed)
    ours, theirs = ListStorage(6), torchrl_data.ListStorage(6)
    for step in range(60):
        n = len(theirs)
        op = rng.choice(["set", "set_many", "get", "get_many", "contains", "setitem", "empty"])
        if op == "set":
            call = ("set", (rng.randrange(n + 2), step))
        elif op == "set_many":
            k = rng.randrange(1, 3)
            call = ("set", ([rng.randrange(n + 2) for _ in range(k)], list(range(step, step + k))))
        elif op == "setitem":
            call = ("__setitem__", (rng.randrange(n + 1), step))
        elif op == "get":
            call = ("get", rng.randrange(-n - 1, n + 1))
        elif op == "get_many":
            call = ("get", [rng.randrange(n) for _ in range(3)] if n else slice(0, 2))
        elif op == "contains":
            call = ("contains", rng.randrange(-n - 1, n + 1))
        else:
            call = ("_empty", ())
        assert _apply(ours, *call) == _apply(theirs, *call), (step, call)
        assert len(ours) == len(theirs)
        assert ours._mutation_revision == theirs._mutation_revision
        assert ours.get(slice(None)) == theirs.get(slice(None))


# -- LazyStackStorage ----------------------------------------------------------------------------------

def test_lazy_stack_reads():
    s = LazyStackStorage()
    s.set(range(3), [item(0, 2), item(1, 3), item(2, 2)])
    single = s.get(1)
    assert isinstance(single, TensorDict) and single["obs"].shape == (3,)
    many = s.get([0, 1])
    assert isinstance(many, LazyStackedTensorDict)
    assert many.batch_size == torch.Size([2])
    assert [td["obs"].shape[0] for td in many.tensordicts] == [2, 3]  # ragged is allowed
    assert many[1]["obs"].tolist() == [1.0, 1.0, 1.0]
    assert s.get(slice(0, 3, 2))["step"].tolist() == [0, 2]


@pytest.mark.parametrize("stack_dim, expected", [(0, (2, 4)), (1, (4, 2)), (-1, (4, 2))])
def test_lazy_stack_dim(stack_dim, expected):
    s = LazyStackStorage(stack_dim=stack_dim)
    for i in range(2):
        s.set(i, TensorDict(obs=torch.full((4,), float(i)), batch_size=[4]))
    out = s.get([0, 1])
    assert tuple(out.batch_size) == expected
    ref = torchrl_data.LazyStackStorage(stack_dim=stack_dim)
    ref.set([0, 1], [s.get(0), s.get(1)])
    assert torch.equal(out["obs"], ref.get([0, 1])["obs"])


def test_an_empty_selection_of_a_lazy_stack_is_named():
    """``rb[2:2]`` or a mask without a flag raised tensordict's "items cannot be empty"
    (TorchRL's too: reference below), which named neither the index nor the storage."""
    ours, theirs = LazyStackStorage(), torchrl_data.LazyStackStorage()
    for s in (ours, theirs):
        s.set(range(3), [item(i) for i in range(3)])
    with pytest.raises(RuntimeError, match="items cannot be empty"):
        theirs.get(slice(2, 2))
    for empty in (slice(2, 2), [], torch.tensor([False, False, False])):
        with pytest.raises(RuntimeError, match=r"index .* selects none of the 3 items, and a lazy stack"):
            ours.get(empty)


def test_lazy_stack_inherits_list_rules():
    s = LazyStackStorage(2)
    s.set(0, item(0))
    with pytest.raises(RuntimeError, match="more than one item away"):
        s.set(2, item(2))
    assert isinstance(s, ListStorage)
    assert s.contains(0) and not s.contains(1)


@pytest.mark.parametrize("kind", ["ListStorage", "LazyStackStorage", "CompressedListStorage"])
@pytest.mark.parametrize("extends", [[15], [6, 6, 6], [9, 1, 4, 3]])
def test_slice_windows_over_a_wrapped_list_storage_match_a_tensor_storage(kind, extends):
    """zstore's SliceSampler orders a full ring by the item written last; list storages did
    not record it, so windows ran from the newest item into the oldest ([12, 13, 14, 5]).
    The reference: the same writes into a LazyTensorStorage, sampled with the same seed."""
    def windows(storage):
        rb = zstore.ReplayBuffer(storage, sampler=zstore.SliceSampler(slice_len=4), batch_size=40)
        first = 0
        for n in extends:  # one long episode, then the ring wraps
            steps = torch.arange(first, first + n)
            rb.extend(TensorDict({"step": steps, ("next", "done"): (steps == 18)[:, None]}, [n]))
            first += n
        return rb.sample(generator=torch.Generator().manual_seed(0))["step"].reshape(10, 4)

    got, want = windows(getattr(zstore, kind)(10)), windows(zstore.LazyTensorStorage(10))
    assert torch.equal(got, want)
    assert all(w.tolist() == list(range(int(w[0]), int(w[0]) + 4)) for w in got)


def test_a_reopened_compressed_storage_knows_its_newest_item(location):
    """A ``CompressedListStorage`` at a URL records the item written last in its commits: a
    reopened one knew none, so zstore's SliceSampler read its full ring in index order and
    drew windows across the wrap. Reference: the same writes into a LazyTensorStorage."""
    def windows(storage):
        rb = zstore.ReplayBuffer(storage, sampler=zstore.SliceSampler(slice_len=4), batch_size=40)
        return rb.sample(generator=torch.Generator().manual_seed(0))["step"].reshape(10, 4)

    writer, want = location.compressed(10), zstore.LazyTensorStorage(10)
    for storage in (writer, want):
        rb = zstore.ReplayBuffer(storage)
        for first, n in ((0, 6), (6, 6), (12, 3)):  # one long episode wrapping the ring at 5
            steps = torch.arange(first, first + n)
            rb.extend(TensorDict({"step": steps, ("next", "done"): (steps == 18)[:, None]}, [n]))
    writer.set(2, writer.get(2), set_cursor=False)  # an update in place moves no cursor
    writer.close()
    again = zstore.open(writer.scratch_dir, location.options)
    assert again._newest_row() == 4
    assert torch.equal(windows(again), windows(want))
