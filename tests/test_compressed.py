"""CompressedListStorage against a reference model (a plain list): fixed-shape and ragged
items, nested keys, every dtype, on memory:// / local / S3; errors; codecs; corruption; cache."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import pickle
import uuid
import warnings
import zlib
from pathlib import Path

import fsspec
import pytest
import torch
import zarr
from tensordict import TensorDict

import zstore
from zstore import autocommit
from zstore import CompressedListStorage, LazyMemmapStorage, stack_items
from zstore.layout import SINGLE_TENSOR_KEY

from test_interop import DTYPES, bits, random_bits


def assert_same(got, expected):
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected))
        return
    assert got.batch_size == expected.batch_size
    assert set(got.keys(True, True)) == set(expected.keys(True, True))
    for key in expected.keys(True, True):
        assert_same(got.get(key), expected.get(key))
    for key in expected.keys(True):
        if isinstance(expected.get(key), TensorDict):
            assert got.get(key).batch_size == expected.get(key).batch_size, key


def transition(i: int, g) -> TensorDict:
    return TensorDict({
        "pixels": torch.randint(0, 255, (2, 8, 8), generator=g, dtype=torch.uint8),
        "action": torch.tensor(i),
        "next": TensorDict({"reward": torch.rand(1, generator=g),
                            "info": TensorDict(done=torch.tensor([i % 3 == 0]), batch_size=[])},
                           batch_size=[]),
    }, batch_size=[])


def check_against(storage, ref):
    assert len(storage) == len(ref)
    for i, item in enumerate(ref):
        assert_same(storage.get(i), item)
    idx = torch.randint(0, len(ref), (17,))
    for got, i in zip(storage.get(idx), idx.tolist()):
        assert_same(got, ref[i])
    assert len(storage.get(slice(None))) == len(ref)


def test_fixed_items_round_trip(location):
    g = torch.Generator().manual_seed(0)
    storage, ref = location.compressed(40), []
    batch = torch.stack([transition(i, g) for i in range(25)])
    storage.set(torch.arange(25), batch)
    ref.extend(batch.unbind(0))
    for i in (25, 3, 26):  # append, overwrite, append
        item = transition(100 + i, g)
        storage.set(i, item)
        if i < len(ref):
            ref[i] = item
        else:
            ref.append(item)
    check_against(storage, ref)
    sampled = storage.get(torch.tensor([1, 5, 5]))
    assert_same(stack_items(sampled), torch.stack([ref[1], ref[5], ref[5]]))


def test_ragged_items_round_trip(location):
    g = torch.Generator().manual_seed(1)
    storage, ref = location.compressed(30), []
    for i in range(20):
        T = int(torch.randint(1, 9, (1,), generator=g))
        traj = TensorDict({"obs": torch.randn(T, 3, generator=g),
                           "next": TensorDict(obs=torch.randn(T, 3, generator=g), batch_size=[T])},
                          batch_size=[T])
        item = TensorDict(traj=traj, tokens=torch.randint(0, 100, (T * 2 + i % 3,), generator=g))
        storage.set(len(ref), item)
        ref.append(item)
    for i in (4, 11):  # overwrites with other shapes (values are appended, then compacted)
        traj = TensorDict({"obs": torch.randn(12, 3),
                           "next": TensorDict(obs=torch.randn(12, 3), batch_size=[12])},
                          batch_size=[12])
        item = TensorDict(traj=traj, tokens=torch.arange(50))
        storage.set(i, item)
        ref[i] = item
    check_against(storage, ref)
    assert "ragged" in repr(storage)


def test_trailing_shape_change_goes_flat():
    storage = CompressedListStorage(10)
    items = [torch.ones(2, 3), torch.ones(4, 3), torch.arange(10.0).reshape(2, 5)]
    for i, item in enumerate(items):
        storage.set(i, item)
    for got, item in zip(storage[:], items):
        assert torch.equal(got, item)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(location, dtype):
    g = torch.Generator().manual_seed(2)
    storage = location.compressed(8)
    ref = [random_bits(dtype, (3, 2), g) for _ in range(3)] + [random_bits(dtype, (5, 2), g)]
    for i, x in enumerate(ref):
        storage.set(i, TensorDict(x=x, batch_size=[]))
    for got, x in zip(storage[:], ref):
        assert_same(got["x"], x)


def zlib_compress(t):
    return torch.frombuffer(bytearray(zlib.compress(t.numpy().tobytes())), dtype=torch.uint8)


def zlib_decompress(payload, meta):
    raw = zlib.decompress(payload.numpy().tobytes())
    return torch.frombuffer(bytearray(raw), dtype=meta["dtype"]).reshape(meta["shape"])


def zlib_pair(calls=None):
    def decompress(payload, meta):
        calls.append(meta)
        return zlib_decompress(payload, meta)

    return zlib_compress, decompress if calls is not None else zlib_decompress


def test_custom_codec_pair(location):
    calls = []
    compress, decompress = zlib_pair(calls)
    storage = location.compressed(10, compression_fn=compress, decompression_fn=decompress)
    data = TensorDict(a=torch.randn(4, 5), b=torch.arange(4), batch_size=[4])
    storage.set(torch.arange(4), data)
    storage.set(4, TensorDict(a=torch.randn(7), b=torch.tensor(9)))  # another shape
    assert_same(stack_items(storage.get(torch.arange(4))), data)
    assert storage[4]["a"].shape == (7,) and storage[4]["b"].item() == 9
    assert calls[0]["type"] == "tensor" and calls[0]["dtype"] in (torch.float32, torch.int64)


def test_list_semantics_and_errors():
    storage = CompressedListStorage(3)
    with pytest.raises(IndexError):
        storage.get(0)
    with pytest.raises(RuntimeError, match="more than one item away"):
        storage.set(1, torch.ones(2))
    storage.set([0, 1], [torch.ones(2), torch.zeros(2)])
    assert storage._mutation_revision == 2
    storage.set(2, torch.ones(2))
    with pytest.raises(RuntimeError, match="maximum capacity"):
        storage.set(3, torch.ones(2))
    with pytest.raises(RuntimeError, match="one-length tuples"):
        storage.get((0, 1))
    with pytest.raises(IndexError):
        storage.get(torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="Cannot extend"):
        storage.set([0], 5)
    assert storage.contains(2) and not storage.contains(3)
    assert storage.contains(torch.tensor([0, 4])).tolist() == [True, False]
    storage.set(slice(0, 2), [torch.full((2,), 7.0), torch.full((2,), 8.0)])
    assert storage[1].tolist() == [8.0, 8.0] and storage[-1].tolist() == [1.0, 1.0]
    state = storage.state_dict()
    other = CompressedListStorage(3)
    other.load_state_dict(state)
    assert [x.tolist() for x in other[:]] == [x.tolist() for x in storage[:]]
    revision = storage._mutation_revision
    storage._empty()
    assert len(storage) == 0 and storage._mutation_revision == revision + 1
    with pytest.warns(UserWarning, match="empty"):
        assert storage.bytes() == 0


def test_per_key_codec_in_zarr_metadata(tmp_path):
    url = str(tmp_path / "rb")
    storage = CompressedListStorage(16, scratch_dir=url, codec={"default": "zstd", "next/reward": None})
    storage.set(torch.arange(4), TensorDict(obs=torch.zeros(4, 8),
                                            next=TensorDict(reward=torch.ones(4, 1), batch_size=[4]),
                                            batch_size=[4]))
    storage.flush()
    group = zarr.open_group(f"{url}/items-1", mode="r")
    names = lambda key: [c.to_dict()["name"] for c in group[key].metadata.codecs]  # noqa: E731
    assert names("obs") == ["bytes", "zstd", "crc32c"]  # compressed: checksummed by default
    assert names("next/reward") == ["bytes"]
    assert group.attrs["zstore"]["codecs"] == {"next/reward": {"name": None, "level": None,
                                                               "checksum": False}}
    with pytest.raises(zstore.MissingKeyError):
        CompressedListStorage(4, codec={"nope": None}).set(0, TensorDict(a=torch.ones(1)))


def test_default_codec_and_sizes():
    frames = torch.zeros(64, 4, 16, 16, dtype=torch.uint8)
    frames[:, :, 4:8, 4:8] = 200
    storage = CompressedListStorage(100)
    storage.set(torch.arange(64), TensorDict(pixels=frames, batch_size=[64]))
    assert str(storage.default_codec) == "zstd:3+crc32c"
    assert storage.raw_nbytes == frames.numel()
    assert storage.compression_ratio > 1 and storage.nbytes > 0
    assert "compression_ratio=" in repr(storage)


def flip_a_byte(chunk: Path) -> None:
    payload = bytearray(chunk.read_bytes())
    payload[len(payload) // 2] ^= 0xFF
    chunk.write_bytes(bytes(payload))


def test_corrupted_chunk_names_key_and_chunk(tmp_path):
    url = tmp_path / "rb"
    storage = CompressedListStorage(64, scratch_dir=str(url), chunks=8, cache_bytes=1 << 20)
    storage.set(torch.arange(32), TensorDict(pixels=torch.arange(32 * 64, dtype=torch.uint8)
                                             .reshape(32, 64), batch_size=[32]))
    storage.flush()
    flip_a_byte(Path(url, "items-1", "pixels", "c", "1", "0"))
    fresh = zstore.open(f"{url}/items-1", mode="r")
    with pytest.raises(zstore.CorruptChunkError, match=r"'pixels'.*chunk 1"):
        fresh.get(torch.tensor([9]))
    with pytest.raises(zstore.CorruptChunkError, match=r"'pixels'.*chunk 1"):
        zstore.open(str(url)).get(torch.tensor([3, 9]))  # through the storage, cold cache
    assert storage.get(2)["pixels"].shape == (64,)  # chunk 0 is intact


def test_corrupted_ragged_values_chunk_names_key_and_chunk(tmp_path):
    url = tmp_path / "rb"
    storage = CompressedListStorage(64, scratch_dir=str(url))
    for i in range(6):  # token lists of varying length: the ragged layout
        storage.set(i, TensorDict(tokens=torch.arange(50 * i, 50 * i + 10 + i)))
    storage.flush()
    values = Path(url, "ragged", "tokens", f"values-{storage._ragged['tokens'].gen}")
    flip_a_byte(values / SINGLE_TENSOR_KEY / "c" / "0")
    with pytest.raises(zstore.CorruptChunkError, match=r"key 'tokens' \(values\).*chunk 0"):
        zstore.open(str(url)).get(3)


def test_cache_serves_repeated_samples():
    storage = CompressedListStorage(200, chunks=16)
    storage.set(torch.arange(200), TensorDict(x=torch.randn(200, 32), batch_size=[200]))
    storage.flush()
    idx = torch.randint(0, 200, (64,))
    storage.get(idx)
    loads = storage.cache_stats.loads
    storage.get(idx)
    assert storage.cache_stats.loads == loads


def test_owned_memory_store_is_deleted_once_collected():
    storage = CompressedListStorage(4)
    storage.set(0, torch.ones(3))
    spec = storage.spec
    assert spec.exists()
    del storage
    gc.collect()
    CompressedListStorage(4)  # the next storage is the safe point where the deletion runs
    assert not spec.exists()


def _leave_the_background_committer_nothing() -> None:
    """Commit every storage with rows not yet committed (other tests' leftovers): the
    background committer would otherwise store memory:// rows into the shared dict at any
    moment, a listing included (CI runs failed so). Every storage it watches, memory:// ones
    too (``commit_pending`` leaves those to the process's end). A function, so that no
    reference to a storage outlives it. One that lost its lease (another test's) stores
    nothing: it stops before storing a row."""
    for pending in autocommit._watched():
        with contextlib.suppress(zstore.LeaseError):
            pending.flush()


@pytest.mark.parametrize("make", [lambda: CompressedListStorage(4),
                                  lambda: LazyMemmapStorage(4, scratch_dir="memory://zstore-tests/gc-"
                                                            + uuid.uuid4().hex, auto_cleanup=True)],
                         ids=["compressed", "memmap"])
def test_collecting_a_memory_storage_does_not_change_the_store_under_a_listing(make):
    """A collection can run a storage's finalizer in the middle of any iteration over the
    shared memory:// dict (fsspec's own listings allocate as they iterate); the finalizer
    must leave the dict alone there, or that listing dies with "dictionary changed size"."""
    storage = make()
    storage.set(0, torch.ones(3))
    storage.flush()
    spec = storage.spec
    _leave_the_background_committer_nothing()
    store = fsspec.filesystem("memory").store
    listing = iter(store)
    next(listing)
    del storage
    gc.collect()  # the finalizer runs while the listing is open
    list(listing)  # raised RuntimeError when the finalizer deleted at once
    assert spec.exists()
    make()  # a safe point: the collected store is deleted now
    assert not spec.exists()


def test_non_tensor_items_are_refused():
    with pytest.raises(TypeError, match="ListStorage"):
        CompressedListStorage(4).set(0, "text")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompressedListStorage(4)


def test_items_are_the_batch_rows():
    g = torch.Generator().manual_seed(3)
    storage = CompressedListStorage(20)
    batch = torch.stack([transition(i, g) for i in range(10)])
    batch["traj"] = TensorDict(obs=torch.randn(10, 4, 2, generator=g), batch_size=[10, 4])
    storage.set(torch.arange(10), batch)
    items = storage.get(torch.tensor([7, 2, 7]))
    assert isinstance(items, list) and len(items) == 3
    for item, i in zip(items, (7, 2, 7)):
        assert_same(item, batch[i])
        assert item.device == torch.device("cpu") and item["traj"].batch_size == (4,)
    assert items[0]["pixels"].data_ptr() == items.batch["pixels"][0].data_ptr()  # views
    assert stack_items(items) is items.batch and items.batch.batch_size == (3,)
    assert storage.get(torch.tensor([], dtype=torch.long)) == []


def test_reopen_with_zstore_open(location):
    g = torch.Generator().manual_seed(4)
    storage = location.compressed(30)
    url = storage.scratch_dir
    ref = [transition(i, g) for i in range(6)]
    storage.set(torch.arange(6), torch.stack(ref))
    for i in (6, 2):  # "next/reward" turns ragged: a new items table and ragged generations
        item = transition(i, g)
        item["next", "reward"] = torch.rand(3, generator=g)
        ref[i:i + 1] = [item]
        storage.set(i, item)
    storage.flush()
    again = zstore.open(url, location.options)
    assert type(again) is CompressedListStorage and len(again) == 7 and again.max_size == 30
    check_against(again, ref)
    again.set(7, ref[0])  # keeps writing, then commits
    again.flush()
    reader = zstore.open(url, location.options, mode="r")
    assert len(reader) == 8 and "ragged" in repr(reader)
    assert_same(reader[7], ref[0])
    with pytest.raises(zstore.ReadOnlyError):
        reader.set(8, ref[0])
    with pytest.raises(zstore.StoreExistsError, match="zstore.open"):
        location.compressed(30, scratch_dir=url)
    again.cleanup()
    with pytest.raises(zstore.StoreNotFoundError):
        zstore.open(url, location.options)


def test_reopen_refuses_custom_codecs_without_their_functions(tmp_path):
    compress, decompress = zlib_pair()
    storage = CompressedListStorage(4, scratch_dir=str(tmp_path / "rb"), compression_fn=compress,
                                    decompression_fn=decompress)
    storage.set(0, torch.arange(5))
    storage.flush()
    with pytest.raises(zstore.NotAZStoreError, match="compression_fn"):
        zstore.open(str(tmp_path / "rb"))


def test_pickle_memory_storage_copies_the_stored_chunks():
    storage = CompressedListStorage(10)
    storage.set(torch.arange(3), TensorDict(x=torch.zeros(3, 1000), batch_size=[3]))
    storage.set(3, TensorDict(x=torch.ones(7)))  # ragged
    payload = pickle.dumps(storage)
    assert len(payload) < 3 * 1000 * 4  # compressed chunks, not decoded items
    copy = pickle.loads(payload)
    assert copy.spec.url != storage.spec.url and len(copy) == 4
    copy.set(0, TensorDict(x=torch.full((5,), 2.0)))
    assert storage[0]["x"].shape == (1000,) and copy[0]["x"].tolist() == [2.0] * 5
    assert copy[3]["x"].tolist() == [1.0] * 7
    assert len(pickle.loads(pickle.dumps(CompressedListStorage(4)))) == 0


def read_items(storage) -> list:
    """Run in a spawned process: the storage arrives pickled."""
    return [item["x"].tolist() for item in storage[:]]


def test_url_storage_pickles_as_its_spec_and_reopens_in_another_process(tmp_path):
    compress, decompress = zlib_pair()
    for kwargs in ({}, {"compression_fn": compress, "decompression_fn": decompress}):
        url = str(tmp_path / f"rb{len(kwargs)}")
        storage = CompressedListStorage(10, scratch_dir=url, **kwargs)
        storage.set(torch.arange(2), TensorDict(x=torch.arange(4.0).reshape(2, 2), batch_size=[2]))
        storage.set(2, TensorDict(x=torch.arange(3.0)))
        payload = pickle.dumps(storage)
        assert url.encode() in payload and b"zarr" not in payload and len(payload) < 2000
        with mp.get_context("spawn").Pool(1) as pool:
            assert pool.apply(read_items, (storage,)) == [[0, 1], [2, 3], [0, 1, 2]]


def _written_elsewhere(location, kind: str) -> tuple[str, object]:
    """A URL holding ``kind`` (what another zstore class or another tool put there), and a
    fingerprint of it to compare after a refused creation."""
    url = location.new(kind)
    fs, root = zstore.StoreSpec.parse(url, location.options).filesystem()
    rows = TensorDict(obs=torch.arange(12.0).view(6, 2), batch_size=[6])
    if kind == "buffer":
        buffer = location.memmap(10, scratch_dir=url)
        buffer.set(torch.arange(6), rows)
        buffer.close()
    elif kind == "dataset":
        buffer = location.memmap(6, scratch_dir=url)
        buffer.set(torch.arange(6), rows.update({("next", "done"): torch.ones(6, 1, dtype=torch.bool)}))
        buffer.close()
        zstore.seal(url, storage_options=location.options)
    elif kind == "checkpoint":
        from checkpoint import TensorStorageCheckpointer

        source = zstore.LazyTensorStorage(10)
        source.set(torch.arange(6), rows)
        source.checkpointer = TensorStorageCheckpointer(storage_options=location.options)
        source.dumps(url)
    else:  # another tool's file
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(f"{root}/notes.txt", b"mine")
    listing = sorted((path, fs.cat_file(path)) for path in fs.find(root)
                     if not path.endswith(".json") or "zstore-lease" not in path)
    return url, listing


@pytest.mark.parametrize("kind", ["buffer", "dataset", "checkpoint", "foreign file"])
def test_a_new_storage_refuses_a_location_holding_anything_else(location, kind):
    """CompressedListStorage only refused a CompressedListStorage at its URL: its first
    commit replaced the root zarr.json of a buffer, a sealed dataset or a checkpoint there
    (which then no longer opened), and it wrote among a folder's other files, which its
    cleanup() then deleted. Now each is refused before anything is written, and left as it
    was."""
    url, before = _written_elsewhere(location, kind)
    error = zstore.StoreExistsError if kind in ("buffer", "dataset") else zstore.NotAZStoreError
    with pytest.raises(error, match="choose"):
        location.compressed(30, scratch_dir=url)
    fs, root = zstore.StoreSpec.parse(url, location.options).filesystem()
    after = sorted((path, fs.cat_file(path)) for path in fs.find(root)
                   if not path.endswith(".json") or "zstore-lease" not in path)
    assert after == before


def test_a_second_storage_at_a_location_not_committed_yet_is_refused(location):
    """A second CompressedListStorage at the URL of one still writing before its first commit
    (a notebook cell run again within ``autocommit_seconds``) took the location over, as
    if the first had been killed: the first's items were then lost at its flush. Now the
    second is refused naming the live writer, and the first's items are kept."""
    url = location.new()
    first = location.compressed(10, scratch_dir=url)
    items = [TensorDict(a=torch.tensor(float(i))) for i in range(3)]
    first.set([0, 1, 2], items)
    with pytest.raises(zstore.LeaseError, match=r"another storage of this process: write "
                       r"through that one, or close\(\) it .*zstore.autocommit.commit_pending"):
        location.compressed(10, scratch_dir=url)
    first.flush()
    reader = zstore.open(url, location.options, mode="r")
    assert [reader.get(i)["a"].item() for i in range(len(reader))] == [0., 1., 2.]
    first.close()
    with pytest.raises(zstore.StoreExistsError, match="zstore.open"):  # committed: reopen it
        location.compressed(10, scratch_dir=url)
    # a live writer whose only write was refused stored nothing: nothing to lose, so a new
    # storage there is built (the notebook cell run again with the data fixed)
    other = location.new()
    refused = location.compressed(10, scratch_dir=other)
    with pytest.raises(TypeError):
        refused.set(0, "text")
    again = location.compressed(10, scratch_dir=other)
    again.set(0, items[0])
    again.close()
    # a storage built to take no lease (lease_ttl=None) is not refused by another's
    third = location.new()
    holder = location.compressed(10, scratch_dir=third)
    holder.set(0, items[0])
    location.compressed(10, scratch_dir=third, lease_ttl=None)
    holder.close()


def test_a_write_of_another_thread_during_close_is_kept(location, monkeypatch):
    """``close()`` committed, then released the lease, as two steps: a write of another
    thread between them returned, and was lost (its next write took the lease again,
    reloading the commit without it). Now the write waits for the close, then commits."""
    import threading

    url = location.new()
    storage = CompressedListStorage(20, scratch_dir=url, storage_options=location.options,
                                    autocommit_seconds=1e9)
    for i in range(3):
        storage.set(i, torch.full((2,), float(i)))
    written = threading.Event()

    def write_between():  # another thread's write, once close() has committed
        storage.set(3, torch.full((2,), 3.0))
        written.set()

    lease, release = storage._lease, storage._lease.release
    writer = threading.Thread(target=write_between)

    def release_after_a_write():
        writer.start()
        # the write waits for the close to end (before: it ran here, and returned)
        assert not written.wait(timeout=2), "a write ran between the commit and the release"
        release()

    monkeypatch.setattr(lease, "release", release_after_a_write)
    storage.close()
    writer.join()
    monkeypatch.setattr(lease, "release", release)
    storage.close()  # the write's own commit
    reader = zstore.open(url, location.options, mode="r")
    assert [t.tolist() for t in reader.get([0, 1, 2, 3])] == [[float(i)] * 2 for i in range(4)]


@pytest.mark.parametrize("on", ["main thread", "fsspec's event loop"])
def test_a_collected_temporary_s3_store_is_deleted_whichever_thread_collects(s3_options,
                                                                            s3_bucket, on):
    """A collection runs on any thread that allocates. On fsspec's event loop thread the
    deletion of a temporary S3 store could not run its requests there (it failed, silently,
    and the store was left in the bucket); on an in-process S3 server's thread, TorchRL's
    test suite run on S3 hung for good. The deletion runs on a thread of its own."""
    import concurrent.futures

    import fsspec.asyn

    url = f"s3://{s3_bucket}/collected-{uuid.uuid4().hex[:8]}"
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=s3_options, auto_cleanup=True)
    storage.set(torch.arange(3), TensorDict(a=torch.ones(3), batch_size=[3]))
    storage.close()
    spec = storage.spec
    storage.cycle = storage  # (only a collection of cycles finds it)
    del storage
    assert spec.exists()
    if on == "main thread":
        gc.collect()
    else:
        collected = concurrent.futures.Future()
        fsspec.asyn.get_loop().call_soon_threadsafe(lambda: collected.set_result(gc.collect()))
        collected.result(timeout=60)
    assert not zstore.StoreSpec.parse(url, s3_options).exists()  # (a parse waits for its deletion)
    again = LazyMemmapStorage(10, scratch_dir=url, storage_options=s3_options, auto_cleanup=True)
    again.set(torch.arange(2), TensorDict(a=torch.zeros(2), batch_size=[2]))  # (was refused:
    again.flush()  # "already exists", or its objects deleted by the old store's deletion)
    assert zstore.open(url, s3_options, mode="r")[:]["a"].tolist() == [0.0, 0.0]
    again.cleanup()


_APPEND_AND_CLOSE = r'''
import json, sys, torch, zstore
url, options = sys.argv[1], json.loads(sys.argv[2])
storage = zstore.open(url, options)
storage.set(list(range(10, 15)), [torch.full((3,), 300.0 + i) for i in range(5)])
storage.close()
'''


def test_a_closed_compressed_storage_leaves_a_later_writer_s_items_alone_at_exit(s3_options,
                                                                                s3_bucket,
                                                                                monkeypatch):
    """A process that closed its ``CompressedListStorage`` on S3 and ran on: at its exit its
    inner tables, still open, folded their log segments from its stale cache and committed,
    without its lease: the items another process appended meanwhile read as zeros."""
    import json
    import subprocess
    import sys
    import weakref

    from zstore.storages import lifecycle

    url = f"s3://{s3_bucket}/closed-then-exit-{uuid.uuid4().hex[:8]}"
    storage = CompressedListStorage(20, scratch_dir=url, storage_options=s3_options)
    storage.set(list(range(10)), [torch.full((3,), 100.0 + i) for i in range(10)])
    storage.close()
    done = subprocess.run([sys.executable, "-c", _APPEND_AND_CLOSE, url, json.dumps(s3_options)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = weakref.WeakKeyDictionary({live: pid for live, pid in lifecycle._LIVE.items()
                                      if live.spec.url.startswith(url)})
    assert len(ours) > 1  # (the storage and its inner tables)
    monkeypatch.setattr(lifecycle, "_LIVE", ours)
    lifecycle._close_live_storages()  # this process's exit, for this test's storages
    reader = zstore.open(url, s3_options, mode="r")
    assert [float(item[0]) for item in reader.get(list(range(15)))] == \
        [100.0 + i for i in range(10)] + [300.0 + i for i in range(5)]
