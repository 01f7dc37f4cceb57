"""Crash-consistency harness: SIGKILL a writer at chosen crash points, then check the store.

A *scenario* is a fixed script of writes and flushes on a small
``LazyMemmapStorage`` (capacity :data:`CAPACITY`; it wraps, so committed rows
get overwritten). Every row encodes ``(generation, index)``: the ``i``-th row
written by script step ``g`` holds the code ``100 * g + i`` in each column
(``a`` int64, ``obs`` float32 ``[3]``, ``next/b`` int32 ``[2]``, each cell with
its own checkable pattern), so a row that is stale, torn across columns or
never written (zeros) is recognised.

One kill point = one child process, forked from a ``forkserver`` that imported
torch, zarr and zstore once (a fresh interpreter costs ~3 s of imports; a fork
~tens of ms). The child arms :func:`zstore._faults.arm` with ``"site:k"``,
logs each step's begin/end to an append-only file (unbuffered ``os.write``,
which survives SIGKILL), runs the script, and kills itself at the ``k``-th hit
of ``site``. The parent then derives from the log which commit is the last
one that landed, and checks (:func:`verify`) exactly the guarantee of
``docs/format.md`` §6:

* the reopened store has that commit's length and cursor (or, if creation's
  first commit never landed, is refused as "not a zstore buffer" and can be
  created again);
* every row below the length holds, in each column, either that commit's value
  or a value written to that position by a step begun after the commit (a
  wrap-around overwrite: not isolated, documented); rows not overwritten hold
  exactly the committed value; no row is zeros or garbage;
* writing continues: a new writer appends a step, flushes, and a fresh reader
  sees the new rows exactly and the rest as above.

``checkpoint.*`` sites: when the ``checkpoint`` package lands, add a scenario
step ``("dumps", url)`` here and its sites to :data:`zstore._faults.SITES`
(see :func:`run_step`); the checker then treats a checkpoint like a commit.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import tempfile
from multiprocessing import forkserver
from typing import Any

import torch
from tensordict import TensorDict

import zstore
from zstore import _faults
from zstore.errors import NotAZStoreError, StoreNotFoundError

CAPACITY = 24
#: (kind, argument): extend n rows; add one row; scatter rows; flush (commit).
SCRIPT: tuple[tuple[str, Any], ...] = (
    ("extend", 5), ("extend", 7), ("flush", None), ("extend", 6), ("add", None), ("add", None),
    ("flush", None), ("extend", 9), ("flush", None), ("scatter", [3, 17, 9, 3]), ("extend", 4),
    ("flush", None), ("extend", 10), ("flush", None), ("scatter", [0, 23, 12]), ("extend", 3),
    ("add", None), ("flush", None), ("extend", 13), ("flush", None), ("extend", 2), ("flush", None),
)
CONTINUE_GENERATION = 99

#: Store layouts the harness runs on: ``kind -> LazyMemmapStorage keyword arguments``.
LAYOUTS = {
    "mmap": {"codec": None},  # local, raw: memory-mapped chunk files written in place
    # local, sharded; commits log partly written shards (S3 does by default)
    "chunked": {"codec": "zstd+crc32c", "chunks": 4, "shards": 8, "tail_log": True},
    "s3": {"codec": "zstd", "chunks": 4, "shards": 8},  # sharded objects on S3
}


def rows_of(generation: int, n: int) -> TensorDict:
    """``n`` rows of step ``generation``: row ``i`` carries the code ``100 * generation + i``."""
    return coded(torch.arange(n, dtype=torch.int64) + 100 * generation)


def coded(code: torch.Tensor) -> TensorDict:
    """Rows carrying the int64 ``code`` s in every column (each cell with its own pattern)."""
    n = len(code)
    return TensorDict(
        a=code,
        obs=code.float().unsqueeze(-1) + torch.tensor([0.0, 0.25, 0.5]),
        next=TensorDict(b=torch.stack([code, -code], -1).int(), batch_size=[n]),
        batch_size=[n])


def decode(td: TensorDict) -> dict[str, torch.Tensor]:
    """Per column, the code of each row, or -1 where a cell breaks its own pattern."""
    a = td["a"]
    obs = td["obs"]
    b = td["next", "b"].long()
    obs_code = obs[:, 0].long()
    obs_ok = (obs - obs_code.unsqueeze(-1).float() == torch.tensor([0.0, 0.25, 0.5])).all(-1)
    return {"a": a,
            "obs": torch.where(obs_ok, obs_code, -1),
            "next/b": torch.where(b[:, 0] == -b[:, 1], b[:, 0], -1)}


def step_rows(kind: str, arg: Any, cursor: int, capacity: int) -> list[int]:
    """Rows a script step writes, given the cursor before it (round robin, like TorchRL's writer)."""
    start = (cursor + 1) % capacity
    if kind == "extend":
        return [(start + i) % capacity for i in range(arg)]
    if kind == "add":
        return [start]
    if kind == "scatter":
        return list(arg)
    return []


@dataclasses.dataclass
class Commit:
    """A committed state of the model: length, cursor and the code at each written row."""

    step: int
    length: int
    cursor: int
    codes: dict[int, int]


class Model:
    """The script replayed on plain Python data: every commit and every write, in order."""

    def __init__(self, script=SCRIPT, capacity: int = CAPACITY):
        self.capacity = capacity
        self.writes: list[tuple[int, dict[int, int]]] = []  # (step, {row: code})
        self.commits: list[Commit] = []
        length, cursor, codes = 0, -1, {}
        for step, (kind, arg) in enumerate(script):
            rows = step_rows(kind, arg, cursor, capacity)
            if step == 0:  # the first write creates the buffer: creation commits (empty)
                self.commits.append(Commit(0, 0, -1, {}))
            if kind == "flush":
                self.commits.append(Commit(step, length, cursor, dict(codes)))
                continue
            written = {row: 100 * (step + 1) + i for i, row in enumerate(rows)}
            self.writes.append((step, written))
            codes.update(written)
            length = min(length + len(rows), capacity)
            cursor = rows[-1]

    def landed(self, last_line: tuple[str, int] | None, site: str) -> Commit | None:
        """The last commit that landed, from the child's last log line and the kill site."""
        if last_line is None:
            return None
        mark, step = last_line
        # a flush commits last; the first write commits the creation first, then writes data
        in_flight_landed = mark == "B" and (
            site == "commit.after" or (step == 0 and site != "commit.before"))
        done = [c for c in self.commits
                if c.step < step or (c.step == step and (mark == "E" or in_flight_landed))]
        return done[-1] if done else None

    def allowed(self, commit: Commit, last_begun: int) -> dict[int, set[int]]:
        """Codes each row may hold after a crash: committed, or overwritten by a later begun step."""
        allowed = {row: {code} for row, code in commit.codes.items()}
        for step, written in self.writes:
            if commit.step < step <= last_begun:
                for row, code in written.items():
                    allowed.setdefault(row, set()).add(code)
        return allowed


# -- the child ---------------------------------------------------------------------------
def run_step(storage, step: int, kind: str, arg: Any, cursor: int, capacity: int):
    """Run one script step on ``storage``; the new cursor."""
    generation = step + 1
    if kind == "flush":
        storage.flush()
        return cursor
    rows = step_rows(kind, arg, cursor, capacity)
    if kind == "extend" or kind == "scatter":
        storage.set(torch.tensor(rows), rows_of(generation, len(rows)))
    elif kind == "add":
        storage.set(rows[0], rows_of(generation, 1)[0])
    else:
        raise ValueError(f"unknown script step {kind!r}")
    return rows[-1]


def child_log(log_path: str, arm: str | None, census_path: str | None) -> int:
    """In a campaign's child: arm the crash point ``arm`` (or count every point passed, for
    a census at ``census_path``); the descriptor of its step log at ``log_path``."""
    if census_path:
        _faults.census(census_path)
    else:
        _faults.arm(arm)
    return os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def writer(url: str, options: dict, layout: dict, log_path: str, arm: str | None,
           census_path: str | None = None, script=SCRIPT, capacity: int = CAPACITY) -> None:
    """The child: run ``script`` with the crash point armed (or counting, for a census)."""
    log = child_log(log_path, arm, census_path)
    storage = zstore.LazyMemmapStorage(capacity, scratch_dir=url, storage_options=options,
                                       autocommit_seconds=1e9, auto_cleanup=False, **layout)
    cursor = -1
    for step, (kind, arg) in enumerate(script):
        os.write(log, f"B {step}\n".encode())
        cursor = run_step(storage, step, kind, arg, cursor, capacity)
        os.write(log, f"E {step}\n".encode())
    if census_path:
        _faults.dump(census_path)


# -- the parent --------------------------------------------------------------------------
def _context():
    """A forkserver context whose server has imported torch, zarr, zstore and this module.

    Python 3.11's forkserver ignores the parent's ``sys.path`` when it preloads,
    so the paths of ``zstore`` and of this file go in its ``PYTHONPATH``.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.dirname(os.path.dirname(os.path.abspath(zstore.__file__)))]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    try:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["crashkit"])
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def census(url: str, options: dict, layout: dict, workdir: str) -> dict[str, int]:
    """Hits per crash site of one uninterrupted run (the kill points that exist)."""
    path = os.path.join(workdir, "census.json")
    child = _context().Process(target=writer, args=(url, options, layout,
                                                    os.path.join(workdir, "census.log"), None, path))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"census run exited with {child.exitcode}")
    with open(path) as handle:
        return json.load(handle)


def kill_points(counts: dict[str, int], limit: int | None = None) -> list[str]:
    """``"site:k"`` for every hit of every site; with ``limit``, the first hit of each site
    (``commit.before:1`` is the creation) and the rest spread evenly."""
    points = [f"{site}:{k}" for site in _faults.SITES for k in range(1, counts.get(site, 0) + 1)]
    if limit is None or len(points) <= limit:
        return points
    chosen = [f"{site}:1" for site in _faults.SITES if counts.get(site)]
    rest = [p for p in points if p not in chosen]
    stride = len(rest) / max(1, limit - len(chosen))
    return chosen + [rest[int(i * stride)] for i in range(limit - len(chosen))]


def _last_lines(log_path: str) -> tuple[tuple[str, int] | None, int]:
    """The last log line as (mark, step) and the last step begun (-1: none)."""
    try:
        with open(log_path) as handle:
            lines = [line.split() for line in handle if line.strip()]
    except FileNotFoundError:
        lines = []
    if not lines:
        return None, -1
    last = (lines[-1][0], int(lines[-1][1]))
    begun = max(int(step) for mark, step in lines if mark == "B")
    return last, begun


def _check_rows(storage, commit: Commit, allowed: dict[int, set[int]], where: str) -> None:
    assert len(storage) == commit.length, f"{where}: length {len(storage)} != committed {commit.length}"
    cursor = storage._last_cursor_index
    assert (cursor if cursor is not None else -1) == commit.cursor, \
        f"{where}: cursor {cursor} != committed {commit.cursor}"
    if not commit.length:
        return
    codes = decode(storage[: commit.length])
    for row in range(commit.length):
        for column, values in codes.items():
            code = int(values[row])
            assert code in allowed.get(row, ()), \
                f"{where}: row {row} column {column} holds {code}, allowed {sorted(allowed.get(row, ()))}"
        if allowed[row] == {commit.codes.get(row)}:
            continue  # not overwritten since the commit: exact, all columns
        # overwritten: each column holds the old or a new value (documented: not isolated)


def verify(url: str, options: dict, layout: dict, model: Model, log_path: str, site: str) -> str:
    """Check the store after a kill at ``site``; continue writing; check again. Returns a summary."""
    last, begun = _last_lines(log_path)
    commit = model.landed(last, site)
    where = f"{url} after kill at {site} (log {last})"
    if commit is None:  # creation's first commit never landed
        try:
            zstore.open(url, options, mode="r")
        except (NotAZStoreError, StoreNotFoundError):
            pass
        else:
            raise AssertionError(f"{where}: a store whose creation never committed opened")
        commit, allowed = Commit(-1, 0, -1, {}), {}
        storage = zstore.LazyMemmapStorage(model.capacity, scratch_dir=url, storage_options=options,
                                           auto_cleanup=False, **layout)
        outcome = "uncreated"
    else:
        allowed = model.allowed(commit, begun)
        reader = zstore.open(url, options, mode="r")
        _check_rows(reader, commit, allowed, where)
        reader.close()
        storage = zstore.open(url, options)
        outcome = f"commit@{commit.step}"
    # writing continues from the committed cursor
    n = 7
    rows = step_rows("extend", n, commit.cursor, model.capacity)
    storage.set(torch.tensor(rows), rows_of(CONTINUE_GENERATION, n))
    storage.close()
    after = Commit(commit.step, min(commit.length + n, model.capacity), rows[-1], dict(commit.codes))
    allowed = {row: set(codes) for row, codes in allowed.items()}
    for i, row in enumerate(rows):
        allowed[row] = {100 * CONTINUE_GENERATION + i}
        after.codes[row] = 100 * CONTINUE_GENERATION + i
    reader = zstore.open(url, options, mode="r")
    _check_rows(reader, after, allowed, where + ", after continuing")
    reader.close()
    return outcome


@dataclasses.dataclass
class Campaign:
    """What one run of kill points found."""

    kind: str
    points: list[str]
    outcomes: dict[str, str]
    failures: dict[str, str]


def run_campaign(kind: str, base_url: str, options: dict, limit: int | None = None,
                 workdir: str | None = None) -> Campaign:
    """Census the scenario on ``kind``'s layout, then kill and verify at each kill point."""
    layout = LAYOUTS[kind]
    workdir = workdir or tempfile.mkdtemp(prefix="zstore-crash-")
    model = Model()
    counts = census(f"{base_url}/census", options, layout, workdir)
    # the uninterrupted run must end exactly in the model's last commit
    final = zstore.open(f"{base_url}/census", options, mode="r")
    _check_rows(final, model.commits[-1], {r: {c} for r, c in model.commits[-1].codes.items()},
                f"{base_url}/census (no kill)")
    final.close()
    points = kill_points(counts, limit)
    ctx = _context()
    outcomes, failures = {}, {}
    for i, point in enumerate(points):
        url = f"{base_url}/kp{i}"
        log_path = os.path.join(workdir, f"kp{i}.log")
        child = ctx.Process(target=writer, args=(url, options, layout, log_path, point))
        child.start()
        child.join()
        if child.exitcode != -9:
            failures[point] = f"writer exited with {child.exitcode}, expected SIGKILL (-9)"
            continue
        try:
            outcomes[point] = verify(url, options, layout, model, log_path, point.rpartition(":")[0])
        except Exception as exc:  # noqa: BLE001 - collected and reported per kill point
            failures[point] = f"{type(exc).__name__}: {exc}"
    return Campaign(kind, points, outcomes, failures)


# -- readers during writes ---------------------------------------------------------------
#: Rows per extend of the concurrent writer; every 4th extend is left uncommitted until the next.
CONCURRENT_EXTENDS = [3 + (j * 7) % 11 for j in range(24)]


def committed_lengths() -> list[int]:
    """The lengths the concurrent writer commits, in order (0: the creation)."""
    out, total = [0], 0
    for j, n in enumerate(CONCURRENT_EXTENDS):
        total += n
        if j % 4 != 3:
            out.append(total)
    if out[-1] != total:
        out.append(total)  # close() commits the rest
    return out


#: Commits after which the concurrent writer waits until a reader has seen them: the readers
#: then see at least that many lengths however slowly they start (the rest run free).
LOCKSTEP_COMMITS = 3
#: How long the writer waits for a reader to see a commit before it gives up (seconds).
LOCKSTEP_TIMEOUT = 240.0


def concurrent_writer(url: str, options: dict, layout: dict, done_path: str, seen: Any,
                      changed: Any) -> None:
    """Append rows whose code is their position + 1 (never wrapping); flush after most extends.

    After each of the first :data:`LOCKSTEP_COMMITS` commits it waits on ``changed`` (a
    condition) until ``seen`` (the longest length a reader has read) reaches it.
    """
    try:
        storage = zstore.LazyMemmapStorage(sum(CONCURRENT_EXTENDS), scratch_dir=url,
                                           storage_options=options, autocommit_seconds=1e9,
                                           auto_cleanup=False, **layout)
        start, commits = 0, 0
        for j, n in enumerate(CONCURRENT_EXTENDS):
            storage.set(torch.arange(start, start + n), coded(torch.arange(start, start + n) + 1))
            start += n
            if j % 4 != 3:
                storage.flush()
                commits += 1
                if commits <= LOCKSTEP_COMMITS:
                    with changed:
                        if not changed.wait_for(lambda: seen.value >= start, LOCKSTEP_TIMEOUT):
                            raise TimeoutError(
                                f"no reader saw length {start} in {LOCKSTEP_TIMEOUT} s")
        storage.close()
    finally:  # the readers stop once this exists, the writer failed or not
        with open(done_path, "w") as handle:
            handle.write("done")


def concurrent_reader(url: str, options: dict, done_path: str, out_path: str, rounds: int,
                      seen_max: Any, changed: Any) -> None:
    """Reopen and read everything committed until the writer is done (at least ``rounds`` times).

    Writes ``{"rounds": .., "lengths": [..]}`` or ``{"error": ..}`` to ``out_path``; raises
    ``seen_max`` to each length it read whole, and tells ``changed``.
    """
    allowed = set(committed_lengths())
    seen: list[int] = []
    result: dict = {}
    try:
        while len(seen) < rounds or not os.path.exists(done_path):
            try:
                reader = zstore.open(url, options, mode="r")
            except (NotAZStoreError, StoreNotFoundError):
                continue  # not created yet
            n = len(reader)
            assert n in allowed, f"length {n} was never committed"
            assert not seen or n >= seen[-1], f"length went back from {seen[-1]} to {n}"
            if n:
                for column, codes in decode(reader[:n]).items():
                    bad = (codes != torch.arange(1, n + 1)).nonzero()
                    assert not len(bad), f"row {int(bad[0])} of {column} holds {int(codes[bad[0]])}"
            reader.close()
            seen.append(n)
            with changed:
                if n > seen_max.value:
                    seen_max.value = n
                    changed.notify_all()
        result = {"rounds": len(seen), "lengths": sorted(set(seen))}
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {exc}", "rounds": len(seen)}
    with open(out_path, "w") as handle:
        json.dump(result, handle)


def readers_during_writes(url: str, options: dict, layout: dict, workdir: str,
                          n_readers: int = 4, rounds: int = 20) -> list[dict]:
    """Run one writer and ``n_readers`` reopening readers at once; each reader's result."""
    ctx = _context()
    done = os.path.join(workdir, "writer-done")
    outs = [os.path.join(workdir, f"reader-{i}.json") for i in range(n_readers)]
    seen, changed = ctx.Value("q", 0, lock=False), ctx.Condition()
    readers = [ctx.Process(target=concurrent_reader,
                           args=(url, options, done, out, rounds, seen, changed)) for out in outs]
    writer_process = ctx.Process(target=concurrent_writer,
                                 args=(url, options, layout, done, seen, changed))
    for process in (*readers, writer_process):
        process.start()
    for process in (writer_process, *readers):
        process.join()
    results = []
    for out in outs:
        with open(out) as handle:
            results.append(json.load(handle))
    if writer_process.exitcode != 0:
        raise RuntimeError(f"writer exited with {writer_process.exitcode}; the readers: {results}")
    return results
