"""Tensor storages against TorchRL's own, for two writes the differential fuzzer found
wrong: an update lacking a key at a negative index or through a mask over every row
(the kept values came from the wrong row), and nested TensorDicts with batch dims of
their own in ``LazyTensorStorage`` (they were dropped)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, tensorclass

import zstore

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")
TorchRLLazyTensorStorage, TensorDictReplayBuffer = T.LazyTensorStorage, T.TensorDictReplayBuffer


def memmap(location, capacity: int):
    """zstore's LazyMemmapStorage, as TorchRL's buffers take it, at ``location``."""
    return zt.LazyMemmapStorage(capacity, scratch_dir=location.new(),
                                storage_options=location.options)


@pytest.mark.parametrize("write", ["negative int", "mask over every row"])
def test_an_update_lacking_a_key_keeps_the_values_of_the_rows_it_writes(location, write):
    """A TensorDictReplayBuffer adds "index" to what it extends; an update without it
    keeps each row's own. On a buffer not yet full, zstore's memmap storage read the kept
    values through the cursor resolved against the length: ``set(-6, td)`` of 7 rows of
    8 wrote row 2 with row 1's index, and a mask with a flag per row raised IndexError."""
    results = []
    for storage in (TorchRLLazyTensorStorage(8), memmap(location, 8)):
        rb = TensorDictReplayBuffer(storage=storage)
        rb.extend(TensorDict(obs=torch.arange(7.), batch_size=[7]))
        if write == "negative int":
            rb.storage.set(-6, TensorDict(obs=torch.tensor(100.)))
        else:
            mask = torch.tensor([True, False, True, False, False, False, True, False])
            rb.storage.set(mask, TensorDict(obs=torch.tensor([10., 20., 30.]), batch_size=[3]))
        rows = rb.storage.get(torch.arange(7))
        results.append((rows["obs"].tolist(), rows["index"].tolist()))
    assert results[1] == results[0]
    assert results[1][1] == list(range(7))


def test_nested_batch_dims_are_kept_in_ram_and_on_every_store(location):
    """``LazyTensorStorage`` allocated nested TensorDicts without their batch dims:
    ``rb[0]["a"].batch_size`` was ``[]`` (TorchRL's: ``[4]``), a sample's ``[2]`` (not
    ``[2, 4]``), and ``rb[0]["a"][1]`` raised."""
    data = TensorDict({"a": TensorDict(x=torch.arange(24.).view(3, 4, 2), batch_size=[3, 4]),
                       "obs": torch.zeros(3)}, batch_size=[3])
    reference = TensorDictReplayBuffer(storage=TorchRLLazyTensorStorage(5))
    reference.extend(data.clone())
    for storage in (zt.LazyTensorStorage(5), memmap(location, 5)):
        rb = TensorDictReplayBuffer(storage=storage)
        rb.extend(data.clone())
        for index in (0, torch.tensor([2, 0])):
            got, expected = rb.storage.get(index), reference.storage.get(index)
            assert got["a"].batch_size == expected["a"].batch_size
            assert got["a", "x"].equal(expected["a", "x"])
        assert rb.storage.get(0)["a"][1]["x"].tolist() == [2., 3.]


def test_documented_differences_deepcopy_shares_the_store_and_dtypes_are_not_cast(tmp_path):
    """docs/torchrl.md: ``copy.deepcopy`` of a URL storage reopens the same store (TorchRL's
    copies the data), whose writer the copy becomes once it writes; and a row of another
    dtype is refused where TorchRL's casts it."""
    import copy

    url = str(tmp_path / "rb")
    storage = zt.LazyMemmapStorage(4, scratch_dir=url)
    storage.set(torch.arange(2), TensorDict(x=torch.zeros(2), batch_size=[2]))
    twin = copy.deepcopy(storage)
    twin.set(0, TensorDict(x=torch.tensor(5.)))
    assert storage.get(0)["x"].item() == 5.0  # the same store
    with pytest.raises(zstore.LeaseError, match="another storage object of this process"):
        storage.set(1, TensorDict(x=torch.tensor(6.)))  # the copy writes it now
    storage = twin
    theirs = TorchRLLazyTensorStorage(4)
    theirs.set(torch.arange(2), TensorDict(x=torch.zeros(2), batch_size=[2]))
    theirs.set(1, TensorDict(x=torch.tensor(7., dtype=torch.float64)))
    assert theirs.get(1)["x"].dtype == torch.float32  # TorchRL's casts
    with pytest.raises(zstore.SchemaError, match="float64"):
        storage.set(1, TensorDict(x=torch.tensor(7., dtype=torch.float64)))
    assert storage.get(1)["x"].item() == 0.0


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copy_of_a_temporary_storage_keeps_its_store_once_the_original_is_collected(copy_of):
    """A copy of a storage without ``scratch_dir`` reopens its temporary store, which the
    original's collection deleted: the copy read rows from memory, then its next write
    raised "holds only a write lease" and left an empty folder behind. The store now lives
    until the last of them is collected; the copy reads and writes as TorchRL's copy."""
    import copy
    import gc
    import os
    import pickle

    def made(cls):
        rb = T.ReplayBuffer(storage=cls(100), batch_size=4)
        rb.extend(TensorDict(x=torch.arange(10.0), batch_size=[10]))
        twin = copy.deepcopy(rb) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(rb))
        return rb, twin

    got = {}
    for name, cls in {"zstore": zt.LazyMemmapStorage, "torchrl": TorchRLLazyTensorStorage}.items():
        rb, twin = made(cls)
        where = getattr(rb.storage, "scratch_dir", None)
        del rb
        gc.collect()
        twin.extend(TensorDict(x=torch.arange(10.0, 15.0), batch_size=[5]))
        got[name] = (len(twin), twin[:]["x"].tolist())
        if name == "zstore":
            assert os.path.isdir(where)
            twin.storage.flush()  # (a storage with uncommitted rows lives until committed)
            del twin
            gc.collect()
            assert not os.path.exists(where)  # deleted with the last of them
    assert got["zstore"] == got["torchrl"] == (15, [float(i) for i in range(15)])


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "TensorStorage"])
@pytest.mark.parametrize("write", ["mask as a list of flags", "a number into a row"])
def test_in_ram_writes_torchrl_takes_through_rb_setitem(kind, write):
    """``rb[[True, False, ...]] = td`` raised torch.nonzero's missing meta kernel, and
    ``rb[0] = 5`` an AttributeError ('int' object has no attribute 'keys'), where
    TorchRL's storages write the flagged rows and broadcast the number into every leaf."""
    results = []
    for module in (T, zt):
        storage = module.LazyTensorStorage(10) if kind == "LazyTensorStorage" else \
            module.TensorStorage(TensorDict(obs=torch.zeros(10, 2), batch_size=[10]))
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
        rb.extend(TensorDict(obs=torch.arange(20.).view(10, 2), batch_size=[10]))
        if write == "a number into a row":
            rb[3] = 5
        else:
            rb[[True, False, True] + [False] * 7] = TensorDict(
                obs=torch.tensor([[-1., -1.], [-2., -2.]]), batch_size=[2])
        results.append(rb[:]["obs"])
    assert torch.equal(*results), results


@tensorclass
class Inner:
    """A tensorclass nested in the items of the test below."""

    pos: torch.Tensor


@tensorclass
class Outer:
    """A tensorclass holding another."""

    inner: Inner
    reward: torch.Tensor


def test_nested_tensorclasses_come_back_as_their_classes(location):
    """They came back as TensorDicts (``batch.inner.pos`` raised AttributeError), where
    TorchRL's storages give the classes back; a reopened store does too."""
    data = Outer(inner=Inner(pos=torch.arange(10.).unsqueeze(-1), batch_size=[10]),
                 reward=torch.arange(10.), batch_size=[10])
    mixed = TensorDict(obs=torch.arange(10.), tc=Inner(pos=torch.ones(10, 2), batch_size=[10]),
                       batch_size=[10])
    for item in (data, mixed):
        ours, theirs = memmap(location, 10), TorchRLLazyTensorStorage(10)
        for storage in (ours, theirs):
            storage.set(torch.arange(10), item)
        ours.flush()
        reopened = zt.open(ours.spec.url, location.options, mode="r") \
            if location.kind != "memory" else ours
        for storage in (ours, theirs, reopened):
            rows = storage.get(torch.tensor([4, 1]))
            nested = rows.inner if item is data else rows["tc"]
            assert type(nested) is Inner, type(nested)
            assert torch.equal(nested.pos, (data.inner.pos if item is data
                                            else mixed["tc"].pos)[torch.tensor([4, 1])])


def test_max_value_writer_matches_torchrl_when_every_write_has_the_same_keys(location):
    """The documented difference (docs/torchrl.md §4): TorchRL's TensorDictMaxValueWriter
    adds "index" on add() only; over a LazyMemmapStorage, whose keys are fixed by its first
    write, extends and adds are the same as TorchRL's each on its own, and a mix is refused
    naming the key (before anything is written) where TorchRL's storages take it."""
    def batch(values):
        return TensorDict(obs=torch.tensor(values), r=torch.tensor(values), batch_size=[len(values)])

    rows = []
    for storage in (TorchRLLazyTensorStorage(5), memmap(location, 5)):
        rb = TensorDictReplayBuffer(storage=storage, batch_size=2,
                                    writer=T.TensorDictMaxValueWriter(rank_key="r"))
        for values in ([3., 1., 4.], [1., 5., 9.], [2., 6.]):
            rb.extend(batch(values))
        rows.append(sorted(rb[:]["obs"].tolist()))
    assert rows[0] == rows[1] and len(rows[0]) == 5, rows  # the five highest ranks kept
    mixed = TensorDictReplayBuffer(storage=memmap(location, 5), batch_size=2,
                                   writer=T.TensorDictMaxValueWriter(rank_key="r"))
    mixed.extend(batch([3., 1.]))
    with pytest.raises(zstore.MissingKeyError, match="index"):
        mixed.add(TensorDict(obs=torch.tensor(9.), r=torch.tensor(9.)))
    assert sorted(mixed[:]["obs"].tolist()) == [1., 3.]


def test_dim_names_of_nested_tensordicts_are_not_stored(location):
    """The documented difference (docs/torchrl.md §4): the values come back, the names do not."""
    nest = TensorDict(x=torch.ones(4, 3, 2), batch_size=[4, 3], names=["t", "agent"])
    storage = memmap(location, 4)
    storage.set(torch.arange(4), TensorDict(nest=nest, batch_size=[4]))
    rows = storage.get(torch.arange(4))
    assert torch.equal(rows["nest", "x"], nest["x"]) and rows["nest"].names == [None, None]


@pytest.mark.parametrize("form", ["TensorDict", "tensor", "dict"])
@pytest.mark.parametrize("kind", ["LazyTensorStorage", "LazyMemmapStorage"])
def test_rb_setitem_of_a_batch_of_one_writes_the_row_as_torchrl(location, kind, form):
    """Regression: ``rb[2] = batch_of_one`` was refused (in RAM: "shape mismatch for key
    'obs'"; at a URL: SchemaError "shape (1,) does not match the buffer's ()"), where
    TorchRL's storages write the one row into row 2, as torch's setitem does."""
    def data(first: int, n: int):
        if form == "TensorDict":
            return TensorDict(obs=torch.arange(first, first + n).float(), batch_size=[n])
        if form == "tensor":
            return torch.arange(first, first + n).float()
        return {"a": torch.arange(first, first + n), "b": torch.ones(n, 2) * first}

    results = []
    for storage in (T.LazyTensorStorage(10),
                    zt.LazyTensorStorage(10) if kind == "LazyTensorStorage" else
                    zt.LazyMemmapStorage(10, scratch_dir=location.new(),
                                         storage_options=location.options)):
        rb = T.ReplayBuffer(storage=storage, batch_size=4)
        rb.extend(data(0, 6))
        rb[2] = data(500, 1)
        got = rb[:6]
        results.append(got if isinstance(got, torch.Tensor) else
                       {k: v.clone() for k, v in got.items()})
    theirs, ours = results
    if form == "tensor":
        assert torch.equal(theirs, ours) and theirs[2] == 500
    else:
        assert theirs.keys() == ours.keys()
        assert all(torch.equal(theirs[k], ours[k]) for k in theirs.keys())


@pytest.mark.parametrize("index", ["slice, lane tensor", "slice, lane list", "rows, lane tensor",
                                   "stepped rows, int lane"])
def test_lanes_picked_by_a_tensor_or_list_are_written_as_torchrl_writes_them(location, index):
    """On an ``ndim=2`` memmap storage, ``storage[:, lanes] = td`` (what ``rb[lanes] = td``
    calls) raised "Attempting to broadcast a dimension": the rows of a slice were indexed
    by a tensor, which torch pairs with the lanes' tensor instead of crossing them."""
    def batch(rows: int, lanes: int, first: int) -> TensorDict:
        return TensorDict(obs=torch.arange(first, first + rows * lanes).float().view(rows, lanes),
                          batch_size=[rows, lanes])

    cursor, value = {"slice, lane tensor": ((slice(None), torch.tensor([1, 0])), batch(10, 2, 700)),
                     "slice, lane list": ((slice(None), [1]), batch(10, 1, 700)),
                     "rows, lane tensor": ((slice(2, 5), torch.tensor([1])), batch(3, 1, 700)),
                     "stepped rows, int lane": ((slice(2, 8, 2), 0), batch(3, 1, 700)[:, 0])}[index]
    results = []
    for storage in (T.LazyMemmapStorage(20, ndim=2), memmap2(location)):
        storage.set(torch.arange(10), batch(10, 2, 0))
        storage[cursor] = value
        results.append(storage[:]["obs"].clone())
    assert torch.equal(results[1], results[0])
    assert (results[1] >= 700).sum() == value.numel()


def test_rb_setitem_of_lanes_on_an_ndim_2_buffer_matches_torchrl(location):
    def lanes(n: int, steps: int, first: int) -> TensorDict:
        return TensorDict(obs=torch.arange(first, first + n * steps).float().view(n, steps),
                          batch_size=[n, steps])

    results = []
    for storage in (T.LazyMemmapStorage(20, ndim=2), memmap2(location)):
        rb = T.ReplayBuffer(storage=storage)
        rb.extend(lanes(2, 10, 0))
        rb[torch.tensor([0, 1])] = lanes(2, 10, 700)
        results.append(rb[:]["obs"].clone())
    assert torch.equal(results[1], results[0]) and bool((results[1] >= 700).all())


def memmap2(location) -> zt.LazyMemmapStorage:
    """zstore's ``ndim=2`` LazyMemmapStorage of 20 cells at ``location``."""
    return zt.LazyMemmapStorage(20, ndim=2, scratch_dir=location.new(),
                                storage_options=location.options)


def test_a_filled_two_dim_tensor_storage_counts_its_cells():
    """A documented difference (docs/torchrl.md, section 4): TorchRL's counts the rows of
    the container (6), and its writes then land in rows [0, 1, 0, 1]."""
    data = TensorDict(obs=torch.arange(18.).reshape(6, 3), batch_size=[6, 3])
    theirs, ours = T.TensorStorage(data.clone(), ndim=2), zt.TensorStorage(data.clone(), ndim=2)
    assert (len(theirs), theirs.max_size) == (6, 6)
    assert (len(ours), ours.max_size) == (18, 18)
    rb = T.TensorDictReplayBuffer(storage=zt.TensorStorage(data.clone().zero_(), ndim=2))
    rb.extend(TensorDict(obs=torch.ones(3, 4), batch_size=[3, 4]))
    assert int(rb.storage._storage["obs"].sum()) == 12  # every one of the 12 cells written
