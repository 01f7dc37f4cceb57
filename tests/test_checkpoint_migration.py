"""Migration from TorchRL checkpoints, CompressedListStorage and StorageEnsemble checkpoints.

TorchRL checkpoints are written by TorchRL 0.14.1 itself; zstore must load
what TorchRL's own ``loads`` restores (where TorchRL is right) — without
unpickling anything.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tensordict import TensorDict
from test_checkpoint import TEDStream, assert_same, spec

import zstore
from checkpoint import (
    CheckpointError,
    StorageEnsembleCheckpointer,
    TensorStorageCheckpointer,
)
from zstore import CompressedListStorage, LazyMemmapStorage, LazyTensorStorage

trl = pytest.importorskip("torchrl.data")


def torchrl_checkpoint(tmp_path, checkpointer, sizes, capacity=12, lanes=()):
    """A TorchRL storage filled through a TorchRL buffer, dumped with ``checkpointer``;
    returns the checkpoint path and what TorchRL's own loads restores."""
    import logging

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    ndim = 1 + len(lanes)
    storage = trl.LazyMemmapStorage(capacity, ndim=ndim)
    rb = trl.ReplayBuffer(storage=storage, batch_size=2)
    if checkpointer is not None:
        rb.storage.checkpointer = checkpointer()
    stream = TEDStream(lanes, seed=4)
    for n in sizes:
        batch = stream.batch(n)
        rb.extend(batch.transpose(0, 1) if lanes else batch)  # a [B, T] batch for ndim=2
    path = tmp_path / "torchrl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rb.storage.dumps(path)
        back = trl.LazyMemmapStorage(capacity, ndim=ndim)
        if checkpointer is not None:
            back.checkpointer = checkpointer()
        back.loads(path)
    return path, back, storage


@pytest.mark.parametrize("sizes", [[5, 4], [7, 9]], ids=["partial", "wrapped"])
def test_torchrl_tensor_storage_checkpoint(tmp_path, sizes):
    path, back, original = torchrl_checkpoint(tmp_path, None, sizes)
    ours = LazyTensorStorage(12)
    ours.loads(path)
    assert len(ours) == len(back) == len(original)
    assert_same(ours.get(slice(None)), back.get(slice(None)).to_tensordict())


def test_torchrl_ndim2_checkpoint(tmp_path):
    path, back, _ = torchrl_checkpoint(tmp_path, None, [3, 2], capacity=12, lanes=(3,))
    ours = LazyTensorStorage(12, ndim=2)
    ours.loads(path)
    assert ours.shape == back.shape and len(ours) == len(back)
    assert_same(ours.get(slice(None)), back.get(slice(None)).to_tensordict())


@pytest.mark.parametrize("name", ["H5StorageCheckpointer", "FlatStorageCheckpointer",
                                  "NestedStorageCheckpointer"])
def test_torchrl_ted_checkpoints(tmp_path, name):
    path, back, original = torchrl_checkpoint(tmp_path, getattr(trl, name), [5, 4])
    ours = LazyTensorStorage(12)
    ours.loads(path)          # the default checkpointer recognises every TorchRL layout
    assert len(ours) == len(back) == 9 and ours._last_cursor_index == 8
    written = slice(0, 9)     # TorchRL's rows past the cursor are garbage: compare written rows
    assert_same(ours.get(written), back.get(written).to_tensordict())
    assert_same(ours.get(written), original.get(written).to_tensordict())


def test_torchrl_pytree_checkpoint(tmp_path):
    storage = trl.LazyTensorStorage(6)
    data = {"a": torch.arange(4), "b": (torch.ones(4, 2), torch.arange(4.0))}
    storage.set(torch.arange(4), data)
    storage.dumps(tmp_path / "pt")
    with pytest.raises(RuntimeError, match="non-initialized pytree"):
        LazyTensorStorage(6).loads(tmp_path / "pt")
    ours = LazyTensorStorage(6)
    ours.set(0, {"a": torch.tensor(0), "b": (torch.zeros(2), torch.tensor(0.0))})
    ours.loads(tmp_path / "pt")
    got = ours.get(slice(None))
    assert len(ours) == 4 and torch.equal(got["a"], data["a"]) and torch.equal(got["b"][0], data["b"][0])


def test_pickled_entries_are_refused(tmp_path):
    path, _, _ = torchrl_checkpoint(tmp_path, None, [3])
    meta = json.loads((path / "meta.json").read_text())
    meta["blob"] = {"type": "NonTensorData"}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "blob").mkdir()
    (path / "blob" / "meta.json").write_text(json.dumps({"_type": "NonTensorData", "is_pickled": True}))
    (path / "blob" / "other.pickle").write_bytes(b"\x80\x04N.")
    with pytest.raises(CheckpointError, match="'blob'.*pickle"):
        LazyTensorStorage(12).loads(path)


# -- CompressedListStorage ----------------------------------------------------------------

def test_compressed_list_storage_round_trip(location):
    source = CompressedListStorage(20)
    items = [TensorDict(pixels=torch.randint(0, 255, (2 + i % 3, 8, 8), dtype=torch.uint8),
                        reward=torch.tensor(float(i)), batch_size=[]) for i in range(7)]
    for i, item in enumerate(items):
        source.set(i, item)
    dest = spec(location, "cls")
    source.dumps(dest)
    target = CompressedListStorage(20)
    target.loads(dest)
    assert len(target) == 7
    for i, item in enumerate(items):
        assert_same(target.get(i), item)
    source.set(7, items[0])
    source.dumps(dest)       # a second checkpoint replaces the first atomically
    target.loads(dest)
    assert len(target) == 8 and torch.equal(target.get(7)["pixels"], items[0]["pixels"])
    with pytest.raises(RuntimeError, match="empty"):
        CompressedListStorage(5).dumps(spec(location, "empty"))
    with pytest.raises(CheckpointError, match="max_size"):
        CompressedListStorage(10).loads(dest)


# -- StorageEnsemble ------------------------------------------------------------------------

class StandIn(zstore.Storage):
    """Minimal stand-in for zstore.StorageEnsemble (written on another branch): its
    checkpoint-relevant surface is TorchRL's ``_storages`` and ``_transforms``."""

    _default_checkpointer = "StorageEnsembleCheckpointer"

    def __init__(self, *storages, transforms=None):
        super().__init__(sum(s.max_size for s in storages))
        self._storages = list(storages)
        self._transforms = transforms or [None] * len(storages)

    def __len__(self):
        return len(self._storages)


def test_storage_ensemble_round_trip(location):
    ensemble_cls = getattr(zstore, "StorageEnsemble", StandIn)
    stream = TEDStream(seed=8)

    def members():
        return (LazyTensorStorage(40),
                LazyMemmapStorage(30, scratch_dir=location.new("m"), storage_options=location.options),
                LazyTensorStorage(10))

    source = ensemble_cls(*members())
    source._storages[0].set(torch.arange(40), stream.batch(40))
    source._storages[1].set(torch.arange(12), stream.batch(12))
    dest = spec(location, "ens")
    source.dumps(dest)
    target = ensemble_cls(*members())
    target.loads(dest)
    for mine, theirs in zip(target._storages[:2], source._storages[:2]):
        assert len(mine) == len(theirs)
        assert_same(mine.get(slice(None)), theirs.get(slice(None)))
    assert len(target._storages[2]) == 0          # the empty member stays empty
    source._storages[0][5] = stream.batch(1)[0]   # change one row of one member
    result = source.dumps(dest)
    record = TensorStorageCheckpointer()._dest(dest).read_commit()
    assert record["records"]["0"]["incremental"] and record["empty_members"] == [2]
    assert sorted(result.members) == [0, 1] and result.members[0].incremental
    assert result.bytes_written == sum(r["bytes_written"] for r in record["records"].values())
    target.loads(dest)
    assert_same(target._storages[0].get(slice(None)), source._storages[0].get(slice(None)))
    assert isinstance(source.checkpointer, StorageEnsembleCheckpointer)
    with pytest.raises(CheckpointError, match="3 members"):
        ensemble_cls(LazyTensorStorage(4)).loads(dest)


@pytest.mark.parametrize("last", ["another capacity", "a CompressedListStorage", "a ListStorage"])
def test_an_ensemble_checkpoint_that_does_not_fit_loads_no_member(location, last):
    """Loading an ensemble checkpoint checked the member count only, then loaded member
    after member: one whose last member did not fit (another capacity or kind, a
    ListStorage, which has no checkpoint to load) replaced the first member's rows
    (in its store too), emptied the members recorded empty, and then raised."""
    stream = TEDStream(seed=9)
    source = zstore.StorageEnsemble(LazyTensorStorage(10), LazyTensorStorage(10), LazyTensorStorage(10))
    source._storages[0].set(torch.arange(3), stream.batch(3))
    source._storages[2].set(torch.arange(4), stream.batch(4))
    dest = spec(location, "ens")
    source.dumps(dest)
    first = LazyMemmapStorage(10, scratch_dir=location.new("first"), storage_options=location.options)
    first.set(torch.arange(2), stream.batch(2))
    first.flush()
    before = first.get(slice(None))
    empty = LazyTensorStorage(10)  # recorded empty: emptied at the load
    empty.set(torch.arange(5), stream.batch(5))
    odd = {"another capacity": LazyTensorStorage(20), "a CompressedListStorage":
           CompressedListStorage(10), "a ListStorage": zstore.ListStorage(10)}[last]
    target = zstore.StorageEnsemble(first, empty, odd)
    with pytest.raises(CheckpointError, match="member 2.*nothing was loaded"):
        target.loads(dest)
    assert len(first) == 2 and len(empty) == 5
    assert_same(first.get(slice(None)), before)
    again = zstore.open(first.scratch_dir, location.options, mode="r")
    assert_same(again.get(slice(None)), before)
    first.close()
