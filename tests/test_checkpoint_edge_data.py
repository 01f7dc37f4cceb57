"""Checkpoints of edge-case data, each against TorchRL's own storages as the reference.

* keys with a zero-size dim (rows of shape ``(0, 3)``): dumped and loaded by zstore's
  storages at every location, and zstore loads TorchRL's dump of them (TorchRL writes no
  file for an empty tensor);
* rows written from tensors that require grad: ``loads`` (raw, the default codec) into
  the in-RAM storage holding them works, as TorchRL's does.
"""

from __future__ import annotations

import fsspec
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import StoreSpec

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")

CAPACITY = 10

#: zstore storages with a zero-size key: name -> factory(location)
ZSTORE_STORAGES = {
    "tensor": lambda location: zstore.LazyTensorStorage(CAPACITY),
    "memmap": lambda location: location.memmap(CAPACITY),
    "memmap-zstd": lambda location: location.memmap(CAPACITY, codec="zstd"),
}


def zero_size_rows(n: int, start: int = 0) -> TensorDict:
    """``n`` rows with keys of zero size (top-level and nested) beside ordinary ones."""
    b = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(a=torch.zeros(n, 0, 3), b=b,
                      nested=TensorDict(empty=torch.zeros(n, 2, 0, dtype=torch.int64), c=-b,
                                        batch_size=[n]),
                      batch_size=[n])


def assert_same_rows(ours, theirs, written: int) -> None:
    """Same length, and the first ``written`` rows equal key by key (shape, dtype, values;
    TorchRL counts rows never written in its length, their values are undefined)."""
    assert len(ours) == len(theirs)
    rows = torch.arange(written)
    got, want = ours.get(rows), theirs.get(rows)
    keys = set(want.keys(include_nested=True, leaves_only=True))
    assert set(got.keys(include_nested=True, leaves_only=True)) == keys
    for key in keys:
        x, y = got.get(key), want.get(key)
        assert (x.shape, x.dtype) == (y.shape, y.dtype), key
        assert torch.equal(x.detach(), y.detach()), key


def spec(location, name: str) -> StoreSpec:
    """A new destination at ``location``."""
    return StoreSpec.parse(location.new(name), location.options)


def upload(local_dir, location, name: str) -> StoreSpec:
    """A copy of the local directory ``local_dir`` at a new destination at ``location``."""
    dest = spec(location, name)
    fs, root = fsspec.core.url_to_fs(dest.url, **location.options)
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        fs.pipe_file(f"{root}/{path.relative_to(local_dir).as_posix()}", path.read_bytes())
    return dest


@pytest.mark.parametrize("kind", sorted(ZSTORE_STORAGES))
def test_zero_size_key_round_trips_as_torchrl(location, tmp_path, kind):
    """Before: dumps failed locally (memoryview cannot cast a view with zeros in its shape)
    and a memory:// / S3 dump succeeded but could not be loaded (could not broadcast)."""
    theirs, ours = T.LazyTensorStorage(CAPACITY), ZSTORE_STORAGES[kind](location)
    dest = spec(location, "ck")
    for storage in (theirs, ours):
        storage.set(torch.arange(7), zero_size_rows(7))
    theirs.dumps(tmp_path / "torchrl")
    ours.dumps(dest)
    for storage in (theirs, ours):  # an incremental dump: rows 0..2 changed, the rest carried over
        storage.set(torch.arange(3), zero_size_rows(3, start=100))
    theirs.dumps(tmp_path / "torchrl")
    assert ours.dumps(dest).incremental

    theirs_again = T.LazyTensorStorage(CAPACITY)
    theirs_again.loads(tmp_path / "torchrl")
    for ours_again in (ZSTORE_STORAGES[kind](location), ours):  # a new storage, the filled one
        ours_again.loads(dest)
        assert_same_rows(ours_again, theirs_again, 7)
        assert ours_again.get(torch.arange(7))["a"].shape == (7, 0, 3)


#: key names that fsspec's cat / copy / rm read as glob patterns
GLOB_KEYS = ("obs[0]", "*", "a?b")


def glob_rows(n: int, start: int = 0) -> TensorDict:
    """``n`` rows whose key names hold glob characters (top-level and nested)."""
    values = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict({**{key: values + i for i, key in enumerate(GLOB_KEYS)},
                       "nest[1]": TensorDict({"*": -values}, batch_size=[n])}, batch_size=[n])


@pytest.mark.parametrize("kind", ["memmap", "memmap-zstd", "compressed"])
def test_keys_with_glob_characters_round_trip_through_checkpoints(location, tmp_path, kind):
    """Before: fsspec's cat and copy read such keys as patterns. A memory:// or S3 dump
    committed and no load could read it; an incremental dump to memory:// deleted the
    loadable generation and committed one without the key's arrays; a
    CompressedListStorage's dump failed or committed unloadable."""
    theirs = T.LazyTensorStorage(CAPACITY)
    ours = (location.compressed(CAPACITY) if kind == "compressed"
            else ZSTORE_STORAGES[kind](location))
    dest = spec(location, "ck")
    for storage in (theirs, ours):
        storage.set(torch.arange(7), glob_rows(7))
    ours.dumps(dest)
    for storage in (theirs, ours):  # a second dump: incremental for the memmap storages
        storage.set(torch.arange(3), glob_rows(3, start=100))
    ours.dumps(dest)
    again = (location.compressed(CAPACITY) if kind == "compressed"
             else ZSTORE_STORAGES[kind](location))
    again.loads(dest)
    assert len(again) == len(ours)
    got = again.get(torch.arange(7))
    got = torch.stack(got) if isinstance(got, list) else got  # (a list storage's items)
    want = theirs.get(torch.arange(7))
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("kind", sorted(ZSTORE_STORAGES))
def test_zero_size_key_of_a_torchrl_dump_loads(location, tmp_path, kind):
    """Before: zstore refused TorchRL's dump of such a buffer ("a.memmap is missing"):
    TorchRL writes no file for an empty tensor."""
    theirs = T.LazyTensorStorage(CAPACITY)
    theirs.set(torch.arange(7), zero_size_rows(7))
    theirs.dumps(tmp_path / "torchrl")
    assert not (tmp_path / "torchrl" / "a.memmap").exists()  # what the loader must cope with
    theirs_again = T.LazyTensorStorage(CAPACITY)
    theirs_again.loads(tmp_path / "torchrl")

    dest = tmp_path / "torchrl" if location.kind == "local" else \
        upload(tmp_path / "torchrl", location, "torchrl")
    filled = ZSTORE_STORAGES[kind](location)
    filled.set(torch.arange(4), zero_size_rows(4, start=50))
    for ours in (ZSTORE_STORAGES[kind](location), filled):
        ours.loads(dest)
        assert_same_rows(ours, theirs_again, 7)


def test_zero_size_key_through_torchrl_replay_buffers(location, tmp_path):
    """Before: ``rb.dumps`` of a TorchRL buffer over a zstore storage failed (memoryview
    cast) where TorchRL's own buffer dumps and loads back."""
    zt = pytest.importorskip("zstore.torchrl")

    def memmap():
        return zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                    storage_options=location.options)

    theirs = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(CAPACITY))
    ours = T.TensorDictReplayBuffer(storage=memmap())
    for rb in (theirs, ours):
        rb.extend(zero_size_rows(5))
    theirs.dumps(tmp_path / "torchrl")
    url = location.new("ckpt")
    zt.dumps(ours, url, location.options)

    theirs_again = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(CAPACITY))
    theirs_again.loads(tmp_path / "torchrl")
    ours_again = T.TensorDictReplayBuffer(storage=memmap())
    zt.loads(ours_again, url, location.options)
    assert_same_rows(ours_again.storage, theirs_again.storage, 5)


def grad_rows(n: int, scale: float = 1.0) -> TensorDict:
    """``n`` rows whose float key requires grad (as a policy's output does)."""
    x = torch.linspace(-1, 1, n * 3).reshape(n, 3) * scale
    return TensorDict(a=x.requires_grad_(), b=torch.arange(n), batch_size=[n])


def test_loads_into_storage_holding_requires_grad_rows(location, tmp_path):
    """Before: ``loads`` into a zstore LazyTensorStorage holding such rows raised
    "Can't call numpy() on Tensor that requires grad" (TorchRL's loads them)."""
    theirs, ours = T.LazyTensorStorage(CAPACITY), zstore.LazyTensorStorage(CAPACITY)
    dest = spec(location, "ck")
    for storage in (theirs, ours):
        storage.set(torch.arange(6), grad_rows(6))
    theirs.dumps(tmp_path / "torchrl")
    ours.dumps(dest)
    for storage in (theirs, ours):  # the rows loads must replace
        storage.set(torch.arange(6), grad_rows(6, scale=5.0))
    theirs.loads(tmp_path / "torchrl")
    ours.loads(dest)
    assert_same_rows(ours, theirs, 6)
    assert ours._storage["a"].requires_grad == theirs._storage["a"].requires_grad



@pytest.mark.parametrize("checkpointer", ["TensorStorageCheckpointer", "FlatStorageCheckpointer",
                                          "H5StorageCheckpointer"])
def test_a_buffer_over_a_preallocated_tensor_storage_loads_its_dump(tmp_path, checkpointer):
    """A TensorDictReplayBuffer adds "index" to a TensorStorage built with the data's keys:
    loading its dump into the same fresh buffer was refused ("keys do not match: only in
    the checkpoint: ['index']"). TorchRL's loads it (its tensor checkpointer drops
    "index"; its Flat and H5 ones fail on it); zstore's keeps "index" too."""
    zt = pytest.importorskip("zstore.torchrl")

    def buffer(module):
        storage = module.TensorStorage(TensorDict(obs=torch.zeros(10, 3), batch_size=[10]))
        return T.TensorDictReplayBuffer(storage=storage, batch_size=4)

    def dumped_and_loaded(module, name):
        rb = buffer(module)
        rb.storage.checkpointer = getattr(module, name)()
        rb.extend(TensorDict(obs=torch.arange(18.).view(6, 3), batch_size=[6]))
        rb.dumps(tmp_path / module.__name__)
        again = buffer(module)
        again.storage.checkpointer = getattr(module, name)()
        again.loads(tmp_path / module.__name__)
        return rb, again

    before, ours = dumped_and_loaded(zt, checkpointer)
    _, theirs = dumped_and_loaded(T, "TensorStorageCheckpointer")
    assert len(ours) == len(theirs) == 10 and ours.writer._cursor == theirs.writer._cursor == 6
    assert torch.equal(ours[:]["obs"], theirs[:]["obs"])
    assert torch.equal(ours[:]["index"], before[:]["index"])
