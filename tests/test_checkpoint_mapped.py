"""Local loads map chunk files copy-on-write; generations key their chunks with "."; loads
window by window start every window on a chunk boundary of every key.

The reference is a plain copy of the data written (and, after writes to the loaded
storage, that copy with the same writes applied). The mapping is checked in
``/proc/self/maps``: a load that silently fell back to reading would pass the data
checks but fail those.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sys

import pytest
import torch
from tensordict import TensorDict

import checkpoint
import zstore
from checkpoint import CheckpointError, TensorStorageCheckpointer
from zstore import LazyTensorStorage, StoreSpec

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="chunk files are mapped on Linux only")

ROWS, CHUNK = 1000, 256  # 4 chunks per key, the last one partial


def data(rows: int = ROWS, seed: int = 0, lanes: tuple[int, ...] = ()) -> TensorDict:
    """Keys whose 256-row chunks are page-aligned (obs, flags, reward) and one that is not
    (odd: 12-byte rows, 3 KiB chunks)."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, *lanes)
    return TensorDict(
        obs=torch.randn((*shape, 4), generator=g),
        odd=torch.randn((*shape, 3), generator=g),
        next=TensorDict(done=torch.rand((*shape, 16), generator=g) < 0.5,
                        reward=torch.randn((*shape, 8), generator=g).to(torch.bfloat16),
                        batch_size=shape),
        batch_size=shape)


def dumped(tmp_path, lanes: tuple[int, ...] = ()) -> tuple[TensorDict, str]:
    source = LazyTensorStorage(ROWS * math.prod(lanes), ndim=1 + len(lanes))
    source.checkpointer = TensorStorageCheckpointer(chunks=CHUNK)
    written = data(lanes=lanes)
    source.set(torch.arange(ROWS), written)
    dest = str(tmp_path / "ck")
    source.dumps(dest)
    return written, dest


def loaded(dest: str, rows: int = ROWS, ndim: int = 1) -> LazyTensorStorage:
    storage = LazyTensorStorage(rows, ndim=ndim)
    storage.checkpointer = TensorStorageCheckpointer()
    storage.loads(dest)
    return storage


def generation_dir(dest: str) -> str:
    record = checkpoint._dest.Destination(StoreSpec.parse(dest)).read_commit()
    return os.path.join(dest, record["generation"])


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}


def assert_equal(a: TensorDict, b: TensorDict) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert a.get(key).dtype == b.get(key).dtype, key
        assert torch.equal(a.get(key), b.get(key)), key


@linux_only
@pytest.mark.parametrize("lanes", [(), (2,)], ids=["ndim1", "ndim2"])
def test_aligned_columns_are_mapped_and_copy_on_write(tmp_path, lanes):
    written, dest = dumped(tmp_path, lanes)
    cells = ROWS * math.prod(lanes)
    storage = loaded(dest, cells, 1 + len(lanes))
    assert_equal(storage.get(slice(None)), written)
    gen = generation_dir(dest)
    files = {f for f in mapped_files() if f.startswith(gen)}
    row_bytes = {"obs": 16, "next/done": 16, "next/reward": 16}
    for path, width in row_bytes.items():  # 256 rows x 16 B x lanes: whole pages
        assert CHUNK * width * math.prod(lanes) % 4096 == 0
        for i in range(4):
            assert os.path.join(gen, path, f"c.{i}" + ".0" * (2 + len(lanes) - 1)) in files, path
    assert not any(f.startswith(os.path.join(gen, "odd")) for f in files)  # 3 KiB chunks: read

    # writes land in private pages: the checkpoint's files do not change
    new = data(10, seed=1, lanes=lanes)
    storage.set(torch.arange(10), new)
    expected = written.clone()
    expected[:10] = new
    assert_equal(storage.get(slice(None)), expected)
    assert_equal(loaded(dest, cells, 1 + len(lanes)).get(slice(None)), written)

    # the checkpoint can go: the mapped pages stay readable
    shutil.rmtree(dest)
    gc.collect()
    assert_equal(storage.get(slice(None)), expected)


@linux_only
def test_single_tensor_storage_is_mapped(tmp_path):
    source = LazyTensorStorage(ROWS)
    source.checkpointer = TensorStorageCheckpointer(chunks=CHUNK)
    values = torch.randn(ROWS, 16)
    source.set(torch.arange(ROWS), values)
    source.dumps(tmp_path / "ck")
    storage = loaded(str(tmp_path / "ck"))
    assert torch.equal(storage.get(slice(None)), values)
    gen = generation_dir(str(tmp_path / "ck"))
    assert any(f.startswith(gen) for f in mapped_files())


@linux_only
def test_mapped_load_dumps_incrementally(tmp_path):
    written, dest = dumped(tmp_path)
    storage = loaded(dest)
    storage.checkpointer = TensorStorageCheckpointer(chunks=CHUNK)
    new = data(10, seed=2)
    storage.set(torch.arange(300, 310), new)  # inside chunk 1 only
    result = storage.dumps(dest)
    assert result.incremental
    assert result.bytes_written == CHUNK * sum(16 if k != "odd" else 12 for k in
                                               ("obs", "odd", "done", "reward"))
    expected = written.clone()
    expected[300:310] = new
    assert_equal(loaded(dest).get(slice(None)), expected)


@pytest.mark.parametrize("key", ["obs", "odd"], ids=["mapped", "read"])
def test_a_truncated_chunk_file_is_named(tmp_path, key):
    _, dest = dumped(tmp_path)
    chunk = os.path.join(generation_dir(dest), key, "c.1.0")
    with open(chunk, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(CheckpointError, match=r"c\.1\.0 holds 100 bytes.*damaged"):
        loaded(dest)


@pytest.mark.parametrize("key", ["obs", "odd"], ids=["mapped", "read"])
def test_a_missing_chunk_file_is_named(tmp_path, key):
    _, dest = dumped(tmp_path)
    chunk = os.path.join(generation_dir(dest), key, "c.2.0")
    os.remove(chunk)
    with pytest.raises(CheckpointError, match=f"{chunk} is missing: the checkpoint is damaged"):
        loaded(dest)


def test_a_missing_chunk_file_of_an_older_generation_reads_as_zeros(tmp_path):
    """Generations written before the commit record said every chunk is stored."""
    written, dest = dumped(tmp_path)
    commit = os.path.join(dest, "zarr.json")
    with open(commit) as handle:
        body = json.load(handle)
    del body["attributes"]["zstore_checkpoint"]["all_chunks_stored"]
    with open(commit, "w") as handle:
        json.dump(body, handle)
    for key in ("obs", "odd"):
        os.remove(os.path.join(generation_dir(dest), key, "c.2.0"))
    got = loaded(dest).get(slice(None))
    for key in ("obs", "odd"):
        assert not got[key][512:768].any()
        assert torch.equal(got[key][:512], written[key][:512])
        assert torch.equal(got[key][768:], written[key][768:])


def test_slash_keyed_generations_still_load_and_carry_over(tmp_path, monkeypatch):
    """Generations written before keys used "." (one directory per chunk)."""
    source = LazyTensorStorage(ROWS)
    source.checkpointer = TensorStorageCheckpointer(chunks=CHUNK)
    written = data()
    source.set(torch.arange(ROWS), written)
    dest = str(tmp_path / "ck")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint._buffer, "KEY_SEPARATOR", "/")
        source.dumps(dest)
    assert os.path.isfile(os.path.join(generation_dir(dest), "obs", "c", "3", "0"))
    assert_equal(loaded(dest).get(slice(None)), written)

    new = data(10, seed=3)
    source.set(torch.arange(10), new)
    result = source.dumps(dest)  # carried over: keeps the previous generation's keys
    assert result.incremental
    assert os.path.isfile(os.path.join(generation_dir(dest), "obs", "c", "3", "0"))
    written[:10] = new
    assert_equal(loaded(dest).get(slice(None)), written)
    assert_equal(zstore.open(generation_dir(dest), mode="r").get(slice(None)), written)

    source.dumps(tmp_path / "fresh")  # a new destination: "." keys
    assert os.path.isfile(os.path.join(generation_dir(str(tmp_path / "fresh")), "obs", "c.3.0"))


@pytest.mark.parametrize("chunks", [None, CHUNK], ids=["one-chunk", "chunked"])
def test_generations_open_as_buffers(tmp_path, chunks):
    """A generation is a zstore buffer: zstore.open reads its "."-keyed chunks through the
    local memory map (one chunk per key) and the chunk reader (several)."""
    source = LazyTensorStorage(ROWS)
    source.checkpointer = TensorStorageCheckpointer(chunks=chunks)
    written = data()
    source.set(torch.arange(ROWS), written)
    source.dumps(tmp_path / "ck")
    opened = zstore.open(generation_dir(str(tmp_path / "ck")), mode="r")
    assert_equal(opened.get(slice(None)), written)
    assert_equal(opened.get(torch.tensor([999, 0, 511, 256])), written[torch.tensor([999, 0, 511, 256])])


def test_loads_a_buffer_whose_keys_have_unaligned_chunk_lengths():
    """A plain zstore buffer whose keys' chunk lengths are not multiples of each other (7
    and 3 rows), loaded into a LazyMemmapStorage window by window: windows must start on a
    chunk boundary of every key."""
    url = "memory://zstore-tests/unaligned-" + os.urandom(4).hex()
    written = TensorDict(a=torch.arange(100.0)[:, None].expand(100, 4).clone(),
                         b=torch.arange(100)[:, None] * 10, batch_size=[100])
    source = zstore.LazyMemmapStorage(100, scratch_dir=url, chunks={"a": 7, "b": 3})
    source.set(torch.arange(100), written)
    source.flush()
    target = zstore.LazyMemmapStorage(100, scratch_dir=url + "-copy")
    target.checkpointer = TensorStorageCheckpointer()
    target.loads(url)
    assert_equal(target.get(slice(None)), written)


def test_an_initialised_storage_is_filled_in_place(tmp_path):
    """Loading into a storage that already has memory fills that memory (another process
    may share it, as TorchRL's in-place load allows): nothing is swapped for a mapping."""
    written, dest = dumped(tmp_path)
    storage = LazyTensorStorage(ROWS)
    storage.set(torch.arange(ROWS), data(seed=9))
    obs = storage._storage["obs"]  # a reference held elsewhere, e.g. a shared-memory view
    storage.loads(dest)
    assert storage._storage["obs"] is obs
    assert torch.equal(obs, written["obs"])
    assert_equal(storage.get(slice(None)), written)
