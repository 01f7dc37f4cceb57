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


def test_an_interrupted_compressed_load_leaves_no_length_without_items(tmp_path, monkeypatch,
                                                                       ctrl_c):
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
    drop = zstore.CompressedListStorage._drop_arrays

    def drop_then_ctrl_c(self):  # a Ctrl-C as the loaded storage's tables are deleted
        drop(self)
        ctrl_c()

    monkeypatch.setattr(zstore.CompressedListStorage, "_drop_arrays", drop_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        target.loads(tmp_path / "ckpt")
    assert len(target) == 0  # (it kept 400, whose items were deleted)
    monkeypatch.setattr(zstore.CompressedListStorage, "_drop_arrays", drop)
    target.loads(tmp_path / "ckpt")
    assert zstore.stack_items(target.get(torch.arange(400)))["x"].tolist() == list(range(400))


def d4rl_file(path, n: int = 300):
    """A small D4RL-style HDF5 file at ``path``."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        f["actions"] = np.zeros((n, 2), dtype=np.float32)
        f["rewards"] = np.arange(n, dtype=np.float32)
        f["terminals"] = np.arange(n) % 50 == 49
        f["timeouts"] = np.zeros(n, dtype=bool)
    return str(path)


_KILLED_IN_CREATION = """
import os, sys, zstore.storages.memmap as memmap
from zstore.dataset import import_d4rl
memmap.create_group = lambda *args, **kwargs: os._exit(9)  # killed once its lease is taken
import_d4rl(sys.argv[1], sys.argv[2], progress=False)
"""


def test_an_import_over_one_killed_in_its_creation_is_deleted_when_it_fails(tmp_path,
                                                                            monkeypatch):
    """An import killed after it took its lease leaves only the lease; the next import
    there, which takes it over, counted the location as not empty and kept its partial
    buffer when it failed: the rerun was then refused (StoreExistsError)."""
    import subprocess

    from zstore.dataset import import_d4rl, importers

    source, url = d4rl_file(tmp_path / "d.hdf5"), str(tmp_path / "ds")
    killed = subprocess.run([sys.executable, "-c", _KILLED_IN_CREATION, source, url],
                            capture_output=True, text=True, timeout=300, check=False)
    assert killed.returncode == 9 and os.listdir(url) == ["zstore-lease.json"], killed.stderr
    write = importers._Writer.write

    def failing(self, batch):
        write(self, batch)
        raise RuntimeError("the source failed part way")

    monkeypatch.setattr(importers._Writer, "write", failing)
    with pytest.raises(RuntimeError, match="part way"):
        import_d4rl(source, url, progress=False)
    assert not os.path.exists(url)
    monkeypatch.setattr(importers._Writer, "write", write)
    assert len(import_d4rl(source, url, progress=False)) > 0


@pytest.mark.parametrize("where", ["creation", "seal"])
def test_an_interrupted_import_leaves_nothing_and_runs_again(tmp_path, monkeypatch, where, ctrl_c):
    """A Ctrl-C in an import's creation of its buffer, or in its seal, left a partial store
    (key folders and no root zarr.json, or an unsealed buffer): running the import again was
    refused. The write in progress ends, the import deletes what it wrote, and runs again."""
    from zstore.dataset import import_d4rl

    path = d4rl_file(tmp_path / "d.hdf5")
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


def _block_lines(after: str = "") -> list[int]:
    """The lines of ``shielded()``'s code (from the first holding ``after``)."""
    import inspect

    source, first = inspect.getsourcelines(signals.shielded.__wrapped__)
    start = next(i for i, text in enumerate(source) if after in text)
    return [first + i for i in range(start, len(source))]


def _at_line(line: int, action) -> list:
    """A tracer calling ``action()`` the first time ``shielded()`` runs ``line``, and the
    list that notes it did; run with :func:`_traced`."""
    code, fired = signals.shielded.__wrapped__.__code__, []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def each_line(frame, event, arg):
            if event == "line" and frame.f_lineno == line and not fired:
                fired.append(line)
                action()
            return each_line
        return each_line
    return tracer, fired


def test_a_ctrl_c_anywhere_in_a_block_s_ending_is_raised_once_and_leaves_no_trace(ctrl_c):
    """A Ctrl-C landing while ``shielded()`` put SIGINT's handler back was swallowed (and
    the next block's Ctrl-C raised at once), or left zstore's handler installed for good
    (a Ctrl-C at the prompt then needed two presses). Sent at every line of the block's
    code in turn, it is raised once, and a Ctrl-C after it behaves as before."""
    for line in _block_lines():
        tracer, fired = _at_line(line, ctrl_c)
        raised, previous = 0, sys.gettrace()
        sys.settrace(tracer)
        try:
            with signals.shielded():
                pass
        except KeyboardInterrupt:
            raised += 1
        finally:
            sys.settrace(previous)
        if not fired:
            continue  # (a line the block never runs here: a worker thread's, say)
        assert raised == 1, f"a Ctrl-C at line {line} was raised {raised} times"
        assert signals._depth == 0
        with pytest.raises(KeyboardInterrupt):  # outside any block: at once
            ctrl_c()
            for _ in range(1000):
                pass
        ran = []
        with pytest.raises(KeyboardInterrupt):  # inside the next block: held to its end
            with signals.shielded():
                ctrl_c()
                ran.append(line)
        assert ran == [line]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_held_in_a_block_is_never_lost_to_a_ctrl_c_as_the_block_ends(ctrl_c,
                                                                             monkeypatch):
    """A SIGTERM held in a block, then a Ctrl-C as the block ended: the KeyboardInterrupt
    was raised in place of the exit, and the exit was lost, or made by some later block.
    Until SIGINT's handler is back the exit wins; after it, the Ctrl-C is raised and the
    exit is made as the next block ends (a loop that catches KeyboardInterrupt goes on to
    its next write, not for ever)."""
    previous = signal.signal(signal.SIGTERM, signals.exit_on_sigterm)
    outcomes = set()
    try:
        for line in _block_lines(after="finally:"):
            monkeypatch.setattr(signals, "_exiting", False)
            tracer, fired = _at_line(line, ctrl_c)
            trace = sys.gettrace()
            sys.settrace(tracer)
            try:
                with signals.shielded():
                    os.kill(os.getpid(), signal.SIGTERM)
            except SystemExit as exc:
                outcomes.add("exit")
                assert exc.code == 128 + signal.SIGTERM
            except KeyboardInterrupt:
                outcomes.add("interrupt, then the exit")
                assert fired, "a KeyboardInterrupt nobody sent"
                monkeypatch.setattr(signals, "_exiting", False)
                with pytest.raises(SystemExit) as later:
                    with signals.shielded():
                        pass
                assert later.value.code == 128 + signal.SIGTERM, f"line {line}"
            else:
                pytest.fail(f"the SIGTERM was lost (Ctrl-C at line {line})")
            finally:
                sys.settrace(trace)
            assert signals._received is None and signals._depth == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "exit" in outcomes
    monkeypatch.setattr(signals, "_exiting", False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_retry_of_failed_writes_interrupted_loses_none(ctrl_c):
    """Failed writes left the list of failed ones all together, before they were started
    again: a Ctrl-C (or a lease renewal that failed) during the first restart dropped the
    others, and the next drain succeeded with them never written."""
    landed, tries, armed = [], {}, []

    def keepalive():  # a lease renewal before each start: the Ctrl-C lands in the first retry
        if armed:
            armed.clear()
            ctrl_c()

    def make(unit):
        async def write():
            tries[unit] = tries.get(unit, 0) + 1
            if tries[unit] == 1:
                raise OSError(5, "503 SlowDown")  # transient: retried
            landed.append(unit)
        return write

    writes = WriteBehind("memory://test", keepalive=keepalive)
    writes.submit(make("a"), 1, frozenset({"a"}))
    writes.submit(make("b"), 1, frozenset({"b"}))
    while writes.in_flight:  # both fail once
        writes._await_oldest()
    armed.append(True)
    with pytest.raises(KeyboardInterrupt):
        writes.drain()
    writes.drain()
    assert sorted(landed) == ["a", "b"]


@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_a_ctrl_c_in_a_storage_s_first_write_lets_it_write_again(location, cls, ctrl_c,
                                                                   monkeypatch):
    """A Ctrl-C held through a buffer's creation was raised before the storage noted the
    group it had created: writing again raised StoreExistsError ("holds a zstore buffer
    ... 0 cells, pass existsok=True"), at that URL for every storage."""
    original = zstore.group._create_arrays

    def ctrl_c_then(*args, **kwargs):
        ctrl_c()
        return original(*args, **kwargs)

    monkeypatch.setattr(zstore.group, "_create_arrays", ctrl_c_then)
    url = location.new()
    storage = getattr(zstore, cls)(100, scratch_dir=url, storage_options=location.options)
    with pytest.raises(KeyboardInterrupt):
        storage.set(torch.arange(4), rows(0, 4))
    monkeypatch.setattr(zstore.group, "_create_arrays", original)
    storage.set(torch.arange(4), rows(0, 4))
    storage.close()
    got = zstore.open(url, location.options, mode="r").get(torch.arange(4))
    got = zstore.stack_items(got) if isinstance(got, list) else got
    assert got["x"].tolist() == [0, 1, 2, 3]


_HOLDS_THE_LEASE = """
import sys, torch, zstore
from tensordict import TensorDict
running = zstore.LazyMemmapStorage(1000, scratch_dir=sys.argv[1])
running._hold_lease()  # as an import that took its lease and is creating its buffer
print("held", flush=True)
sys.stdin.readline()
running.set(torch.arange(4), TensorDict(x=torch.arange(4), batch_size=[4]))
running.close()
print("written", flush=True)
"""


def test_a_failed_import_leaves_an_import_running_there_alone(tmp_path):
    """An import refused by the lease of another import creating its buffer there (the
    location empty but for that lease) deleted the location, the other's lease included:
    both failed, and nothing was left."""
    import subprocess

    from zstore.dataset import import_d4rl

    source, url = d4rl_file(tmp_path / "d.hdf5"), str(tmp_path / "ds")
    with subprocess.Popen([sys.executable, "-c", _HOLDS_THE_LEASE, url], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as other:
        try:
            assert other.stdout.readline().strip() == "held", other.stderr.read()
            with pytest.raises(zstore.LeaseError, match="being written"):
                import_d4rl(source, url, progress=False)
            assert os.listdir(url) == ["zstore-lease.json"]
            other.stdin.write("go\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == "written", other.stderr.read()
        finally:
            if other.poll() is None:
                other.stdin.close()  # (it ends once its write is done, or at once if refused)
                other.wait(timeout=120)
    assert zstore.open(url, mode="r").get(torch.arange(4))["x"].tolist() == [0, 1, 2, 3]
