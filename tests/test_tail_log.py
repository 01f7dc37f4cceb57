"""Log segments (zstore.tail): commits of partly written units upload only the new rows.

Checked against a plain TensorDict model on memory://, local and S3 (moto): every
committed row is read back by a new reader, a reopened writer, and, once the writer
closed, by zarr-python alone; the bytes a commit uploads are the rows it adds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from tensordict import TensorDict
from zarr.storage import FsspecStore

import zstore
from zstore.errors import CorruptChunkError, FormatVersionError
from zstore.format_version import check_format_version
from zstore.tail import TAIL_PREFIX


def cartpole(n: int, g: torch.Generator) -> TensorDict:
    """``n`` CartPole-like rows (about 45 B each)."""
    return TensorDict(obs=torch.randn(n, 4, generator=g), action=torch.randint(0, 2, (n,), generator=g),
                      reward=torch.randn(n, generator=g), done=torch.zeros(n, 1, dtype=torch.bool),
                      batch_size=[n])


def nbytes(td: TensorDict) -> int:
    return sum(v.numel() * v.element_size() for v in td.values(include_nested=True, leaves_only=True))


def assert_rows(storage, model: TensorDict, n: int, where: str) -> None:
    got = storage[torch.arange(n)]
    for key in model.keys():
        assert torch.equal(got[key], model[key][:n]), f"{where}: key {key}"


@pytest.fixture
def put_bytes(monkeypatch):
    """Bytes of every object a zarr FsspecStore writes (S3, memory://), by key, and of every
    commit (the root ``zarr.json``, written through the lease), under ``"commits/zarr.json"``."""
    from zstore.lease import Lease

    written: dict[str, int] = {}
    original = FsspecStore.set
    write_metadata = Lease.write_metadata

    async def counting(self, key, value, *args, **kwargs):
        written[key] = written.get(key, 0) + len(value.to_bytes())
        return await original(self, key, value, *args, **kwargs)

    def counted_commit(self, data, **kwargs):
        written["commits/zarr.json"] = written.get("commits/zarr.json", 0) + len(data)
        return write_metadata(self, data, **kwargs)

    monkeypatch.setattr(FsspecStore, "set", counting)
    monkeypatch.setattr(Lease, "write_metadata", counted_commit)
    return written


def open_storage(location, url, capacity=1000, **kwargs):
    kwargs.setdefault("codec", "zstd")
    kwargs.setdefault("chunks", 16)
    kwargs.setdefault("shards", 64)
    return zstore.LazyMemmapStorage(capacity, scratch_dir=url, storage_options=location.options,
                                    tail_log=True, autocommit_seconds=float("inf"), **kwargs)


def five_rows_logged(location, url, seed):
    """A buffer at ``url`` whose one commit logged rows 0..4 as segment 0 of group 16x64."""
    storage = open_storage(location, url, capacity=128)
    storage.set(torch.arange(5), cartpole(5, torch.Generator().manual_seed(seed)))
    storage.flush()
    return storage


def test_commits_log_the_tail_and_every_reader_sees_the_committed_rows(location):
    """Random extends, overwrites and commits, reopened readers and writers, against a model."""
    g = torch.Generator().manual_seed(3)
    url = location.new()
    storage = open_storage(location, url, capacity=200)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    model = cartpole(200, g).zero_()
    committed = 0
    for step in range(24):
        if step % 5 == 4:  # an in-place update of recent rows, as TorchRL's set_at_ does
            idx = torch.randint(0, max(1, len(storage)), (3,), generator=g).unique()
            rows = cartpole(len(idx), g)
            storage.set(idx, rows, set_cursor=False)
            model[idx] = rows
        else:
            n = int(torch.randint(1, 13, (), generator=g))
            rows = cartpole(n, g)
            start = writer._cursor
            writer.extend(rows)
            model[(torch.arange(n) + start) % 200] = rows
        if step % 2:
            storage.flush()
            committed = len(storage)
            if step == 1:
                assert storage._meta.tail, "a commit of a partly written shard logs its rows"
            reader = zstore.open(url, location.options, mode="r")
            assert len(reader) == committed
            assert_rows(reader, model, committed, f"reader after step {step}")
            reader.close()
    storage.flush()
    committed = len(storage)
    # a new writer (the old one is gone, as after a crash) reads the segments and goes on
    storage._table.close()
    storage._release_lease()
    again = zstore.open(url, location.options)
    assert_rows(again, model, committed, "reopened writer")
    rows = cartpole(5, g)
    again.set(torch.arange(committed, committed + 5), rows)
    model[committed: committed + 5] = rows
    again.close()  # consolidates: no segment left, zarr alone reads every row
    group = zarr.open_group(url, mode="r", storage_options=location.options or None)
    block = group.attrs["zstore"]
    assert "tail" not in block and block["format_version"] == 1
    for key in model.keys():
        np.testing.assert_array_equal(group[key][: committed + 5], model[key][: committed + 5].numpy())
    final = zstore.open(url, location.options, mode="r")
    assert_rows(final, model, committed + 5, "after close")


@pytest.mark.parametrize("capacity", [10_000, 1_000_000])
def test_a_commit_per_extend_uploads_about_the_bytes_extended(location, put_bytes, capacity):
    """40 extends of 200 CartPole rows, each committed: the uploads are about the rows.

    Before log segments, each commit rewrote the tail chunk or shard whole: 49x the
    rows at capacity 10k and 466x at 1M (4 MB of shard for 9 KB of rows per commit).
    """
    if location.kind == "local":
        pytest.skip("local files are not counted by the FsspecStore wrapper")
    g = torch.Generator().manual_seed(0)
    url = location.new()
    storage = zstore.LazyMemmapStorage(capacity, scratch_dir=url, storage_options=location.options,
                                       tail_log=True)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(cartpole(1, g))
    storage.flush()
    put_bytes.clear()
    extended = 0
    for _ in range(40):
        rows = cartpole(200, g)
        extended += nbytes(rows)
        writer.extend(rows)
        storage.flush()
    data = sum(n for key, n in put_bytes.items() if not key.endswith("zarr.json"))
    metadata = sum(n for key, n in put_bytes.items() if key.endswith("zarr.json"))
    assert data <= 1.2 * extended, (data, extended)
    # bounded per commit: the record lists at most 64 segments a unit, and on S3 the copy of
    # the nodes' metadata (format.md §6)
    assert 0 < metadata <= 40 * 16384, metadata  # measured: 3.4-8.3 KiB, 7.1-13.9 on S3
    storage.close()


def test_segments_are_dropped_once_their_unit_is_stored_whole(location):
    """A completed shard replaces its segments: the next commit lists none, their objects go."""
    g = torch.Generator().manual_seed(1)
    url = location.new()
    storage = open_storage(location, url, capacity=256, chunks=16, shards=64)
    for start in range(0, 60, 10):
        storage.set(torch.arange(start, start + 10), cartpole(10, g))
        storage.flush()
    assert [seg.first for seg in storage._meta.tail["16x64"]] == [0, 10, 20, 30, 40, 50]
    fs, root = zstore.store.StoreSpec.parse(url, location.options).filesystem()
    assert len(fs.ls(f"{root}/{TAIL_PREFIX}/16x64", refresh=True)) == 6
    storage.set(torch.arange(60, 70), cartpole(10, g))  # completes shard 0, logs row 64..69
    storage.flush()
    assert [(seg.first, seg.stop) for seg in storage._meta.tail["16x64"]] == [(64, 70)]
    assert len(fs.ls(f"{root}/{TAIL_PREFIX}/16x64", refresh=True)) == 1
    storage.close()


def test_a_reader_whose_segment_was_consolidated_reads_the_stored_unit(location):
    """A reader opened before the writer stored the unit whole reads the new unit instead."""
    g = torch.Generator().manual_seed(2)
    url = location.new()
    storage = open_storage(location, url, capacity=128, chunks=8, shards=32)
    model = cartpole(40, g)
    storage.set(torch.arange(20), model[:20])
    storage.flush()
    reader = zstore.open(url, location.options, mode="r")  # lists the segment of rows 0..19
    storage.set(torch.arange(20, 40), model[20:40])  # completes shard 0: stored whole
    storage.flush()  # drops the segment and deletes its object
    assert_rows(reader, model, 20, "reader opened before the consolidation")
    storage.close()


def test_a_reader_counts_the_segments_it_fetches_all_at_once(location):
    """CacheStats.requests / fetched_bytes count a live writer's log segments a reader fetches,
    and the segments of a read are in flight together."""
    g = torch.Generator().manual_seed(7)
    url = location.new()
    storage = open_storage(location, url, capacity=256, chunks=16, shards=64)
    model = cartpole(60, g)
    for start in range(0, 60, 10):  # six commits: six segments of shard 0, no shard stored
        storage.set(torch.arange(start, start + 10), model[start:start + 10])
        storage.flush()
    fs, root = zstore.store.StoreSpec.parse(url, location.options).filesystem()
    sizes = fs.du(f"{root}/{TAIL_PREFIX}/16x64", total=False)
    assert len(sizes) == 6
    reader = zstore.open(url, location.options, mode="r")
    assert_rows(reader, model, 60, "reader of a live writer")
    stats = reader.cache_stats
    assert stats.fetched_bytes == sum(sizes.values())  # the shard objects do not exist yet
    assert stats.requests == len(model.keys()) + 6  # each key's absent shard, each segment
    if location.kind != "memory":  # memory:// answers each get before the next one starts
        assert stats.peak_in_flight == 6
    storage.close()


def test_a_damaged_or_missing_segment_raises_naming_it(location):
    url = location.new()
    storage = five_rows_logged(location, url, seed=4)
    storage._table.close()  # gone without closing (a crash): the segment stays the only copy
    storage._release_lease()
    fs, root = zstore.store.StoreSpec.parse(url, location.options).filesystem()
    path = f"{root}/{TAIL_PREFIX}/16x64/0"
    data = bytearray(fs.cat_file(path))
    data[3] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptChunkError, match="16x64/0.*CRC32C"):
        zstore.open(url, location.options, mode="r")[0]
    fs.rm_file(path)
    with pytest.raises(CorruptChunkError, match="16x64/0.*missing"):
        zstore.open(url, location.options, mode="r")[0]


def test_a_store_with_segments_is_format_2_and_older_readers_refuse_it(location):
    url = location.new()
    storage = five_rows_logged(location, url, seed=5)
    block = zarr.open_group(url, mode="r", storage_options=location.options or None).attrs["zstore"]
    assert block["format_version"] == 2 and block["tail"] == {"16x64": [[0, 5, 0]]}
    check_format_version(block, url)  # this zstore reads it
    with pytest.raises(FormatVersionError, match="upgrade zstore"):
        check_format_version({**block, "format_version": 3}, url)
    storage.close()


def test_remote_buffers_log_by_default_and_local_ones_do_not(location):
    storage = zstore.LazyMemmapStorage(10, scratch_dir=location.new(), storage_options=location.options)
    assert storage.tail_log is (location.kind == "s3")
    storage.close()


@pytest.mark.usefixtures("s3fs_transport")  # the fault is injected into s3fs
def test_a_failed_segment_upload_loses_no_row(location, monkeypatch):
    """A segment upload that keeps failing fails the commit; the rows are logged again later."""
    if location.kind == "local":
        pytest.skip("local stores are not written through FsspecStore")
    g = torch.Generator().manual_seed(6)
    url = location.new()
    storage = open_storage(location, url, capacity=128)
    model = cartpole(10, g)
    storage.set(torch.arange(10), model)
    original = FsspecStore.set

    async def refusing(self, key, value, *args, **kwargs):
        if TAIL_PREFIX in key:
            raise ConnectionError("the network is down")
        return await original(self, key, value, *args, **kwargs)

    monkeypatch.setattr(FsspecStore, "set", refusing)
    with pytest.raises(OSError, match="log segment .*the network is down"):
        storage.flush()
    assert len(zstore.open(url, location.options, mode="r")) == 0  # nothing was committed
    monkeypatch.setattr(FsspecStore, "set", original)
    storage.flush()
    reader = zstore.open(url, location.options, mode="r")
    assert len(reader) == 10
    assert_rows(reader, model, 10, "after the retry")
    storage.close()


def test_sealing_a_buffer_whose_commit_lists_segments_stores_them_first(location):
    """Regression: ``zstore.seal(url)`` of a buffer whose last commit listed log segments
    (a writer still open, or killed) published them as they were: plain Zarr read those
    rows as zeros, and the episode index, computed from the chunks, missed the episode
    whose done flag was in a segment (1 episode of 2)."""
    import zarr

    url = location.new()
    writer = zstore.LazyMemmapStorage(1000, scratch_dir=url, storage_options=location.options,
                                      tail_log=True, chunks=100, codec="zstd")
    n = 30
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[[9, 29]] = True
    writer.set(torch.arange(n), TensorDict(
        obs=torch.arange(1, n + 1).float()[:, None],
        next=TensorDict(done=done, reward=torch.ones(n, 1), batch_size=[n]), batch_size=[n]))
    writer.flush()
    assert writer._meta.tail  # the rows are in a log segment, their block not complete
    assert zstore.seal(url, location.options) == 2
    dataset = zstore.open_dataset(url, location.options)
    assert not dataset._meta.tail and dataset.episodes["length"].tolist() == [10, 20]
    plain = zarr.open_group(url, mode="r", storage_options=location.options or None)
    assert plain["obs"][:n, 0].tolist() == list(range(1, n + 1))
