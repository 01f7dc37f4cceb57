"""CompressedListStorage crash safety: a killed writer leaves its last commit, readers theirs.

The writer runs a fixed script of appends and flushes (:data:`FLUSHES`) in which the
``tok`` key turns ragged between the first two commits (its items table is rebuilt) and
its ragged values fill and are compacted between the next two. Each kill point is one
child forked from :mod:`crashkit`'s forkserver that SIGKILLs itself at the ``k``-th hit
of a crash site (``zstore._faults``: ``commit.before`` / ``commit.after`` around every
inner table's commit and the root block's, ``store.after`` after chunk stores). The
parent then checks against the reference model (the items written, a list): the store
reopens at a commit that landed with exactly its items, or, if none did, a new storage
is created there; writing continues; and after the next writer's commits no table the
root block does not name is left.
"""

from __future__ import annotations

import json
import math
import os
import re

import crashkit
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import _faults
from zstore.errors import NotAZStoreError, StoreNotFoundError
from zstore.store import StoreSpec

CAPACITY = 400
#: The item count at each flush: ``tok`` is fixed-shape until item 12, then ragged; its
#: values are compacted at item 21.
FLUSHES = (12, 20, 45, 90, 150)
RESUME = 40  # items a writer appends after the crash
SITES = ("commit.before", "commit.after", "store.after")
_TABLE = re.compile(r"items-\d+|ragged/.+/(index|values)(-\d+)?")


def item(i: int) -> TensorDict:
    """Item ``i`` of the reference model: ``tok`` holds ``i`` (3 tokens, then 1 to 7)."""
    length = 3 if i < FLUSHES[0] else 1 + (5 * i) % 7
    return TensorDict(tok=torch.full((length,), i, dtype=torch.int64),
                      x=torch.tensor([float(i), -float(i)]))


def assert_items(storage, n: int) -> None:
    """``storage`` holds exactly the model's first ``n`` items."""
    assert len(storage) == n
    for i, got in enumerate(storage.get(slice(None)) if n else []):
        want = item(i)
        assert torch.equal(got["tok"], want["tok"]) and torch.equal(got["x"], want["x"]), i


def tables_on_store(url: str, options: dict) -> set[str]:
    """Every inner table stored under ``url``, as a path below it."""
    fs, root = StoreSpec.parse(url, options).filesystem()
    fs.invalidate_cache()
    root = root.rstrip("/")
    dirs = {path[len(root) + 1:].rpartition("/")[0] for path in fs.find(root)
            if path.endswith("/zarr.json")}
    return {d for d in dirs if _TABLE.fullmatch(d)}


def writer(url: str, options: dict, log_path: str, arm: str | None,
           census_path: str | None = None) -> None:
    """The child: write the script, logging ``B``/``E`` around each flush, killed at ``arm``."""
    log = crashkit.child_log(log_path, arm, census_path)
    storage = zstore.CompressedListStorage(CAPACITY, scratch_dir=url, storage_options=options,
                                           autocommit_seconds=math.inf)
    written = 0
    for step, stop in enumerate(FLUSHES):
        for i in range(written, stop):
            storage.set(i, item(i))
        written = stop
        os.write(log, f"B {step}\n".encode())
        storage.flush()
        os.write(log, f"E {step}\n".encode())
    if census_path:
        _faults.dump(census_path)


def run_child(ctx, *args) -> int:
    """Run :func:`writer` in a forked child; its exit code."""
    child = ctx.Process(target=writer, args=args)
    child.start()
    child.join()
    return child.exitcode


def landed(log_path: str) -> set[int | None]:
    """The item counts the last landed commit may have (``None``: no commit)."""
    last, _ = crashkit._last_lines(log_path)
    if last is None:
        return {None}
    mark, step = last
    before = FLUSHES[step - 1] if step else None
    return {FLUSHES[step]} if mark == "E" else {before, FLUSHES[step]}


def verify(url: str, options: dict, log_path: str) -> str:
    """Check the store a killed writer left, write on, and check again; the outcome."""
    allowed = landed(log_path)
    try:
        reader = zstore.open(url, mode="r", storage_options=options)
    except (NotAZStoreError, StoreNotFoundError):
        assert None in allowed, f"no commit reopens; expected {allowed}"
        storage = zstore.CompressedListStorage(CAPACITY, scratch_dir=url, storage_options=options,
                                               autocommit_seconds=math.inf)
        outcome = "uncreated"
    else:
        assert len(reader) in allowed, (len(reader), allowed)
        assert_items(reader, len(reader))
        storage = zstore.open(url, storage_options=options)
        outcome = f"commit@{len(reader)}"
    start = len(storage)
    for i in range(start, start + RESUME):
        storage.set(i, item(i))
    storage.flush()
    storage.close()  # a second commit: what the first retired is deleted
    reader = zstore.open(url, mode="r", storage_options=options)
    assert_items(reader, start + RESUME)
    assert tables_on_store(url, options) == set(reader.checkpoint_tables())
    return outcome


def kill_points(counts: dict[str, int], limit: int | None) -> list[str]:
    """Every hit of :data:`SITES`; with ``limit``, each site's first hit and the rest spread."""
    points = [f"{site}:{k}" for site in SITES for k in range(1, counts.get(site, 0) + 1)]
    if limit is None or len(points) <= limit:
        return points
    first = [f"{site}:1" for site in SITES if counts.get(site)]
    rest = [p for p in points if p not in first]
    stride = len(rest) / (limit - len(first))
    return first + [rest[int(i * stride)] for i in range(limit - len(first))]


@pytest.mark.timeout(900)
@pytest.mark.filterwarnings("ignore:took over the write lease")  # the killed writer's
@pytest.mark.parametrize("location,limit", [("local", None), ("s3", 8)], indirect=["location"])
def test_killed_writer_leaves_the_last_commit_and_writing_continues(location, limit, tmp_path):
    """A writer killed after a key turned ragged or its values were compacted left a root
    block naming tables it had deleted: the store neither reopened nor could be created again."""
    ctx = crashkit._context()
    census = tmp_path / "census.json"
    assert run_child(ctx, location.new("census"), location.options, str(tmp_path / "census.log"),
                     None, str(census)) == 0
    counts = json.loads(census.read_text())
    failures, outcomes = {}, {}
    for n, point in enumerate(kill_points(counts, limit)):
        url, log = location.new(f"kill{n}"), str(tmp_path / f"kill{n}.log")
        code = run_child(ctx, url, location.options, log, point)
        try:
            assert code == -9, f"the child exited with {code}"
            outcomes[point] = verify(url, location.options, log)
        except AssertionError as exc:
            failures[point] = str(exc)
        except Exception as exc:  # noqa: BLE001 - collected, reported together
            failures[point] = f"{type(exc).__name__}: {exc}"
    assert not failures, json.dumps(failures, indent=1)
    assert "uncreated" in outcomes.values()  # kills fell before the first commit ...
    if limit is None:  # ... and after each one
        assert {f"commit@{n}" for n in FLUSHES} <= set(outcomes.values()), outcomes


def test_a_reader_keeps_its_commit_while_the_writer_rebuilds_tables(location):
    """A reader opened at a commit read zeros, or failed with StoreNotFoundError, once the
    writer turned a key ragged or compacted its values (the tables were deleted at once)."""
    url = location.new()
    opts = location.options
    writer_ = location.compressed(CAPACITY, scratch_dir=url, autocommit_seconds=math.inf)

    def write(start: int, stop: int) -> None:
        for i in range(start, stop):
            writer_.set(i, item(i))

    write(0, FLUSHES[0])
    writer_.flush()
    at_first = zstore.open(url, mode="r", storage_options=opts)
    write(FLUSHES[0], FLUSHES[1])  # tok turns ragged: a new items table
    before_flush = zstore.open(url, mode="r", storage_options=opts)
    writer_.flush()
    assert_items(at_first, FLUSHES[0])
    assert_items(before_flush, FLUSHES[0])
    at_second = zstore.open(url, mode="r", storage_options=opts)
    named = set(at_second.checkpoint_tables())
    write(FLUSHES[1], FLUSHES[3])  # the values fill: compacted into new tables
    writer_.flush()
    assert named - set(writer_.checkpoint_tables()), "the script compacts no table"
    assert_items(at_second, FLUSHES[1])
    writer_.flush()  # the tables the last commit stopped naming are deleted
    assert tables_on_store(url, opts) == set(writer_.checkpoint_tables())
    assert_items(zstore.open(url, mode="r", storage_options=opts), FLUSHES[3])
