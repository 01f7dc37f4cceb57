"""A process SIGKILLed in the middle of ``dumps`` leaves the previous checkpoint loadable.

The child process writes checkpoint 1, changes some rows, and starts checkpoint
2 with a fault hook that SIGKILLs it at the k-th occurrence of a point: a chunk
write, a carried-over chunk copy, just before the commit, just after it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import (
    CheckpointError,
    H5StorageCheckpointer,
    TensorStorageCheckpointer,
    _dest,
)
from zstore import LazyTensorStorage
from zstore.processes import process_tag

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import os, signal, sys
import torch
from tensordict import TensorDict
import checkpoint, zstore
from checkpoint import _dest


def scenario(dest, point, k, kind, first):
    storage = zstore.LazyTensorStorage(64)
    storage.checkpointer = (checkpoint.H5StorageCheckpointer() if kind.startswith("h5")
                            else checkpoint.TensorStorageCheckpointer(chunks=8))
    g = torch.Generator().manual_seed(0)
    storage.set(torch.arange(64), TensorDict(obs=torch.randn(64, 4, generator=g), batch_size=[64]))
    seen = {"n": 0}

    def fault(name):
        if name == point:
            seen["n"] += 1
            if seen["n"] == k:
                os.kill(os.getpid(), signal.SIGKILL)

    if first:
        _dest._FAULT = fault
    storage.dumps(dest)
    storage.set(torch.arange(24), TensorDict(obs=torch.randn(24, 4, generator=g), batch_size=[24]))
    _dest._FAULT = fault
    storage.dumps(dest)


# one interpreter start for every scenario: each runs (and is killed) in a forked child;
# nothing here touches zarr's event loop before forking
for line in sys.stdin.read().splitlines():
    dest, point, k, kind, first = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            scenario(dest, point, int(k), kind, first == "1")
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    print(dest, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, flush=True)
"""
SCENARIOS = {  # name: (point, k, kind, first dump killed)
    "write": ("write", 2, "tensor", False),        # new chunks half written
    "copy": ("copy", 3, "tensor", False),          # unchanged chunks half carried over
    "commit": ("commit", 1, "tensor", False),      # all staged, commit record not yet written
    "committed": ("committed", 1, "tensor", False),  # committed, old generation not yet deleted
    "h5-write": ("write", 1, "h5", False),
    "h5-commit": ("commit", 1, "h5", False),
    "h5-dir": ("commit", 1, "h5-dir", False),     # into a directory: the file is left to it
    "first": ("write", 2, "tensor", True),         # no checkpoint was ever committed
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, str]:
    """Run every scenario in one child interpreter; ``{scenario: destination}``."""
    root = tmp_path_factory.mktemp("killed")
    dests = {name: str(root / (f"{name}.h5" if kind == "h5" else name))
             for name, (_, _, kind, _) in SCENARIOS.items()}
    lines = "\n".join(f"{dests[n]} {p} {k} {kind} {int(first)}"
                       for n, (p, k, kind, first) in SCENARIOS.items())
    done = subprocess.run([sys.executable, "-c", CHILD], input=lines, cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = dict(line.split() for line in done.stdout.splitlines())
    assert results == {dest: "True" for dest in dests.values()}, done.stderr[-3000:]
    return dests


def expected(generation: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(64, 4, generator=g)
    if generation == 2:
        obs[:24] = torch.randn(24, 4, generator=g)
    return obs


def load(dest: str, kind: str = "tensor") -> torch.Tensor:
    storage = LazyTensorStorage(64)
    storage.checkpointer = H5StorageCheckpointer() if kind.startswith("h5") \
        else TensorStorageCheckpointer()
    storage.loads(dest)
    assert len(storage) == 64
    return storage.get(slice(None))["obs"]


@pytest.mark.parametrize(("name", "survivor"), [
    ("write", 1), ("copy", 1), ("commit", 1), ("committed", 2)])
def test_killed_dump_leaves_a_loadable_checkpoint(killed, name, survivor):
    dest = killed[name]
    assert torch.equal(load(dest), expected(survivor))
    # the next dump over the debris works and removes the leftovers
    storage = LazyTensorStorage(64)
    storage.loads(dest)
    storage.dumps(dest)
    _dest.settle()                       # old generations are deleted in the background
    names = sorted(p.name for p in Path(dest).iterdir())
    assert len(names) == 2 and "zarr.json" in names and names[0].startswith("gen-"), names
    assert torch.equal(load(dest), expected(survivor))


@pytest.mark.parametrize("name", ["h5-write", "h5-commit", "h5-dir"])
def test_killed_h5_dump_keeps_the_previous_file(killed, name):
    assert torch.equal(load(killed[name], "h5"), expected(1))


def test_killed_h5_dump_into_a_directory_leaves_a_dot_name_the_next_dump_removes(killed):
    """The killed dump's temporary file, as large as the checkpoint, was left for good."""
    dest = Path(killed["h5-dir"])
    (leftover,) = dest.glob(".checkpoint.h5.*.partial")  # the killed dump's temporary file
    running = dest / f".checkpoint.h5.{process_tag()}.abc123.partial"  # a live dump's
    running.touch()
    storage = LazyTensorStorage(64)
    storage.checkpointer = H5StorageCheckpointer()
    storage.loads(dest)
    storage.dumps(dest)
    assert torch.equal(load(str(dest), "h5"), expected(1))
    assert not leftover.exists() and running.exists()


def test_first_dump_killed_fails_clearly(killed):
    with pytest.raises(CheckpointError, match=f"{killed['first']}.*incomplete checkpoint"):
        load(killed["first"])
