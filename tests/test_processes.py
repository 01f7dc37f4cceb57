"""Storages across processes: pickled as a spec and reopened; forked children see only
what is committed and never commit their parent's state."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import zstore


def rows(start: int, n: int) -> TensorDict:
    return TensorDict(x=torch.arange(start, start + n, dtype=torch.float32), batch_size=[n])


def read_all(storage) -> list[float]:
    """Run in a spawned process: the storage arrives pickled."""
    return storage[:]["x"].tolist()


def test_pickle_is_a_spec_not_live_objects(location):
    storage = zstore.LazyMemmapStorage(32, scratch_dir=location.new(),
                                       storage_options=location.options, codec="zstd", chunks=8)
    storage.set(torch.arange(5), rows(0, 5))
    payload = pickle.dumps(storage)  # flushes and commits first
    assert b"fsspec" not in payload and b"zarr" not in payload
    again = pickle.loads(payload)
    assert again[:]["x"].tolist() == [0, 1, 2, 3, 4]
    assert len(zstore.open(storage.scratch_dir, location.options, mode="r")) == 5


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_spawned_process_reads_the_pickled_storage(kind, tmp_path, request):
    if kind == "s3":
        options = request.getfixturevalue("s3_options")
        url = f"s3://{request.getfixturevalue('s3_bucket')}/spawned"
    else:
        options, url = {}, str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options)
    storage.set(torch.arange(6), rows(10, 6))
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(read_all, (storage,)) == [10, 11, 12, 13, 14, 15]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("codec", [None, "zstd"])
def test_forked_child_sees_committed_rows_only_and_never_commits_for_the_parent(tmp_path, codec):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(64, scratch_dir=url, codec=codec,
                                       chunks=None if codec is None else 16)
    storage.set(torch.arange(4), rows(1, 4))
    storage.flush()
    storage.set(torch.arange(4, 8), rows(5, 4))  # not committed when the child is forked
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = len(storage) == 4 and storage[:]["x"].tolist() == [1, 2, 3, 4]
        storage.close()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    storage.flush()
    assert zstore.open(url, mode="r")[:]["x"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_never_reuses_the_parents_filesystem(s3_options, s3_bucket):
    """fsspec caches filesystems and s3fs runs its own event loop: a child gets new ones."""
    base = f"s3://{s3_bucket}/fork-fs-{os.getpid()}"
    storage = zstore.LazyMemmapStorage(16, scratch_dir=f"{base}/lms", storage_options=s3_options,
                                       codec="zstd", chunks=4)
    storage.set(torch.arange(6), rows(0, 6))
    storage.flush()
    assert storage[:]["x"].tolist() == [0, 1, 2, 3, 4, 5]  # the parent's cache is warm
    items = zstore.CompressedListStorage(8, scratch_dir=f"{base}/items", storage_options=s3_options)
    items.set(0, torch.arange(3))
    items.close()  # committed, lease released: the child may write
    reopened = zstore.open(f"{base}/items", s3_options)
    assert reopened.get(0).tolist() == [0, 1, 2]
    parent_fs = storage.spec.filesystem()[0]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            ok = storage.spec.filesystem()[0] is not parent_fs
            ok = ok and storage[:]["x"].tolist() == [0, 1, 2, 3, 4, 5]
            reopened.set(1, torch.arange(4))
            reopened.close()
        except BaseException:  # noqa: BLE001 - any failure in the child is a failed check
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [t.tolist() for t in zstore.open(f"{base}/items", s3_options, mode="r").get([0, 1])] == \
        [[0, 1, 2], [0, 1, 2, 3]]
    assert storage.spec.filesystem()[0] is parent_fs  # the parent keeps its own
    storage.close()


def _never_runs(storage) -> None:  # the spawn is refused before a child starts
    raise AssertionError("a refused storage reached a spawned process")


@pytest.mark.parametrize("make", [
    lambda url: zstore.ListStorage(8),
    lambda url: zstore.LazyStackStorage(8),
], ids=["ListStorage", "LazyStackStorage"])
def test_spawning_a_process_with_an_in_ram_list_storage_is_refused(make, tmp_path):
    """As TorchRL's: the child would write into a copy of the list, silently lost."""
    storage = make(str(tmp_path / "rb"))
    storage.set(0, rows(0, 1))
    process = mp.get_context("spawn").Process(target=_never_runs, args=(storage,))
    with pytest.raises(RuntimeError, match="Cannot share a storage of type .*LazyMemmapStorage"):
        process.start()
    pickle.loads(pickle.dumps(storage))  # plain pickling (a copy, asked for) still works


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "LazyMemmapStorage"])
def test_spawning_a_process_with_a_storage_not_initialized_is_refused(kind, tmp_path):
    storage = zstore.LazyTensorStorage(8) if kind == "LazyTensorStorage" else \
        zstore.LazyMemmapStorage(8, scratch_dir=str(tmp_path / "rb"))
    process = mp.get_context("spawn").Process(target=_never_runs, args=(storage,))
    with pytest.raises(RuntimeError, match="it has not been initialized yet.*Write its first rows"):
        process.start()


def extend_buffer(rb, value: float, n: int, done) -> None:
    """Run in a spawned process: the buffer (storage and writer) arrives pickled."""
    try:
        rb.extend(rows(0, n).apply(lambda x: torch.full_like(x, value)))
        done.put("finish")
    except BaseException as exc:  # reported, so the parent fails with the reason
        done.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("kind", ["memmap-local", "tensor-in-ram"])
def test_processes_handed_a_buffer_write_rows_of_their_own(kind, tmp_path):
    """zstore's own buffer and writer, in the parent and two spawned processes writing at
    once: every write takes rows of its own (a shared cursor), none overwrites another's."""
    storage = (zstore.LazyMemmapStorage(40, scratch_dir=str(tmp_path / "rb"))
               if kind == "memmap-local" else zstore.LazyTensorStorage(40))
    rb = zstore.ReplayBuffer(storage, writer=zstore.TensorDictRoundRobinWriter())
    rb.extend(rows(0, 8).apply(lambda x: torch.zeros_like(x)))
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    children = [ctx.Process(target=extend_buffer, args=(rb, value, 8, done)) for value in (1, 2)]
    for child in children:
        child.start()
    for _ in children:
        assert done.get(timeout=120) == "finish"
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    rb.extend(rows(0, 8).apply(lambda x: torch.full_like(x, 3.0)))
    assert len(rb) == 32 and rb.writer._cursor == 32
    stored = rb[:32]
    assert sorted(stored["x"].tolist()) == [0.0] * 8 + [1.0] * 8 + [2.0] * 8 + [3.0] * 8
    assert stored["index"].tolist() == list(range(32))  # each row knows where it was written
    if kind == "memmap-local":
        storage.flush()
        assert len(zstore.open(storage.scratch_dir, mode="r")) == 32


def hold_the_locks_until_killed(rb, holding, never) -> None:
    """Run in a spawned process: be in the middle of a write (the writer's and the
    storage's locks held) when the parent kills it."""
    with rb.writer._ints.lock, rb.storage._counts.lock:
        holding.put("holding")
        never.get()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["memmap-local", "tensor-in-ram"])
def test_a_process_killed_in_the_middle_of_a_write_leaves_the_others_writing(kind, tmp_path):
    """The kernel releases what a killed process held: the others neither wait for ever nor
    skip rows (its write never finished, so the cursor is where it was)."""
    storage = (zstore.LazyMemmapStorage(40, scratch_dir=str(tmp_path / "rb"))
               if kind == "memmap-local" else zstore.LazyTensorStorage(40))
    rb = zstore.ReplayBuffer(storage)
    rb.extend(rows(0, 8))
    ctx = mp.get_context("spawn")
    holding, never = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=hold_the_locks_until_killed, args=(rb, holding, never))
    child.start()
    assert holding.get(timeout=120) == "holding"
    child.kill()
    child.join(120)
    rb.extend(rows(8, 8))  # waited for ever on the dead process's lock before
    assert len(rb) == 16 and rb.writer._cursor == 16
    assert rb[:16]["x"].tolist() == list(range(16))


def test_a_copy_of_a_storage_shared_with_processes_shares_nothing(tmp_path):
    """After a storage was handed to a process, a plain pickle of it (a copy) is a snapshot:
    it pickles (multiprocessing's shared memory would refuse), and its writes stay its own."""
    storage = zstore.LazyTensorStorage(16)
    rb = zstore.ReplayBuffer(storage)
    rb.extend(rows(0, 4))
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    child = ctx.Process(target=extend_buffer, args=(rb, 1, 2, done))
    child.start()
    assert done.get(timeout=120) == "finish"
    child.join(120)
    copy = pickle.loads(pickle.dumps(rb))
    assert len(copy) == 6 and copy.writer._cursor == 6
    copy.extend(rows(0, 2))
    assert len(copy) == 8 and len(rb) == 6 and rb.writer._cursor == 6


def test_a_lease_holder_keeps_its_lease_while_the_processes_sharing_it_write_nothing(
        tmp_path, monkeypatch):
    """The processes writing with the lease holder write without the lease: an idle group's
    lease must not go stale (another writer could then take the store)."""
    from zstore import lease as lease_mod

    now = [1_000_000.0]
    monkeypatch.setattr(lease_mod, "clock", lambda: now[0])
    storage = zstore.LazyMemmapStorage(16, scratch_dir=str(tmp_path / "rb"), lease_ttl=60)
    storage.set(torch.arange(2), rows(0, 2))
    storage.flush()
    storage._share_with_processes()  # what pickling it for a spawned process does
    lease = storage._lease
    renewed = lease._renewed
    assert storage._commit_due_at() > lease_mod.time.monotonic() + 20  # nothing due yet
    now[0] += 31  # past half the ttl, nothing written
    assert storage._commit_due_at() <= lease_mod.time.monotonic()
    assert storage._commit_if_idle()
    assert lease._renewed == now[0] > renewed
    now[0] += 45  # 76 s after the first renewal: without the keep-alive, stale by now
    with pytest.raises(zstore.LeaseError, match="being written"):
        lease_mod.Lease(storage.spec, 60).ensure()  # another writer is still kept out


def test_a_memory_store_unpickled_in_another_process_is_refused():
    """Pickled to a process that multiprocessing did not start (a Ray actor), a memory://
    buffer with nothing written came back as a fresh store of that process: what it wrote
    there was lost to the writer's process without a word. In its own process a copy works."""
    storage = zstore.LazyMemmapStorage(10, scratch_dir="memory://zstore-tests/pickled-away")
    blob = pickle.dumps(storage)
    assert pickle.loads(blob).max_size == 10
    done = subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                          input=blob, capture_output=True, timeout=120, check=False)
    assert done.returncode == 1
    assert b"RuntimeError: Cannot unpickle the LazyMemmapStorage at memory://zstore-tests/pickled-away " \
        b"in another process" in done.stderr, done.stderr

