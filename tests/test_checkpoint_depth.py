"""Checkpoints used as users do, where they used to lose data silently.

The reference is the storage before the dump: a checkpoint loads back bit for bit, or
fails with a ``CheckpointError`` naming what is wrong (as TorchRL's own checkpoints fail
when one of their files is missing); never with rows silently replaced by zeros.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage as TorchRLLazyTensorStorage

from checkpoint import (
    CheckpointError,
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    NestedStorageCheckpointer,
    TensorStorageCheckpointer,
)
from test_checkpoint import TEDStream, assert_same, fill, spec
from zstore import LazyTensorStorage
from zstore.processes import process_tag

#: Checkpointers whose generations are Zarr chunk objects (H5 is one file).
CHUNKED = {
    "raw": lambda: TensorStorageCheckpointer(chunks=4),
    "zstd": lambda: TensorStorageCheckpointer(chunks=4, codec="zstd"),
    "flat": FlatStorageCheckpointer,
    "nested": NestedStorageCheckpointer,
}


def _dumped(name: str, dest) -> LazyTensorStorage:
    """A wrapped TED storage (12 rows) dumped at ``dest`` with checkpointer ``name``."""
    storage = LazyTensorStorage(12)
    storage.checkpointer = CHUNKED[name]()
    fill(storage, "full", TEDStream())
    storage.dumps(dest)
    return storage


def _loaded(name: str, dest) -> LazyTensorStorage:
    again = LazyTensorStorage(12)
    again.checkpointer = CHUNKED[name]()
    again.loads(dest)
    return again


def _chunk_objects(dest, key: str) -> list[str]:
    """The chunk objects of array ``key`` (e.g. ``"obs"``) in the checkpoint at ``dest``."""
    fs, root = dest.filesystem()
    return sorted(path for path in fs.find(root)
                  if f"/{key}/c" in path and not path.endswith("zarr.json"))


@pytest.mark.parametrize("name", CHUNKED)
def test_a_missing_chunk_object_fails_the_load_instead_of_reading_zeros(location, name):
    dest = spec(location, "ck")
    storage = _dumped(name, dest)
    assert_same(_loaded(name, dest)._storage, storage._storage)  # intact: bit for bit
    fs, _ = dest.filesystem()
    lost = _chunk_objects(dest, "obs")[0]
    fs.rm_file(lost)  # a partial copy of the checkpoint, a deleted file
    with pytest.raises(CheckpointError, match="is missing: the checkpoint is damaged") as caught:
        _loaded(name, dest)
    assert lost.rsplit("/", 3)[-1] in str(caught.value)


def test_a_corrupt_compressed_chunk_names_the_checkpoint_and_the_key(location):
    """Flipped bytes in a zstd chunk fail the load naming the checkpoint, the key and the rows
    (the error named the key alone: not which of a run's checkpoints was damaged)."""
    dest = spec(location, "ck")
    _dumped("zstd", dest)
    fs, _ = dest.filesystem()
    damaged = next(path for path in _chunk_objects(dest, "obs")
                   if re.search(r"/gen-[^/]+/obs/c", path))  # not next/obs's
    data = bytearray(fs.cat_file(damaged))
    data[8:24] = bytes(b ^ 0xFF for b in data[8:24])
    fs.pipe_file(damaged, bytes(data))
    with pytest.raises(CheckpointError) as caught:
        _loaded("zstd", dest)
    message = str(caught.value)
    assert dest.url in message and "of key 'obs'" in message, message
    assert message.endswith("the checkpoint is damaged (a chunk does not decode): load an "
                            "intact copy"), message


def test_an_h5_dump_to_a_store_deletes_the_temporary_files_of_killed_ones(location):
    """An H5 dump to a remote store writes its file in the temporary directory first; one
    killed there left it (as large as the checkpoint) for good. The next dump of that file
    deletes those of processes that are gone (a tag of an earlier zstore, without the pid
    namespace, or with it left empty, included), and keeps a running dump's."""
    if location.kind == "local":
        pytest.skip("a local dump's temporary file is in its directory (test_checkpoint_crash)")
    gone = subprocess.run([sys.executable, "-c", "from zstore.processes import process_tag; "
                           "print(process_tag())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    scratch = Path(tempfile.gettempdir())
    left = scratch / f".checkpoint.h5.{gone}.a1b2c3.partial"
    earlier = scratch / f".checkpoint.h5.{gone.rsplit('@', 1)[0]}.b2c3d4.partial"  # no namespace
    untold = scratch / f".checkpoint.h5.{gone.rsplit('@', 1)[0]}@.c3d4e5.partial"  # not told
    running = scratch / f".checkpoint.h5.{process_tag()}.d4e5f6.partial"
    left.write_bytes(b"\0" * 1024)
    earlier.write_bytes(b"\0" * 1024)
    untold.write_bytes(b"\0" * 1024)
    running.touch()
    try:
        storage = LazyTensorStorage(12)
        storage.checkpointer = H5StorageCheckpointer()
        fill(storage, "full", TEDStream())
        storage.dumps(spec(location, "h5"))
        assert not left.exists() and not earlier.exists() and not untold.exists()
        assert running.exists()
    finally:
        for path in (left, earlier, untold, running):
            path.unlink(missing_ok=True)


@pytest.mark.parametrize("name", CHUNKED)
def test_all_zero_rows_round_trip(tmp_path, name):
    """Chunks of zeros are stored too (zarr skips them by default): they load as zeros."""
    storage = _dumped(name, tmp_path / "first")
    storage.set(torch.arange(8), torch.zeros_like(storage[torch.arange(8)]))
    storage.dumps(tmp_path / "ck")
    assert_same(_loaded(name, tmp_path / "ck")._storage, storage._storage)


@pytest.mark.parametrize("name", CHUNKED)
def test_a_missing_array_is_named(tmp_path, name):
    """Flat and Nested loaded the checkpoint without the key (its rows gone, no error)."""
    _dumped(name, tmp_path / "ck")
    (array_meta,) = tmp_path.glob("ck/gen-*/obs/zarr.json")
    array_meta.unlink()
    with pytest.raises(CheckpointError, match=r"the array of key 'obs' \(obs/zarr.json\) is missing"):
        _loaded(name, tmp_path / "ck")


@pytest.mark.parametrize("name", CHUNKED)
@pytest.mark.parametrize("lost", ["zarr.json", "generation"])
def test_a_missing_generation_says_the_checkpoint_is_damaged(tmp_path, name, lost):
    """It said "not a zstore buffer" (Tensor) or raised zarr's GroupNotFoundError (Flat,
    Nested), naming neither the checkpoint's damage nor the fix."""
    import shutil

    _dumped(name, tmp_path / "ck")
    (generation,) = tmp_path.glob("ck/gen-*")
    if lost == "zarr.json":
        (generation / "zarr.json").unlink()
    else:
        shutil.rmtree(generation)
    with pytest.raises(CheckpointError, match="the committed generation .* is missing: the "
                                              "checkpoint is damaged"):
        _loaded(name, tmp_path / "ck")


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_compressed_list_checkpoint_fails_the_load(location, damage):
    """A CompressedListStorage checkpoint that lost a chunk loaded it as zeros (and one cut
    short failed only at a later read, naming a memory:// URL of the storage's own)."""
    from zstore import CompressedListStorage

    storage = CompressedListStorage(10)
    for i in range(6):
        storage.set(i, TensorDict(obs=torch.full((3,), float(i + 1)), reward=torch.ones(1)))
    dest = spec(location, "cls")
    storage.dumps(dest)
    again = CompressedListStorage(10)
    again.loads(dest)
    assert [again.get(i)["obs"][0].item() for i in range(6)] == [1, 2, 3, 4, 5, 6]
    fs, _ = dest.filesystem()
    chunk = next(path for path in sorted(fs.find(dest.filesystem()[1]))
                 if "/obs/c" in path and not path.endswith("zarr.json"))
    if damage == "deleted":
        fs.rm_file(chunk)
    else:
        fs.pipe_file(chunk, fs.cat_file(chunk)[:5])
    with pytest.raises(CheckpointError, match="the checkpoint is damaged") as caught:
        CompressedListStorage(10).loads(dest)
    assert chunk.rsplit("/", 4)[-1] in str(caught.value)


@pytest.mark.parametrize(("location", "first"), [
    ("memory", "tensor"), ("local", "tensor"), ("s3", "tensor"), ("local", "torchrl")],
    indirect=["location"])
def test_h5_dump_refuses_a_directory_holding_another_checkpoint(location, first):
    """An H5 file written next to another checkpoint would not replace it: every loader
    but H5's would go on loading the old rows. Refused, as the reverse is, and unchanged."""
    dest = spec(location, "ck")
    if first == "torchrl":  # TorchRL writes local directories only
        trl = TorchRLLazyTensorStorage(12)
        fill(trl, "full", TEDStream())
        trl.dumps(Path(dest.url))
    else:
        _dumped("raw", dest)
    before = LazyTensorStorage(12)
    before.loads(dest)
    storage = LazyTensorStorage(12)
    storage.checkpointer = H5StorageCheckpointer()
    fill(storage, "partial", TEDStream(seed=1))
    with pytest.raises(CheckpointError, match=f"^{re.escape(dest.redacted())} holds "):
        storage.dumps(dest)
    after = LazyTensorStorage(12)
    after.loads(dest)
    assert_same(after._storage, before._storage)
    assert len(after) == len(before)


@pytest.mark.parametrize("name", ["raw", "zstd"])
def test_incremental_dump_rewrites_chunks_its_previous_generation_lost(location, name):
    """Carried-over chunks come from the previous generation: one it lost is written
    from the storage's rows, not left out of the new generation."""
    dest = spec(location, "ck")
    storage = _dumped(name, dest)
    fs, _ = dest.filesystem()
    fs.rm_file(_chunk_objects(dest, "obs")[0])
    storage.set(torch.tensor([11]), storage[torch.tensor([0])])  # one changed chunk
    assert storage.dumps(dest).incremental
    assert_same(_loaded(name, dest)._storage, storage._storage)
