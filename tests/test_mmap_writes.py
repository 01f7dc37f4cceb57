"""Writes to a local memory-mapped buffer (zstore.table.MmapTable): single rows, blocks and
scattered rows hold exactly what a plain TensorDict model holds; the sparse chunk files get
their disk blocks allocated a few MiB ahead of the writes, so that a full disk is an
``OSError`` naming the key, not a SIGBUS."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import zstore

ROWS = 64
WIDE = 2048  # float32 per row: 8 KiB, two pages


def _item(gen: torch.Generator) -> TensorDict:
    return TensorDict(obs=torch.randn(WIDE, generator=gen),
                      half=torch.randn(WIDE, generator=gen).to(torch.bfloat16),
                      action=torch.randint(0, 9, (), generator=gen),
                      done=torch.rand((), generator=gen) > 0.5, batch_size=[])


def _model(gen: torch.Generator) -> TensorDict:
    return torch.stack([_item(gen) for _ in range(ROWS)]).zero_()


def _assert_same(got: TensorDict, want: TensorDict) -> None:
    for key in want.keys():
        assert torch.equal(got[key], want[key]), key


def _all_rows(storage) -> TensorDict:
    """Every row of the buffer, written or not (``get`` stops at its length)."""
    rows = storage.table.read(torch.arange(ROWS))
    return TensorDict({key: rows[key].view(dtype) for key, dtype in
                       (("obs", torch.float32), ("half", torch.bfloat16), ("action", torch.int64),
                        ("done", torch.bool))}, batch_size=[ROWS])


def test_every_write_path_matches_a_model(tmp_path):
    gen = torch.Generator().manual_seed(0)
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(ROWS, scratch_dir=url)
    model = _model(gen)

    def put(index, value):
        storage.set(index, value)
        model[index] = value

    for row in (0, 1, 5, 40, 3):  # fresh rows, past the high-water mark and below it
        put(row, _item(gen))
    for row in (1, 40, 2):  # rewritten rows and a fresh one below the high-water mark
        put(row, _item(gen))
    put(range(8, 24), torch.stack([_item(gen) for _ in range(16)]))  # a contiguous block
    scattered = torch.stack([_item(gen) for _ in range(4)])
    storage.set(torch.tensor([60, 10, 50, 10]), scattered)  # the last write of row 10 wins
    for row, item in zip((60, 10, 50, 10), scattered):
        model[row] = item
    grad = _item(gen)
    grad["obs"] = grad["obs"].requires_grad_()  # NumPy refuses a tensor that needs grad
    storage.set(30, grad)
    model[30] = grad.detach()
    block = torch.stack([_item(gen) for _ in range(6)])
    strided = block.apply(lambda v: v.T.contiguous().T if v.ndim == 2 else v)  # column-major rows
    assert not strided["obs"].is_contiguous()
    put(range(41, 47), strided)
    _assert_same(_all_rows(storage), model)
    storage.close()
    _assert_same(_all_rows(zstore.open(url, mode="r")), model)


def test_disk_blocks_are_allocated_ahead_of_the_writes_and_the_files_stay_sparse(tmp_path):
    url = str(tmp_path / "rb")
    rows = zstore.table.RESERVE_BYTES // WIDE  # obs: four reservations long
    storage = zstore.LazyMemmapStorage(rows, scratch_dir=url)
    storage.set(0, _item(torch.Generator().manual_seed(1)))
    obs = storage.table.chunk_files["obs"]
    assert os.stat(obs).st_size == rows * 4 * WIDE
    allocated = os.stat(obs).st_blocks * 512
    assert zstore.table.RESERVE_BYTES <= allocated < 2 * zstore.table.RESERVE_BYTES, allocated
    ahead = storage.table.reserved
    storage.set(range(ahead, ahead + 3), torch.stack([_item(torch.Generator()) for _ in range(3)]))
    allocated = os.stat(obs).st_blocks * 512
    assert (ahead + 3) * 4 * WIDE <= allocated < os.stat(obs).st_size, allocated


_FILL_A_SMALL_DISK = """
import sys, torch, zstore
from tensordict import TensorDict
storage = zstore.LazyMemmapStorage(64, scratch_dir=sys.argv[1])
rows = [TensorDict(obs=torch.full((8192,), float(i), dtype=torch.float64), batch_size=[])
        for i in range(64)]  # 64 KiB a row: 4 MiB of sparse file on a 1 MiB disk
written = 0
try:
    for row in rows[:4]:
        storage.set(written, row)
        written += 1
    storage.set(range(4, 64), torch.stack(rows[4:]))  # a block, then single rows
    written = 64
except OSError as exc:
    print("extend failed:", exc)
try:
    for row in rows[written:]:
        storage.set(written, row)
        written += 1
except OSError as exc:
    print("add failed:", exc)
got = storage.get(torch.arange(written))["obs"][:, 0]
assert torch.equal(got, torch.arange(written, dtype=torch.float64)), got
print("kept", written)
"""


@contextlib.contextmanager
def _small_disk(tmp_path):
    """A 1 MiB tmpfs mounted for the block (Linux, as root; skips elsewhere)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounts a 1 MiB tmpfs (Linux, as root)")
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_an_error_naming_the_key_not_a_crash(tmp_path):
    with _small_disk(tmp_path) as disk:
        run = subprocess.run([sys.executable, "-c", _FILL_A_SMALL_DISK, str(disk / "rb")],
                             capture_output=True, text=True, timeout=300)
    # through a map of the sparse file, the first store past the disk's end is a SIGBUS (-7)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    assert "extend failed: [Errno 28] cannot allocate rows 4..63 of key 'obs'" in run.stdout
    kept = int(run.stdout.split("kept ")[1])
    assert 4 < kept < 16, run.stdout  # the disk's room ahead ran out, then the disk itself
    assert f"add failed: [Errno 28] cannot allocate rows {kept}..{kept} of key 'obs'" in run.stdout
    assert "No space left on device" in run.stdout


_WRITE_INTO_HOLES = """
import os, sys, torch, zstore
from tensordict import TensorDict
url, filler, spare = sys.argv[1:]
with open(spare, "wb") as f:  # room for the commit's metadata, not for a row
    f.write(b"x" * 32768)
try:
    with open(filler, "wb") as f:
        while True:
            f.write(b"x" * 4096)
            f.flush()
except OSError:
    pass
os.remove(spare)
storage = zstore.open(url)
row = lambda v: TensorDict(obs=torch.full((8192,), v, dtype=torch.float64), batch_size=[])
try:
    storage.set(10, row(10.0))
except OSError as exc:
    print("write failed:", exc)
os.remove(filler)
storage.set(10, row(10.0))
storage.flush()
# rows 0..10 (only those: reading a hole of a tmpfs file through a map takes a page too)
print("first values", storage.get(torch.arange(11))["obs"][:, 0].tolist())
"""


def test_holes_of_a_sparse_copy_are_allocated_before_a_reopened_buffer_writes(tmp_path):
    """A buffer copied sparse (cp --sparse, rsync -S) has holes where its rows were zeros;
    on a full disk, writing one through the map of a reopened buffer must not SIGBUS."""
    source = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(64, scratch_dir=source)
    values = torch.zeros(64)
    values[:4] = torch.arange(1.0, 5.0)  # 4 rows of data, 60 rows of zeros: 3.75 MiB of holes
    storage.set(range(64), TensorDict(obs=values[:, None].expand(64, 8192).to(torch.float64),
                                      batch_size=[64]))
    storage.close()
    with _small_disk(tmp_path) as disk:
        subprocess.run(["cp", "-r", "--sparse=always", source, str(disk / "rb")], check=True)
        obs = next(p for p in (disk / "rb").rglob("*") if p.is_file() and p.stat().st_size
                   == 64 * 8192 * 8)
        assert obs.stat().st_blocks * 512 < 512 * 1024  # holes where the zeros were
        run = subprocess.run([sys.executable, "-c", _WRITE_INTO_HOLES, str(disk / "rb"),
                              str(disk / "filler"), str(disk / "spare")],
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)  # not SIGBUS (-7)
    assert "write failed: [Errno 28] cannot allocate rows 0..10 of key 'obs'" in run.stdout
    values[10] = 10.0
    assert f"first values {values[:11].tolist()}" in run.stdout
