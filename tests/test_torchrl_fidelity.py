"""zstore.torchrl beyond the storages' methods: TorchRL users change their imports, nothing else.

``storage._storage`` (the container TorchRL's samplers, checkpointers and user code read),
twins of every name on TorchRL's "Storage Backends" page, and TorchRL's cleanup attributes,
each compared with TorchRL's own storage fed the same data.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.utils import assert_close
from test_torchrl_integration import BATCH, CAPACITY, assert_same_samples, fill, transitions

import zstore
from zstore.errors import ReadOnlyError

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

STORAGES = ("Storage", "ListStorage", "LazyStackStorage", "CompressedListStorage", "TensorStorage",
            "LazyTensorStorage", "LazyMemmapStorage", "StorageEnsemble")


def filled_pair(location, tmp_path, url=None):
    """``(zstore.torchrl, torchrl)`` LazyMemmapStorage, fed the same three wrapping extends."""
    ours = zt.LazyMemmapStorage(CAPACITY, scratch_dir=url or location.new(),
                                storage_options=location.options if location else None)
    theirs = T.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path / "torchrl")
    assert ours._storage is None and theirs._storage is None  # both: before the first write
    fill(T.TensorDictReplayBuffer(storage=ours), T.TensorDictReplayBuffer(storage=theirs))
    return ours, theirs


def test_container_holds_the_rows_torchrls_does(location, tmp_path):
    ours, theirs = filled_pair(location, tmp_path)
    got, want = ours._storage, theirs._storage
    assert got.shape == got.batch_size == want.shape and len(got) == len(want)
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for index in (3, -1, slice(5, 20, 3), torch.tensor([0, 49, 7]), [2, 2, 40]):
        assert_close(got[index], want[index].clone())
    for key in ("episode", ("next", "done")):
        assert torch.equal(got.get(key), want.get(key)) and torch.equal(got[key], want[key])
    assert got.get("missing", None) is None


def test_ndim2_container_holds_the_cells_torchrls_does(location):
    steps = torch.arange(18).reshape(6, 3)  # [time, env]
    data = TensorDict({"obs": steps.float().unsqueeze(-1),
                       ("next", "done"): (steps % 5 == 4).unsqueeze(-1)}, batch_size=[6, 3])
    ours = zt.LazyMemmapStorage(30, ndim=2, scratch_dir=location.new(),
                                storage_options=location.options)
    theirs = T.LazyTensorStorage(30, ndim=2)
    for storage in (ours, theirs):
        storage.set(slice(0, 6), data)
    assert ours._storage.shape == theirs._storage.shape == torch.Size([10, 3])
    for index in (2, (1, 2), slice(0, 4), (torch.tensor([0, 5]), torch.tensor([1, 2])),
                  (slice(1, 3), torch.tensor([0, 2]))):
        assert_close(ours._storage[index], theirs._storage[index])


def test_local_container_is_views_of_the_maps(tmp_path):
    ours, _ = filled_pair(None, tmp_path, url=str(tmp_path / "rb"))
    assert type(ours._storage) is TensorDict  # as TorchRL's: is_tensor_collection code paths
    ours._storage["observation"][7] = 42.0  # an in-place edit lands in the chunk files
    assert ours.get(7)["observation"].tolist() == [42.0, 42.0]


def test_container_access_reads_nothing(location, tmp_path):
    ours, _ = filled_pair(location, tmp_path)
    if ours.scratch_dir.startswith("/"):
        pytest.skip("a local raw buffer's container is views of its maps")
    table, read = ours.table, ours.table.read
    rows_read = []
    table.read = lambda rows, *a: rows_read.append(len(rows)) or read(rows, *a)
    container = ours._storage
    assert (container.shape, len(container)) == (torch.Size([CAPACITY]), CAPACITY)
    assert ("next", "done") in container.keys(include_nested=True)
    assert sum(rows_read) == 0
    container[[4, 9]]
    assert sum(rows_read) == 2


def test_container_writes_reach_the_store(location, tmp_path):
    ours, _ = filled_pair(location, tmp_path)
    row = ours.get(0).clone()
    row["observation"] += 100
    ours._storage[11] = row
    ours.flush()
    reopened = zstore.open(ours.scratch_dir, location.options, mode="r")
    assert_close(reopened.get(11), row)
    with pytest.raises(AttributeError, match="storage.set"):
        ours._storage = TensorDict()
    readonly = zt.open(ours.scratch_dir, location.options, mode="r")._storage
    with pytest.raises(ReadOnlyError):
        readonly[0] = row
    with pytest.raises(TypeError, match="every row"):
        readonly["episode"] = torch.zeros(CAPACITY)


def test_every_storage_backend_name_has_a_twin():
    names = STORAGES + zt.CHECKPOINTERS + ("ImmutableDatasetWriter",)
    assert len(names) == 17
    for name in names:
        ours = getattr(zt, name)
        assert issubclass(ours, getattr(T, name)) and ours.__module__ == "zstore.torchrl", name
    import checkpoint

    for name in zt.CHECKPOINTERS:
        assert issubclass(getattr(zt, name), getattr(checkpoint, name)), name


def test_checkpointer_twin_saves_and_loads(tmp_path):
    storage = zt.LazyTensorStorage(CAPACITY)
    storage.checkpointer = zt.TensorStorageCheckpointer()
    storage.set(torch.arange(20), transitions(20))
    storage.dumps(tmp_path / "ckpt")
    again = zt.LazyTensorStorage(CAPACITY)
    again.checkpointer = zt.TensorStorageCheckpointer()
    again.loads(tmp_path / "ckpt")
    assert len(again) == 20 and torch.equal(again.get(slice(None))["episode"],
                                            storage.get(slice(None))["episode"])


def test_immutable_dataset_writer_is_accepted(location, tmp_path):
    written, theirs = filled_pair(location, tmp_path)
    written.flush()
    dataset = zt.open(written.scratch_dir, location.options, mode="r")
    rbs = [T.TensorDictReplayBuffer(storage=storage, writer=writer, batch_size=BATCH)
           for storage, writer in ((dataset, zt.ImmutableDatasetWriter()),
                                   (theirs, T.ImmutableDatasetWriter()))]
    assert_same_samples(*rbs)
    for rb in rbs:
        with pytest.raises(RuntimeError, match="This dataset doesn't allow writing."):
            rb.extend(transitions(3))


def _members(cls, location, n: int = 2):
    kw = {} if location is None else {"storage_options": location.options}
    members = []
    for i in range(n):
        storage = cls(CAPACITY, **({} if location is None else {"scratch_dir": location.new()}), **kw)
        storage.set(torch.arange(10), transitions(10, 100 * i))
        members.append(storage)
    return members


def test_storage_ensemble_in_a_buffer(location):
    ours = zt.StorageEnsemble(*_members(zt.LazyMemmapStorage, location), scratch_dir=location.new(),
                              storage_options=location.options)
    theirs = T.StorageEnsemble(*_members(T.LazyTensorStorage, None))
    index = {"buffer_ids": [1, 0], "index": [torch.tensor([3, 4]), torch.tensor([0])]}
    for rb_ours, rb_theirs in ((T.TensorDictReplayBuffer(storage=ours), T.TensorDictReplayBuffer(storage=theirs)),
                               (T.ReplayBuffer(storage=ours), T.ReplayBuffer(storage=theirs))):
        assert rb_ours._collate_fn is rb_theirs._collate_fn
        got, want = rb_ours._storage.get(index), rb_theirs._storage.get(index)
        assert [i for i, _ in got] == [i for i, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert_close(a, b)
    assert isinstance(ours[[1]], T.StorageEnsemble)
    reopened = zt.open(ours.spec.url, location.options, mode="r")
    assert isinstance(reopened, T.StorageEnsemble)
    assert all(isinstance(m, T.LazyMemmapStorage) for m in reopened._storages)


def test_replay_buffer_ensemble_over_zstore_storages(location):
    def ensemble(members):
        rbs = [T.TensorDictReplayBuffer(storage=s, batch_size=BATCH) for s in members]
        return T.ReplayBufferEnsemble(*rbs, batch_size=BATCH)

    ours = ensemble(_members(zt.LazyMemmapStorage, location))
    theirs = ensemble(_members(T.LazyTensorStorage, None))
    assert_same_samples(ours, theirs)
    def composed(storages):
        return T.ReplayBufferEnsemble(storages=storages, batch_size=BATCH,
                                      samplers=T.SamplerEnsemble(T.RandomSampler(), T.RandomSampler()),
                                      writers=T.WriterEnsemble(T.RoundRobinWriter(), T.RoundRobinWriter()))

    assert_same_samples(composed(zt.StorageEnsemble(*_members(zt.LazyMemmapStorage, location))),
                        composed(T.StorageEnsemble(*_members(T.LazyTensorStorage, None))))


def test_cleanup_attributes_as_torchrl():
    ours, theirs = zt.LazyMemmapStorage(CAPACITY), T.LazyMemmapStorage(CAPACITY)
    for storage in (ours, theirs):
        storage.set(torch.arange(5), transitions(5))
        assert storage._auto_cleanup and not storage._cleaned_up
        storage.cleanup()
        assert storage._cleaned_up and not storage.cleanup()
    assert not zstore.StoreSpec.parse(ours.scratch_dir).exists()
    kept = zt.LazyMemmapStorage(CAPACITY, scratch_dir="memory://zstore-tests/kept")
    assert not kept._auto_cleanup
