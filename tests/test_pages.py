"""Paging advice of memory-mapped buffers (zstore._pages): a read-only local buffer's
chunk files are mapped for random access, its random reads ask for all their pages at once
while they wait for the disk, a long contiguous read reads ahead for its own pages only,
and a writer's maps keep the kernel's read-around."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zstore
import zstore._pages
import zstore.table

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="madvise and /proc/self/smaps are Linux's")


def _mappings() -> list[tuple[str, set[str]]]:
    """This process's mappings, from /proc/self/smaps: (header line, VmFlags)."""
    out, header = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if line[:1].isalnum() and "-" in head and ":" not in head:
            header = line
        elif header is not None and line.startswith("VmFlags:"):
            out.append((header, set(line.split()[1:])))
    return out


def _advice_of(path: Path) -> list[set[str]]:
    """The VmFlags of every mapping of ``path`` in this process (``rr``: random read,
    ``sr``: sequential read)."""
    return [flags for header, flags in _mappings() if header.endswith(str(path))]


def _buffer(tmp_path: Path, rows: int = 4096) -> tuple[str, TensorDict]:
    url = str(tmp_path / "rb")
    data = TensorDict(obs=torch.randint(0, 255, (rows, 1024), dtype=torch.uint8),
                      reward=torch.randn(rows), batch_size=[rows])
    storage = zstore.LazyMemmapStorage(rows, scratch_dir=url)
    storage.set(torch.arange(rows), data)
    storage.close()
    return url, data


def _obs_chunk(url: str) -> Path:
    chunks = [p for p in Path(url, "obs").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(chunks) == 1, chunks
    return chunks[0]


def test_a_read_only_buffer_is_mapped_for_random_access(tmp_path):
    url, data = _buffer(tmp_path)
    reader = zstore.open(url, mode="r")
    idx = torch.randint(0, len(data), (256,))
    assert torch.equal(reader.get(idx)["obs"], data["obs"][idx])
    flags = _advice_of(_obs_chunk(url))
    assert flags and all("rr" in f for f in flags), flags


def test_a_long_contiguous_read_reads_ahead_then_maps_random_again(tmp_path):
    url, data = _buffer(tmp_path)  # obs: 4 MiB, above zstore._pages.SCAN_BYTES
    reader = zstore.open(url, mode="r")
    seen = []
    original = zstore._pages.advise

    def spy(mapped, advice):
        seen.append(advice)
        return original(mapped, advice)

    zstore._pages.advise = spy
    try:
        got = reader.get(torch.arange(len(data)))
    finally:
        zstore._pages.advise = original
    assert torch.equal(got["obs"], data["obs"]) and torch.equal(got["reward"], data["reward"])
    assert seen == [zstore._pages.MADV_SEQUENTIAL, zstore._pages.MADV_RANDOM]  # obs only
    flags = _advice_of(_obs_chunk(url))
    assert flags and all("rr" in f and "sr" not in f for f in flags), flags


def test_a_writers_maps_keep_the_kernels_read_around(tmp_path):
    url, data = _buffer(tmp_path)
    writer = zstore.open(url)
    writer.set(0, data[1])
    assert torch.equal(writer.get(torch.tensor([0]))["obs"][0], data["obs"][1])
    flags = _advice_of(_obs_chunk(url))
    assert flags and not any({"rr", "sr"} & f for f in flags), flags


def test_prefetch_asks_for_exactly_the_pages_of_the_rows_in_coalesced_runs(tmp_path, monkeypatch):
    row_bytes, rows = 3000, 200  # rows straddle page boundaries
    path = tmp_path / "column"
    path.write_bytes(bytes(row_bytes * rows))
    mapped = torch.from_file(str(path), shared=False, size=row_bytes * rows,
                             dtype=torch.uint8).view(rows, row_bytes)
    calls = []
    monkeypatch.setattr(zstore._pages, "advise_range",
                        lambda address, nbytes, advice: calls.append((address, nbytes, advice)))
    wanted = np.array([7, 0, 1, 5, 100, 101, 7, 199])
    zstore._pages.prefetch_rows(mapped, wanted)
    page, base = mmap.PAGESIZE, mapped.data_ptr()
    expected = {p for r in wanted.tolist()
                for p in range((base + r * row_bytes) // page, (base + (r + 1) * row_bytes - 1) // page + 1)}
    covered = []
    for address, nbytes, advice in calls:
        assert advice == zstore._pages.MADV_WILLNEED and address % page == 0 and nbytes % page == 0
        covered.append(range(address // page, (address + nbytes) // page))
    assert {p for run in covered for p in run} == expected
    assert all(a.stop < b.start for a, b in zip(covered, covered[1:]))  # disjoint, not adjacent


def test_a_read_only_table_prefetches_only_while_its_reads_wait_for_the_disk(tmp_path, monkeypatch):
    url, data = _buffer(tmp_path)
    reader = zstore.open(url, mode="r")
    table = reader._table
    prefetched = []
    original = zstore.table.prefetch_rows
    monkeypatch.setattr(zstore.table, "prefetch_rows",
                        lambda mapped, rows: (prefetched.append(len(rows)), original(mapped, rows)))
    monkeypatch.setattr(zstore.table, "disk_reads", lambda: 0)  # a warm page cache
    idx = torch.randint(0, len(data), (256,))
    assert table.cold  # a fresh reader assumes the disk
    assert torch.equal(reader.get(idx)["obs"], data["obs"][idx])
    assert prefetched == [256, 256] and not table.cold  # both keys; then no disk read seen
    assert torch.equal(reader.get(idx)["reward"], data["reward"][idx])
    assert prefetched == [256, 256]
    reads = iter(range(0, 100, 7))  # every read now waits for the disk
    monkeypatch.setattr(zstore.table, "disk_reads", lambda: next(reads))
    reader.get(idx)
    assert table.cold and prefetched == [256, 256]
    reader.get(idx)
    assert prefetched == [256, 256, 256, 256]


def _drop_page_cache(path: Path) -> None:
    """Write ``path``'s pages back, then drop them from the page cache (unmapped ones)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _in_page_cache(path: Path, offset: int, nbytes: int) -> bool:
    """Whether reading ``nbytes`` at ``offset`` needs no disk (``RWF_NOWAIT`` refuses then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(nbytes)], offset, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _drop_or_skip(path: Path, offset: int, nbytes: int) -> None:
    """Drop ``path``'s page cache; skip the test where ``nbytes`` at ``offset`` stay cached."""
    _drop_page_cache(path)
    if _in_page_cache(path, offset, nbytes):
        pytest.skip("this filesystem kept the chunk file's pages cached")


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2's RWF_NOWAIT")
def test_a_table_keeps_prefetching_while_its_prefetched_reads_still_read_the_disk(
        tmp_path, monkeypatch):
    """A prefetched read takes no major fault (its faults find the pages being read in), yet
    it read from the disk: the next read must prefetch too. Judged by major faults alone,
    every other sample of a disk-resident buffer faulted its pages in one at a time."""
    row_bytes, rows = 64 << 10, 256  # 16 pages a row
    url = str(tmp_path / "rb")
    data = TensorDict(obs=torch.randint(0, 255, (rows, row_bytes), dtype=torch.uint8),
                      batch_size=[rows])
    storage = zstore.LazyMemmapStorage(rows, scratch_dir=url)
    storage.set(torch.arange(rows), data)
    storage.close()
    chunk = _obs_chunk(url)
    reader = zstore.open(url, mode="r")
    prefetched = []
    original = zstore.table.prefetch_rows
    monkeypatch.setattr(zstore.table, "prefetch_rows",
                        lambda mapped, wanted: (prefetched.append(wanted.tolist()),
                                                original(mapped, wanted)))
    for round_ in range(4):
        idx = torch.arange(round_, rows, 32)  # rows no earlier round mapped
        _drop_or_skip(chunk, int(idx[0]) * row_bytes, row_bytes)
        assert torch.equal(reader.get(idx)["obs"], data["obs"][idx])
        assert prefetched[-1] == idx.tolist(), f"round {round_} did not prefetch"
        assert reader._table.cold  # its pages came from the disk
    assert len(prefetched) == 4


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2's RWF_NOWAIT")
@pytest.mark.parametrize("background", [False, True])
def test_prefetch_asks_the_disk_for_the_rows_pages_ahead_of_the_read(tmp_path, background):
    url, data = _buffer(tmp_path, rows=2048)
    chunk = _obs_chunk(url)
    reader = zstore.open(url, mode="r")
    idx = torch.arange(7, 2048, 97)
    _drop_or_skip(chunk, int(idx[0]) * 1024, 1024)
    before = zstore._pages.disk_reads()
    future = reader.prefetch(idx, background=background)
    if background:
        assert future.result() is None
    assert zstore._pages.disk_reads() > before  # the reads were asked of the disk
    assert torch.equal(reader.get(idx)["obs"], data["obs"][idx])


def test_add_writes_rows_that_numpy_cannot_view(tmp_path):
    """add() writes a row through a NumPy view of the map; a tensor NumPy refuses (one that
    needs grad, a conjugate view) goes through torch instead, with the same bytes."""
    storage = zstore.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "rb"))
    grad = torch.randn(3, requires_grad=True)
    z = torch.randn(2, dtype=torch.complex64)
    storage.set(0, TensorDict(x=grad, z=z.conj()))
    storage.set(1, TensorDict(x=grad.detach() * 2, z=z))
    got = storage.get(torch.tensor([0, 1]))
    assert torch.equal(got["x"], torch.stack([grad.detach(), grad.detach() * 2]))
    assert torch.equal(got["z"], torch.stack([z.conj().resolve_conj(), z]))


def _flags_at(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    for header, flags in _mappings():
        start, end = (int(x, 16) for x in header.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return flags
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(zstore._pages.MADV_HUGEPAGE is None, reason="no MADV_HUGEPAGE here")
@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("huge", [True, False])
def test_a_large_read_lands_in_memory_advised_for_huge_pages(tmp_path, where, huge, monkeypatch):
    """A large result is gathered into memory advised ``MADV_HUGEPAGE`` (``hg``), faulted in
    2 MiB at a time: the 4 KiB faults of a fresh 108 MiB result cost 4x the copy. Where
    huge pages are not wanted (a balloon reports free memory), zstore gives no such advice.

    The plain case is judged by the advice given, not by the mapping's flags: glibc may
    serve the result from heap memory that an earlier test of this process advised, and a
    mapping keeps its flags when its memory is freed and reused."""
    monkeypatch.setattr(zstore._pages, "HUGE_PAGES", huge)
    advised, advise_range = [], zstore._pages.advise_range

    def recording(address, nbytes, advice):
        advised.append((address, nbytes, advice))
        return advise_range(address, nbytes, advice)

    monkeypatch.setattr(zstore._pages, "advise_range", recording)
    rows = 1024
    url = str(tmp_path / "rb") if where == "local" else f"memory://pages/{tmp_path.name}"
    data = TensorDict(obs=torch.randint(0, 255, (rows, 40_000), dtype=torch.uint8),
                      batch_size=[rows])
    storage = zstore.LazyMemmapStorage(rows, scratch_dir=url)
    storage.set(torch.arange(rows), data)
    storage.flush()
    reader = zstore.open(url, mode="r")
    got = reader.get(torch.arange(rows))["obs"]  # 39 MiB: glibc maps it afresh
    assert torch.equal(got, data["obs"])
    huge_advice = [(a, n) for a, n, advice in advised if advice == zstore._pages.MADV_HUGEPAGE]
    if huge:
        assert any(a <= got.data_ptr() < a + n for a, n in huge_advice), huge_advice
        assert "hg" in _flags_at(got.data_ptr()), "the kernel did not take the advice"
    else:
        assert huge_advice == [], "huge pages advised where they are not wanted"
    storage.close()


def _virtio(root: Path, *devices: tuple[str, str]) -> Path:
    """A sysfs ``virtio/devices`` tree of (device id, feature bits) entries."""
    for number, (device, features) in enumerate(devices):
        entry = root / f"virtio{number}"
        entry.mkdir(parents=True)
        (entry / "device").write_text(device + "\n")
        (entry / "features").write_text(features + "\n")
    return root


def test_a_balloon_that_reports_free_pages_turns_huge_pages_off(tmp_path, monkeypatch):
    """A virtio balloon (device 0x0005) with free page reporting (feature bit 5) hands free
    2 MiB blocks back to the hypervisor: huge pages are then not wanted. Other devices, a
    balloon without reporting, or no virtio bus leave them on; the variable overrides."""
    monkeypatch.delenv(zstore._pages.HUGE_PAGES_ENV, raising=False)
    reporting = _virtio(tmp_path / "a", ("0x0001", "1" * 64), ("0x0005", "011001" + "0" * 58))
    silent = _virtio(tmp_path / "b", ("0x0005", "011000" + "0" * 58), ("0x0002", "1" * 64))
    assert zstore._pages.free_pages_reported(reporting)
    assert not zstore._pages.free_pages_reported(silent)
    assert not zstore._pages.free_pages_reported(tmp_path / "no-virtio-bus")
    if zstore._pages.MADV_HUGEPAGE is None:
        return
    assert not zstore._pages.huge_pages_wanted(reporting)
    assert zstore._pages.huge_pages_wanted(silent)
    monkeypatch.setenv(zstore._pages.HUGE_PAGES_ENV, "1")
    assert zstore._pages.huge_pages_wanted(reporting)
    monkeypatch.setenv(zstore._pages.HUGE_PAGES_ENV, "0")
    assert not zstore._pages.huge_pages_wanted(silent)
    monkeypatch.setenv(zstore._pages.HUGE_PAGES_ENV, "yes")
    with pytest.warns(UserWarning, match="ZSTORE_HUGE_PAGES='yes' is neither 1 nor 0"):
        assert not zstore._pages.huge_pages_wanted(reporting)
