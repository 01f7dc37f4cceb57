"""TensorStorage / LazyTensorStorage (in RAM) against SPEC §1.3, §1.5, §1.6, §2.5, §2.6, §7.

Where TorchRL behaves well its storages are the reference; where SPEC §9 lists a
TorchRL bug, the test asserts the corrected behaviour.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tensordict import TensorDict, tensorclass

import zstore
from zstore import LazyTensorStorage, SchemaError, TensorStorage

torchrl_data = pytest.importorskip("torchrl.data")


@tensorclass
class Pair:
    obs: torch.Tensor
    reward: torch.Tensor


def tds(n: int, start: int = 0, lanes: tuple[int, ...] = ()) -> TensorDict:
    values = torch.arange(start, start + n).reshape(n, *[1] * len(lanes)).expand(n, *lanes)
    return TensorDict(
        obs=values.unsqueeze(-1).float().expand(*values.shape, 3).clone(),
        next=TensorDict(done=(values % 2 == 0).unsqueeze(-1), batch_size=values.shape),
        batch_size=values.shape,
    )


# -- construction and lazy initialisation ----------------------------------------------------------

def test_constructor_errors():
    with pytest.raises(ValueError, match="Expected storage to be non-null"):
        TensorStorage(None)
    with pytest.raises(ValueError, match="The max-size and the storage shape mismatch"):
        TensorStorage(torch.zeros(4, 2), max_size=5)


def test_prefilled_storage_is_full():
    s = TensorStorage(tds(4))
    assert s.initialized and s.max_size == 4 and len(s) == 4 and s._is_full
    assert s.shape == torch.Size([4])
    assert s.get(2)["obs"].tolist() == [2.0, 2.0, 2.0]


def test_bare_tensor_storage_cannot_initialise_and_len_is_untouched():
    s = TensorStorage(None, 10)
    with pytest.raises(TypeError, match="initialized during construction"):
        s.set(0, torch.zeros(2))
    # TorchRL bumps len before failing (SPEC §1.3); zstore does not
    assert len(s) == 0 and s._last_cursor_index is None and not s.initialized


def test_uninitialised_state():
    s = LazyTensorStorage(10)
    assert not s.initialized and len(s) == 0 and s.shape is None and s._storage is None
    assert s.contains(0) is False
    with pytest.raises(RuntimeError, match="Cannot get elements out of a non-initialized storage"):
        s.get(0)


@pytest.mark.parametrize("kind", ["td", "tensor", "pytree", "tensorclass"])
def test_lazy_init_allocates_full_capacity(kind):
    s = LazyTensorStorage(7)
    data = {
        "td": tds(2),
        "tensor": torch.ones(2, 3, dtype=torch.float16),
        "pytree": {"a": torch.ones(2, 3), "b": (torch.zeros(2, dtype=torch.int32),)},
        "tensorclass": Pair(obs=torch.ones(2, 3), reward=torch.zeros(2), batch_size=[2]),
    }[kind]
    s.set(torch.arange(2), data)
    assert s.initialized
    container = s._storage
    if kind == "td":
        assert isinstance(container, TensorDict) and container.batch_size == torch.Size([7])
        assert container["next", "done"].shape == (7, 1) and container["next", "done"].dtype == torch.bool
    elif kind == "tensor":
        assert container.shape == (7, 3) and container.dtype == torch.float16
    elif kind == "pytree":
        assert container["a"].shape == (7, 3) and container["b"][0].dtype == torch.int32
    else:
        assert isinstance(container, Pair) and container.batch_size == torch.Size([7])
        assert isinstance(s.get(1), Pair)


def test_int_cursor_initialises_from_the_item_itself():
    s = LazyTensorStorage(5)
    s.set(2, torch.ones(4))
    assert s._storage.shape == (5, 4)


def test_consolidated_requires_tensordict():
    s = LazyTensorStorage(5, consolidated=True)
    with pytest.raises(ValueError, match="Cannot consolidate non-tensordict storages"):
        s.set(torch.arange(2), torch.ones(2, 3))


def test_list_of_items_is_stacked_or_refused():
    s = LazyTensorStorage(5)
    s.set(torch.arange(2), [torch.ones(3), torch.zeros(3)])
    assert s.get(0).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="Stacking the elements of the list resulted in an error"):
        s.set(torch.arange(2), [torch.ones(3), torch.zeros(4)])


# -- length, shape, last cursor, revision -------------------------------------------------------------

def test_len_counts_writes_covers_the_last_row_and_is_capped_at_capacity():
    s = LazyTensorStorage(6)
    s.set(0, torch.ones(2))
    assert len(s) == 1 and s.shape == torch.Size([1])  # shape is the current length (ndim 1)
    s.set(torch.tensor([0, 0]), torch.ones(2, 2))  # duplicates count, as in TorchRL
    assert len(s) == 3
    s.set(4, torch.ones(2))  # a writer that skipped rows: the row it wrote is reachable
    assert len(s) == 5 and s.get(4).tolist() == [1.0, 1.0]
    s.set(torch.arange(6), torch.ones(6, 2))
    assert len(s) == 6 and s._is_full and s.shape == torch.Size([6])
    s = LazyTensorStorage(5)
    s.set(torch.arange(5), torch.ones(5, 2))
    assert len(s) == 5 and s._is_full and s.shape == torch.Size([5])


def test_setitem_moves_neither_len_nor_last_cursor():
    s = LazyTensorStorage(5)
    s.set(torch.arange(2), tds(2))
    rev = s._mutation_revision
    s[4] = tds(1, 9)[0]  # also lazily fine on an initialised storage
    assert len(s) == 2 and s._last_cursor_index == 1 and s._mutation_revision == rev + 1
    fresh = LazyTensorStorage(5)
    fresh[0] = tds(1)[0]  # __setitem__ initialises too
    assert fresh.initialized and len(fresh) == 0


@pytest.mark.parametrize("cursor, lead, expected", [
    (3, (), 3), (np.int64(2), (), 2), (torch.tensor([4, 1]), (2,), 1),
    (torch.tensor([[0, 2], [3, 1]]), (2, 2), 1), (range(1, 4), (3,), 3), (slice(1, 3), (2,), 2),
    (slice(None), (10,), 9), ([2, 0, 1], (3,), 1),
])
def test_last_cursor_index(cursor, lead, expected):
    data = torch.ones(*lead, 2)
    s = LazyTensorStorage(10)
    s.set(cursor, data)
    assert s._last_cursor_index == expected
    ref = torchrl_data.LazyTensorStorage(10)
    ref.set(cursor, data)
    assert len(s) == min(max(len(ref), expected + 1), 10)  # TorchRL counts writes; zstore
    # also covers the last row written
    if not isinstance(cursor, list):  # TorchRL reads a list of ints as coordinates: first item
        assert ref._last_cursor_index == expected


def test_mutation_revision_steps():
    s = LazyTensorStorage(6)
    steps = [
        lambda: s.set(torch.arange(3), tds(3)),
        lambda: s.set(0, tds(1)[0]),
        lambda: s.__setitem__(slice(0, 2), tds(2, 5)),
        lambda: s._empty(),
        lambda: s.load_state_dict(s.state_dict()),
    ]
    for i, step in enumerate(steps, 1):
        step()
        assert s._mutation_revision == i


def test_empty_keeps_data_and_initialisation():
    s = LazyTensorStorage(4)
    s.set(torch.arange(4), tds(4))
    s._empty()
    assert len(s) == 0 and s.initialized and s.shape == torch.Size([0])


def test_counters_are_64_bit():
    s = LazyTensorStorage(2**40)  # nothing allocated until the first write
    s._len = 2**33 + 3
    assert len(s) == 2**33 + 3  # TorchRL's int32 mp.Value would wrap (SPEC §9.3)


# -- ndim > 1 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_size, lanes, rows, rounded", [(100, 3, 34, 102), (10, 4, 3, 12),
                                                            (12, 4, 3, 12)])
def test_ndim2_rounds_max_size_to_whole_rows(max_size, lanes, rows, rounded):
    s = LazyTensorStorage(max_size, ndim=2)
    ref = torchrl_data.LazyTensorStorage(max_size, ndim=2)
    assert s._max_size_along_dim0(batched_data=tds(2, lanes=(lanes,))) == rows
    for storage in (s, ref):
        storage.set(torch.arange(2), tds(2, lanes=(lanes,)))
    assert s.max_size == ref.max_size == rounded
    assert s._storage.batch_size == torch.Size([rows, lanes])
    assert len(s) == len(ref) == 2 * lanes
    assert s.shape == ref.shape == torch.Size([2, lanes])
    assert s._max_size_along_dim0() == rows


def test_ndim2_tensor_feature_dims_are_not_lanes():
    # TorchRL multiplies the feature dims in too (max_size 60, SPEC §9.11)
    s = LazyTensorStorage(10, ndim=2)
    s.set(torch.arange(3), torch.ones(3, 4, 5))
    assert s.max_size == 12 and s._storage.shape == (3, 4, 5)
    s.set(torch.arange(3), torch.ones(3, 4, 5))
    assert s._is_full


def test_ndim2_reads_flatten_and_random_indices():
    s = LazyTensorStorage(9, ndim=2)
    s.set(torch.arange(2), tds(2, lanes=(3,)))
    ref = torchrl_data.LazyTensorStorage(9, ndim=2)
    ref.set(torch.arange(2), tds(2, lanes=(3,)))
    index = (torch.tensor([1, 0]), torch.tensor([2, 1]))
    assert (s.get(index) == ref.get(index)).all()
    flat = s.flatten()
    assert isinstance(flat, TensorStorage) and flat.ndim == 1 and len(flat) == 6
    assert (flat[:] == ref.flatten()[:]).all()
    s._rng = torch.Generator().manual_seed(0)
    rows, lanes = s._rand_given_ndim(50)
    assert 0 <= int(rows.min()) and int(rows.max()) < 2 and int(lanes.max()) < 3


def test_ndim2_errors_before_init():
    s = LazyTensorStorage(9, ndim=2)
    with pytest.raises(RuntimeError, match="Cannot flatten a non-initialized storage"):
        s.flatten()
    with pytest.raises(ValueError, match="single_data or batched_data must be passed"):
        s._max_size_along_dim0()


# -- contains ------------------------------------------------------------------------------------------

def test_contains():
    s = LazyTensorStorage(10)
    s.set(torch.arange(4), tds(4))
    assert s.contains(3) and s.contains(-4) and not s.contains(4) and not s.contains(-5)
    assert s.contains(torch.tensor([0, 4, -1])).tolist() == [True, False, True]
    assert s.contains(torch.tensor(2)).shape == torch.Size([])
    for bad in ("1", np.int64(1)):
        with pytest.raises(NotImplementedError, match="is not supported yet"):
            s.contains(bad)


def test_contains_checks_every_coordinate_ndim2():
    s = LazyTensorStorage(8, ndim=2)
    s.set(torch.arange(2), tds(2, lanes=(2,)))
    coords = torch.tensor([[0, 1], [1, 2], [2, 0], [1, -1]])
    assert s.contains(coords).tolist() == [True, False, False, True]


# -- state dicts ------------------------------------------------------------------------------------

def test_state_dict_round_trip_tensordict():
    s = LazyTensorStorage(6)
    s.set(torch.arange(4), tds(4))
    sd = s.state_dict()
    assert set(sd) == {"_storage", "initialized", "_len"} and sd["_len"] == 4
    for target in (LazyTensorStorage(6), s):
        target.load_state_dict(sd)
        assert target.initialized and len(target) == 4
        assert (target[:] == tds(4)).all()
    ref = torchrl_data.LazyTensorStorage(6)
    ref.load_state_dict(sd)  # TorchRL reads zstore's state dict
    assert (ref[:] == tds(4)).all()


def test_state_dict_round_trip_tensor():
    s = LazyTensorStorage(5)
    s.set(torch.arange(3), torch.arange(6.0).view(3, 2))
    other = LazyTensorStorage(5)
    other.load_state_dict(s.state_dict())
    assert torch.equal(other[:], s[:]) and len(other) == 3
    assert other._storage.data_ptr() != s._storage.data_ptr()


def test_state_dict_uninitialised_and_errors():
    assert LazyTensorStorage(5).state_dict() == {"_storage": {}, "initialized": False, "_len": 0}
    s = LazyTensorStorage(5)
    s.set(0, {"a": torch.ones(2)})
    with pytest.raises(TypeError, match="are not supported by"):
        s.state_dict()
    t = LazyTensorStorage(5)
    t.set(0, torch.ones(2))
    with pytest.raises(RuntimeError, match="Cannot copy a storage of type"):
        t.load_state_dict({"_storage": tds(5).state_dict(), "initialized": True, "_len": 5})


# -- conditional patches ---------------------------------------------------------------------------

def test_conditional_patch_trio():
    s = LazyTensorStorage(6)
    with pytest.raises(RuntimeError, match="Conditional updates require an initialized storage"):
        s._conditional_patch_leaf("obs")
    s.set(torch.arange(4), tds(4))
    assert s.supports_conditional_update
    with pytest.raises(KeyError):
        s._conditional_patch_leaf("nope")
    index = torch.tensor([1, 3])
    good = TensorDict(obs=torch.full((2, 3), -1.0), batch_size=[2])
    s._validate_conditional_patch(index, good)
    with pytest.raises(ValueError, match="dtype mismatch for patch key"):
        s._validate_conditional_patch(index, good.double())
    with pytest.raises(ValueError, match="shape mismatch for patch key"):
        s._validate_conditional_patch(index, TensorDict(obs=torch.zeros(2, 4), batch_size=[2]))
    rev = s._mutation_revision
    s._apply_conditional_patch(index, good)
    assert s._mutation_revision == rev + 1 and len(s) == 4
    assert s[:]["obs"][:, 0].tolist() == [0.0, -1.0, 2.0, -1.0]
    assert s[:]["next", "done"].equal(tds(4)["next", "done"])  # untouched key


# -- repr -----------------------------------------------------------------------------------------

def test_repr():
    s = LazyTensorStorage(3)
    assert "<empty>" in repr(s)
    s.set(0, torch.ones(2))
    assert "len=1" in repr(s) and "max_size=3" in repr(s)


# -- differential run against TorchRL's LazyTensorStorage ------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_random_ops_match_torchrl(seed):
    rng = random.Random(seed)
    cap = 9
    ours, theirs = LazyTensorStorage(cap), torchrl_data.LazyTensorStorage(cap)
    written = torch.zeros(cap, dtype=torch.bool)
    count = 0  # TorchRL's count of the rows written
    length = 0  # that count, raised to cover the last row written (never counting a row twice)
    for step in range(50):
        op = rng.choice(["set_int", "set_many", "setitem", "get", "empty"])
        if op == "set_int":
            i = rng.randrange(cap)
            for s in (ours, theirs):
                s.set(i, tds(1, step)[0])
            written[i] = True
            count = min(count + 1, cap)
            length = min(max(length, count, i + 1), cap)
        elif op in ("set_many", "setitem"):
            rows = torch.tensor(rng.sample(range(cap), rng.randrange(1, 4)))  # distinct rows
            for s in (ours, theirs):
                if op == "set_many":
                    s.set(rows, tds(len(rows), step))
                else:
                    s[rows] = tds(len(rows), step)
            written[rows] = True
            if op == "set_many":
                count = min(count + len(rows), cap)
                length = min(max(length, count, int(rows[-1]) + 1), cap)
        elif op == "empty":
            for s in (ours, theirs):
                s._empty()
            count = length = 0
        elif len(theirs):
            index = torch.tensor([rng.randrange(len(theirs)) for _ in range(4)])
            mask = written[index]
            assert (ours.get(index)[mask] == theirs.get(index)[mask]).all()
        assert len(ours) == length and len(theirs) == count
        assert ours._mutation_revision == theirs._mutation_revision
        assert ours._last_cursor_index == theirs._last_cursor_index
        if theirs.initialized:
            assert ours.shape == (theirs._total_shape if length == cap else torch.Size([length]))



def test_a_key_the_rows_lack_is_zero_where_unwritten_as_torchrl(monkeypatch):
    """TorchRL's buffer adds an ``index`` key to what it extends; a ``TensorStorage`` given
    rows without it creates it, zeros where nothing was written (as TorchRL's). It was
    ``torch.empty``: whatever the allocator handed back (here made visible: ones)."""
    T = pytest.importorskip("torchrl.data")
    zt = pytest.importorskip("zstore.torchrl")
    got = {}
    for module in (T, zt):
        if module is zt:  # uninitialised memory, made deterministic
            real = torch.empty
            monkeypatch.setattr(torch, "empty", lambda *a, **k: real(*a, **k).fill_(1))
        rb = T.TensorDictReplayBuffer(storage=module.TensorStorage(
            TensorDict(obs=torch.zeros(64, 3), batch_size=[64])))
        rb.extend(TensorDict(obs=torch.ones(10, 3), batch_size=[10]))
        got[module] = rb.storage.get(torch.arange(64))["index"].tolist()
    assert got[zt] == got[T] == list(range(10)) + [0] * 54


@pytest.mark.parametrize("write", ["extend", "add", "setitem"])
@pytest.mark.parametrize("first_nested", [True, False], ids=["nested-then-tensor",
                                                             "tensor-then-nested"])
def test_a_key_that_changes_between_nested_and_tensor_is_refused_keeping_every_row(
        write, first_nested):
    """Before: a later batch whose ``nest`` was a tensor where the rows held a nested
    TensorDict replaced that node in every row (``nest/c`` lost, zeros read); TorchRL's
    extend refuses it. The reverse raised tensordict's bare KeyError."""
    def batch(n: int, nested: bool, start: float) -> TensorDict:
        values = torch.arange(start, start + n)
        nest = TensorDict(c=values.unsqueeze(-1), batch_size=[n]) if nested else values
        return TensorDict(a=values, nest=nest, batch_size=[n])

    storage = LazyTensorStorage(16)
    storage.set(torch.arange(4), batch(4, first_nested, 0.0))
    before = storage.get(torch.arange(4)).clone()
    later = batch(2, not first_nested, 100.0)
    with pytest.raises(SchemaError, match="key 'nest' is a .* cannot become .*nothing was written"):
        if write == "extend":
            storage.set(torch.arange(4, 6), later)
        elif write == "add":
            storage.set(4, later[0])
        else:
            storage[0] = later[0]
    after = storage.get(torch.arange(4))
    assert set(after.keys(True, True)) == set(before.keys(True, True))
    assert (after == before).all()
