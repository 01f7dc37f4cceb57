"""A cold read fetches the chunks of all its block groups at once (zstore/table.py).

Keys whose rows differ in size get chunks of different lengths, and so belong to different
block groups. A cold read of such a buffer fetched one group's chunks, then the next
group's: a round trip per group. The groups now fetch together. Each test gates the
groups' GETs: a GET waits until the other group has a GET in flight too, and records
whether that happened before :data:`WAIT` seconds passed. Values are checked against the
rows written, on memory, local and S3 stores.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from tensordict import TensorDict
from zarr.storage import WrapperStore

import zstore

#: How long a gated GET waits for the other group's (a bound, never reached when they overlap).
WAIT = 5.0
N = 96


def _rows(n: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    return TensorDict({
        "pixels": torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, generator=gen),
        "reward": torch.randn(n, generator=gen),
    }, [n])


class _Overlaps:
    """What the gated GETs of the groups saw: whether each met the other group's GETs."""

    def __init__(self, groups: int):
        self.groups = groups
        self.started: set[int] = set()
        self.met: list[bool] = []
        self.event: asyncio.Event | None = None

    async def gate(self, group: int) -> None:
        """Wait until every group has started a GET (or :data:`WAIT` passed)."""
        if self.event is None:
            self.event = asyncio.Event()
        self.started.add(group)
        if len(self.started) == self.groups:
            self.event.set()
        try:
            await asyncio.wait_for(self.event.wait(), WAIT)
        except TimeoutError:
            self.met.append(False)
        else:
            self.met.append(True)


class _Gated(WrapperStore):
    """A store whose GETs pass :meth:`_Overlaps.gate` first."""

    def __init__(self, store, overlaps: _Overlaps, group: int):
        super().__init__(store)
        self._overlaps, self._group = overlaps, group

    async def get(self, key, prototype, byte_range=None):
        await self._overlaps.gate(self._group)
        return await self._store.get(key, prototype, byte_range=byte_range)


def _written(location) -> tuple[str, TensorDict]:
    data = _rows(N)
    # zstd: a local buffer then goes through the chunk cache too (a raw one is memory-mapped)
    storage = location.memmap(N, codec="zstd")
    storage.set(torch.arange(N), data)
    storage.close()
    return storage.scratch_dir, data


def _gated_reader(url: str, location) -> tuple[zstore.LazyMemmapStorage, _Overlaps]:
    reader = zstore.open(url, location.options, mode="r")
    groups = reader.table.groups
    assert len(groups) == 2, [g.leaves for g in groups]  # pixels and reward chunk differently
    overlaps = _Overlaps(len(groups))
    for number, group in enumerate(groups):
        group.store = _Gated(group.store, overlaps, number)
    return reader, overlaps


def test_a_cold_read_fetches_every_group_at_once(location):
    url, data = _written(location)
    reader, overlaps = _gated_reader(url, location)
    idx = torch.tensor([5, 40, 41, 90])
    got = reader.get(idx)
    assert torch.equal(got["pixels"], data["pixels"][idx])
    assert torch.equal(got["reward"], data["reward"][idx])
    assert overlaps.met and all(overlaps.met), overlaps.met
    warm = len(overlaps.met)
    assert torch.equal(reader.get(idx)["pixels"], data["pixels"][idx])
    assert len(overlaps.met) == warm  # a warm read sends no request


def test_a_prefetch_fetches_every_group_at_once(location):
    url, data = _written(location)
    reader, overlaps = _gated_reader(url, location)
    reader.prefetch(torch.arange(N), background=True).result(timeout=60)
    assert overlaps.met and all(overlaps.met), overlaps.met
    fetched = len(overlaps.met)
    got = reader.get(torch.arange(N))
    assert torch.equal(got["pixels"], data["pixels"]) and torch.equal(got["reward"], data["reward"])
    assert len(overlaps.met) == fetched


def test_a_failing_group_raises_after_every_group_ended(location):
    """A group's failed fetch on the group pool is raised to the reader, and the buffer
    reads again once the store answers."""
    url, data = _written(location)
    reader = zstore.open(url, location.options, mode="r")
    groups = reader.table.groups
    healthy = groups[1].store

    class _Broken(WrapperStore):
        async def get(self, key, prototype, byte_range=None):
            raise ConnectionError(f"no route to {key}")

    groups[1].store = _Broken(healthy)
    with pytest.raises(Exception, match="no route to"):
        reader.get(torch.tensor([3, 70]))
    groups[1].store = healthy
    got = reader.get(torch.tensor([3, 70]))
    assert torch.equal(got["pixels"], data["pixels"][[3, 70]])
    assert torch.equal(got["reward"], data["reward"][[3, 70]])


def test_a_shut_down_group_pool_leaves_the_reads_to_the_caller(location, monkeypatch):
    """At interpreter exit the pool refuses work: a last commit's reads still read every
    group."""
    from concurrent.futures import ThreadPoolExecutor

    from zstore import table

    url, data = _written(location)
    gone = ThreadPoolExecutor(1)
    gone.shutdown()
    monkeypatch.setattr(table.GROUP_READERS, "_pool", gone)
    got = zstore.open(url, location.options, mode="r").get(torch.tensor([0, 50, 95]))
    assert torch.equal(got["pixels"], data["pixels"][[0, 50, 95]])
    assert torch.equal(got["reward"], data["reward"][[0, 50, 95]])
