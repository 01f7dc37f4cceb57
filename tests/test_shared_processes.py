"""Processes sharing one buffer, as TorchRL's do (issue #20): a storage handed to processes
that multiprocessing spawns is written by all of them, each seeing the others' rows and
length, and ``shared_init=True`` lets the first process that writes create the rows.

Every scenario runs over zstore's storage and over TorchRL's own with the same writes, and
what each process observed must be the same. A persistent store's rows are committed by the
process that holds its lease, whichever process wrote them, and reopen intact."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from tensordict import TensorDict

import zstore

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

SPAWN = multiprocessing.get_context("spawn")
WAIT = 120  # seconds a process waits for another's message (a loaded machine is slow to spawn)


def batch(value: float, n: int = 10) -> TensorDict:
    return TensorDict({"a": torch.full((n,), float(value)), "next": {"reward": torch.ones(n)}},
                      [n])


def buffer(storage) -> "T.TensorDictReplayBuffer":
    return T.TensorDictReplayBuffer(storage=storage, writer=T.TensorDictRoundRobinWriter(),
                                    sampler=T.RandomSampler(), batch_size=4)


# -- run in the spawned processes --------------------------------------------------------------
def extend_then_look(rb, to_parent, from_parent) -> None:
    """Extend, let the parent write, then report what this process sees."""
    try:
        rb.extend(batch(1))
        to_parent.put("extended")
        assert from_parent.get(timeout=WAIT) == "extended"
        to_parent.put((len(rb), rb[:]["a"].tolist()))
    except BaseException as exc:  # reported, so the parent fails with the reason
        to_parent.put(f"{type(exc).__name__}: {exc}")


def extend_rows(rb, value: float, n: int, done, make=batch, one_by_one: bool = False,
                turn=None) -> None:
    """Extend ``rb`` by ``make(value, n)`` (or add its rows one by one); put "finish" (or the
    error) on ``done``. Given a ``turn`` queue, write only while holding its token."""
    try:
        rows = make(value, n)
        if turn is not None:
            turn.get(timeout=WAIT)
        try:
            if one_by_one:
                for i in range(n):
                    rb.add(rows[i])
            else:
                rb.extend(rows)
        finally:
            if turn is not None:
                turn.put("token")
        done.put("finish")
    except BaseException as exc:
        done.put(f"{type(exc).__name__}: {exc}")


def expect(queue, want):
    got = queue.get(timeout=WAIT)
    assert got == want, got
    return got


def children_extend(rb, values: tuple[float, ...], n: int, make=batch,
                    one_by_one: bool = False, at_once: bool = False) -> None:
    """Spawn one process per value, each extending ``rb`` by ``make(value, n)`` (or adding
    its rows one by one); return when every one has finished. They write one after the
    other, in whichever order they come, unless ``at_once``: TorchRL's own writers move
    their shared cursor without a lock, so processes writing at once under them can take
    the same rows (docs/torchrl.md §4), on TorchRL's storages as on zstore's."""
    done = SPAWN.Queue()
    turn = None if at_once else SPAWN.Queue()
    children = [SPAWN.Process(target=extend_rows,
                              args=(rb, value, n, done, make, one_by_one, turn))
                for value in values]
    if turn is not None:
        turn.put("token")
    for child in children:
        child.start()
    for _ in children:
        expect(done, "finish")
    for child in children:
        child.join(WAIT)
        assert child.exitcode == 0


# -- the scenarios -----------------------------------------------------------------------------
def parent_and_child(storage) -> tuple:
    """TorchRL's multi-process buffer test, observed: the parent writes 10 rows, a child
    10, the parent 10 more (the ring of 21 wraps); each reports what it then sees."""
    rb = buffer(storage)
    rb.extend(batch(0))
    to_parent, from_parent = SPAWN.Queue(), SPAWN.Queue()
    child = SPAWN.Process(target=extend_then_look, args=(rb, to_parent, from_parent))
    child.start()
    try:
        expect(to_parent, "extended")
        seen_after_child = (len(rb), rb[:]["a"].tolist())
        rb.extend(batch(2))
        from_parent.put("extended")
        seen_by_child = to_parent.get(timeout=WAIT)
        assert not isinstance(seen_by_child, str), seen_by_child
    finally:
        child.join(WAIT)
    assert child.exitcode == 0
    return seen_after_child, seen_by_child, (len(rb), rb[:]["a"].tolist())


def torchrl_observes(scenario, tmp_path):
    return scenario(T.LazyMemmapStorage(21, scratch_dir=tmp_path / "torchrl"))


STORAGES = {
    "memmap-temporary": lambda tmp_path: zt.LazyMemmapStorage(21),
    "memmap-local": lambda tmp_path: zt.LazyMemmapStorage(21, scratch_dir=tmp_path / "rb"),
    "tensor-in-ram": lambda tmp_path: zt.LazyTensorStorage(21),
}


@pytest.mark.parametrize("kind", sorted(STORAGES))
def test_a_child_writes_the_buffer_its_parent_reads(kind, tmp_path):
    ours = parent_and_child(STORAGES[kind](tmp_path))
    theirs = torchrl_observes(parent_and_child, tmp_path)
    assert ours == theirs
    assert ours[0] == (20, [0.0] * 10 + [1.0] * 10)
    assert ours[1] == (21, [2.0] * 9 + [0.0] + [1.0] * 10 + [2.0])  # the ring of 21 wrapped


def test_rows_of_several_children_are_committed_by_the_lease_holder(tmp_path):
    url = str(tmp_path / "rb")
    storage = zt.LazyMemmapStorage(64, scratch_dir=url)
    rb = buffer(storage)
    rb.extend(batch(0, 8))
    children_extend(rb, (1, 2), 8)
    assert len(rb) == 24
    assert sorted(rb[:]["a"].tolist()) == [0.0] * 8 + [1.0] * 8 + [2.0] * 8
    storage.flush()  # the parent holds the lease: it commits every process's rows
    again = zstore.open(url, mode="r")
    assert len(again) == 24
    assert sorted(again[:]["a"].tolist()) == [0.0] * 8 + [1.0] * 8 + [2.0] * 8
    rb.extend(batch(3, 8))  # the parent still writes: nobody took its lease
    storage.flush()
    assert len(zstore.open(url, mode="r")) == 32


def test_a_parent_that_exits_commits_the_rows_of_its_children(tmp_path):
    """The parent never flushes: its exit commits what a child wrote."""
    url = str(tmp_path / "rb")
    script = textwrap.dedent(f"""
        import multiprocessing, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_shared_processes import batch, buffer, extend_rows, zt

        if __name__ == "__main__":
            ctx = multiprocessing.get_context("spawn")
            rb = buffer(zt.LazyMemmapStorage(32, scratch_dir={url!r}, autocommit_seconds=3600))
            rb.extend(batch(0, 4))
            done = ctx.Queue()
            child = ctx.Process(target=extend_rows, args=(rb, 5, 6, done))
            child.start()
            assert done.get(timeout=120) == "finish"
            child.join()
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    again = zstore.open(url, mode="r")
    assert len(again) == 10
    assert again[:]["a"].tolist() == [0.0] * 4 + [5.0] * 6


#: a script whose children share a shared_init buffer; the one that creates the rows (and
#: holds the lease) lets the other write only once its own exit commit is done
HOLDER_EXITS_WHILE_ANOTHER_WRITES = """
import multiprocessing, sys, threading
sys.path.insert(0, {tests!r})
HANDS = {{}}


def after_the_exit_commit():
    # registered as the child starts, before it imports zstore: runs after zstore's exit commit
    if HANDS.get("role") == "holder":
        HANDS["go"].put("go")
        assert HANDS["done"].get(timeout=120) == "done"
    elif HANDS.get("role") == "other":
        HANDS["done"].put("done")


threading._register_atexit(after_the_exit_commit)


def write(rb, role, value, go, done):
    from test_shared_processes import batch
    HANDS.update(role=role, go=go, done=done)
    if role == "other":
        assert go.get(timeout=120) == "go"
    rb.extend(batch(value, 4))


if __name__ == "__main__":
    from test_shared_processes import T, zt
    ctx = multiprocessing.get_context("spawn")
    rb = T.TensorDictReplayBuffer(
        storage=zt.LazyMemmapStorage(16, scratch_dir={url!r}, shared_init=True), shared=True)
    go, done = ctx.Queue(), ctx.Queue()
    children = [ctx.Process(target=write, args=(rb, role, value, go, done))
                for role, value in (("holder", 1), ("other", 2))]
    for child in children:
        child.start()
    for child in children:
        child.join(240)
        assert child.exitcode == 0, child.exitcode
    import zstore
    again = zstore.open({url!r}, mode="r")
    print(len(again), sorted(again[:]["a"].tolist()))
"""


def test_rows_written_while_the_lease_holder_exits_are_committed(tmp_path):
    """Two children share a shared_init buffer. The first creates the rows and holds the lease;
    once its exit commit is done, and before it ends, the other writes and exits. The holder
    gave the lease back with that last commit, so the other finds it free and commits its
    rows itself: the store holds all 8 once both have ended (it held 4: the other left its
    rows to a holder that commits no more; the shared_init test below lost them at times)."""
    script = tmp_path / "main.py"
    script.write_text(HOLDER_EXITS_WHILE_ANOTHER_WRITES.format(
        tests=str(__import__("pathlib").Path(__file__).parent), url=str(tmp_path / "rb")))
    seen = subprocess.run([sys.executable, str(script)], check=True, timeout=300,
                          capture_output=True, text=True).stdout.split("\n")[-2]
    assert seen == str(8) + " " + str([1.0] * 4 + [2.0] * 4)


def orphan_writes(rb, ready, go: str, done: str) -> None:
    """A collector that outlives its parent: extend, say so, wait for ``go`` (a FIFO), extend
    again, and write what happened to ``done`` (a FIFO)."""
    rb.extend(batch(-1, 2))
    ready.put("ready")
    with open(go) as fifo:
        fifo.read()
    try:
        rb.extend(batch(-2, 2))
        outcome = "written"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    with open(done, "w") as fifo:
        fifo.write(outcome)


#: a script whose process holds the lease, hands the buffer to a collector, commits the
#: collector's first rows, then is killed (the collector lives on)
HOLDER_KILLED = """
import multiprocessing, os, signal, sys
sys.path.insert(0, {tests!r})

if __name__ == "__main__":
    from test_shared_processes import buffer, batch, orphan_writes, zt
    ctx = multiprocessing.get_context("spawn")
    rb = buffer(zt.LazyMemmapStorage(32, scratch_dir={url!r}))
    rb.extend(batch(0, 4))
    ready = ctx.Queue()
    child = ctx.Process(target=orphan_writes, args=(rb, ready, {go!r}, {done!r}))
    child.start()
    assert ready.get(timeout=120) == "ready"
    rb.storage.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_collector_outliving_its_killed_lease_holder_is_refused(tmp_path):
    """The lease holder is killed; its collector lives on. A new run takes the store over and
    writes rows 6..13. The collector's next extend landed at its stale cursor, in those
    committed rows (and, once the new run closed, it took the free lease and committed its
    shorter length): it is now refused with a LeaseError naming the dead holder."""
    import os
    import select

    url, go, done = str(tmp_path / "rb"), str(tmp_path / "go"), str(tmp_path / "done")
    os.mkfifo(go)
    os.mkfifo(done)
    script = tmp_path / "main.py"
    script.write_text(HOLDER_KILLED.format(tests=str(__import__("pathlib").Path(__file__).parent),
                                           url=url, go=go, done=done))
    killed = subprocess.run([sys.executable, str(script)], timeout=300)
    assert killed.returncode == -9
    resumed = zstore.open(url)
    assert len(resumed) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "took over the write lease ... no longer runs"
        resumed.set(torch.arange(6, 14), batch(7, 8).set("index", torch.arange(6, 14)))
    resumed.flush()
    reader = os.open(done, os.O_RDONLY | os.O_NONBLOCK)  # before the collector opens it to write
    with open(go, "w") as fifo:
        fifo.write("go")
    assert select.select([reader], [], [], WAIT)[0], "the collector did not report"
    with os.fdopen(reader) as fifo:
        outcome = fifo.read()
    assert outcome.startswith("LeaseError") and "has exited" in outcome, outcome
    resumed.close()
    again = zstore.open(url, mode="r")
    assert len(again) == 14
    assert again[:]["a"].tolist() == [0.0] * 4 + [-1.0] * 2 + [7.0] * 8


# -- shared_init ------------------------------------------------------------------------------
def children_write_parent_reads(storage) -> tuple:
    """TorchRL's shared_init case: the parent never writes; two children each extend 4 rows."""
    rb = T.TensorDictReplayBuffer(storage=storage, batch_size=4, shared=True)
    children_extend(rb, (1, 2), 4)
    sample = rb.sample()
    return len(rb), rb.write_count, sorted(rb[:]["a"].tolist()), tuple(sample["a"].shape)


@pytest.mark.parametrize("kind", ["memmap", "tensor"])
def test_shared_init_lets_the_first_child_create_the_rows(kind, tmp_path):
    url = str(tmp_path / "rb")
    make = {"memmap": lambda: zt.LazyMemmapStorage(16, scratch_dir=url, shared_init=True),
            "tensor": lambda: zt.LazyTensorStorage(16, shared_init=True)}[kind]
    ours = children_write_parent_reads(make())
    theirs = children_write_parent_reads(
        T.LazyMemmapStorage(16, scratch_dir=tmp_path / "torchrl", shared_init=True))
    assert ours == theirs == (8, 8, [1.0] * 4 + [2.0] * 4, (4,))
    if kind == "memmap":  # the children exited: each committed, the last as lease holder
        again = zstore.open(url, mode="r")
        assert len(again) == 8 and sorted(again[:]["a"].tolist()) == [1.0] * 4 + [2.0] * 4


@pytest.mark.parametrize("kind", ["memmap", "tensor"])
def test_shared_init_storage_works_in_one_process(kind, tmp_path):
    storage = {"memmap": lambda: zt.LazyMemmapStorage(10, scratch_dir=tmp_path / "rb",
                                                      shared_init=True),
               "tensor": lambda: zt.LazyTensorStorage(10, shared_init=True)}[kind]()
    with pytest.raises(RuntimeError, match="non-initialized"):
        storage.get(0)  # nothing written anywhere: refused, never a wait for ever
    rb = buffer(storage)
    rb.extend(batch(4, 6))
    assert len(rb) == 6 and rb[:]["a"].tolist() == [4.0] * 6


def test_shared_init_refused_first_write_lets_the_next_writer_create_the_rows():
    storage = zt.LazyTensorStorage(8, shared_init=True)
    odd = TensorDict(a=torch.zeros(2), batch_size=[2])
    odd.set_non_tensor("name", "x")
    with pytest.raises(zstore.SchemaError, match="shared_init"):
        storage.set(torch.arange(2), odd)
    assert not storage.initialized
    storage.set(torch.arange(2), batch(1, 2))
    assert len(storage) == 2 and storage[:]["a"].tolist() == [1.0, 1.0]


def test_shared_init_refusals_name_the_reason(location):
    with pytest.raises(RuntimeError, match="Cannot share a compilable storage"):
        zt.LazyTensorStorage(4, shared_init=True, compilable=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        storage = zt.LazyTensorStorage(4, shared_init=True, device="cuda")
    assert storage.device == torch.device("cpu")
    assert any("cannot be honored" in str(w.message) for w in caught)
    codec = "zstd" if location.kind == "local" else None
    with pytest.raises(ValueError, match=f"shared_init=True needs a local, uncompressed.*"
                                         f"{location.base}.*StorageEnsemble"):
        location.memmap(4, codec=codec, shared_init=True)


def test_a_store_processes_cannot_write_together_says_so(location):
    """Rows processes cannot share (memory://, a bucket, compressed chunks): a spawned
    process is refused at once for memory://, and elsewhere reads what is committed and is
    refused a write with the way out; the writer's rows stay as they were."""
    storage = zt.LazyMemmapStorage(16, scratch_dir=location.new(), storage_options=location.options,
                                   codec="zstd" if location.kind == "local" else None)
    rb = buffer(storage)
    rb.extend(batch(0, 4))
    done = SPAWN.Queue()
    child = SPAWN.Process(target=extend_rows, args=(rb, 1, 2, done))
    if location.kind == "memory":
        with pytest.raises(RuntimeError, match="memory:// stores live inside one process"):
            child.start()
        return
    child.start()
    refusal = done.get(timeout=WAIT)
    child.join(WAIT)
    assert refusal.startswith("LeaseError") and "handed to this process by the process " \
        "writing it" in refusal and "StorageEnsemble" in refusal, refusal
    storage.flush()
    again = zstore.open(storage.scratch_dir, location.options, mode="r")
    assert len(again) == 4 and again[:]["a"].tolist() == [0.0] * 4


def make_counting_env():
    from torchrl.testing.mocking_classes import CountingEnv

    return CountingEnv(max_steps=7)


def collect(storage) -> "T.ReplayBuffer":
    """TorchRL's multi-process collector, two workers writing the buffer they were handed.

    Through zstore.torchrl's writer, on either storage: the workers write at once, and
    TorchRL's own writer can give both the same rows (docs/torchrl.md §4)."""
    from torchrl.collectors import MultiSyncCollector
    from torchrl.testing.mocking_classes import CountingEnvCountPolicy

    rb = T.ReplayBuffer(storage=storage, batch_size=8, writer=zt.RoundRobinWriter())
    policy = CountingEnvCountPolicy(make_counting_env().action_spec)  # the same frames each run
    collector = MultiSyncCollector([make_counting_env, make_counting_env], policy=policy,
                                   frames_per_batch=40, total_frames=200, replay_buffer=rb)
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    return rb


def frames(rb) -> list[int]:
    """The frames' step counts, sorted: the same multiset whatever order the workers wrote in."""
    return sorted(rb[:]["observation"].flatten().tolist())


@pytest.mark.parametrize("kind", ["memmap-local", "tensor-in-ram"])
def test_a_multiprocess_collector_fills_a_zstore_buffer(kind, tmp_path):
    url = str(tmp_path / "rb")
    storage = (zt.LazyMemmapStorage(1000, scratch_dir=url) if kind == "memmap-local"
               else zt.LazyTensorStorage(1000))
    ours = collect(storage)
    theirs = collect(T.LazyMemmapStorage(1000, scratch_dir=tmp_path / "torchrl"))
    assert len(ours) == len(theirs) == 200 and ours.write_count == theirs.write_count == 200
    assert frames(ours) == frames(theirs)  # every frame a row of its own: none overwritten
    assert ours.sample()["observation"].shape == theirs.sample()["observation"].shape
    if kind == "memmap-local":
        ours.storage.flush()
        assert frames(T.ReplayBuffer(storage=zstore.torchrl.open(url, mode="r"))) == frames(ours)


@pytest.mark.parametrize("kind", ["memmap-local", "tensor-in-ram", "memmap-shared-init"])
def test_an_incremental_checkpoint_keeps_the_rows_other_processes_wrote(kind, tmp_path):
    """A checkpoint knows which rows changed from per-row write stamps: those of another
    process count too, so the incremental dump after a child's write misses none of them."""
    make = {"memmap-local": lambda: zt.LazyMemmapStorage(64, scratch_dir=tmp_path / "rb"),
            "tensor-in-ram": lambda: zt.LazyTensorStorage(64),
            "memmap-shared-init": lambda: zt.LazyMemmapStorage(64, scratch_dir=tmp_path / "rb",
                                                               shared_init=True)}[kind]
    storage = make()
    rb = buffer(storage)
    rb.extend(batch(0, 8))
    target = tmp_path / "checkpoint"
    storage.dumps(target)
    children_extend(rb, (1,), 8)
    second = storage.dumps(target)
    assert second.incremental and second.length == 16
    restored = zt.LazyTensorStorage(64)
    restored.loads(target)
    assert len(restored) == 16
    assert restored[:16]["a"].tolist() == [0.0] * 8 + [1.0] * 8


@pytest.mark.parametrize("kind", ["tensor", "memmap"])
def test_a_shared_init_storage_only_children_wrote_dumps_without_a_read_first(kind, tmp_path):
    """The parent never wrote nor read: its dumps raised "Cannot save a non-initialized
    storage" (len said 16), unless a read had mapped the children's rows first."""
    storage = zt.LazyTensorStorage(64, shared_init=True) if kind == "tensor" else \
        zt.LazyMemmapStorage(64, scratch_dir=tmp_path / "rb", shared_init=True)
    rb = buffer(storage)
    children_extend(rb, (1, 2), 8)
    assert len(storage) == 16
    storage.dumps(tmp_path / "checkpoint")
    restored = zt.LazyTensorStorage(64)
    restored.loads(tmp_path / "checkpoint")
    assert sorted(restored[:16]["a"].tolist()) == [1.0] * 8 + [2.0] * 8


def tensor_rows(value: float, n: int) -> torch.Tensor:
    return torch.full((n, 2), float(value))


@pytest.mark.parametrize("item", ["tensor", "pytree"])
def test_shared_init_keeps_tensors_and_pytrees(item):
    """The rows of an in-RAM ``shared_init`` storage are files any process maps, whatever
    the items are: the same rows as TorchRL's ``LazyTensorStorage`` holds."""
    def data(value: float, n: int):
        rows = torch.full((n, 2), value)
        return rows if item == "tensor" else {"obs": rows, "nested": {"step": torch.arange(n)}}

    ours, theirs = zt.LazyTensorStorage(6, shared_init=True), T.LazyTensorStorage(6)
    for storage in (ours, theirs):
        storage.set(torch.arange(4), data(1.0, 4))
        storage.set(torch.tensor([4, 5, 0]), data(2.0, 3))
    assert len(ours) == len(theirs) == 6
    for got, want in zip(torch.utils._pytree.tree_leaves(ours.get(torch.arange(6))),
                         torch.utils._pytree.tree_leaves(theirs.get(torch.arange(6)))):
        assert torch.equal(got, want)


def test_shared_init_tensor_rows_written_by_children():
    rb = T.ReplayBuffer(storage=zt.LazyTensorStorage(12, shared_init=True), batch_size=2)
    children_extend(rb, (1, 2), 3, tensor_rows)
    assert len(rb) == 6
    assert sorted(rb[:6][:, 0].tolist()) == [1.0] * 3 + [2.0] * 3


@pytest.mark.parametrize("kind", ["memmap-local", "tensor-in-ram"])
def test_zstore_torchrl_writers_give_each_process_rows_of_its_own(kind, tmp_path):
    """Two processes adding rows one by one, at once, through zstore.torchrl's writer twin:
    every row they wrote is there (TorchRL's writer moves its shared cursor unlocked)."""
    storage = (zt.LazyMemmapStorage(600, scratch_dir=tmp_path / "rb") if kind == "memmap-local"
               else zt.LazyTensorStorage(600))
    rb = T.TensorDictReplayBuffer(storage=storage, writer=zt.TensorDictRoundRobinWriter())
    rb.extend(batch(0, 4))
    children_extend(rb, (1, 2), 200, one_by_one=True, at_once=True)
    assert len(rb) == 404 and rb.write_count == 404
    assert sorted(rb[:404]["a"].tolist()) == [0.0] * 4 + [1.0] * 200 + [2.0] * 200
    assert rb[:404]["index"].tolist() == list(range(404))


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("n", [1, 10], ids=["add", "extend"])
def test_rows_written_in_another_order_than_taken_are_counted_once(kind, n, location):
    """Processes under TorchRL's own writers take their rows from the shared cursor without a
    lock, and may write them in the other order (the later rows first; it made a 30-row run
    of docs/torchrl.md's example report 40 rows). Each row counts once, as on TorchRL's own
    storage, and the length reopens as it was."""
    ours = zt.LazyTensorStorage(100) if kind == "LazyTensorStorage" else \
        zt.LazyMemmapStorage(100, scratch_dir=location.new(), storage_options=location.options)
    theirs = T.LazyTensorStorage(100)
    for storage in (ours, theirs):
        for start in (0, 2 * n, n):  # the process that took rows n.. writes last
            if n == 1:
                storage.set(start, batch(start, 1)[0])
            else:
                storage.set(torch.arange(start, start + n), batch(start, n))
    assert len(ours) == len(theirs) == 3 * n
    assert ours.get(torch.arange(3 * n))["a"].tolist() == theirs.get(torch.arange(3 * n))["a"].tolist()
    if kind == "LazyMemmapStorage":
        ours.flush()
        assert len(zstore.open(ours.scratch_dir, location.options, mode="r")) == 3 * n
