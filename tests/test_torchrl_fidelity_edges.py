"""Edge cases where zstore.torchrl's storages did what TorchRL's do not, each against TorchRL.

* ``CompressedListStorage.get`` of a negative-step slice, and ``contains`` of negative
  indices, as TorchRL's list storages;
* a ``bool`` cursor is the int it stands for (``ListStorage.set(True, x)``);
* a ``uint8`` index is a mask, and ``None`` / ``True`` add a leading dim, as torch indexes;
  so does a ``None`` ahead of a tuple index, and ``...`` stands for the dims it spans, in
  ``get`` and ``set`` of every tensor storage, ``ndim=2`` included;
* an empty nested TensorDict of the items comes back from reads, a reopen included;
* tensorclass items come back as their class after ``loads`` into a new buffer or a reopen
  (when the class's module is imported: nothing is imported for a name read from a store);
* a boolean mask (NumPy, as TorchRL's buffer hands ``rb[mask] = td`` over) writes the masked
  rows of a ``TensorStorage`` / ``LazyTensorStorage``;
* a wrong shape or dtype on ``extend`` raises a ``RuntimeError``, as TorchRL's storages do;
* items ``CompressedListStorage`` cannot store (TorchRL's keeps them as they are) are refused
  with an error naming the key, what differs and the way out, which then stores them.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase, is_non_tensor, tensorclass

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")


def as_plain(item):
    """An item as nested lists / strings, for exact comparison."""
    if isinstance(item, torch.Tensor):
        return (str(item.dtype), item.tolist())
    if isinstance(item, (list, tuple)):
        return [as_plain(x) for x in item]
    if isinstance(item, dict):
        return {key: as_plain(value) for key, value in item.items()}
    if isinstance(item, TensorDictBase):
        return {key: as_plain(value) for key, value in item.items(include_nested=True)
                if not isinstance(value, TensorDictBase)}
    return item.tolist() if is_non_tensor(item) else item


def filled(module, items):
    storage = module.CompressedListStorage(10)
    for i, item in enumerate(items):
        storage.set(i, item)
    return storage


@pytest.mark.parametrize("index", [slice(None, None, -1), slice(3, 0, -2), slice(-1, -4, -1),
                                   slice(0, 3, -1), slice(None, None, 2)])
def test_compressed_get_negative_step_slice_as_torchrl(index):
    items = [torch.full((2,), float(i)) for i in range(4)]
    tds = [TensorDict(obs=torch.full((3,), float(i))) for i in range(4)]
    for data in (items, tds):
        ours, theirs = filled(zt, data).get(index), filled(T, data).get(index)
        assert as_plain(list(ours)) == as_plain(list(theirs))


def test_compressed_contains_wraps_negative_indices_as_torchrl():
    items = [torch.ones(2) for _ in range(3)]
    ours, theirs = filled(zt, items), filled(T, items)
    for i in (-4, -3, -1, 0, 2, 3):
        assert ours.contains(i) == theirs.contains(i), i
    probe = torch.tensor([-1, -3, -4, 2, 3])
    assert ours.contains(probe).tolist() == theirs.contains(probe).tolist() \
        == [True, True, False, True, False]


def test_bool_cursor_is_an_int_as_torchrl():
    for name, first, second in (("ListStorage", "a", "b"),
                                ("CompressedListStorage", torch.zeros(2), torch.ones(2))):
        ours, theirs = getattr(zt, name)(10), getattr(T, name)(10)
        for storage in (ours, theirs):
            storage.set(0, first)
            storage.set(True, second)
        assert len(ours) == len(theirs) == 2, name
        assert as_plain(ours.get(True)) == as_plain(theirs.get(True)), name
        assert as_plain(list(ours.get(slice(None)))) == as_plain(list(theirs.get(slice(None))))
        assert ours.contains(True) == theirs.contains(True)


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "TensorStorage"])
def test_numpy_bool_mask_set_as_torchrl(kind):
    def make(module):
        if kind == "TensorStorage":
            storage = module.TensorStorage(TensorDict(obs=torch.zeros(10), batch_size=[10]))
        else:
            storage = module.LazyTensorStorage(10)
        storage.set(torch.arange(10), TensorDict(obs=torch.arange(10.0), batch_size=[10]))
        return storage

    mask = np.arange(10) % 3 == 0
    got = {}
    for module in (zt, T):
        storage = make(module)
        storage[mask] = TensorDict(obs=torch.full((4,), -1.0), batch_size=[4])
        storage.set(torch.from_numpy(mask), TensorDict(obs=-torch.arange(4.0) - 2, batch_size=[4]),
                    set_cursor=False)
        got[module] = storage[:]["obs"].tolist()
    assert got[zt] == got[T] == [-2.0, 1, 2, -3, 4, 5, -4, 7, 8, -5]


def test_buffer_setitem_with_a_bool_mask_as_torchrl():
    got = {}
    for module in (zt, T):
        rb = T.TensorDictReplayBuffer(storage=module.LazyTensorStorage(10))
        rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
        rb[torch.arange(10) % 3 == 0] = TensorDict(obs=torch.full((4,), -1.0),
                                                   index=torch.arange(4), batch_size=[4])
        got[module] = rb[:]["obs"].tolist()
    assert got[zt] == got[T] == [-1.0, 1, 2, -1, 4, 5, -1, 7, 8, -1]


@pytest.mark.parametrize("where", ["memory", "local"])
def test_uint8_none_and_bool_indices_read_as_torchrl(where, tmp_path):
    """A uint8 index read rows 0 and 1 over and over (torch, and TorchRL, take it as a mask),
    ``rb[None]`` dropped the new leading dim and ``rb[True]`` raised IndexError."""
    url = f"memory://zstore-tests/u8-{uuid.uuid4().hex}" if where == "memory" else str(tmp_path / "rb")
    data = TensorDict(obs=torch.arange(6) * 10, batch_size=[6])
    ours = T.TensorDictReplayBuffer(storage=zt.LazyMemmapStorage(6, scratch_dir=url))
    theirs = T.TensorDictReplayBuffer(storage=T.LazyMemmapStorage(6))  # full: its mask's length
    for rb in (ours, theirs):
        rb.extend(data.clone())
    mask = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.uint8)
    for index in (mask, None, True, False, Ellipsis, mask.bool()):
        got, want = ours[index], theirs[index]
        # (TorchRL's TensorDict says batch [6] for the uint8 mask, over its 3 rows of obs)
        assert got.batch_size == want["obs"].shape, index
        assert torch.equal(got["obs"], want["obs"]), index
    assert ours.storage.get(mask)["obs"].tolist() == [10, 30, 40]
    with pytest.raises(IndexError, match="boolean index of shape"):
        ours[mask[:4]]


def test_an_empty_index_built_from_an_empty_list_reads_no_row_as_torchrl(tmp_path):
    """``rb[torch.tensor([])]`` (an empty list's tensor is float; TorchRL's buffer hands it
    over as an empty NumPy array) raised "row indices must be integers" on a memmap storage;
    TorchRL's storages and zstore's in-RAM one read no row."""
    data = TensorDict(x=torch.arange(5.0), batch_size=[5])
    for name, storage in _tensor_storages(tmp_path, 1):
        rb = T.ReplayBuffer(storage=storage, batch_size=3)
        rb.extend(data.clone())
        got = rb[torch.tensor([])]
        assert got.batch_size == (0,) and got["x"].shape == (0,), name


def _tensor_storages(tmp_path, ndim):
    """zstore's tensor storages, in RAM and on memory:// and local stores, with TorchRL's
    ``LazyTensorStorage`` (the reference) first."""
    url = f"memory://zstore-tests/axes-{uuid.uuid4().hex}"
    return [("torchrl", T.LazyTensorStorage(6, ndim=ndim)),
            ("in RAM", zt.LazyTensorStorage(6, ndim=ndim)),
            ("memory", zt.LazyMemmapStorage(6, ndim=ndim, scratch_dir=url)),
            ("local", zt.LazyMemmapStorage(6, ndim=ndim, scratch_dir=str(tmp_path / f"rb{ndim}")))]


@pytest.mark.parametrize("ndim,index,value", [
    (2, (None, 1), [[100, 100, 100]]),
    (2, (None, slice(0, 1)), [[[100, 100, 100]]]),
    (2, (None, torch.tensor([0, 1])), [[[100, 101, 102], [103, 104, 105]]]),
    (2, (..., 1), [100, 101]),
    (2, (Ellipsis, torch.tensor([0, 2])), [[100, 101], [102, 103]]),
    (2, (None, None, 0, ...), [[[100, 101, 102]]]),
    (1, (None, 2), [100]),
    (1, Ellipsis, [100, 101, 102, 103, 104, 105]),
    (1, (None, ...), [[100, 101, 102, 103, 104, 105]]),
], ids=str)
def test_new_axes_and_ellipsis_index_as_torchrl(tmp_path, ndim, index, value):
    """A ``None`` ahead of a tuple index was taken for "every row" by a memmap storage, so
    ``get((None, 1))`` of an ``ndim=2`` buffer read lane 1 of every row, and a ``set`` wrote
    there before it raised; a ``set`` at ``(..., 1)`` wrote its cells, then raised (the rows
    it marked for checkpoints never marked). Now reads and writes are torch's and TorchRL's."""
    rows = torch.arange(6).view(2, 3) if ndim == 2 else torch.arange(6)
    data = TensorDict(a=rows, batch_size=rows.shape)
    got = {}
    for name, storage in _tensor_storages(tmp_path, ndim):
        storage.set(slice(0, len(rows)), data)
        read = storage.get(index)
        read = (list(read.batch_size), read["a"].tolist())  # (TorchRL's is a view)
        written = torch.as_tensor(value)
        storage.set(index, TensorDict(a=written, batch_size=written.shape), set_cursor=False)
        got[name] = (*read, storage.get(slice(None))["a"].tolist())
        if name not in ("torchrl", "in RAM"):  # and as stored
            storage.flush()
            reopened = zt.open(storage.scratch_dir, mode="r")
            assert reopened.get(index)["a"].tolist() == storage.get(index)["a"].tolist(), name
    assert got["in RAM"] == got["memory"] == got["local"] == got["torchrl"]


@pytest.mark.parametrize("index", [(Ellipsis, 1), (Ellipsis, slice(0, 2)), (Ellipsis, None),
                                   (None, Ellipsis, 2), (1, Ellipsis), Ellipsis], ids=str)
def test_ellipsis_spans_a_plain_tensors_own_dims_as_torchrl(tmp_path, index):
    """In a storage of plain ``[6, 3]`` tensors, ``...`` spans each row's own dims too:
    ``get((..., 1))`` is column 1 (an expansion over the storage's dims alone read row 1)."""
    got = {}
    for name, storage in _tensor_storages(tmp_path, 1):
        storage.set(slice(0, 6), torch.arange(18.0).view(6, 3))
        read = storage.get(index)
        got[name] = (list(read.shape), read.tolist())
    assert got["in RAM"] == got["memory"] == got["local"] == got["torchrl"]


@pytest.mark.parametrize("cursor", [-1, -3, torch.tensor([-1]), torch.tensor([0, -2]),
                                    slice(-2, None), slice(-1, 6), slice(None, -4),
                                    slice(-1, -1)], ids=str)
def test_a_position_from_the_end_counts_one_write_as_torchrl(tmp_path, cursor):
    """``set(-1, row)`` of a memmap storage holding 3 rows of 6 made its length 6 (the rows
    between never written, read as zeros, sampled); TorchRL counts the write: 4. A slice
    from the end (``set(slice(-2, None), rows)``) did the same. (Rows
    TorchRL never wrote hold ``torch.empty``'s garbage: only the written ones compare.)"""
    got = {}
    for name, storage in _tensor_storages(tmp_path, 1):
        storage.set(torch.arange(3), TensorDict(a=torch.arange(1, 4), batch_size=[3]))
        n = 1 if isinstance(cursor, int) else \
            len(range(6)[cursor]) if isinstance(cursor, slice) else len(cursor)
        storage.set(cursor, TensorDict(a=torch.full((n,), 9), batch_size=[n])
                    if n > 1 or not isinstance(cursor, int) else TensorDict(a=torch.tensor(9)))
        got[name] = (len(storage), storage.get(torch.arange(3))["a"].tolist(),
                     storage._last_cursor_index if isinstance(cursor, slice) else None)
        # (an empty slice from the end moved a memmap storage's cursor to its last row)
        if name not in ("torchrl", "in RAM"):
            storage.flush()
            assert len(zt.open(storage.scratch_dir, mode="r")) == got[name][0], name
    assert got["in RAM"] == got["memory"] == got["local"] == got["torchrl"]


def test_a_nested_list_of_positions_writes_as_torchrl(tmp_path):
    """``storage[[[0, 1], [2, 3]]] = td`` (a ``[2, 2]`` batch): the in-RAM storage took the
    nested list for a tuple of indices, as torch does, where a TensorDict (and TorchRL's
    storage) takes it for one ``[2, 2]`` index tensor, and refused it ("too many indices")."""
    got = {}
    for name, storage in _tensor_storages(tmp_path, 1):
        storage.set(torch.arange(6), TensorDict(a=torch.arange(6.0), batch_size=[6]))
        storage[[[0, 1], [2, 3]]] = TensorDict(a=torch.tensor([[10.0, 11.0], [12.0, 13.0]]),
                                               batch_size=[2, 2])
        got[name] = (storage.get(slice(None))["a"].tolist(),
                     storage.get([[0, 1], [2, 3]])["a"].tolist())
    assert got["in RAM"] == got["memory"] == got["local"] == got["torchrl"] == \
        ([10.0, 11.0, 12.0, 13.0, 4.0, 5.0], [[10.0, 11.0], [12.0, 13.0]])


def test_a_uint8_mask_writes_as_torchrl(tmp_path):
    """A uint8 mask is a mask to ``set`` too: the in-RAM storage refused it ("tensors used as
    indices must be long, int, byte or bool")."""
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.uint8)
    got = {}
    for name, storage in _tensor_storages(tmp_path, 1):
        storage.set(slice(0, 6), TensorDict(a=torch.arange(6), batch_size=[6]))
        storage.set(mask, TensorDict(a=torch.tensor([7, 8, 9]), batch_size=[3]), set_cursor=False)
        got[name] = storage.get(slice(None))["a"].tolist()
    assert got["in RAM"] == got["memory"] == got["local"] == got["torchrl"] == [7, 1, 8, 3, 4, 9]


def test_an_empty_nested_tensordict_comes_back_as_torchrl(tmp_path):
    """A memmap storage dropped a nested TensorDict that holds nothing (no array stores it):
    ``td["info"]`` of a read raised KeyError where TorchRL's storages give it back."""
    td = TensorDict({"obs": torch.arange(4), "info": TensorDict(batch_size=[4]),
                     "deep": {"er": TensorDict(batch_size=[4, 2])},
                     "sub": TensorDict(e=TensorDict(batch_size=[4, 2]), batch_size=[4, 2])},
                    batch_size=[4])
    url = str(tmp_path / "rb")
    theirs, ours = T.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "t")), \
        zt.LazyMemmapStorage(4, scratch_dir=url)
    for storage in (theirs, ours):
        storage.set(torch.arange(4), td)
    ours.flush()
    for read in (ours.get(torch.tensor([0, 1])), ours.get(2), zt.open(url, mode="r")[1:3]):
        want = theirs.get(torch.tensor([0, 1])) if read.batch_size == (2,) else theirs.get(2)
        assert sorted(map(str, read.keys(True))) == sorted(map(str, want.keys(True)))
        assert read["deep", "er"].batch_size == want["deep", "er"].batch_size
        assert read["sub", "e"].batch_size == want["sub", "e"].batch_size
    ours.close()


@tensorclass
class Step:
    obs: torch.Tensor
    text: str


def test_tensorclass_items_come_back_as_their_class_after_loads_and_reopen(tmp_path):
    """Loaded into a new buffer, or reopened, zstore's storages gave back plain TensorDicts
    (``batch.obs`` raised AttributeError); TorchRL's give back the class."""
    data = Step(obs=torch.arange(6.0)[:, None], text=[f"s{i}" for i in range(6)], batch_size=[6])
    places = iter(range(10))
    stores = {"tensor": (lambda: zt.LazyTensorStorage(10), lambda: T.LazyTensorStorage(10)),
              "memmap": (lambda: zt.LazyMemmapStorage(10, scratch_dir=str(tmp_path / f"rb{next(places)}")),
                         lambda: T.LazyMemmapStorage(10))}
    for kind, (ours, theirs) in stores.items():
        got = []
        for make in (ours, theirs):
            rb = T.ReplayBuffer(storage=make())
            rb.extend(data.clone())
            rb.dumps(tmp_path / f"{kind}-{len(got)}")
            fresh = T.ReplayBuffer(storage=make())
            fresh.loads(tmp_path / f"{kind}-{len(got)}")
            got.append(fresh[torch.tensor([4, 1])])
        assert type(got[0]) is type(got[1]) is Step, kind
        assert got[0].obs.tolist() == got[1].obs.tolist()
        assert got[0].text == ["s4", "s1"]  # (TorchRL's dumps keep one string: docs/checkpoints.md)
    url = str(tmp_path / "reopened")
    storage = zt.LazyMemmapStorage(10, scratch_dir=url)
    storage.set(torch.arange(6), data)
    storage.close()
    again = zt.open(url).get(torch.tensor([2]))
    assert type(again) is Step and again.text == ["s2"]


def test_a_stored_class_name_resolves_only_to_an_imported_tensorclass():
    from zstore.layout import loaded_tensorclass

    assert loaded_tensorclass(f"{__name__}.Step") is Step
    for name in ("zstore_no_such_module.Step", "os.path", f"{__name__}.as_plain", "", None):
        assert loaded_tensorclass(name) is None, name


def test_lazy_stack_of_strings_in_memmap_as_torchrl(tmp_path):
    def batch():
        return TensorDict.lazy_stack([TensorDict(obs=torch.tensor(float(i)), txt=f"str{i}")
                                      for i in range(5)])
    got = {}
    for name, storage in (("ours", zt.LazyMemmapStorage(8, scratch_dir=tmp_path / "z")),
                          ("theirs", T.LazyTensorStorage(8))):
        rb = T.TensorDictReplayBuffer(storage=storage)
        rb.extend(batch())
        got[name] = (rb[:]["obs"].tolist(), list(rb[:]["txt"]))
    assert got["ours"] == got["theirs"]


@pytest.mark.parametrize("what", ["wrong shape", "wrong dtype"])
def test_a_refused_extend_raises_runtime_error_as_torchrl(what, tmp_path):
    good = TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
    bad = {"wrong shape": TensorDict(obs=torch.zeros(3, 5), batch_size=[3]),
           "wrong dtype": TensorDict(obs=torch.zeros(3, 4, dtype=torch.float64), batch_size=[3])}[what]
    caught = {}
    for name, storage in (("ours", zt.LazyMemmapStorage(10, scratch_dir=tmp_path / "z")),
                          ("theirs", T.LazyMemmapStorage(10, scratch_dir=tmp_path / "t"))):
        rb = T.TensorDictReplayBuffer(storage=storage)
        rb.extend(good.clone())
        with pytest.raises(RuntimeError) as info:
            rb.extend(bad.clone())
        caught[name] = info.value
    assert isinstance(caught["ours"], ValueError)  # `except ValueError` still catches it
    assert "obs" in str(caught["ours"])


HETEROGENEOUS = {
    "ndim changes": ([TensorDict(obs=torch.zeros(2, 3)), TensorDict(obs=torch.arange(5.0))],
                     ["('obs',)", "1 dims", "first item's 2"]),
    "scalar then vector": ([torch.tensor(1.0), torch.arange(3.0)],
                           ["item tensor", "1 dims", "first item's 0"]),
    "dtype changes": ([TensorDict(obs=torch.zeros(3)), TensorDict(obs=torch.arange(3))],
                      ["('obs',)", "torch.int64", "torch.float32"]),
    "tensor dtype changes": ([torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.float16)],
                             ["item tensor", "torch.float16", "torch.uint8"]),
    "string field": ([TensorDict(obs=torch.zeros(3), instr="go left")],
                     ["('instr',)", "NonTensorData", "tensors only"]),
    "an extra key": ([TensorDict(obs=torch.zeros(3)),
                      TensorDict(obs=torch.zeros(3), mask=torch.ones(3, dtype=torch.bool))],
                     ["adds ['mask']"]),
    "tensor then TensorDict": ([torch.zeros(3), TensorDict(obs=torch.zeros(3))],
                               ["a TensorDict", "first item was not"]),
    "a dict": ([{"obs": torch.zeros(3)}], ["got a dict"]),
}


@pytest.mark.parametrize("case", list(HETEROGENEOUS))
def test_compressed_refuses_what_torchrl_keeps_naming_the_key_and_the_way_out(case):
    items, named = HETEROGENEOUS[case]
    theirs = filled(T, items)  # TorchRL's CompressedListStorage keeps every item as it is
    storage = zt.CompressedListStorage(10)
    with pytest.raises((TypeError, KeyError, ValueError)) as info:
        for i, item in enumerate(items):
            storage.set(i, item)
    message = str(info.value)
    for part in named + ["zstore.ListStorage", "LazyStackStorage"]:
        assert part in message, (part, message)
    assert len(storage) == len(items) - 1  # the items before the refused one stay
    way_out = zt.ListStorage(10)  # the way out the error names holds them as TorchRL's does
    for i, item in enumerate(items):
        way_out.set(i, item)
    assert as_plain(way_out.get(list(range(len(items))))) == \
        as_plain(theirs.get(list(range(len(items)))))


def test_a_meta_lazy_tensor_storage_takes_writes_as_torchrl_s_does():
    """``LazyTensorStorage(n, device="meta")`` (a shape-only dry run) failed at its first
    write ("Cannot copy out of meta tensor"): the positions, moved to the meta device, were
    then read back for the range check. TorchRL's stores the rows and returns meta samples."""
    data = TensorDict(obs=torch.ones(4, 2), action=torch.arange(4), batch_size=[4])
    got = {}
    for name, module in (("torchrl", T), ("zstore", zt)):
        storage = module.LazyTensorStorage(10, device="meta")
        storage.set(torch.arange(4), data)
        storage.set(torch.tensor([5, 6]), data[:2])
        sample = storage.get(torch.tensor([1, 2, 6]))
        got[name] = (sample.device, sample["obs"].shape, sample["action"].dtype)
        lengths = len(storage)
    assert got["zstore"] == got["torchrl"] == (torch.device("meta"), torch.Size([3, 2]),
                                               torch.int64)
    assert lengths == 7  # (TorchRL's counts 6: its positions, moved to meta, are unknown)


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_rows_are_stored_as_values_whether_cached_or_not(kind, tmp_path):
    """Rows written with an autograd graph (a policy's outputs, outside ``no_grad``):
    gradients reached the writer's graph through rows still in the cache and not through
    rows read back from the store, and every write chained the cache onto the graph,
    keeping it alive. A persistent storage stores values: samples never require grad,
    whatever the cache holds (TorchRL's in-RAM storages keep the graph; docs/torchrl.md)."""
    url = str(tmp_path / "rb") if kind == "local" else f"memory://grad-{uuid.uuid4().hex}"
    weights = torch.ones(3, requires_grad=True)
    for cache_bytes in (1 << 20, 1):
        storage = zt.LazyMemmapStorage(8, scratch_dir=f"{url}-{cache_bytes}", chunks=2,
                                       cache_bytes=cache_bytes)
        rows = torch.arange(12.0).reshape(4, 3) * weights
        storage.set(torch.arange(4), TensorDict(a=rows, batch_size=[4]))
        storage.set(torch.arange(4, 8), TensorDict(a=torch.zeros(4, 3), batch_size=[4]))
        sample = storage.get(torch.tensor([0, 1, 5]))["a"]
        assert not sample.requires_grad and sample.grad_fn is None
        assert sample.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [0.0, 0.0, 0.0]]
        assert weights.grad is None


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_a_key_indexes_every_row_written_as_torchrl_s_memmap_storage(kind, tmp_path):
    """``storage["obs"]`` of a LazyMemmapStorage raised torch's "new(): invalid data type
    'str'"; TorchRL's returns that key of every row written (a missing key: KeyError)."""
    data = TensorDict(obs=torch.arange(8.0).view(4, 2),
                      next=TensorDict(reward=torch.arange(4.0), batch_size=[4]), batch_size=[4])
    url = str(tmp_path / "rb") if kind == "local" else f"memory://key-{uuid.uuid4().hex}"
    ours = zt.LazyMemmapStorage(10, scratch_dir=url)
    theirs = T.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "torchrl"))
    for storage in (ours, theirs):
        storage.set(torch.arange(4), data)
    for key in ("obs", ("next", "reward")):
        assert torch.equal(ours[key], theirs[key]) and torch.equal(ours.get(key), theirs.get(key))
    for storage in (ours, theirs):
        with pytest.raises(KeyError):
            storage["missing"]
