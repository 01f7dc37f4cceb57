"""Several processes on one S3 server: writers own one storage each under one prefix, readers
see them through a StorageEnsemble; a second writer is refused; a SIGKILLed holder's lease is
taken over once stale (time driven explicitly, no sleeps).

Every row encodes its writer and index, so a lost, torn or uncommitted row is visible.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.errors import LeaseError
from zstore.conditional import objects_for
from zstore.lease import LEASE_NAME
from zstore.store import StoreSpec

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

CTX = mp.get_context("fork")
WRITERS, READERS = 4, 2
K, BATCHES = 8, 6  # rows per commit, commits per writer
CAPACITY = K * BATCHES


def encode(writer: int, index: torch.Tensor) -> TensorDict:
    """Row ``i`` of writer ``w``: ``[w, i, w * 10**6 + i, (7919 i + w) mod 10007]``."""
    x = torch.stack([torch.full_like(index, writer), index, writer * 10**6 + index,
                     (index * 7919 + writer) % 10007], 1)
    return TensorDict(x=x, batch_size=[len(index)])


def write_batch(storage, writer: int, batch: int) -> None:
    index = torch.arange(batch * K, (batch + 1) * K)
    storage.set(index, encode(writer, index))
    storage.flush()


def writer_main(writer, url, options, ready, go, errors) -> None:
    try:
        storage = zstore.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=options,
                                           codec="zstd", chunks=4, autocommit_seconds=1e9)
        write_batch(storage, writer, 0)
        ready.wait()  # the parent now tries to write here too
        go.wait()
        for batch in range(1, BATCHES):
            write_batch(storage, writer, batch)
        storage.close()
    except BaseException as exc:  # pragma: no cover - reported to the parent
        errors.put(f"writer {writer}: {exc!r}")
        raise


def check_rows(member, writer: int) -> tuple[int, list[str]]:
    n = len(member)
    problems = [] if n % K == 0 else [f"member {writer}: length {n} is not a commit boundary"]
    if n and not torch.equal(member[:n]["x"], encode(writer, torch.arange(n))["x"]):
        problems.append(f"member {writer}: rows differ from what was written")
    return n, problems


def reader_main(reader, prefix, options, done, results) -> None:
    lengths, passes, problems = [0] * WRITERS, 0, []
    while True:
        finished = done.is_set()  # read before the pass: the last pass sees every commit
        ensemble = zstore.open(prefix, options, mode="r")
        for writer, member in enumerate(ensemble._storages):
            n, found = check_rows(member, writer)
            problems += found
            if n < lengths[writer]:
                problems.append(f"member {writer}: length went back from {lengths[writer]} to {n}")
            lengths[writer] = n
        passes += 1
        if finished:
            break
    results.put((reader, lengths, passes, problems))


def test_writers_own_storages_readers_see_only_committed_rows(s3_options, s3_bucket):
    prefix = f"s3://{s3_bucket}/multi-{os.getpid()}"
    urls = [f"{prefix}/collector-{w}" for w in range(WRITERS)]
    ready, go = CTX.Barrier(WRITERS + 1), CTX.Barrier(WRITERS + 1)
    done, errors, results = CTX.Event(), CTX.Queue(), CTX.Queue()
    writers = [CTX.Process(target=writer_main, args=(w, urls[w], s3_options, ready, go, errors))
               for w in range(WRITERS)]
    for process in writers:
        process.start()
    ready.wait(timeout=120)

    # every writer holds its lease now: a second writer on collector-0 is refused
    holder = json.loads(objects_for(StoreSpec.parse(urls[0], s3_options)).read(LEASE_NAME)[0])
    assert holder["pid"] == writers[0].pid
    intruder = zstore.open(urls[0], s3_options)
    with pytest.raises(LeaseError) as refused:
        intruder.set(K, encode(99, torch.tensor([K]))[0])
    assert urls[0] in str(refused.value) and holder["owner"] in str(refused.value)
    assert "testing" not in str(refused.value)  # credentials never appear
    assert len(zstore.open(urls[0], s3_options, mode="r")) == K  # nothing changed

    zstore.StorageEnsemble(*(zstore.open(u, s3_options, mode="r") for u in urls),
                           scratch_dir=prefix, storage_options=s3_options)
    readers = [CTX.Process(target=reader_main, args=(r, prefix, s3_options, done, results))
               for r in range(READERS)]
    for process in readers:
        process.start()
    go.wait(timeout=120)
    for process in writers:
        process.join(timeout=300)
    done.set()
    reports = [results.get(timeout=300) for _ in readers]
    for process in readers:
        process.join(timeout=60)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in writers + readers] == [0] * (WRITERS + READERS)
    for reader, lengths, passes, problems in reports:
        assert problems == [], (reader, problems)
        assert lengths == [CAPACITY] * WRITERS and passes >= 1
    final = zstore.open(prefix, s3_options, mode="r")
    for writer, member in enumerate(final._storages):
        assert check_rows(member, writer) == (CAPACITY, [])  # no row lost
        assert objects_for(member.spec).read(LEASE_NAME) is None  # released by close()


def doomed_holder(url, options, committed, hold) -> None:
    storage = zstore.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=options,
                                       codec="zstd", chunks=4, lease_ttl=600.0,
                                       autocommit_seconds=1e9)
    write_batch(storage, 7, 0)
    index = torch.arange(K, 2 * K)
    storage.set(index, encode(7, index))  # written, never committed
    committed.set()
    hold.wait()  # until SIGKILL


def test_lease_of_a_killed_writer_is_taken_over(s3_options, s3_bucket):
    """Refused while its holder runs; taken over at once when the holder (same machine) died,
    long before its ttl (with a ttl of 1 s the lease went stale on a loaded machine before the
    refusal was asked for, and was taken over as stale)."""
    url = f"s3://{s3_bucket}/doomed-{os.getpid()}"
    committed, hold = CTX.Event(), CTX.Event()
    process = CTX.Process(target=doomed_holder, args=(url, s3_options, committed, hold))
    process.start()
    assert committed.wait(timeout=120)
    taker = zstore.open(url, s3_options)
    with pytest.raises(LeaseError, match=f"/{process.pid}/"):
        taker.set(K, encode(8, torch.tensor([K]))[0])
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert process.exitcode == -signal.SIGKILL

    spec = StoreSpec.parse(url, s3_options)
    record = json.loads(objects_for(spec).read(LEASE_NAME)[0])
    assert record["pid"] == process.pid and record["ttl"] == 600.0  # nobody released it
    index = torch.arange(K, 2 * K)
    with pytest.warns(UserWarning, match=f"took over the write lease .*/{process.pid}/.*no longer runs"):
        taker.set(index, encode(8, index))
    taker.flush()
    rows = zstore.open(url, s3_options, mode="r")[:]["x"]
    # the dead writer's committed rows are intact, its uncommitted ones never became visible
    assert torch.equal(rows[:K], encode(7, torch.arange(K))["x"])
    assert torch.equal(rows[K:], encode(8, index)["x"])
    taker.close()
    assert objects_for(spec).read(LEASE_NAME) is None
