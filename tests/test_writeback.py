"""Write-behind (zstore.writeback): uploads overlap the caller, and never break the commit."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.writeback import WriteBehind


def rows(start: int, n: int) -> TensorDict:
    """``n`` rows whose values are their write numbers."""
    values = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(x=values.unsqueeze(-1).expand(n, 2).clone(), batch_size=[n])


def test_failed_background_write_is_never_committed_and_is_retried(tmp_path):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, codec="zstd", chunks=4)
    storage.set(torch.arange(4), rows(0, 4))
    storage.flush()  # committed: rows 0..3
    blocker = tmp_path / "rb" / "x" / "c" / "1"
    blocker.write_bytes(b"")  # chunk 1's folder is now a file: its uploads fail
    storage.set(torch.arange(4, 8), rows(4, 4))  # completes chunk 1: the upload starts
    for _ in range(2):  # a commit never follows a lost write, however often asked
        with pytest.raises(OSError, match=r"cannot write rows \(4, 8\) of key 'x'"):
            storage.flush()
    again = zstore.open(url, mode="r")
    assert len(again) == 4 and again[:]["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    blocker.unlink()  # the fault goes away: the kept rows are stored, then committed
    storage.flush()
    again = zstore.open(url, mode="r")
    assert again[:]["x"][:, 0].tolist() == [float(v) for v in range(8)]


@pytest.mark.all_s3_servers
def test_rewritten_shard_ends_with_newest_bytes(location):
    """The same shard stored again and again: the store holds the last version."""
    url = location.new()
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url, storage_options=location.options,
                                       chunks=2, shards=8, cache_bytes=1)
    for generation in range(6):
        for row in range(8):  # add() one row at a time; the shard completes at row 7
            storage.set(row, rows(100 * generation + row, 1)[0])
    storage.flush()
    again = zstore.open(url, location.options, mode="r")
    assert again[:]["x"][:, 0].tolist() == [500.0 + r for r in range(8)]


def test_disjoint_units_do_not_wait_for_each_other():
    gate = threading.Event()
    order: list[str] = []

    async def slow() -> None:
        await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        order.append("slow")

    async def fast() -> None:
        order.append("fast")

    writes = WriteBehind("test", limit_bytes=1 << 20)
    writes.submit(slow, 10, frozenset({0}))
    writes.submit(fast, 10, frozenset({1}))  # returns although unit 0 is still in flight
    assert writes.in_flight == 2
    gate.set()
    writes.drain()
    assert sorted(order) == ["fast", "slow"] and writes.in_flight == 0


def test_byte_limit_awaits_the_oldest_write():
    done: list[int] = []

    def write(i: int):
        async def run() -> None:
            done.append(i)
        return run

    writes = WriteBehind("test", limit_bytes=100)
    for i in range(5):
        writes.submit(write(i), 60, frozenset({i}))
        assert writes.in_flight == 1  # 60 + 60 > 100: the previous one was awaited first
    writes.drain()
    assert done == [0, 1, 2, 3, 4]


def flaky(failures: int, log: list[str], name: str):
    """A write that fails its first ``failures`` attempts."""
    attempts = iter(range(1_000))

    async def run() -> None:
        if next(attempts) < failures:
            raise OSError(f"{name} failed")
        log.append(name)
    return run


def test_a_transient_failure_is_retried_before_later_writes_of_its_unit():
    log: list[str] = []
    writes = WriteBehind("s3://bucket/rb")
    writes.submit(flaky(1, log, "old"), 1, frozenset({0, 1}))
    writes.submit(flaky(0, log, "new"), 1, frozenset({1}))  # waits: "old" lands first
    writes.drain()
    assert log == ["old", "new"]


def test_a_write_rewriting_the_whole_unit_supersedes_a_failed_one():
    log: list[str] = []
    writes = WriteBehind("s3://bucket/rb")
    writes.submit(flaky(99, log, "old"), 1, frozenset({0}))
    with pytest.raises(OSError, match="old failed"):
        writes.drain()
    writes.submit(flaky(0, log, "new"), 1, frozenset({0}))
    writes.drain()
    assert log == ["new"]


def test_a_persistent_failure_names_the_store_and_keeps_raising():
    writes = WriteBehind("s3://bucket/rb")
    writes.submit(flaky(99, [], "put"), 1, frozenset({0, 1}))
    for _ in range(2):
        with pytest.raises(OSError, match=r"writing to s3://bucket/rb failed.*put failed"):
            writes.drain()
    with pytest.raises(OSError, match="put failed"):  # a write of one of its units cannot jump it
        writes.submit(flaky(0, [], "later"), 1, frozenset({1}))
