"""The hot-chunk cache: exact rows after interleaved writes, evictions and reopenings,
memory bounded by the budget, tiers, sharded layouts and the direct chunk reader."""

from __future__ import annotations

import pytest
import torch
import zarr
from tensordict import TensorDict

import zstore
from zstore.cache import ChunkCache
from zstore.table import ChunkedTable

ROW_BYTES = 4 * 6 + 8 + 4  # obs float32[6] + action int64 + reward float32


def transitions(n: int, start: int = 0) -> TensorDict:
    """Rows whose values encode their write order, so stale rows are detectable."""
    ids = torch.arange(start, start + n)
    return TensorDict({
        "obs": ids.float().unsqueeze(-1).expand(n, 6) + torch.arange(6) / 10,
        "action": ids,
        "next": {"reward": ids.float() * 0.5},
    }, [n])


# -- the slot table itself ---------------------------------------------------------------
def make_cache(n_blocks=10, slots=3):
    return ChunkCache(n_blocks, 4, {"x": (torch.float32, (2,))}, budget_bytes=slots * 4 * 2 * 4)


def test_cache_evicts_least_recently_used_clean_slot():
    cache = make_cache()
    first = cache.assign(torch.tensor([0, 1, 2]))
    cache.touch(first[torch.tensor([0, 2])])  # block 1 is now the least recently used
    cache.assign(torch.tensor([5]))
    assert int(cache.slot_of[1]) == -1
    assert int(cache.slot_of[5]) == int(first[1])
    assert cache.stats.evictions == 1 and cache.stats.evicted_bytes == cache.block_bytes


def test_cache_never_evicts_dirty_slots():
    cache = make_cache()
    slots = cache.assign(torch.tensor([0, 1, 2]))
    cache.mark_dirty(slots[:2])
    cache.assign(torch.tensor([7]))
    assert int(cache.slot_of[0]) >= 0 and int(cache.slot_of[1]) >= 0
    assert int(cache.slot_of[2]) == -1
    cache.mark_dirty(cache.slot_of[torch.tensor([7])])
    with pytest.raises(MemoryError):
        cache.assign(torch.tensor([8]))
    cache.mark_clean(slots[:2])
    assert cache.n_dirty == 1


def test_cache_invalidate_keeps_dirty_blocks():
    cache = make_cache()
    slots = cache.assign(torch.tensor([0, 1]))
    cache.mark_dirty(slots[:1])
    cache.invalidate()
    assert int(cache.slot_of[0]) == int(slots[0]) and int(cache.slot_of[1]) == -1
    assert cache.stats.resident_bytes == cache.block_bytes


def test_budget_sets_slot_count_and_is_respected():
    cache = make_cache(n_blocks=100, slots=5)
    assert cache.n_slots == 5
    assert sum(s.numel() * s.element_size() for s in cache.slabs.values()) <= 5 * cache.block_bytes
    assert make_cache(n_blocks=2, slots=5).n_slots == 2  # never more slots than blocks


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown cache tier 'disk'"):
        zstore.cache_tier("disk")


# -- exact rows through the storage ------------------------------------------------------
@pytest.mark.parametrize("budget_blocks", [3, 1000])
def test_interleaved_writes_evictions_and_reopen_return_stored_rows(location, budget_blocks):
    capacity = 60
    storage = location.memmap(capacity, chunks=8, codec="zstd",
                              cache_bytes=budget_blocks * 8 * ROW_BYTES)
    url = storage.scratch_dir
    reference = zstore.LazyTensorStorage(capacity)
    writer, ref_writer = zstore.RoundRobinWriter(), zstore.RoundRobinWriter()
    writer.register_storage(storage)
    ref_writer.register_storage(reference)
    gen = torch.Generator().manual_seed(0)
    written = 0
    for step in range(25):
        op = step % 5
        if op in (0, 3):
            n = int(torch.randint(1, 23, (), generator=gen))
            batch = transitions(n, written)
            writer.extend(batch)
            ref_writer.extend(batch.clone())
            written += n
        elif op == 1:
            item = transitions(1, written)[0]
            writer.add(item)
            ref_writer.add(item.clone())
            written += 1
        elif op == 2:
            idx = torch.randint(0, len(reference), (5,), generator=gen)
            patch = transitions(5, 10_000 + step)
            storage[idx] = patch
            reference[idx] = patch.clone()
        idx = torch.randint(0, len(reference), (17,), generator=gen)
        assert (storage.get(idx) == reference.get(idx)).all(), f"step {step}"
        if step % 8 == 7:
            storage.flush()
            storage = zstore.open(url, location.options, cache_bytes=budget_blocks * 8 * ROW_BYTES)
            writer = zstore.RoundRobinWriter()
            writer.register_storage(storage)
            assert writer._cursor == ref_writer._cursor
    assert (storage[:] == reference[:]).all()
    stats = storage.cache_stats
    assert stats.resident_bytes <= stats.capacity_bytes
    if any(g.cache.n_slots < g.n_blocks for g in storage.table.groups):
        assert stats.evictions > 0


def test_sampling_memory_stays_within_budget_for_a_store_ten_times_larger(location):
    capacity, chunk = 400, 8
    budget = 4 * chunk * ROW_BYTES  # 4 blocks of 50: the store is 12x the budget
    storage = location.memmap(capacity, codec="zstd", chunks=chunk, cache_bytes=budget)
    url = storage.scratch_dir
    data = transitions(capacity)
    storage.set(torch.arange(capacity), data)
    storage.flush()
    reader = zstore.open(url, location.options, mode="r", cache_bytes=budget)
    table = reader.table
    assert isinstance(table, ChunkedTable)
    slab_bytes = sum(s.numel() * s.element_size() for g in table.groups for s in g.cache.slabs.values())
    assert slab_bytes <= budget
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        idx = torch.randint(0, capacity, (64,), generator=gen)  # far more blocks than slots
        assert (reader.get(idx) == data[idx]).all()
        assert reader.cache_stats.resident_bytes <= budget
    assert reader.cache_stats.loads > capacity // chunk  # it had to evict and reload


@pytest.mark.parametrize("background", [False, True])
def test_prefetch_turns_the_next_read_into_hits(location, background):
    storage = location.memmap(64, chunks=8, codec="zstd")
    url = storage.scratch_dir
    storage.set(torch.arange(64), transitions(64))
    storage.flush()
    reader = zstore.open(url, location.options, mode="r")
    idx = torch.tensor([3, 40, 41, 63])
    future = reader.prefetch(idx, background=background)
    if background:
        future.result()
    loads = reader.cache_stats.loads
    hits = reader.cache_stats.hits
    assert (reader.get(idx) == transitions(64)[idx]).all()
    assert reader.cache_stats.loads == loads
    assert reader.cache_stats.hits == hits + len(idx)


def test_a_reader_sees_a_writer_rows_only_after_commit(location):
    storage = location.memmap(64, chunks=8, codec="zstd", autocommit_seconds=3600)
    url = storage.scratch_dir
    storage.set(torch.arange(8), transitions(8))  # fills one chunk: stored, not committed
    storage.set(torch.arange(8, 11), transitions(3, 8))
    assert len(zstore.open(url, location.options, mode="r")) == 0
    storage.flush()
    reader = zstore.open(url, location.options, mode="r")
    assert len(reader) == 11
    assert (reader[:] == transitions(11)).all()


# -- layouts -------------------------------------------------------------------------------
def test_autocommit_commits_on_write_when_due(location):
    storage = location.memmap(64, chunks=8, codec="zstd", autocommit_seconds=0)
    url = storage.scratch_dir
    storage.set(torch.arange(5), transitions(5))
    assert (zstore.open(url, location.options, mode="r")[:] == transitions(5)).all()


@pytest.mark.parametrize("codec", [None, "zstd", "lz4", "blosc-zstd"])
def test_sharded_layout_round_trips(location, codec):
    storage = location.memmap(100, chunks=4, shards=16, codec=codec)
    url = storage.scratch_dir
    data = transitions(100)
    storage.set(torch.arange(100), data)
    storage.flush()
    array = zarr.open_group(url, mode="r", storage_options=location.options or None)["obs"]
    codecs = array.metadata.to_dict()["codecs"]
    assert codecs[0]["name"] == "sharding_indexed"
    assert tuple(codecs[0]["configuration"]["chunk_shape"])[0] == 4
    reader = zstore.open(url, location.options, mode="r", cache_bytes=6 * 4 * ROW_BYTES)
    assert all(r is not None for r in reader.table.readers.values())  # direct reads in use
    idx = torch.randperm(100, generator=torch.Generator().manual_seed(2))[:40]
    assert (reader.get(idx) == data[idx]).all()
    assert (reader[:] == data).all()


def test_object_stores_default_to_shards_sized_from_the_item(s3_bucket, s3_options):
    url = f"s3://{s3_bucket}/cache-default-shards"
    storage = zstore.LazyMemmapStorage(100_000, scratch_dir=url, storage_options=s3_options)
    storage.set(torch.arange(10), transitions(10))
    chunk, shard = storage._meta.layout["obs"]
    assert shard is not None and shard % chunk == 0 and shard > chunk
    assert chunk * 6 * 4 <= 1 << 20 < 2 * chunk * 6 * 4  # ~1 MiB of "obs" per chunk
    action_chunk, _ = storage._meta.layout["action"]
    assert action_chunk == min(100_000, (1 << 20) // 8)  # narrow keys get longer chunks


def test_zarr_fallback_reader_matches_direct_reader(location):
    storage = location.memmap(50, codec="zstd", chunks=5, shards=20)
    url = storage.scratch_dir
    data = transitions(50)
    storage.set(torch.arange(50), data)
    storage.flush()
    reader = zstore.open(url, location.options, mode="r")
    for group in reader.table.groups:
        group.readers = dict.fromkeys(group.readers)  # force zarr's getitem
    assert (reader[:] == data).all()


def test_local_raw_buffers_are_memory_mapped(tmp_path):
    storage = zstore.LazyMemmapStorage(32, scratch_dir=tmp_path / "rb")
    storage.set(torch.arange(32), transitions(32))
    assert type(storage.table).__name__ == "MmapTable"
    assert storage.cache_stats is None
    chunk = tmp_path / "rb" / "obs" / "c" / "0" / "0"
    assert chunk.stat().st_size == 32 * 6 * 4  # the chunk file is the raw array


def test_corrupt_chunk_names_key_and_chunk(tmp_path):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(32, scratch_dir=url, codec="zstd", chunks=8)
    storage.set(torch.arange(32), transitions(32))
    storage.flush()
    chunk = tmp_path / "rb" / "obs" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:5])
    reader = zstore.open(url, mode="r")
    with pytest.raises(zstore.CorruptChunkError, match=r"'obs'.*chunk 1"):
        reader.get(torch.tensor([9]))


# -- tiers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["pinned", "cuda"])
def test_gpu_tiers_return_stored_rows(location, tier):
    if not torch.cuda.is_available():
        pytest.skip(f"the {tier!r} tier needs CUDA, which this machine lacks")
    device = "cuda" if tier == "cuda" else "cpu"
    storage = location.memmap(40, chunks=8, codec="zstd", cache=tier, device=device)
    url = storage.scratch_dir
    data = transitions(40)
    storage.set(torch.arange(40), data.to(device))
    storage.flush()
    reader = zstore.open(url, location.options, mode="r", cache=tier, device=device)
    idx = torch.tensor([0, 17, 39, 17])
    out = reader.get(idx.to(device))
    assert out["obs"].device.type == device
    assert (out.cpu() == data[idx]).all()


def test_gpu_tiers_refuse_clearly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for tier in ("pinned", "cuda"):
        with pytest.raises(RuntimeError, match=f"'{tier}' cache tier needs CUDA"):
            zstore.cache_tier(tier)


def test_a_device_the_cache_cannot_return_samples_on_is_refused_naming_the_fix(location):
    """``zstore.open(url, device="cuda")`` of a host-cached buffer returned CPU samples (any
    string passed, "garbage" too), where the constructor refused; and a refusal's advice
    (cache='cuda') failed on a machine without CUDA. Every device is now checked against
    the tier, naming the fix, before anything is written."""
    import fsspec

    storage = location.memmap(10, chunks=4)
    storage.set(torch.arange(4), transitions(4))
    storage.close()
    compressed = zstore.CompressedListStorage(10, scratch_dir=location.new("cls"),
                                              storage_options=location.options)
    compressed.set(0, transitions(1)[0])
    compressed.close()
    cuda = torch.cuda.is_available()
    refusals = {"garbage": r"device='garbage' is not a torch device",
                "meta": r"does not fit cache='host'.*device='cpu'.*\.to\('meta'\)",
                "cuda:0": (r"does not fit cache='host'.*cache='cuda'" if cuda
                           else r"does not fit cache='host'.*CUDA is not available")}
    for device, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            zstore.open(storage.scratch_dir, location.options, mode="r", device=device)
        fresh = location.new()
        with pytest.raises(ValueError, match=message):
            location.memmap(10, scratch_dir=fresh, device=device)
        fs, path = fsspec.core.url_to_fs(fresh, **location.options)
        assert not fs.exists(path)  # refused before anything was written
    with pytest.raises(ValueError, match=r"does not fit cache='cuda'.*device='cuda'"):
        zstore.cache_tier("cuda", "cpu")  # (checked before CUDA is looked for)
    for device in (None, "auto", "cpu", "cpu:0", torch.device("cpu")):
        reader = zstore.open(storage.scratch_dir, location.options, mode="r", device=device)
        assert reader.device == torch.device("cpu")
        assert (reader.get(torch.arange(4)) == transitions(4)).all()
    if not cuda:  # a CompressedListStorage returns items on any device it is given
        fresh = location.new("cls")
        with pytest.raises(RuntimeError, match=r"device='cuda' needs CUDA.*device='cpu'"):
            zstore.CompressedListStorage(10, scratch_dir=fresh, device="cuda",
                                         storage_options=location.options)
        fs, path = fsspec.core.url_to_fs(fresh, **location.options)
        assert not fs.exists(path)
        with pytest.raises(RuntimeError, match=r"device='cuda' needs CUDA"):
            zstore.open(compressed.scratch_dir, location.options, mode="r", device="cuda")


def test_nbytes_and_compression_ratio_measure_the_store(tmp_path):
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=tmp_path / "rb", codec="zstd", chunks=100)
    storage.set(torch.arange(500), TensorDict(x=torch.zeros(500, 64), batch_size=[500]))
    chunk_files = [p for p in (tmp_path / "rb" / "x").rglob("*") if p.is_file()]
    assert storage.nbytes == sum(p.stat().st_size for p in (tmp_path / "rb").rglob("*")
                                 if p.is_file() and p.name != "zstore-lease.json")
    assert chunk_files and storage.raw_nbytes == 500 * 64 * 4
    assert storage.compression_ratio > 10  # zeros compress well
    assert "compression_ratio=" in repr(storage)


def test_a_sparse_memory_mapped_buffer_counts_the_bytes_its_files_hold(tmp_path):
    """nbytes of a local raw buffer is what its files hold on disk, not their apparent size
    (2 rows of a 10^8-row buffer showed 372.5 GiB stored)."""
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        f.truncate(2**30)
    if probe.stat().st_blocks * 512 >= 2**30:
        pytest.skip("this filesystem has no sparse files")
    capacity, row_bytes = 10**6, 1000 * 4
    storage = zstore.LazyMemmapStorage(capacity, scratch_dir=tmp_path / "rb")
    storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 1000), batch_size=[2]))
    files = [p for p in (tmp_path / "rb").rglob("*") if p.is_file() and p.name != "zstore-lease.json"]
    assert sum(p.stat().st_size for p in files) > capacity * row_bytes  # the files' apparent size
    held = sum(min(p.stat().st_size, p.stat().st_blocks * 512) for p in files)
    assert storage.nbytes == held < capacity * row_bytes / 100
    assert storage.summary().stored_bytes == held
    assert storage.compression_ratio == 2 * row_bytes / held
