"""Ctrl-C (SIGINT's KeyboardInterrupt; a notebook's stop button) in the middle of zstore's
work, in a process that goes on: nothing committed is lost, and the objects keep working.

Each interruption is a real SIGINT sent to this process at the point under test, so it
reaches the main thread as a user's would (not a KeyboardInterrupt raised by the test)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import signals
from zstore.writeback import WriteBehind


@pytest.fixture
def ctrl_c():
    """A function sending SIGINT to this process, which raises KeyboardInterrupt here, as in
    a notebook, whatever handler the test runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield lambda: os.kill(os.getpid(), signal.SIGINT)
    signal.signal(signal.SIGINT, previous)


def rows(start: int, n: int) -> TensorDict:
    ids = torch.arange(start, start + n)
    return TensorDict(x=ids, obs=ids.float().unsqueeze(-1).expand(n, 4).clone(), batch_size=[n])


def test_one_ctrl_c_waits_for_the_block_and_a_second_stops_it_at_once(ctrl_c):
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with signals.shielded():
            ctrl_c()
            ran.append("after one")
    assert ran == ["after one"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with signals.shielded():
            ctrl_c()
            ctrl_c()
            ran.append("after two")
    assert ran == ["after one"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with signals.shielded():  # no interruption left over from the second block
        ran.append("clean")
    assert ran == ["after one", "clean"]


@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_ctrl_c_just_after_the_lease_is_replaced_loses_no_row(location, cls, ctrl_c):
    """A Ctrl-C between the lease object's replace (a flush's renewal) and the note of its
    new version left the storage believing in a version it no longer had: the next flush
    raised LeaseError naming this process as the holder, every later write and reopen for
    the lease's ttl too, and the rows since the last commit were lost (1 in 10-30
    interrupted flushes). It is raised once the renewal is noted; the next flush commits."""
    url = location.new()
    storage = getattr(zstore, cls)(1000, scratch_dir=url, storage_options=location.options)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(rows(0, 100))
    storage.flush()
    writer.extend(rows(100, 100))
    objects = storage._lease.lease.objects
    replace = objects.replace

    def replace_then_ctrl_c(*args, **kwargs):
        token = replace(*args, **kwargs)
        objects.replace = replace
        ctrl_c()  # the signal lands as the replace returns
        return token

    objects.replace = replace_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        storage.flush()
    assert objects.replace is replace  # the interruption came where it was meant to
    storage.flush()
    writer.extend(rows(200, 10))
    storage.close()
    reader = zstore.open(url, location.options, mode="r")
    got = reader.get(torch.arange(210))
    got = zstore.stack_items(got) if isinstance(got, list) else got
    assert got["x"].tolist() == list(range(210))


def _main_thread_in(function: str) -> bool:
    """Whether the main thread is running ``function`` now (waiting in it)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None


def test_a_write_whose_wait_was_interrupted_stays_in_flight(ctrl_c):
    """drain() took a write out of those in flight before waiting for it: interrupted, the
    write went on unwatched, and a later drain (so the commit after it) no longer waited for
    it. It stays in flight until it has ended."""
    release, landed = threading.Event(), []
    writes = WriteBehind("memory://test")

    async def write():
        while not _main_thread_in("_await_oldest"):
            await asyncio.sleep(0.001)
        ctrl_c()  # while the main thread waits for this write
        await asyncio.to_thread(release.wait, 60)
        landed.append(True)

    writes.submit(write, 1, frozenset({0}))
    with pytest.raises(KeyboardInterrupt):
        writes.drain()
    assert writes.in_flight == 1 and not landed
    release.set()
    writes.drain()
    assert writes.in_flight == 0 and landed == [True]


def test_an_interrupted_compressed_load_leaves_no_length_without_items(tmp_path, monkeypatch):
    """A CompressedListStorage.loads interrupted while it reopened its item table kept the
    checkpoint's length: len 400, and get(0) raised IndexError. It is left empty; loading
    again works."""
    source = zstore.CompressedListStorage(1000)
    source.set(torch.arange(400), rows(0, 400))
    source.dumps(tmp_path / "ckpt")
    target = zstore.CompressedListStorage(1000)
    reopen = zstore.CompressedListStorage.reopened_inner_table

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt  # where Ctrl-C landed in 21 of 40 interrupted loads

    monkeypatch.setattr(zstore.CompressedListStorage, "reopened_inner_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        target.loads(tmp_path / "ckpt")
    assert len(target) == 0
    monkeypatch.setattr(zstore.CompressedListStorage, "reopened_inner_table", reopen)
    target.loads(tmp_path / "ckpt")
    assert zstore.stack_items(target.get(torch.arange(400)))["x"].tolist() == list(range(400))


@pytest.mark.parametrize("where", ["creation", "seal"])
def test_an_interrupted_import_leaves_nothing_and_runs_again(tmp_path, monkeypatch, where, ctrl_c):
    """A Ctrl-C in an import's creation of its buffer, or in its seal, left a partial store
    (key folders and no root zarr.json, or an unsealed buffer): running the import again was
    refused. The write in progress ends, the import deletes what it wrote, and runs again."""
    h5py = pytest.importorskip("h5py")
    from zstore.dataset import import_d4rl

    n = 300
    path = tmp_path / "d.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        f["actions"] = np.zeros((n, 2), dtype=np.float32)
        f["rewards"] = np.arange(n, dtype=np.float32)
        f["terminals"] = np.arange(n) % 50 == 49
        f["timeouts"] = np.zeros(n, dtype=bool)
    module, name = {"creation": (zstore.group, "_create_arrays"),
                    "seal": (zstore.storages.sealing, "write_index")}[where]
    original = getattr(module, name)

    def ctrl_c_then(*args, **kwargs):
        ctrl_c()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, ctrl_c_then)
    url = str(tmp_path / "ds")
    with pytest.raises(KeyboardInterrupt):
        import_d4rl(str(path), url, progress=False)
    assert not os.path.exists(url)
    monkeypatch.setattr(module, name, original)
    dataset = import_d4rl(str(path), url, progress=False)
    reference = import_d4rl(str(path), str(tmp_path / "reference"), progress=False)
    assert len(dataset) == len(reference) > 0
    assert (dataset[:] == reference[:]).all()
