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


def test_failed_background_write_is_never_committed(tmp_path):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, codec="zstd", chunks=4)
    storage.set(torch.arange(4), rows(0, 4))
    storage.flush()  # committed: rows 0..3
    (tmp_path / "rb" / "x" / "c" / "1").write_bytes(b"")  # chunk 1's folder is now a file
    storage.set(torch.arange(4, 8), rows(4, 4))  # completes chunk 1: its upload starts and fails
    for _ in range(2):  # sticky: a lost write can never be followed by a commit
        with pytest.raises(OSError, match=r"cannot write rows \(4, 8\) of key 'x'"):
            storage.flush()
    again = zstore.open(url, mode="r")
    assert len(again) == 4
    assert again[:]["x"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


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
    writes.submit(slow(), 10, frozenset({0}))
    writes.submit(fast(), 10, frozenset({1}))  # returns although unit 0 is still in flight
    assert writes.in_flight == 2
    gate.set()
    writes.drain()
    assert sorted(order) == ["fast", "slow"] and writes.in_flight == 0


def test_byte_limit_awaits_the_oldest_write():
    done: list[int] = []

    async def write(i: int) -> None:
        done.append(i)

    writes = WriteBehind("test", limit_bytes=100)
    for i in range(5):
        writes.submit(write(i), 60, frozenset({i}))
        assert writes.in_flight == 1  # 60 + 60 > 100: the previous one was awaited first
    writes.drain()
    assert done == [0, 1, 2, 3, 4]


def test_failure_names_the_store_and_keeps_raising():
    async def broken() -> None:
        raise OSError("disk full")

    async def fine() -> None:
        pass

    writes = WriteBehind("s3://bucket/rb")
    writes.submit(broken(), 1, frozenset({0}))
    with pytest.raises(OSError, match=r"earlier write to s3://bucket/rb failed.*disk full"):
        writes.drain()
    with pytest.raises(OSError, match="disk full"):
        writes.submit(fine(), 1, frozenset({1}))
