"""Cold reads decode their chunks on the shared pool (zstore.chunkio.decode_pool).

Behaviour, not timing: a cold multi-chunk ``get`` equals a list model on memory://,
local and S3; a corrupt chunk among several decoded at once still raises
CorruptChunkError naming key and chunk (and leaves no half-loaded slot); several
chunks decode on more than one thread, one chunk and small uncompressed chunks on none
of the pool's, large uncompressed ones are copied into their cache slots on it; a forked
child and a shut-down pool still read.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zstore
import zstore.blocks
import zstore.chunkio
from conftest import Location
from zstore import CorruptChunkError, StoreSpec
from zstore.chunkio import ColumnReader

N, PER_CHUNK = 48, 4


@pytest.fixture(autouse=True)
def parallel_small_reads(monkeypatch):
    """These stores are small: let every read of more than one chunk decode in parallel."""
    monkeypatch.setattr(zstore.blocks, "PARALLEL_BYTES", 0, raising=False)


def item(i: int) -> TensorDict:
    g = torch.Generator().manual_seed(i)
    return TensorDict(obs=torch.randint(0, 255, (4, 8, 8), dtype=torch.uint8, generator=g),
                      tokens=torch.arange(i % 5 + 1) * i,  # ragged: its length varies
                      a=torch.tensor(i), batch_size=[])


def written(location) -> tuple[str, list[TensorDict]]:
    """A committed CompressedListStorage of N items, ``PER_CHUNK`` a chunk; its URL and model."""
    url = location.new()
    storage = location.compressed(N, scratch_dir=url, chunks=PER_CHUNK)
    model = [item(i) for i in range(N)]
    for i, x in enumerate(model):
        storage.set(i, x)
    storage.close()
    return url, model


def local(tmp_path) -> Location:
    """A local directory as a Location (the tests that need one place only)."""
    return Location("local", str(tmp_path), {})


def cold(url, location):
    return zstore.open(url, location.options, mode="r")


def test_a_multi_chunk_cold_get_equals_the_list_model(location):
    url, model = written(location)
    idx = torch.tensor([45, 3, 3, 17, 0, 46, 29, 8, 40, 17, 22, 11])  # unsorted, repeated
    got = cold(url, location).get(idx)
    assert len(got) == len(idx)
    for k, x in zip(idx.tolist(), got):
        assert (x == model[k]).all(), k
    reader = cold(url, location)
    batch = zstore.stack_items(reader.get(torch.arange(N)))
    assert (batch["obs"] == torch.stack([x["obs"] for x in model])).all()
    assert batch["a"].tolist() == list(range(N))
    assert reader.cache_stats.loads >= N // PER_CHUNK  # every chunk of obs loaded once


def corrupt_chunk(url, location, chunk: int) -> tuple:
    """Flip a byte of the stored obs chunk ``chunk`` (its own object, or inside its shard:
    remote stores shard); returns (fs, path, original bytes)."""
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    reader = cold(url, location)._table.table.readers["obs"]
    shard = chunk // reader.per_shard
    path = next(p for p in fs.find(root) if f"/obs/c/{shard}/" in p)
    original = fs.cat_file(path)
    at = 7
    if reader.sharded:
        index = np.frombuffer(original[-(16 * reader.per_shard + 4):-4], dtype="<u8")
        at += int(index.reshape(-1, 2)[chunk % reader.per_shard, 0])
    fs.pipe_file(path, original[:at] + bytes([original[at] ^ 0x40]) + original[at + 1:])
    return fs, path, original


def test_a_corrupt_chunk_among_parallel_decodes_names_key_and_chunk(location):
    url, model = written(location)
    fs, path, original = corrupt_chunk(url, location, 5)
    reader = cold(url, location)
    with pytest.raises(CorruptChunkError, match=r"'obs', chunk 5"):
        reader.get(torch.arange(N))  # 12 chunks of obs, decoded at once
    fs.pipe_file(path, original)
    got = zstore.stack_items(reader.get(torch.arange(N)))  # no slot kept half-loaded
    assert (got["obs"] == torch.stack([x["obs"] for x in model])).all()


def recording_decodes(monkeypatch) -> list[str]:
    """Names of the threads each chunk decode runs on. The pool's first two decodes wait for
    each other (a barrier, not a sleep): they pass only when two threads decode at once, and
    time out into an error when one thread would decode them in turn."""
    names: list[str] = []
    lock, met = threading.Lock(), threading.Barrier(2, timeout=30)
    decode = ColumnReader._decode

    def recorded(self, *args, **kwargs):
        name = threading.current_thread().name
        with lock:
            names.append(name)
            waits = name.startswith("zstore-decode") and len(names) <= 2
        if waits:
            met.wait()
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(ColumnReader, "_decode", recorded)
    return names


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: decodes stay on the caller")
def test_several_chunks_decode_on_more_than_one_thread_one_chunk_on_the_caller(
        tmp_path, monkeypatch):
    url, model = written(local(tmp_path))
    tensors = zstore.CompressedListStorage(N, scratch_dir=str(tmp_path / "tensors"), chunks=4)
    tensors.set(range(N), torch.stack([x["obs"] for x in model]))
    tensors.close()
    names = recording_decodes(monkeypatch)
    one = zstore.open(str(tmp_path / "tensors"), mode="r").get(5)  # one key, one chunk
    assert (one == model[5]["obs"]).all()
    assert names and not any(n.startswith("zstore-decode") for n in names)
    names.clear()
    zstore.open(url, mode="r").get(torch.arange(N))
    workers = {n for n in names if n.startswith("zstore-decode")}
    assert len(workers) > 1, names


def _sum_all(url: str, queue) -> None:
    queue.put(int(zstore.stack_items(zstore.open(url, mode="r").get(torch.arange(N))).sum()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_decodes_on_a_pool_of_its_own(tmp_path):
    """The parent's pool threads do not exist in a forked child (it would wait forever)."""
    url = str(tmp_path / "tensors")
    storage = zstore.CompressedListStorage(N, scratch_dir=url, chunks=PER_CHUNK)
    data = torch.arange(N * 64).reshape(N, 64)
    storage.set(range(N), data)
    storage.close()
    zstore.open(url, mode="r").get(torch.arange(N))  # the parent's pool is started
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_sum_all, args=(url, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == int(data.sum())
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()


def test_a_shut_down_pool_decodes_on_the_caller(tmp_path, monkeypatch):
    """At interpreter exit the pool refuses work: a last commit's reads still decode."""
    url, model = written(local(tmp_path))
    gone = ThreadPoolExecutor(2)
    gone.shutdown()
    monkeypatch.setattr(zstore.chunkio._DECODERS, "_pool", gone)
    got = zstore.stack_items(zstore.open(url, mode="r").get(torch.arange(N)))
    assert (got["obs"] == torch.stack([x["obs"] for x in model])).all()


def _raw_buffer(name: str) -> tuple[str, TensorDict]:
    """A committed raw (bytes + crc32c) memory:// buffer of N rows, 1 KiB chunks."""
    url = f"memory://zstore-test-parallel/{os.getpid()}-{name}"
    storage = zstore.LazyMemmapStorage(N, scratch_dir=url, codec=None, chunks=PER_CHUNK)
    data = TensorDict(obs=torch.arange(N * 64.0).reshape(N, 64), batch_size=[N])
    storage.set(torch.arange(N), data)
    storage.close()
    return url, data


def test_small_uncompressed_chunks_are_checked_on_the_caller(monkeypatch):
    """A raw buffer's chunks (bytes + crc32c) below POOL_COPY_BYTES are checked and copied
    where they are read: that costs less than a thread hand-off, so the pool never sees them."""
    assert 4 * 64 * 4 < zstore.chunkio.POOL_COPY_BYTES
    url, data = _raw_buffer("raw")
    names = recording_decodes(monkeypatch)
    got = zstore.open(url, mode="r").get(torch.arange(N))
    assert torch.equal(got["obs"], data["obs"])
    assert len(names) == N // PER_CHUNK  # every chunk was read and checked ...
    assert not any(n.startswith("zstore-decode") for n in names)  # ... off the pool
    StoreSpec.parse(url).delete()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: copies stay on the caller")
def test_large_uncompressed_chunks_are_copied_into_their_slots_on_the_pool(monkeypatch):
    """From POOL_COPY_BYTES on (here lowered to these 1 KiB chunks), a raw chunk's copy is
    worth a thread: a bulk read copies chunks into their cache slots on the pool while the
    rest of its requests are in flight, each straight into its slot (no second copy)."""
    monkeypatch.setattr(zstore.chunkio, "POOL_COPY_BYTES", 4 * 64 * 4)
    url, data = _raw_buffer("raw-pooled")
    names = recording_decodes(monkeypatch)
    decode, landed = ColumnReader._decode, []

    def into_slot(self, payload, block, out=None):
        result = decode(self, payload, block, out)
        landed.append(out is not None and result is out)
        return result

    monkeypatch.setattr(ColumnReader, "_decode", into_slot)
    got = zstore.open(url, mode="r").get(torch.arange(N))
    assert torch.equal(got["obs"], data["obs"])
    assert len(names) == N // PER_CHUNK
    assert len({n for n in names if n.startswith("zstore-decode")}) > 1, names
    assert landed and all(landed), landed
    StoreSpec.parse(url).delete()


def test_reads_and_commits_swap_no_process_wide_warning_state(tmp_path, monkeypatch):
    """``warnings.catch_warnings`` swaps the process's warning state, not a thread's. Decode
    threads entered it around every chunk (torch's warning about read-only arrays), and the
    background committer around a CompressedListStorage's open: one that straddled a
    caller's ``catch_warnings(record=True)`` on another thread took its record with it (a
    test expecting one warning got none, once, in a full run). Neither enters it now: the
    chunks' decoding and a commit (what the background threads run) swap nothing."""
    import warnings

    import zstore

    memmap = zstore.LazyMemmapStorage(64, scratch_dir=str(tmp_path / "rb"), codec="zstd")
    memmap.set(torch.arange(64), TensorDict(obs=torch.arange(64.0), batch_size=[64]))
    items = zstore.CompressedListStorage(8, scratch_dir=str(tmp_path / "items"))

    def entered(*args, **kwargs):
        raise AssertionError("warnings.catch_warnings entered on a read or commit path")

    memmap.flush()
    reader = zstore.open(str(tmp_path / "rb"), mode="r")  # (on the caller's thread: it may)
    with monkeypatch.context() as patch:
        patch.setattr(warnings, "catch_warnings", entered)
        read = reader.get(torch.arange(64))["obs"].tolist()
        items.set(0, TensorDict(obs=torch.ones(3)))
        items.flush()
    assert read == list(range(64))
    assert zstore.open(str(tmp_path / "items"))[0]["obs"].tolist() == [1.0, 1.0, 1.0]
