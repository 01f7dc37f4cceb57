"""zstore buffers in Ray actors (zstore.ray, docs/scaling.md §5): a local Ray cluster.

Ray's memory:// is per process, so buffers live in a local directory or on moto S3.
Every row encodes ``(collector id, serial)`` and sits at row ``serial``, so a reader
can tell a row that was written (and committed) from anything else.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import sys
import time

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.errors import LeaseError

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'zstore[ray]')")
pytest.importorskip("torchrl", reason="TorchRL is not installed")
import zstore.ray as zray  # noqa: E402
import zstore.torchrl  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.xdist_group("ray")]

# the actors below travel by value: Ray's workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CAPACITY = 10_000
DEADLINE = 120.0  # seconds to wait for a commit on two busy cores


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (no dashboard) for the whole session."""
    if ray.is_initialized():  # someone else's: use it, leave it
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def rows(collector: int, start: int, n: int) -> TensorDict:
    serial = torch.arange(start, start + n)
    return TensorDict(meta=torch.stack([torch.full_like(serial, collector), serial], 1),
                      obs=serial[:, None].float().expand(n, 3).clone(), batch_size=[n])


def check_rows(td: TensorDict, collector: int | torch.Tensor, serial: torch.Tensor) -> None:
    assert torch.equal(td["meta"][:, 0], torch.as_tensor(collector).expand(len(serial)))
    assert torch.equal(td["meta"][:, 1], serial)
    assert torch.equal(td["obs"][:, 0], serial.float())


def wait_committed(url: str, options: dict, length: int) -> None:
    """Poll the committed length (a fresh reader each time) until it reaches ``length``."""
    deadline = time.monotonic() + DEADLINE
    seen = None
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, zstore.errors.ZStoreError):
            seen = len(zstore.open(url, options, mode="r"))
            if seen >= length:
                return
        time.sleep(0.2)
    pytest.fail(f"{url}: {seen} rows committed after {DEADLINE} s, expected {length}")


def kill(buffer) -> None:
    """``ray.kill`` the buffer's actor (SIGKILL: nothing runs at exit) and drop the handle."""
    ray.kill(buffer._rb, no_restart=True)
    with contextlib.suppress(Exception):
        buffer.close()


# -- a. TorchRL's RayReplayBuffer over a store --------------------------------------------

@pytest.mark.parametrize("location", ["local", pytest.param("s3", marks=pytest.mark.campaign)], indirect=True)
def test_ray_replay_buffer_survives_kill(ray_cluster, location):
    url = location.new("rb")
    make = functools.partial(zray.replay_buffer, url, CAPACITY, storage_options=location.options,
                             autocommit_seconds=1, batch_size=64,
                             remote_config={"num_cpus": 0})
    rb = make()
    for k in range(5):
        rb.extend(rows(0, 200 * k, 200))
    sample = rb.sample()
    assert sample.shape == (64,)
    check_rows(sample, 0, sample["meta"][:, 1])
    wait_committed(url, location.options, 1000)  # by the actor's background commit
    ray.kill(rb._rb, no_restart=True)
    for end in (zray.commit, zray.close):  # Ray's error, with what it means for the store
        with pytest.raises(ray.exceptions.RayActorError) as err:
            end(rb)
        assert any(url in note and "replay_buffer over the URL again" in note
                   for note in getattr(err.value, "__notes__", ())), err.value
    kill(rb)

    rb = make()  # a new actor over the same URL reopens the committed buffer
    try:
        assert len(rb) == 1000
        check_rows(rb[torch.arange(1000)], 0, torch.arange(1000))
        rb.extend(rows(0, 1000, 100))  # writing continues at the committed cursor
        assert len(rb) == 1100
        check_rows(rb[torch.arange(1100)], 0, torch.arange(1100))
        rb.extend(rows(0, 1100, 10))
        assert zray.commit(rb) == 1110  # at once, not after autocommit_seconds
        assert len(zstore.open(url, location.options, mode="r")) == 1110
        rb.extend(rows(0, 1110, 10))
    finally:
        assert zray.close(rb) == 1120  # commits, releases the lease, ends the actor
    assert not rb.is_alive
    assert zray.close(rb) is None  # closing twice: nothing left to commit
    with pytest.raises(RuntimeError, match="closed.*replay_buffer over its URL"):
        zray.commit(rb)
    zstore.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options,
                             existsok=True).close()  # the lease is free: a writer starts
    check_rows(zstore.open(url, location.options, mode="r").get(torch.arange(1120)), 0,
               torch.arange(1120))


DRIVER = """
import atexit, sys, torch, ray, zstore.ray as zray
from tensordict import TensorDict
hooks, register, unregister = [], atexit.register, atexit.unregister
atexit.register = lambda f, *a, **k: (hooks.append(f), register(f, *a, **k))[1]
atexit.unregister = lambda f: (hooks.__setitem__(slice(None), [h for h in hooks if h != f]),
                               unregister(f))[1]
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
serial = torch.arange(50)
buffers = []
for url in sys.argv[2:4]:
    buffers.append(zray.replay_buffer(url, int(sys.argv[4]), autocommit_seconds=float("inf"),
                                      remote_config={"num_cpus": 0}))
    buffers[-1].extend(TensorDict(meta=torch.stack([torch.zeros_like(serial), serial], 1),
                                  obs=serial[:, None].float().expand(50, 3).clone(),
                                  batch_size=[50]))
ours = [h for h in hooks if getattr(h, "__module__", None) == "zstore.ray"]
assert len(ours) == 1, f"each buffer registered an exit hook of its own: {ours}"
if sys.argv[5] == "ray.shutdown()":
    ray.shutdown()
"""  # a driver that ends without zstore.ray.close (its actors then die with it)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ending", ["exit", "ray.shutdown()"])
def test_a_driver_ending_without_close_commits(ray_cluster, tmp_path, ending):
    """Its rows were lost with the actors Ray kills when the driver ends (they are committed
    at the driver's exit now, by one exit hook however many buffers it built). A driver
    ending with ``ray.shutdown()`` lost them until 2026-12-06: it disconnects before the
    exit hook runs (``zstore.ray`` now wraps it to commit first)."""
    import subprocess

    urls = [str(tmp_path / "rb"), str(tmp_path / "rb2")]
    address = ray.get_runtime_context().gcs_address
    # a hang guard only: a new driver and its two actors each import torch and Ray, which
    # took over 120 s on a loaded two-core machine
    subprocess.run([sys.executable, "-c", DRIVER, address, *urls, str(CAPACITY), ending],
                   check=True, timeout=4 * DEADLINE)
    for url in urls:
        reader = zstore.open(url, mode="r")
        assert len(reader) == 50
        check_rows(reader.get(torch.arange(50)), 0, torch.arange(50))


def test_a_memory_url_is_refused(ray_cluster):
    """An actor's memory:// store is its own: the rows would go with it, unseen."""
    with pytest.raises(ValueError, match="memory://zstore-tests/rb lives in one process.*s3://"):
        zray.replay_buffer("memory://zstore-tests/rb", 10, remote_config={"num_cpus": 0})


def test_an_unreachable_store_fails_when_built(ray_cluster):
    """The store's own error, from the build, naming the URL (not an ActorDiedError at the
    first use, its cause buried under an unrelated internal error)."""
    unreachable = {"endpoint_url": "http://127.0.0.1:9", "key": "testing", "secret": "testing",
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(ConnectionError, match="its server cannot be reached") as error:
        zray.replay_buffer("s3://zstore-tests/rb", 10, storage_options=unreachable,
                           remote_config={"num_cpus": 0})
    assert "could not open s3://zstore-tests/rb" in " ".join(error.value.__notes__)


@ray.remote(num_cpus=0, max_retries=0)
def collect_and_commit(client, start: int, n: int) -> int:
    """A collector task handed the buffer's ``client()``: it writes, then commits."""
    client.extend(rows(0, start, n))
    return zray.commit(client)


def test_a_task_handed_a_client_commits(ray_cluster, tmp_path):
    """``commit(client)`` works where the client goes; ``close(client)`` is refused before
    it closes anything."""
    url = str(tmp_path / "rb")
    rb = zray.replay_buffer(url, CAPACITY, autocommit_seconds=math.inf,
                            remote_config={"num_cpus": 0})
    assert ray.get(collect_and_commit.remote(rb.client(), 0, 10)) == 10
    check_rows(zstore.open(url, mode="r").get(torch.arange(10)), 0, torch.arange(10))
    with pytest.raises(TypeError, match="client.. cannot close it"):
        zray.close(rb.client())  # the storage stays open: the buffer writes on
    rb.extend(rows(0, 10, 5))
    assert zray.close(rb) == 15


def test_existsok_resumes_as_storage_factory_does(tmp_path):
    """``existsok=True`` adopted a committed buffer only at its first write, after the
    writer had started at cursor 0: row 0 was overwritten first (no Ray needed). It now
    adopts it when built, as storage_factory's reopening does."""
    from torchrl.data import ReplayBuffer

    url = str(tmp_path / "rb")
    first = zstore.torchrl.LazyMemmapStorage(100, scratch_dir=url)
    first.set(torch.arange(10), rows(0, 0, 10))
    first.close()
    for build in (functools.partial(zstore.torchrl.LazyMemmapStorage, 100, scratch_dir=url,
                                    existsok=True), zray.storage_factory(url, 100)):
        rb = ReplayBuffer(storage=build, writer=zstore.torchrl.RoundRobinWriter)
        assert len(rb) == len(zstore.open(url, mode="r"))
        rb.extend(rows(0, len(rb), 5))
        rb.storage.close()
    reread = zstore.open(url, mode="r")
    assert len(reread) == 20
    check_rows(reread.get(torch.arange(20)), 0, torch.arange(20))


def test_prefix_ensemble_without_ray(tmp_path):
    """Members are committed buffers named collector-*; refresh() sees new commits and
    members; a member still being created (only its lease there) is not one yet."""
    import pickle

    prefix = str(tmp_path / "run")
    assert zray.ensemble(prefix).names == []  # nothing there yet
    first = zray.open_member(prefix, 0, 100)
    first.set(torch.arange(4), rows(0, 0, 4))
    first.flush()
    zray.open_member(prefix, 1, 100)  # lease taken, nothing committed
    zstore.LazyMemmapStorage(10, scratch_dir=f"{prefix}/other").set(
        torch.arange(2), rows(7, 0, 2))  # not collector-*
    reader = zray.ensemble(prefix)
    assert reader.names == ["collector-0"] and reader.lengths() == [4]
    first.set(torch.arange(4, 6), rows(0, 4, 2))
    first.flush()
    assert reader.lengths() == [4]  # what it opened, until refreshed
    assert reader.refresh().lengths() == [6]
    td, member, index = pickle.loads(pickle.dumps(reader)).sample(
        50, torch.Generator().manual_seed(0), return_index=True)
    assert torch.equal(member, torch.zeros(50, dtype=torch.long))
    check_rows(td, 0, index)
    with pytest.raises(zstore.SchemaError, match="not 50"):  # (it was a bare ValueError)
        zray.storage_factory(f"{prefix}/collector-0", 50)()
    with pytest.raises(RuntimeError, match="nothing is committed"):
        zray.ensemble(str(tmp_path / "empty")).sample(3)


def test_import_does_not_import_ray():
    import subprocess

    code = "import sys, zstore.ray; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# -- b. collectors under one prefix, a learner reading them as one ensemble ---------------

@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=3)
class Collector:
    """Owns ``<prefix>/collector-<i>``; row ``serial`` holds ``(i, serial)``."""

    def __init__(self, prefix: str, i: int, options: dict, *, lease_ttl: float = 30.0,
                 wait: float = 60.0, tag: int | None = None):
        self.i = i
        self.tag = i if tag is None else tag  # the collector id its rows hold
        self.storage = zray.open_member(prefix, i, CAPACITY, storage_options=options,
                                        autocommit_seconds=math.inf, lease_ttl=lease_ttl,
                                        wait=wait)
        self.writer = zstore.RoundRobinWriter()  # as docs/scaling.md's collector writes
        self.writer.register_storage(self.storage)
        self.next = len(self.storage)  # the next serial (the buffer never wraps here)

    def collect(self, n: int, commit: bool = True) -> int:
        self.writer.extend(rows(self.tag, self.next, n))
        self.next += n
        if commit:
            self.storage.flush()
        return self.next

    def position(self) -> tuple[int, int]:
        """(process id, the next serial)."""
        return os.getpid(), self.next

    def commit(self) -> int:
        self.storage.flush()
        return len(self.storage)

    def stall_then_collect(self, signal, n: int) -> int:
        """Stall (holding the storage, its last writes uncommitted) until ``signal`` is
        sent, then write ``n`` rows and commit them."""
        ray.get(signal.wait.remote())
        return self.collect(n)


def test_a_second_open_of_a_member_in_one_process_is_refused(location):
    """Ray runs a worker's next task in the same process, and storage objects of one process
    share its lease: four tasks opening member 0 without closing it each wrote at the
    committed length, over the rows the one before had not committed (20 rows of 40 left).
    A second open while the first is open is now refused; after a close it opens."""
    prefix = location.new("collectors")
    first = zray.open_member(prefix, 0, 100, storage_options=location.options)
    first.set(torch.arange(10), rows(0, 0, 10))
    with pytest.raises(LeaseError, match="another storage object of this process") as err:
        zray.open_member(prefix, 0, 100, storage_options=location.options)
    assert zray.member_url(prefix, 0) in str(err.value)
    first.set(torch.arange(10, 20), rows(0, 10, 10))  # the first still writes
    first.close()
    second = zray.open_member(prefix, 0, 100, storage_options=location.options)
    assert len(second) == 20
    check_rows(second.get(torch.arange(20)), 0, torch.arange(20))
    second.flush()
    del second  # dropped without close (a task that returned): the next open is not refused
    gc.collect()
    third = zray.open_member(prefix, 0, 100, storage_options=location.options)
    assert len(third) == 20
    third.close()


def test_a_restarted_collector_overwrites_its_oldest_rows(location):
    """docs/scaling.md's collector after a restart, once its ring wrapped: it reopens its
    member and writes through a RoundRobinWriter, which resumes after the newest committed
    row. The example used to resume at ``len(rb)`` (the capacity once wrapped), overwriting
    the newest rows; the model is a plain ring of serials."""
    prefix = location.new("collectors")

    def collector():
        storage = zray.open_member(prefix, 0, 100, storage_options=location.options)
        writer = zstore.RoundRobinWriter()
        writer.register_storage(storage)
        return storage, writer

    storage, writer = collector()
    ring = [None] * 100
    for serial in (0, 60, 120):  # 150 rows in three collects: the ring wrapped
        n = 60 if serial < 120 else 30
        writer.extend(rows(0, serial, n))
        for s in range(serial, serial + n):
            ring[s % 100] = s
    storage.close()  # the actor's restart reopens its member
    storage, writer = collector()
    writer.extend(rows(0, 150, 20))
    for s in range(150, 170):
        ring[s % 100] = s
    storage.flush()
    got = zstore.open(zray.member_url(prefix, 0), location.options, mode="r").get(torch.arange(100))
    assert got["meta"][:, 1].tolist() == ring
    storage.close()


@ray.remote(num_cpus=0)
class Learner:
    def __init__(self, prefix: str, options: dict):
        self.ensemble = zray.ensemble(prefix, options)

    def step(self, batch: int) -> tuple[list[str], list[int], torch.Tensor]:
        self.ensemble.refresh()
        names, lengths = list(self.ensemble.names), self.ensemble.lengths()
        td, member, index = self.ensemble.sample(batch, return_index=True)
        return names, lengths, td["meta"], member, index

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every committed row of every member (``meta``), by member name."""
        self.ensemble.refresh()
        return {name: self.ensemble[m].get(torch.arange(length))["meta"]
                for m, (name, length) in enumerate(zip(self.ensemble.names,
                                                       self.ensemble.lengths()))}


@ray.remote(num_cpus=0)
class Signal:
    """A Ray-side event: ``wait()`` blocks its caller until ``send()``."""

    def __init__(self):
        import asyncio

        self.event = asyncio.Event()
        self.waiters = 0

    async def wait(self) -> None:
        self.waiters += 1
        await self.event.wait()

    async def send(self) -> None:
        self.event.set()

    async def waiting(self) -> int:
        return self.waiters


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {DEADLINE} s")


def restarted(actor, old_pid: int) -> int:
    """Wait until ``actor`` runs in a new process (``ray.kill`` returns at once); its
    next serial."""
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        with contextlib.suppress(ray.exceptions.ActorUnavailableError):
            pid, position = ray.get(actor.position.remote())
            if pid != old_pid:
                return position
        time.sleep(0.2)
    pytest.fail(f"the actor was not restarted within {DEADLINE} s")


@pytest.mark.parametrize("location", ["local", pytest.param("s3", marks=pytest.mark.campaign)], indirect=True)
def test_collectors_and_learner(ray_cluster, location):
    prefix = location.new("run")
    opts = location.options
    collectors = [Collector.remote(prefix, i, opts) for i in range(2)]
    assert ray.get([c.collect.remote(100) for c in collectors]) == [100, 100]
    learner = Learner.remote(prefix, opts)

    def learner_sees(committed: list[int]) -> None:
        names, lengths, meta, member, index = ray.get(learner.step.remote(256))
        assert names == [f"collector-{i}" for i in range(len(committed))]
        assert lengths == committed
        assert len(meta) == 256
        # every row sampled is the row its collector wrote there, and was committed
        assert torch.equal(meta[:, 0], member) and torch.equal(meta[:, 1], index)
        assert (index < torch.tensor(committed)[member]).all()

    learner_sees([100, 100])
    ray.get(collectors[1].collect.remote(50, commit=False))  # written, never committed
    pid, _ = ray.get(collectors[1].position.remote())
    ray.kill(collectors[1], no_restart=False)  # SIGKILL; Ray restarts it (max_restarts=1)
    # the restarted actor reopens at its last commit (taking the dead holder's lease)
    assert restarted(collectors[1], pid) == 100
    learner_sees([100, 100])
    assert ray.get(collectors[1].collect.remote(30)) == 130  # serials 100.. written again
    assert ray.get(collectors[0].collect.remote(20)) == 120
    learner_sees([120, 130])

    collectors.append(Collector.remote(prefix, 2, opts))  # a new member: seen on refresh
    ray.get(collectors[2].collect.remote(10))
    learner_sees([120, 130, 10])
    reader = zray.ensemble(prefix, opts)
    for i, n in enumerate([120, 130, 10]):
        check_rows(reader[i].get(torch.arange(n)), i, torch.arange(n))
    for actor in collectors + [learner]:
        ray.kill(actor, no_restart=True)


@pytest.mark.parametrize("location", ["local", pytest.param("s3", marks=pytest.mark.campaign)], indirect=True)
def test_a_killed_learner_loses_nothing(ray_cluster, location):
    """The learner holds no state of its own: a new one over the prefix reads every
    committed row of every member, the rows its collectors report having committed."""
    prefix = location.new("run")
    opts = location.options
    collectors = [Collector.remote(prefix, i, opts) for i in range(3)]
    committed = ray.get([c.collect.remote(40 * (i + 1)) for i, c in enumerate(collectors)])
    assert committed == [40, 80, 120]
    learner = Learner.remote(prefix, opts)
    names, lengths, meta, member, index = ray.get(learner.step.remote(128))
    assert lengths == committed
    assert torch.equal(meta[:, 0], member) and torch.equal(meta[:, 1], index)
    committed = ray.get([c.collect.remote(25) for c in collectors])  # while it samples
    ray.get(collectors[0].collect.remote(7, commit=False))  # written, not committed
    in_flight = learner.step.remote(128)  # a step the kill may cut short
    ray.kill(learner, no_restart=True)
    with contextlib.suppress(ray.exceptions.RayActorError):
        ray.get(in_flight, timeout=DEADLINE)

    learner = Learner.remote(prefix, opts)
    seen = ray.get(learner.read_all.remote())
    assert list(seen) == [f"collector-{i}" for i in range(3)]
    for i, n in enumerate(committed):
        meta = seen[f"collector-{i}"]
        assert len(meta) == n  # every committed row, and the uncommitted 7 not
        assert torch.equal(meta[:, 0], torch.full((n,), i))
        assert torch.equal(meta[:, 1], torch.arange(n))
    names, lengths, meta, member, index = ray.get(learner.step.remote(256))
    assert lengths == committed
    assert torch.equal(meta[:, 0], member) and torch.equal(meta[:, 1], index)
    for actor in collectors + [learner]:
        ray.kill(actor, no_restart=True)


# -- c. one writer per storage ------------------------------------------------------------

@ray.remote(num_cpus=0, max_retries=0)
def second_writer(prefix: str, i: int, options: dict) -> None:
    storage = zray.open_member(prefix, i, CAPACITY, storage_options=options)
    storage.set(torch.arange(5), rows(99, 0, 5))  # never reached
    storage.flush()


@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_second_writer_refused(ray_cluster, location):
    prefix = location.new("run")
    # a ttl no loaded machine outlasts: a lease not renewed for 30 s is rightly taken over, and
    # starting the second writer's worker can take that long with other tests beside it
    collector = Collector.remote(prefix, 0, location.options, lease_ttl=3600.0)
    ray.get(collector.collect.remote(40))
    with pytest.raises(LeaseError, match="being written by"):
        ray.get(second_writer.remote(prefix, 0, location.options))
    check_rows(zstore.open(zray.member_url(prefix, 0), location.options, mode="r")
               .get(torch.arange(40)), 0, torch.arange(40))
    assert ray.get(collector.collect.remote(10)) == 50  # the holder writes on
    ray.kill(collector, no_restart=True)


STALL_TTL = 2.0  # seconds: the stalled collector's lease ttl (any positive number is accepted)


@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
def test_a_collector_stalled_past_its_ttl_stores_nothing_over_its_successor(ray_cluster,
                                                                            location):
    """A collector stalls (blocked on a signal, its last rows uncommitted) past its lease
    ttl; a successor takes the member over and commits; the woken collector is refused."""
    prefix = location.new("run")
    opts = location.options
    url = zray.member_url(prefix, 0)
    stalled = Collector.options(max_restarts=0, max_task_retries=0).remote(
        prefix, 0, opts, lease_ttl=STALL_TTL)
    assert ray.get(stalled.collect.remote(100)) == 100
    assert ray.get(stalled.collect.remote(50, commit=False)) == 150  # its last, uncommitted
    signal = Signal.remote()
    woken = stalled.stall_then_collect.remote(signal, 10)  # stalls holding its storage
    wait_until(lambda: ray.get(signal.waiting.remote()) == 1, "the collector stalls")

    # the successor waits (polling, up to DEADLINE) for the stalled lease to expire
    successor = Collector.options(max_restarts=0, max_task_retries=0).remote(
        prefix, 0, opts, wait=DEADLINE, tag=1)
    assert ray.get(successor.position.remote())[1] == 100  # it resumes at the last commit
    assert ray.get(successor.collect.remote(30)) == 130
    assert len(zstore.open(url, opts, mode="r")) == 130

    ray.get(signal.send.remote())  # the stalled collector wakes up and writes on
    # its first write renews the lease, which the successor holds now: refused, nothing stored
    with pytest.raises(LeaseError, match="lost the write lease"):
        ray.get(woken, timeout=DEADLINE)
    with pytest.raises(LeaseError, match="does not hold the write lease|lost the write lease"):
        ray.get(stalled.commit.remote(), timeout=DEADLINE)  # and a retry commits nothing

    reader = zstore.open(url, opts, mode="r")
    assert len(reader) == 130  # exactly the successor's commit
    got = reader.get(torch.arange(130))
    check_rows(got[:100], 0, torch.arange(100))
    check_rows(got[100:], 1, torch.arange(100, 130))  # none of the stalled rows
    assert ray.get(successor.collect.remote(10)) == 140  # the successor writes on
    reader = zstore.open(url, opts, mode="r")
    assert len(reader) == 140
    check_rows(reader.get(torch.arange(100, 140)), 1, torch.arange(100, 140))
    for actor in (stalled, successor, signal):
        ray.kill(actor, no_restart=True)
