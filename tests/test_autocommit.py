"""Durability does not wait for the next write: an idle buffer is committed in the background,
and SIGTERM commits before the process ends.

The reference is the list of rows written; the store is read back by a fresh
``zstore.open`` (what another process or a restarted job sees).
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
import zarr
from tensordict import TensorDict
from zarr.core.sync import sync

import zstore
from zstore import autocommit
from zstore.lease import LEASE_NAME

ROWS, BURSTS = 200, 5
WINDOW = 3.0  # seconds: far longer than the burst takes, so no write of it commits it


def burst(i: int) -> TensorDict:
    serial = torch.arange(i * ROWS, (i + 1) * ROWS)
    return TensorDict(obs=serial[:, None].float().expand(ROWS, 3).clone(), step=serial,
                      batch_size=[ROWS])


def committed_len(url: str, options: dict) -> int:
    try:
        return len(zstore.open(url, options, mode="r"))
    except (zstore.errors.StoreNotFoundError, zstore.errors.NotAZStoreError):
        return 0  # nothing committed yet


def wait_until(condition, timeout: float) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass (the deadline is generous:
    the test asserts that the commit comes without another write, not how fast)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def assert_rows(url: str, options: dict, n: int) -> None:
    again = zstore.open(url, options, mode="r")
    assert len(again) == n
    rows = again.get(torch.arange(n))
    rows = zstore.stack_items(rows) if isinstance(rows, list) else rows
    assert rows["step"].tolist() == list(range(n))


@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_a_buffer_left_idle_after_a_burst_is_committed_without_another_write(location, cls):
    url = location.new()
    storage = getattr(zstore, cls)(10_000, scratch_dir=url, storage_options=location.options,
                                   autocommit_seconds=WINDOW)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    for i in range(BURSTS):
        writer.extend(burst(i))
    # the commit is visible before its thread marks the storage clean (it first deletes the
    # log segments the commit dropped): wait for both
    assert wait_until(lambda: committed_len(url, location.options) == ROWS * BURSTS
                      and not storage._uncommitted, 120)
    assert_rows(url, location.options, ROWS * BURSTS)
    writer.extend(burst(BURSTS))  # writing goes on after a background commit
    storage.flush()
    assert_rows(url, location.options, ROWS * (BURSTS + 1))


@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_a_storage_dropped_after_its_background_commit_releases_its_lease(location):
    """A program that writes a storage and drops it without ``close()`` (a Ray task returning)
    gets its rows committed in the background, and then the storage collected and its lease
    released. The background thread kept the last storage it committed in a loop variable
    while it slept: the lease stayed, and the next writer of that store, in this process or
    another, was refused (here forever; elsewhere for the lease's ttl)."""
    url = location.new()
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=url, storage_options=location.options,
                                       autocommit_seconds=0.5)
    storage.set(torch.arange(ROWS), burst(0))
    dropped = weakref.ref(storage)
    del storage
    assert wait_until(lambda: gc.collect() is not None and dropped() is None, 60), \
        "the committed storage is still held"
    again = zstore.open(url, location.options)
    assert len(again) == ROWS  # committed, and writable again: no LeaseError
    again.set(torch.arange(ROWS, 2 * ROWS), burst(1))
    again.close()
    assert_rows(url, location.options, 2 * ROWS)


def test_the_window_is_five_seconds_unless_told(tmp_path):
    """The README's default: rows are committed at most 5 s after they are written, by every
    persistent storage and by a reopened one."""
    url = str(tmp_path / "rb")
    built = [zstore.LazyMemmapStorage(10, scratch_dir=url),
             zstore.CompressedListStorage(10, scratch_dir=str(tmp_path / "cls"))]
    built[0].set(torch.arange(2), burst(0)[:2])
    built[0].close()
    for storage in [*built, zstore.open(url)]:
        assert storage.autocommit_seconds == 5.0


def test_no_background_commit_with_an_infinite_window(location):
    storage = zstore.LazyMemmapStorage(100, scratch_dir=location.new(),
                                       storage_options=location.options,
                                       autocommit_seconds=math.inf)
    storage.set(torch.arange(ROWS // 2), burst(0)[: ROWS // 2])
    assert storage._uncommitted and storage._commit_due_at() == math.inf
    assert storage not in autocommit._sweep(time.monotonic())[0]  # never due


def test_the_background_commit_skips_a_storage_that_is_being_written(location):
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=location.new(),
                                       storage_options=location.options, autocommit_seconds=60)
    storage.set(torch.arange(10), burst(0)[:10])
    holding, release = threading.Event(), threading.Event()

    def write_in_progress():  # holds what a write holds, on the writer's thread
        with storage._commit_lock:
            holding.set()
            release.wait(timeout=120)

    writer = threading.Thread(target=write_in_progress)
    writer.start()
    try:
        assert holding.wait(timeout=120)
        assert storage._commit_if_idle() is False and storage._uncommitted
    finally:
        release.set()
        writer.join(timeout=120)
    assert storage._commit_if_idle() is True and not storage._uncommitted


WRITER = textwrap.dedent("""
    import math, sys, torch, zstore
    from tensordict import TensorDict
    url, window, cls = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    options = {k: v for k, v in zip(sys.argv[4::2], sys.argv[5::2])}
    storage = getattr(zstore, cls)(10_000, scratch_dir=url, storage_options=options,
                                   autocommit_seconds=window)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    for i in range(%(bursts)d):
        serial = torch.arange(i * %(rows)d, (i + 1) * %(rows)d)
        writer.extend(TensorDict(obs=serial[:, None].float().expand(%(rows)d, 3).clone(),
                                 step=serial, batch_size=[%(rows)d]))
    print("written", flush=True)
    sys.stdin.read()  # idle, as an actor between calls, until killed
""") % {"bursts": BURSTS, "rows": ROWS}


def start_writer(url: str, options: dict, window: float,
                 cls: str = "LazyMemmapStorage") -> subprocess.Popen:
    args = [sys.executable, "-c", WRITER, url, str(window), cls]
    for key in ("endpoint_url", "key", "secret"):
        if key in options:
            args += [key, options[key]]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout.readline().strip() == "written", proc.communicate(timeout=60)
    return proc


@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_a_writer_killed_while_idle_keeps_what_it_wrote(location):
    """The measured failure: five extends, then the process is killed; a reopen had 0 rows."""
    url = location.new()
    proc = start_writer(url, location.options, window=WINDOW)
    try:
        assert wait_until(lambda: committed_len(url, location.options) == ROWS * BURSTS, 120)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert_rows(url, location.options, ROWS * BURSTS)


@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_sigterm_commits_before_the_process_ends(location, cls):
    url = location.new()
    proc = start_writer(url, location.options, window=math.inf, cls=cls)  # only SIGTERM commits
    assert committed_len(url, location.options) == 0
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert_rows(url, location.options, ROWS * BURSTS)


def test_sigterm_handler_leaves_a_program_handler_alone():
    code = textwrap.dedent("""
        import signal
        from zstore import autocommit
        mine = lambda *a: None
        signal.signal(signal.SIGTERM, mine)
        assert autocommit.commit_on_sigterm() is False
        assert signal.getsignal(signal.SIGTERM) is mine
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.stdout.strip() == "ok", done.stderr


LEFT_OPEN = textwrap.dedent("""
    import gc, json, os, signal, sys, threading, torch, zstore
    from tensordict import TensorDict
    url, how, options, kind = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=url, storage_options=options,
                                       codec="zstd", chunks=64) \
        if kind == "LazyMemmapStorage" else zstore.CompressedListStorage(1000, scratch_dir=url,
                                                                         storage_options=options)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(TensorDict(step=torch.arange(57), batch_size=[57]))
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait()  # until the signal ends the process
    if how == "dropped":  # neither flushed nor closed: its rows must still be committed
        del writer, storage
        gc.collect()
    # "exit": the script ends with the storage open
""")


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "CompressedListStorage"])
@pytest.mark.parametrize("how", ["exit", "sigterm", "dropped"])
@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_a_storage_left_open_is_closed_when_the_process_ends(location, how, kind):
    """At exit and on SIGTERM a compressed buffer is committed *and closed*: its log segments
    folded into its chunks and its lease released, silently. Its close ran after
    ``concurrent.futures`` had shut its pools down, failed to decode, and left the lease
    (a restart elsewhere waited out its ttl) and a page of asyncio warnings. A storage
    dropped unflushed was forgotten (the autocommit held it weakly): none of its rows
    were ever committed. A CompressedListStorage left open was committed but kept its
    lease until 2026-12-07."""
    url = location.new()
    done = subprocess.run([sys.executable, "-c", LEFT_OPEN, url, how, json.dumps(location.options),
                           kind], capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == (128 + signal.SIGTERM if how == "sigterm" else 0), done.stderr
    assert done.stderr == ""
    group = zarr.open_group(url, mode="r", storage_options=location.options or None)
    block = group.attrs["zstore"]
    assert block["length"] == 57 and "tail" not in block and block["format_version"] == 1
    assert not sync(group.store.exists(LEASE_NAME))
    stored = zstore.open(url, location.options, mode="r")
    assert [int(stored.get(i)["step"]) for i in range(57)] == list(range(57))


TERM_IN_RENEWAL = textwrap.dedent("""
    import os, signal, sys, torch, zstore
    from tensordict import TensorDict
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=sys.argv[1])
    storage.set(torch.arange(100), TensorDict(x=torch.arange(100), batch_size=[100]))
    storage.flush()
    storage.set(torch.arange(100, 200), TensorDict(x=torch.arange(100, 200), batch_size=[100]))
    replace, sent = os.replace, []
    def term_after_the_lease_is_replaced(src, dst):
        replace(src, dst)
        if str(dst).endswith("zstore-lease.json") and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # as a kill -TERM landing there by chance
    os.replace = term_after_the_lease_is_replaced
    storage.flush()
    print("not reached")
""")


def test_sigterm_inside_a_lease_renewal_still_commits_at_exit(tmp_path):
    """SIGTERM's exit was raised between the lease object's replace and the lease's note of
    its new version: the exit commit then failed (LeaseError: "does not hold the write
    lease") and the 100 rows written since the last commit were lost (1 kill in 6-20)."""
    url = str(tmp_path / "rb")
    done = subprocess.run([sys.executable, "-c", TERM_IN_RENEWAL, url], capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 128 + signal.SIGTERM and done.stderr == "", done.stderr
    assert "not reached" not in done.stdout
    assert zstore.open(url, mode="r")[:]["x"].tolist() == list(range(200))


def test_exit_lets_a_background_commit_end_and_starts_none(monkeypatch):
    """At exit the shared pools shut down right after the exit commit: a background commit
    still running then failed with a warning (seen on a memory:// CompressedListStorage
    whose commit was compressing when the script ended). The exit commit now waits for one
    in flight, and the background thread starts none after it."""
    monkeypatch.setattr(autocommit, "_exiting", False)
    storage = zstore.CompressedListStorage(10, autocommit_seconds=math.inf)
    storage.set(0, torch.zeros(3))
    in_flight, release = threading.Event(), threading.Event()
    order = []

    def background_commit():  # holds the storage as _commit_if_idle does while it flushes
        with storage._commit_lock:
            in_flight.set()
            release.wait(timeout=60)
            order.append("background commit ended")

    committer = threading.Thread(target=background_commit)
    committer.start()
    assert in_flight.wait(timeout=60)
    exited = threading.Event()
    at_exit = threading.Thread(target=lambda: (autocommit._commit_pending_at_exit(),
                                               order.append("exit commit ended"), exited.set()))
    at_exit.start()
    assert not exited.wait(timeout=0.5), "the exit commit returned with a commit in flight"
    release.set()
    committer.join(timeout=60)
    at_exit.join(timeout=60)
    assert order == ["background commit ended", "exit commit ended"]
    assert storage._has_uncommitted()
    assert storage._commit_if_idle() and storage._has_uncommitted()  # it starts no commit


def _closes_nothing_of_its_parent(storage) -> None:
    """In a forked child: run the exit hook that closes live storages; exit 1 if it closed
    the parent's ``storage``."""
    from zstore.storages import lifecycle

    lifecycle._close_live_storages()
    os._exit(0 if storage._table is not None else 1)


@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_a_forked_child_leaves_its_parents_storages_open(location):
    """The exit hooks run where multiprocessing's children end too (it calls threading's
    shutdown there): a child closed its parent's storages, whose clients and I/O loop are the
    parent's (make test-obstore timed out on test_multiwriter, a writer child never ending)."""
    url = location.new()
    storage = zstore.LazyMemmapStorage(100, scratch_dir=url, storage_options=location.options,
                                       codec="zstd", chunks=10, autocommit_seconds=math.inf)
    storage.set(torch.arange(5), burst(0)[:5])
    storage.flush()
    child = mp.get_context("fork").Process(target=_closes_nothing_of_its_parent, args=(storage,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, "the child closed its parent's storage"
    storage.set(torch.arange(5, 10), burst(0)[5:10])
    storage.flush()
    assert_rows(url, location.options, 10)
    storage.close()


def _reads_committed_rows(storage, want) -> None:
    """In a forked child: read the committed rows; exit 0 when they are ``want``."""
    os._exit(0 if storage.get(torch.arange(5))["obs"].tolist() == want else 1)


@pytest.mark.parametrize("location", ["local", "memory", "s3"], indirect=True)
def test_a_child_forked_during_a_commit_reads(location):
    """A child forked while a thread of its parent held the storage's locks (its background
    commit, a writer thread) inherited them held by a thread that does not exist in the
    child: its first read waited for good (a DataLoader worker started mid-commit hung)."""
    url = location.new()
    storage = zstore.LazyMemmapStorage(100, scratch_dir=url, storage_options=location.options,
                                       codec="zstd", chunks=10, autocommit_seconds=math.inf)
    storage.set(torch.arange(5), burst(0)[:5])
    storage.flush()
    want = storage.get(torch.arange(5))["obs"].tolist()
    code = _fork_while_held([storage._commit_lock, storage._table.lock], _reads_committed_rows,
                            (storage, want))
    assert code == 0, f"the child's read did not return (exit code {code})"
    storage.close()


def _fork_while_held(locks, target, args) -> int | None:
    """The exit code of a child forked (running ``target(*args)``) while another thread
    holds ``locks``, as a background commit holds them; a child alive after 120 s is
    killed (a negative code)."""
    held, release = threading.Event(), threading.Event()

    def commit_in_flight():
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in reversed(locks):
            lock.release()

    thread = threading.Thread(target=commit_in_flight)
    thread.start()
    held.wait()
    try:
        child = mp.get_context("fork").Process(target=target, args=args)
        child.start()
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
            child.join()
    finally:
        release.set()
        thread.join()
    return child.exitcode


def _sees_committed_items(storage, want) -> None:
    """In a forked child: exit 0 when ``storage`` holds the items ``want``, each read as
    its own item (exit 2 on an error, with the error on stderr)."""
    try:
        got = [storage.get(i).tolist() for i in range(len(storage))]
        os._exit(0 if got == want else 1)
    except Exception as exc:  # noqa: BLE001 - the parent reads the exit code
        print(repr(exc), file=sys.stderr, flush=True)
        os._exit(2)


@pytest.mark.parametrize("committed", [0, 5])
@pytest.mark.parametrize("location", ["local", "memory", "s3"], indirect=True)
def test_a_forked_child_of_a_compressed_list_storage_reads_what_was_committed(location,
                                                                              committed):
    """A child forked from a CompressedListStorage with uncommitted items counted them but
    read zeros in their place (their chunks were never stored), and hung when forked while
    a background commit held the storage's lock. As a LazyMemmapStorage's child (and
    docs/scaling.md), it now reads exactly the committed items, lock held or not."""
    url = location.new()
    storage = zstore.CompressedListStorage(100, scratch_dir=url, storage_options=location.options,
                                           autocommit_seconds=math.inf)
    items = [torch.full((4,), float(i + 1)) for i in range(8)]
    for i, item in enumerate(items[:committed]):
        storage.set(i, item)
    if committed:
        storage.flush()
    for i in range(committed, 8):
        storage.set(i, items[i])
    code = _fork_while_held([storage._commit_lock], _sees_committed_items,
                            (storage, [item.tolist() for item in items[:committed]]))
    assert code == 0, f"the child did not read the committed items (exit code {code})"
    assert [storage.get(i).tolist() for i in range(len(storage))] == [i.tolist() for i in items]
    storage.close()
    assert [t.tolist() for t in zstore.open(url, location.options, mode="r").get(
        list(range(8)))] == [i.tolist() for i in items]


@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_commit_pending_commits_every_open_storage_now(location, cls):
    """``autocommit.commit_pending()`` does what exit does, on demand: before a store's
    server goes away, say (the test suite's S3 servers use it)."""
    if location.kind == "memory":
        pytest.skip("a memory:// store ends with its process: exit commits nothing there")
    urls = [location.new() for _ in range(2)]
    storages = [getattr(zstore, cls)(1000, scratch_dir=url, storage_options=location.options,
                                     autocommit_seconds=math.inf) for url in urls]
    for storage in storages:
        writer = zstore.RoundRobinWriter()
        writer.register_storage(storage)
        writer.extend(burst(0))
    assert [committed_len(url, location.options) for url in urls] == [0, 0]
    autocommit.commit_pending()
    for url in urls:
        assert_rows(url, location.options, ROWS)
    for storage in storages:
        storage.close()


@pytest.mark.parametrize("opener", ["zstore", "zstore.torchrl"])
@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_a_resumed_run_writes_with_the_window_and_lease_ttl_it_is_opened_with(location, cls,
                                                                               opener):
    """Neither setting is stored: ``open`` takes them again. zstore.open took no commit window
    and zstore.torchrl.open neither, so a run resumed through it with a 1 s window committed
    every 5 s, and its lease could be taken over only after 60 s."""
    url = location.new()
    storage = getattr(zstore, cls)(100, scratch_dir=url, storage_options=location.options)
    storage.set(0, burst(0)[0])
    storage.close()
    again = pytest.importorskip(opener).open(url, location.options, autocommit_seconds=math.inf,
                                             lease_ttl=12.0)
    again.set(1, burst(0)[1])
    assert again._uncommitted and again._commit_due_at() == math.inf
    if location.kind != "memory":  # (a memory:// store takes no lease)
        assert again._lease.ttl == 12.0
    again.close()
    assert len(zstore.open(url, location.options, mode="r")) == 2


@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_a_storage_left_to_its_writer_is_not_tried_again_and_again(cls, tmp_path):
    """A storage with uncommitted writes whose lease was released or lost is left to its
    writer; the background thread still found it due and tried it again at once, forever
    (a CompressedListStorage that lost its lease kept a core busy for the rest of the
    process). It is now no longer watched."""
    storage = getattr(zstore, cls)(10, scratch_dir=str(tmp_path / "rb"), autocommit_seconds=0.05)
    storage.set(torch.arange(2), burst(0)[:2])
    storage.flush()
    storage.set(torch.arange(2, 4), burst(0)[2:4])  # not committed
    storage._lease.release()  # as a lease another writer took
    assert wait_until(lambda: storage not in autocommit._watched(), timeout=30)
    assert storage._commit_due_at() is not None  # still uncommitted: its writer's to act on


def _empties_then_loads(storage) -> None:
    """In a forked child: exit 0 when emptying, writing and loading act on the child's
    own state (exit 1: the parent's committed items came back)."""
    storage._empty()  # what rb.empty() calls
    storage.set(0, torch.full((4,), 7.0))
    emptied = len(storage) == 1
    storage.load_state_dict({"_storage": [torch.full((4,), 8.0)]})
    os._exit(0 if emptied and [t.tolist() for t in storage.get(slice(None))] == [[8.0] * 4] else 1)


@pytest.mark.parametrize("location", ["local", "memory"], indirect=True)
def test_a_forked_child_without_a_lease_empties_and_loads_its_own_items(location):
    """A forked child of a CompressedListStorage without a lease (``lease_ttl=None``) that
    emptied it or loaded a state dict had the parent's committed items restored over its
    work at its next write (only a write took the parent's committed state in the child)."""
    storage = zstore.CompressedListStorage(10, scratch_dir=location.new(), lease_ttl=None,
                                           storage_options=location.options)
    for i in range(3):
        storage.set(i, torch.full((4,), float(i)))
    storage.flush()
    child = mp.get_context("fork").Process(target=_empties_then_loads, args=(storage,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
