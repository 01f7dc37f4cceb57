"""TorchRL's in-place buffer updates over zstore.torchrl storages are stored, never lost.

TorchRL's ``rb.set_at_``, ``rb.set_`` and ``rb.update_`` write into ``storage[:]``, and
``rb[key] = value`` assigns a key of it. Each test applies the same updates to a TorchRL
buffer over a zstore.torchrl storage and to a plain TensorDict (the reference model: what
TorchRL's own buffer holds after the same extend), then compares them: read back through
the buffer and the storage, after ``flush()`` and a reopen (persistent stores, on
memory://, a local directory and S3 on loopback, raw and compressed), after an incremental
checkpoint (in-RAM stores). A read-only store refuses every such update.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict, tensorclass

import zstore
from zstore import ReadOnlyError

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

CAPACITY, FILLED = 128, 100


def rows(n: int, lanes: tuple[int, ...] = ()) -> TensorDict:
    """``n`` rows (of ``lanes`` cells each) of every dtype kind, nested keys included."""
    shape = (n, *lanes)
    step = torch.arange(n * int(np.prod(lanes))).reshape(shape)
    return TensorDict({"obs": step.unsqueeze(-1).float().expand(*shape, 3).clone(),
                       "action": step % 5,
                       ("next", "reward"): step.unsqueeze(-1).double() / 10,
                       ("next", "done"): (step % 7 == 6).unsqueeze(-1)}, batch_size=list(shape))


#: In-place updates as TorchRL's buffer takes them; a TensorDict takes the same calls.
UPDATES = {
    "set_at_": lambda t: t.set_at_("obs", torch.full((3, 3), -1.0), torch.tensor([97, 3, 50])),
    "set_at_ nested, numpy index": lambda t: t.set_at_(
        ("next", "done"), torch.ones(2, 1, dtype=torch.bool), np.array([0, 99])),
    "set_at_ mask": lambda t: t.set_at_("action", torch.tensor(-7), torch.arange(FILLED) % 9 == 0),
    "set_": lambda t: t.set_(("next", "reward"), torch.linspace(0, 1, FILLED).double()[:, None]),
    "update_": lambda t: t.update_(TensorDict(
        obs=torch.randn(FILLED, 3, generator=torch.Generator().manual_seed(1)),
        batch_size=[FILLED])),
    "update_ keys_to_update": lambda t: t.update_(TensorDict(
        obs=torch.zeros(FILLED, 3), action=torch.full((FILLED,), 3), batch_size=[FILLED]),
        keys_to_update=["action"]),
    "assign a key": lambda t: t.__setitem__("action", torch.arange(FILLED) * 11),
}


def extended(rb, data: TensorDict) -> TensorDict:
    """Extend ``rb`` with ``data``; return what TorchRL's own buffer then holds (``data`` with
    the ``index`` key it adds), as a plain TensorDict."""
    rb.extend(data.clone())
    reference = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(
        CAPACITY, ndim=rb.storage.ndim), dim_extend=rb.dim_extend)
    reference.extend(data.clone())
    return reference[:].clone()


def apply_updates(*targets) -> None:
    for update in UPDATES.values():
        for target in targets:
            update(target)


def assert_equal(got, want) -> None:
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert torch.equal(got.get(key), want.get(key)), key


def memmap_buffer(location, url: str, codec=None, ndim: int = 1):
    """A buffer over a new LazyMemmapStorage (``ndim=2``: rows of lanes, extended by rows)."""
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options,
                                   codec=codec, ndim=ndim)
    return T.TensorDictReplayBuffer(storage=storage, dim_extend=0), storage


# -- persistent stores ----------------------------------------------------------------------

@pytest.mark.parametrize("codec", [None, "zstd"])
def test_in_place_updates_are_stored_and_committed(location, codec):
    url = location.new()
    rb, storage = memmap_buffer(location, url, codec)
    model = extended(rb, rows(FILLED))
    apply_updates(rb, model)
    assert_equal(rb[:], model)
    assert_equal(storage.get(torch.arange(FILLED)), model)

    storage.flush()
    again = zt.open(url, location.options)
    assert_equal(again.get(slice(None)), model)
    storage.close()
    # the reopened storage writes through too (it takes the lease at that write)
    rb2 = T.TensorDictReplayBuffer(storage=again, writer=zt.TensorDictRoundRobinWriter())
    rb2.set_at_("obs", torch.zeros(1, 3), 42)
    model.set_at_("obs", torch.zeros(1, 3), 42)
    again.flush()
    assert_equal(zstore.open(url, location.options, mode="r").get(slice(None)), model)


def test_in_place_updates_of_a_2d_storage(location):
    url = location.new()
    rb, storage = memmap_buffer(location, url, ndim=2)
    model = extended(rb, rows(30, (4,)))
    for target in (rb, model):
        target.set_at_("obs", torch.full((2, 3), 5.0),
                       (torch.tensor([29, 1]), torch.tensor([3, 0])))  # two cells
        target.update_(TensorDict(action=torch.ones(30, 4, dtype=torch.int64), batch_size=[30, 4]))
    assert_equal(rb[:], model)
    storage.flush()
    assert_equal(zstore.open(url, location.options).get(slice(None)), model)


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def test_in_place_updates_of_tensorclasses(location):
    url = location.new()
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options)
    rb = T.ReplayBuffer(storage=storage)
    data = rows(FILLED)
    rb.extend(Transition(obs=data["obs"], reward=data["next", "reward"], batch_size=[FILLED]))
    model = TensorDict(obs=data["obs"], reward=data["next", "reward"], batch_size=[FILLED])
    for target in (rb, model):
        target.set_at_("obs", torch.full((2, 3), 8.0), torch.tensor([1, 60]))
        target.set_("reward", torch.ones(FILLED, 1, dtype=torch.float64))
    assert_equal(rb[:]._tensordict, model)
    storage.flush()
    # reopened without the class: TensorDicts
    assert_equal(zstore.open(url, location.options).get(slice(None)), model)


def test_a_read_only_store_refuses_in_place_updates(location):
    url = location.new()
    rb, storage = memmap_buffer(location, url)
    model = extended(rb, rows(FILLED))
    storage.flush()
    dataset = zt.open(url, location.options, mode="r")
    ro = T.TensorDictReplayBuffer(storage=dataset, writer=T.ImmutableDatasetWriter())
    for update in UPDATES.values():
        with pytest.raises(ReadOnlyError, match="read-only"):
            update(ro)
    assert_equal(zstore.open(url, location.options, mode="r").get(slice(None)), model)


def test_assigning_a_new_key_is_refused(location):
    rb, _ = memmap_buffer(location, location.new())
    rb.extend(rows(FILLED))
    with pytest.raises(KeyError, match="keys are fixed at its first write"):
        rb["new"] = torch.zeros(FILLED)


#: Updates of one row, as TorchRL's buffers store them (``storage[i]`` is a view there).
ROW_UPDATES = {
    "rb[i].set_": lambda t: t[7].set_("obs", torch.full((3,), -2.0)),
    "rb[-i].update_": lambda t: t[-3].update_(TensorDict(action=torch.tensor(-5))),
    "rb[i].set_ nested": lambda t: t[12].set_(("next", "done"), torch.tensor([True])),
    "rb[:][i].set_": lambda t: t[:][40].set_(("next", "reward"),
                                             torch.full((1,), 9.0, dtype=torch.float64)),
    "rb[:][i].update_": lambda t: t[:][41].update_(TensorDict(obs=torch.ones(3))),
}


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_assigned_rows_lacking_keys_keep_their_other_keys(location, codec):
    """``rb[i] = td`` without the ``index`` key a TensorDictReplayBuffer adds (or any other
    key) raised MissingKeyError; TorchRL's storages keep the keys it leaves out. New rows
    still need every key."""
    url = location.new()
    rb, storage = memmap_buffer(location, url, codec)
    model = extended(rb, rows(FILLED))
    for target in (rb, model):
        target[2] = TensorDict(obs=torch.full((3,), -2.0), batch_size=[])
        target[torch.tensor([60, 5, 60])] = TensorDict(
            {"obs": -torch.ones(3, 3), ("next", "reward"): torch.full((3, 1), 0.5).double()},
            batch_size=[3])
    assert_equal(rb[:], model)
    with pytest.raises(zstore.errors.MissingKeyError, match=r"row\(s\) \[101\] were never written"):
        storage.set(101, TensorDict(obs=torch.zeros(3), batch_size=[]), set_cursor=False)
    storage.flush()
    assert_equal(zt.open(url, location.options).get(slice(None)), model)
    storage.close()


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_updates_of_one_row_are_stored(location, codec):
    """``rb[i]`` and ``rb[:][i]`` (a row, a 0-dim TensorDict) store their in-place updates
    as TorchRL's storages do: ``rb[:][i].set_`` used to raise (and was lost on a copy), and
    ``rb[i]`` was a copy whose updates were lost on every store."""
    url = location.new()
    rb, storage = memmap_buffer(location, url, codec)
    model = extended(rb, rows(FILLED))
    for update in ROW_UPDATES.values():
        update(rb)
        update(model)
    assert_equal(rb[:], model)
    storage.flush()
    assert_equal(zstore.open(url, location.options, mode="r").get(slice(None)), model)


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "TensorStorage"])
def test_updates_of_one_row_in_ram_match_torchrl(kind):
    def buffer(module):
        storage = (module.LazyTensorStorage(CAPACITY) if kind == "LazyTensorStorage"
                   else module.TensorStorage(rows(CAPACITY).zero_()))
        return T.TensorDictReplayBuffer(storage=storage)

    ours, theirs = buffer(zt), buffer(T)
    for rb in (ours, theirs):
        rb.extend(rows(FILLED))
        for update in ROW_UPDATES.values():
            update(rb)
    assert_equal(ours[:], theirs[:])


def test_local_slices_are_views_of_the_files(tmp_path):
    """As TorchRL's memmap: a writable local raw buffer's slice is the files' memory."""
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=str(tmp_path / "rb"))
    storage.set(torch.arange(FILLED), rows(FILLED))
    view = storage[10:20]
    view["obs"][0] = 42.0
    assert torch.equal(storage.get(10)["obs"], torch.full((3,), 42.0))


# -- in-RAM stores --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["LazyTensorStorage", "TensorStorage"])
def test_in_ram_updates_reach_incremental_checkpoints(kind, tmp_path):
    def new_storage():
        if kind == "LazyTensorStorage":
            return zt.LazyTensorStorage(CAPACITY)
        return zt.TensorStorage(rows(FILLED).zero_().set("index", torch.zeros(FILLED).long()))

    storage = new_storage()
    rb = T.TensorDictReplayBuffer(storage=storage)
    model = extended(rb, rows(FILLED))
    dest = tmp_path / "checkpoint"
    storage.dumps(dest)
    apply_updates(rb, model)
    assert_equal(rb[:], model)
    storage.dumps(dest)  # incremental: only the rows marked as written since the first dump
    fresh = new_storage()
    fresh.loads(dest)
    assert_equal(fresh.get(slice(None)), model)


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("remembered", [True, False], ids=["remembered", "read-back"])
def test_edits_of_the_tensors_themselves_reach_incremental_checkpoints(kind, remembered, location,
                                                                       tmp_path):
    """Writes into the container's tensors (or a local memmap's file views), which no
    storage.set sees: a second dump carried the first dump's chunks over, so the edits were
    lost (TorchRL's checkpoint holds them). "read-back": the first generation's digests are
    not remembered (another process made it), so they are read from it."""
    import checkpoint

    if kind == "LazyTensorStorage":
        storage = zt.LazyTensorStorage(CAPACITY)
    else:  # a local raw buffer, whose slices are views of its chunk files
        storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=str(tmp_path / "rb"))
    rb = T.TensorDictReplayBuffer(storage=storage)
    storage.checkpointer = checkpoint.TensorStorageCheckpointer(chunks=8)  # after: rb sets one
    extended(rb, rows(FILLED))
    dest = zstore.StoreSpec.parse(location.new("ckpt"), location.options)
    first = storage.dumps(dest)
    storage._storage["obs"][3] = 999.0                   # a tensor of the container
    storage[40:41]["obs"].fill_(777.0)                   # a view of a slice
    storage._storage["next", "reward"][FILLED - 1].mul_(2)
    if not remembered:
        checkpoint._buffer._KNOWN.clear()
    second = storage.dumps(dest)
    assert second.incremental and second.bytes_written < first.bytes_written // 4  # 3 chunks
    fresh = zt.LazyTensorStorage(CAPACITY)
    fresh.loads(dest)
    assert_equal(fresh.get(slice(None)), storage.get(slice(None)))
    assert fresh.get(3)["obs"].tolist() == [999.0] * 3 and fresh.get(40)["obs"][0] == 777.0


def test_a_storage_loaded_from_a_bucket_dumps_back_without_reading_it_again(s3_bucket, s3_options,
                                                                          monkeypatch):
    """The load records the digests of the rows it read: the first dump after it compares
    with them, where it downloaded the whole previous generation to compare."""
    import checkpoint

    source = zt.LazyTensorStorage(CAPACITY)
    source.checkpointer = checkpoint.TensorStorageCheckpointer(chunks=8)
    source.set(torch.arange(FILLED), rows(FILLED))
    dest = zstore.StoreSpec.parse(f"s3://{s3_bucket}/loaded-{np.random.randint(1 << 30)}",
                                  s3_options)
    first = source.dumps(dest)
    resumed = zt.LazyTensorStorage(CAPACITY)
    resumed.checkpointer = checkpoint.TensorStorageCheckpointer(chunks=8)
    resumed.loads(dest)
    resumed._storage["obs"][3] = 999.0  # in place: only the digests see it

    def read_back(*args, **kwargs):
        raise AssertionError("the dump read the previous generation back")

    monkeypatch.setattr(checkpoint._buffer._GenerationReader, "read", read_back)
    second = resumed.dumps(dest)
    monkeypatch.undo()
    assert second.incremental and second.bytes_written < first.bytes_written // 4
    again = zt.LazyTensorStorage(CAPACITY)
    again.loads(dest)
    assert_equal(again.get(slice(None)), resumed.get(slice(None)))
    assert again.get(3)["obs"].tolist() == [999.0] * 3


#: Index assignments as TorchRL's ``test_storage_inplace_writing_ndim`` makes them: into
#: ``rb[:]`` of an ``ndim=2`` buffer extended along time (``dim_extend=1``), which TorchRL
#: reads as ``storage[:, :]`` transposed to ``[lanes, time]``.
def index_assignments(rb) -> None:
    def cells(n: int, lanes: int = 0) -> TensorDict:
        out = TensorDict({"obs": torch.full((n, 3), -1.0), "action": torch.zeros(n).long(),
                          ("next", "reward"): torch.full((n, 1), 0.5).double(),
                          ("next", "done"): torch.ones(n, 1, dtype=torch.bool)}, [n])
        return out.expand(lanes, n) if lanes else out

    rb[0, 3:4] = cells(1)
    rb[1, 5:6] = cells(1)
    rb[:, 7:8] = cells(1, 2)
    rb[:, 10:20] = cells(10)  # broadcast over the lanes
    rb[:][1, 21:23].set_("action", torch.full((2,), 9))  # an in-place update of a view
    rb[:][0].set_at_("obs", torch.full((3,), 4.0), 40)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_index_assignments_of_a_2d_buffer_are_stored(location, codec, tmp_path):
    """``rb[lane, t0:t1] = td`` (and an update of such a view) lands, as in TorchRL's memmap:
    it was lost on every store before (the view was a copy)."""
    url = location.new()
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options,
                                   codec=codec, ndim=2)
    rb = T.ReplayBuffer(storage=storage)
    reference = T.ReplayBuffer(storage=T.LazyMemmapStorage(
        CAPACITY, ndim=2, scratch_dir=str(tmp_path / "torchrl")))
    data = rows(2 * 50).reshape(2, 50)  # two lanes of 50 steps
    for buffer in (rb, reference):
        buffer.extend(data.clone())
        index_assignments(buffer)
    want = reference[:].to_tensordict()
    assert not torch.equal(want["action"], data["action"])  # the updates changed the rows
    assert_equal(rb[:], want)
    assert len(rb) == len(reference) and rb._writer._cursor == reference._writer._cursor
    storage.flush()
    again = zstore.open(url, location.options, mode="r")
    assert_equal(again.get(slice(None)).transpose(0, 1), want)


def test_index_assignments_of_an_in_ram_2d_buffer_reach_incremental_checkpoints(tmp_path):
    storage = zt.LazyTensorStorage(CAPACITY, ndim=2)
    rb = T.ReplayBuffer(storage=storage)
    reference = T.ReplayBuffer(storage=T.LazyTensorStorage(CAPACITY, ndim=2))
    data = rows(2 * 50).reshape(2, 50)
    rb.extend(data.clone())
    reference.extend(data.clone())
    dest = tmp_path / "checkpoint"
    storage.dumps(dest)
    index_assignments(rb)
    index_assignments(reference)
    storage.dumps(dest)  # incremental: only the rows marked as written since the first dump
    fresh = zt.LazyTensorStorage(CAPACITY, ndim=2)
    fresh.loads(dest)
    assert_equal(fresh.get(slice(None)).transpose(0, 1), reference[:])


def tensor_assignments(rb) -> None:
    """TorchRL's ``rb[i, j] = x`` of a buffer of plain tensors is ``rb[:][i, j] = x``."""
    rb[1, 0] = torch.tensor(99.0)
    rb[2:4, 1] = torch.tensor(7.0)
    rb[:][5, 1] = -1.0
    rb[:].transpose(0, 1)[0, 6] = 42.0  # into a view of the slice
    rb[torch.tensor([8, 9]), 0] = torch.tensor(3.0)  # an index of tensors
    rb[:][0:2, 0:2] = 0.0


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("store", ["in RAM", "raw", "zstd"])
def test_index_assignments_of_plain_tensors_are_stored_as_torchrl_stores_them(location, store,
                                                                              ndim, tmp_path):
    """A buffer of plain tensors: ``rb[1, 0] = x`` was lost (silently) on every
    ``LazyMemmapStorage`` of ``ndim=2`` and, of ``ndim=1``, on every store but a local raw
    one: ``rb[:]`` was a copy. It lands now, and is committed, as in TorchRL's storages."""
    def fill(rb):
        values = torch.arange(CAPACITY * 3.0).view(-1, 3)[:60]
        rb.extend(values.view(2, 30, 3).transpose(0, 1) if ndim == 2 else values)

    url = location.new()
    storage = (zt.LazyTensorStorage(CAPACITY, ndim=ndim) if store == "in RAM" else
               zt.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options,
                                    codec=None if store == "raw" else "zstd", ndim=ndim))
    ours, theirs = T.ReplayBuffer(storage=storage), T.ReplayBuffer(storage=T.LazyMemmapStorage(
        CAPACITY, ndim=ndim, scratch_dir=str(tmp_path / "torchrl")))
    for rb in (ours, theirs):
        fill(rb)
        before = rb[:].clone()
        tensor_assignments(rb)
    want = theirs[:].clone()
    assert not torch.equal(want, before)  # (the assignments changed the rows)
    assert torch.equal(ours[:], want)
    if store != "in RAM":
        storage.flush()
        again = zstore.open(url, location.options, mode="r").get(slice(None))
        assert torch.equal(again.transpose(0, 1) if ndim == 2 else again, want)


@pytest.mark.parametrize("store", ["in RAM", "memory"])
def test_a_slice_of_plain_tensors_compiles_and_a_read_only_one_is_the_reader_s(store, tmp_path):
    """The slice that stores its assignments is the copy only (in RAM it is views, which
    store them anyway): ``torch.compile`` of code over ``rb[:]`` raised a RecursionError on
    every store, and an edit of a read-only store's slice (a reader normalising its copy)
    raised ReadOnlyError."""
    url = f"memory://zstore-tests/compiled-{tmp_path.name}"
    storage = zt.LazyTensorStorage(16) if store == "in RAM" else \
        zt.LazyMemmapStorage(16, scratch_dir=url)
    rb = T.ReplayBuffer(storage=storage)
    rb.extend(torch.arange(20.0).view(10, 2))
    twice = torch.compile(lambda rows: (rows * 2).sum(), backend="eager")
    assert twice(rb[:]).item() == 380.0
    if store == "memory":
        storage.flush()
        copy = zstore.torchrl.open(url, mode="r").get(slice(None))
        copy[:, 0] -= 5  # the reader's own copy
        assert copy[0].tolist() == [-5.0, 1.0] and rb[0].tolist() == [0.0, 1.0]
