"""The ``zstore demo`` job: fill a persistent replay buffer, reopen it from another process.

1. A batch of point-mass environments, simulated in torch, is stepped in
   parallel; episodes terminate (goal reached, or the arena left) or are
   truncated. Transitions are laid out as TorchRL's TED format.
2. They are written with a :class:`~zstore.RoundRobinWriter` into a
   :class:`~zstore.LazyMemmapStorage` at a local path, any URL, or an S3 bucket
   on a moto server on loopback, then flushed (data first, commit last).
3. A new Python process (``python -m zstore.demo --reader``) reopens the buffer
   with ``zstore.open(url, mode="r")``, checks its length, cursor and contents,
   samples random batches and trajectory slices through a
   :class:`~zstore.ReplayBuffer` (:class:`~zstore.RandomSampler`,
   :class:`~zstore.SliceSampler`), and reports back as JSON.
4. A short report: what was written, how long each step took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator, Mapping, TextIO

import torch
from tensordict import TensorDict

import zstore

from .cli_commands import DEFAULT_TRANSITIONS
from .errors import ZStoreError

#: Environments stepped in parallel.
NUM_ENVS = 8
#: Environment steps per rollout (one ``writer.extend`` writes ``NUM_ENVS * ROLLOUT_STEPS`` rows).
ROLLOUT_STEPS = 64
#: Rows per random batch read back.
BATCH_SIZE = 256
#: Warm random batches timed after the first one.
WARM_BATCHES = 30
#: Trajectory slices read back, and their length.
SLICES, SLICE_LEN = 4, 16
#: Longest the reader process may take (seconds) before the demo gives up.
READER_TIMEOUT = 300.0

_TRAJ_KEY = ("collector", "traj_ids")


class DemoError(ZStoreError):
    """The demo could not run, or what it read back differs from what it wrote."""


class PointMassEnv:
    """A batch of 2-D point masses steered towards the origin, stepped in parallel in torch.

    Observation ``[x, y, vx, vy]``, action a force in ``[-1, 1]^2``, reward the
    negative distance to the origin (``+10`` on reaching it, ``-10`` on leaving
    the arena). An episode *terminates* when the mass rests at the origin or
    leaves the arena, and is *truncated* after ``max_steps`` steps. The acting
    policy (:meth:`rollout`) is a noisy PD controller with per-episode gains, so
    some episodes succeed and others time out.

    >>> env = PointMassEnv(2, seed=0)
    >>> env.rollout(5).batch_size
    torch.Size([2, 5])
    """

    def __init__(self, num_envs: int = NUM_ENVS, *, seed: int = 0, max_steps: int = 100,
                 dt: float = 0.1, arena: float = 2.0):
        self.num_envs, self.max_steps, self.dt, self.arena = num_envs, max_steps, dt, arena
        self.generator = torch.Generator().manual_seed(seed)
        pos, self.gains = self._fresh(num_envs)
        self.state = torch.cat([pos, torch.zeros_like(pos)], -1)  # [x, y, vx, vy]
        self.steps = torch.zeros(num_envs, dtype=torch.int64)
        self.traj_ids = torch.arange(num_envs)
        self._next_id = torch.tensor(num_envs)

    def _fresh(self, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial positions and PD gains ``(kp, kd)`` of new episodes."""
        pos = (torch.rand(*shape, 2, generator=self.generator) * 2 - 1) * 1.5
        gains = torch.rand(*shape, 2, generator=self.generator) * 1.5
        return pos, gains + torch.tensor([0.1, 0.0])

    def rollout(self, steps: int) -> TensorDict:
        """Step every env ``steps`` times; a TED TensorDict of batch size ``[num_envs, steps]``."""
        b, g = self.num_envs, self.generator
        noise = 0.5 * torch.randn(steps, b, 2, generator=g)
        fresh_pos, fresh_gains = self._fresh(steps, b)
        fresh = torch.cat([fresh_pos, torch.zeros_like(fresh_pos)], -1)
        obs, next_obs = torch.empty(steps, b, 4), torch.empty(steps, b, 4)
        act = torch.empty(steps, b, 2)
        rew = torch.empty(steps, b)
        term = torch.empty(steps, b, dtype=torch.bool)
        trunc = torch.empty(steps, b, dtype=torch.bool)
        ids = torch.empty(steps, b, dtype=torch.int64)
        state, gains, count, traj = self.state, self.gains, self.steps, self.traj_ids
        for t in range(steps):
            obs[t], ids[t] = state, traj
            pos, vel = state[:, :2], state[:, 2:]
            a = (-gains[:, :1] * pos - gains[:, 1:] * vel + noise[t]).clamp(-1, 1)
            vel = vel + self.dt * a
            pos = pos + self.dt * vel
            state = torch.cat([pos, vel], -1)
            count = count + 1
            dist = pos.norm(dim=-1)
            goal = (dist < 0.1) & (vel.norm(dim=-1) < 0.2)
            out = dist > self.arena
            done_t = goal | out
            trunc_t = (count >= self.max_steps) & ~done_t
            next_obs[t], act[t], term[t], trunc[t] = state, a, done_t, trunc_t
            rew[t] = -dist + 10.0 * goal - 10.0 * out
            reset = done_t | trunc_t
            new_ids = self._next_id + torch.cumsum(reset, 0) - 1
            self._next_id = self._next_id + reset.sum()
            traj = torch.where(reset, new_ids, traj)
            keep = ~reset.unsqueeze(-1)
            state = torch.where(keep, state, fresh[t])
            gains = torch.where(keep, gains, fresh_gains[t])
            count = torch.where(reset, 0, count)
        self.state, self.gains, self.steps, self.traj_ids = state, gains, count, traj

        def env_major(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1).contiguous()

        return TensorDict({
            "observation": env_major(obs),
            "action": env_major(act),
            ("next", "observation"): env_major(next_obs),
            ("next", "reward"): env_major(rew).unsqueeze(-1),
            ("next", "done"): env_major(term | trunc).unsqueeze(-1),
            ("next", "terminated"): env_major(term).unsqueeze(-1),
            ("next", "truncated"): env_major(trunc).unsqueeze(-1),
            _TRAJ_KEY: env_major(ids),
        }, batch_size=[b, steps])


# -- helpers --------------------------------------------------------------------------------

def _name(key: str | tuple[str, ...]) -> str:
    return ".".join(key) if isinstance(key, tuple) else key


def _leaves(td: TensorDict) -> list[tuple[str, torch.Tensor]]:
    return [(_name(k), v) for k, v in td.items(include_nested=True, leaves_only=True)]


def _schema(td: TensorDict) -> list[list[Any]]:
    """``[name, dtype, feature shape]`` of every leaf of a batch of rows."""
    return [[k, str(v.dtype).removeprefix("torch."), list(v.shape[1:])] for k, v in _leaves(td)]


def _sums(td: TensorDict) -> dict[str, float]:
    """Order-independent per-key checksums (float64 sums) of a batch of rows."""
    return {k: float(v.to(torch.float64).sum()) for k, v in _leaves(td)}


def _count(value: int | None) -> str:
    return "none" if value is None else f"{value:,}"


def fmt_time(seconds: float) -> str:
    """``0.0012`` -> ``'1.2 ms'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


@contextlib.contextmanager
def loopback_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """Run moto's S3 server on 127.0.0.1 (a free port) with a fresh bucket.

    Yields ``("s3://<bucket>", storage_options)``; the server stops on exit,
    and every object in it is gone.
    """
    from zstore.testing.s3 import MissingPackage, MotoS3

    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: "testing" for name in names})
    try:
        try:
            server = MotoS3()
        except MissingPackage as exc:
            raise DemoError(f"--s3: {exc}") from exc
        with server:
            bucket = server.new_bucket("zstore-demo")
            yield f"s3://{bucket}", dict(server.storage_options)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stored_bytes(url: str, options: Mapping[str, Any], names: list[str]) -> dict[str, int]:
    """Bytes on the store under each key's array and in total (``"*"``)."""
    fs, root = zstore.StoreSpec.parse(url, options).filesystem()
    out = {name: int(fs.du(f"{root}/{name.replace('.', '/')}")) for name in names}
    out["*"] = int(fs.du(root))
    return out


# -- the reader (runs in another process) ---------------------------------------------------

def read_back(url: str, storage_options: Mapping[str, Any] | None, *, length: int, cursor: int,
              schema: list[list[Any]], sums: Mapping[str, float], seed: int = 0) -> dict[str, Any]:
    """Reopen the buffer read-only, check it, sample it, and return what was seen and timed.

    ``length``, ``cursor``, ``schema`` and ``sums`` are what the writer expects;
    each difference is listed under ``"problems"``.
    """
    problems: list[str] = []
    gen = torch.Generator().manual_seed(seed + 1)
    t0 = time.perf_counter()
    storage = zstore.open(url, storage_options, mode="r")
    t_open = time.perf_counter() - t0
    try:
        n, last = len(storage), storage._last_cursor_index
        if n != length:
            problems.append(f"length {n}, the writer committed {length}")
        if last != cursor:
            problems.append(f"cursor {last}, the writer committed {cursor}")
        if n == 0:
            return {"problems": problems or ["the buffer is empty"]}
        rb = zstore.ReplayBuffer(storage, sampler=zstore.RandomSampler(),
                                 writer=zstore.ImmutableDatasetWriter(), batch_size=BATCH_SIZE)

        def sample() -> tuple[TensorDict, float]:
            start = time.perf_counter()
            batch = rb.sample(generator=gen)
            return batch, time.perf_counter() - start

        first, t_first = sample()
        warm = [sample() for _ in range(WARM_BATCHES)]
        batches = [first, *(b for b, _ in warm)]
        if _schema(first) != [list(x) for x in schema]:
            problems.append(f"batch schema {_schema(first)} differs from the written {schema}")
        reward = torch.cat([b["next", "reward"] for b in batches])
        done = torch.cat([b["next", "done"] for b in batches])

        start = time.perf_counter()
        everything = storage.get(torch.arange(n))
        t_scan = time.perf_counter() - start
        got = _sums(everything)
        bad = [k for k in sums if not math.isclose(got.get(k, math.nan), sums[k],
                                                    rel_tol=1e-9, abs_tol=1e-6)]
        problems += [f"contents of {k!r} differ: checksum {got.get(k)} != written {sums[k]}"
                     for k in bad]

        slicer = zstore.ReplayBuffer(
            storage, sampler=zstore.SliceSampler(slice_len=SLICE_LEN, traj_key=_TRAJ_KEY),
            writer=zstore.ImmutableDatasetWriter())
        try:
            pieces, info = slicer.sample(SLICES * SLICE_LEN, generator=gen, return_info=True)
        except ValueError:  # no trajectory of SLICE_LEN consecutive rows
            pieces, info = None, {"index": torch.empty(0, SLICE_LEN, dtype=torch.int64)}
        slices = []
        for i, rows in enumerate(info["index"].reshape(-1, SLICE_LEN)):
            piece = pieces[i * SLICE_LEN:(i + 1) * SLICE_LEN]
            lo, hi = int(rows[0]), int(rows[-1])
            ids = piece[_TRAJ_KEY]
            chained = torch.equal(piece["next", "observation"][:-1], piece["observation"][1:])
            early_end = bool(piece["next", "done"][:-1].any())
            if not (chained and bool((ids == ids[0]).all()) and not early_end):
                problems.append(f"slice {lo}..{hi} is not one trajectory")
            end = piece["next"][-1]
            slices.append({
                "traj": int(ids[0]), "rows": [lo, hi],
                "return": float(piece["next", "reward"].sum()), "chained": chained,
                "end": "terminated" if bool(end["terminated"]) else
                       "truncated" if bool(end["truncated"]) else "",
            })
        stats = storage.cache_stats
        return {
            "pid": os.getpid(), "class": type(storage).__name__, "length": n, "cursor": last,
            "problems": problems, "t_open": t_open, "t_first": t_first,
            "t_warm": statistics.median(t for _, t in warm), "t_scan": t_scan,
            "batches": len(batches), "reward_mean": float(reward.mean()),
            "done_frac": float(done.float().mean()), "keys_checked": len(sums) - len(bad),
            "slices": slices, "cache": dataclasses.asdict(stats) if stats is not None else None,
        }
    finally:
        storage.close()


def _reader_entry() -> int:
    """``python -m zstore.demo --reader``: a request as JSON on stdin, the answer as JSON on stdout."""
    request = json.load(sys.stdin)
    try:
        answer = read_back(**request)
    except ZStoreError as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    json.dump(answer, sys.stdout)
    return 0


def spawn_reader(request: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """Run :func:`read_back` in a new Python process; its answer and the process's wall time."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "zstore.demo", "--reader"],
                              input=json.dumps(request), capture_output=True, text=True,
                              timeout=READER_TIMEOUT, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        raise DemoError(f"the reader process did not finish in {READER_TIMEOUT:.0f} s") from None
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        raise DemoError(f"the reader process failed (exit code {proc.returncode}):\n{tail}")
    answer = json.loads(proc.stdout)
    if "error" in answer:
        raise DemoError(f"the reader process could not read the buffer: {answer['error']}")
    return answer, elapsed


# -- the demo -------------------------------------------------------------------------------

def run_demo(transitions: int = DEFAULT_TRANSITIONS, *, capacity: int | None = None,
             url: str | None = None, storage_options: Mapping[str, Any] | None = None,
             s3: bool = False, codec: str | None = None, seed: int = 0, keep: bool = False,
             out: TextIO | None = None) -> int:
    """Write ``transitions`` simulated transitions, read them back in another process, report.

    The buffer goes to ``url`` (kept), to a bucket on a loopback S3 server
    (``s3=True``), or to a fresh temporary directory (removed unless ``keep``).
    Returns 0; raises :class:`DemoError` (a :class:`~zstore.ZStoreError`) when
    what is read back differs from what was written.
    """
    out = out or sys.stdout
    capacity = capacity or transitions
    t_total = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url, options, where, ending = _location(stack, url, storage_options, s3, keep)
        storage = zstore.LazyMemmapStorage(capacity, scratch_dir=url, storage_options=options,
                                           codec=codec)
        stack.callback(storage.close)
        spec = storage.spec
        print(f"zstore demo: {transitions:,} transitions from {NUM_ENVS} point-mass envs "
              f"-> {spec.redacted()}", file=out)
        print(f"  {where}, codec {storage.codec}, capacity {capacity:,}", file=out)

        writer = zstore.RoundRobinWriter()
        writer.register_storage(storage)
        env = PointMassEnv(NUM_ENVS, seed=seed)
        first_kept = transitions - min(transitions, capacity)  # older rows are overwritten
        sums: dict[str, float] = {}
        t_sim = t_write = 0.0
        written = terminated = truncated = 0
        example = None
        while written < transitions:
            start = time.perf_counter()
            batch = env.rollout(ROLLOUT_STEPS).reshape(-1)[: transitions - written]
            t_sim += time.perf_counter() - start
            start = time.perf_counter()
            writer.extend(batch)
            t_write += time.perf_counter() - start
            terminated += int(batch["next", "terminated"].sum())
            truncated += int(batch["next", "truncated"].sum())
            tail = batch[max(0, first_kept - written):]
            for k, v in _sums(tail).items():
                sums[k] = sums.get(k, 0.0) + v
            written += len(batch)
            example = batch
        start = time.perf_counter()
        storage.flush()
        t_flush = time.perf_counter() - start
        length, cursor = len(storage), storage._last_cursor_index

        schema = _schema(example)
        names = [name for name, _, _ in schema]
        stored = _stored_bytes(url, options, names)
        row_bytes = {k: v[:1].numel() * v.element_size() for k, v in _leaves(example)}
        size = zstore.display.format_bytes
        print(f"\n  {'key':<22}{'dtype':<9}{'shape':<7}{'bytes':>11}{'stored':>11}", file=out)
        for name, dtype, shape in schema:
            print(f"  {name:<22}{dtype:<9}{str(shape):<7}{size(row_bytes[name] * length):>11}"
                  f"{size(stored[name]):>11}", file=out)
        print(f"  {'total':<38}{size(sum(row_bytes.values()) * length):>11}"
              f"{size(stored['*']):>11}", file=out)
        print(f"  {length:,} rows stored; episodes: {terminated:,} terminated, {truncated:,} "
              f"truncated", file=out)

        request = {"url": url, "storage_options": options, "length": length, "cursor": cursor,
                   "schema": schema, "sums": sums, "seed": seed}
        got, t_reader = spawn_reader(request)
        _print_reader(got, out)
        problems = got["problems"]
        if problems:
            raise DemoError("the reader saw a buffer other than the one written: "
                            + "; ".join(problems))

        rate = transitions / max(t_write + t_flush, 1e-9)
        rows = [
            ("simulate", fmt_time(t_sim), f"{transitions / max(t_sim, 1e-9):,.0f} transitions/s"),
            ("fill (writer.extend)", fmt_time(t_write), f"{rate:,.0f} transitions/s with flush"),
            ("flush", fmt_time(t_flush), "data, then the commit"),
            ("reader process", fmt_time(t_reader), "start python, import zstore, all below"),
            ("reopen", fmt_time(got["t_open"]), 'zstore.open(url, mode="r")'),
            ("first sample", fmt_time(got["t_first"]), f"{BATCH_SIZE} random rows"),
            ("warm sample", fmt_time(got["t_warm"]),
             f"median of {WARM_BATCHES}, {BATCH_SIZE / max(got['t_warm'], 1e-9):,.0f} rows/s"),
            ("full scan", fmt_time(got["t_scan"]), f"{length:,} rows"),
        ]
        print("\n  timings", file=out)
        for label, value, note in rows:
            print(f"    {label:<22}{value:>9}   {note}", file=out)
    print(f"  total {fmt_time(time.perf_counter() - t_total)}; {ending}", file=out)
    return 0


def _location(stack: contextlib.ExitStack, url: str | None,
              storage_options: Mapping[str, Any] | None, s3: bool,
              keep: bool) -> tuple[str, dict[str, Any], str, str]:
    """Where the buffer goes: URL, storage options, a description, and what happens at the end."""
    if s3:
        base, options = stack.enter_context(loopback_s3())
        return f"{base}/demo-buffer", options, "S3 on loopback (moto)", "server stopped"
    if url is not None:
        return url, dict(storage_options or {}), "chosen by --url", f"kept at {url}"
    tmp = tempfile.mkdtemp(prefix="zstore-demo-")
    url = os.path.join(tmp, "buffer")
    if keep:
        return url, {}, "local, kept", f"kept at {url}"
    stack.callback(shutil.rmtree, tmp, ignore_errors=True)
    return url, {}, "local, temporary", "temporary store removed"


def _print_reader(got: Mapping[str, Any], out: TextIO) -> None:
    """The reader's findings, a few lines."""
    status = "ok" if not got["problems"] else "MISMATCH"
    print(f"\n  reader (pid {got['pid']}, a new process): zstore.open(url, mode=\"r\") -> "
          f"{got['class']}, len {got['length']:,}, cursor {_count(got['cursor'])}  {status}", file=out)
    batches = f"{got['batches']} batches of {BATCH_SIZE}"
    print(f"    {batches:<22}mean reward {got['reward_mean']:.3f}, "
          f"done {got['done_frac']:.1%}", file=out)
    print(f"    full scan             {got['keys_checked']} keys match the written data "
          f"(checksums)", file=out)
    for piece in got["slices"]:
        lo, hi = piece["rows"]
        chain = "obs chain ok" if piece["chained"] else "obs chain BROKEN"
        end = f", then {piece['end']}" if piece["end"] else ""
        print(f"    slice of traj {piece['traj']:<7}rows {lo:,}-{hi:,}, return {piece['return']:.2f}"
              f"{end}; {chain}", file=out)
    if not got["slices"]:
        print(f"    no trajectory of {SLICE_LEN}+ consecutive rows to slice", file=out)
    cache = got["cache"]
    if cache is None:
        print("    cache                 none: the chunk files are memory-mapped", file=out)
    else:
        print(f"    cache                 hits {cache['hits']:,}, misses {cache['misses']:,}, "
              f"loaded {zstore.display.format_bytes(cache['loaded_bytes'])}", file=out)


if __name__ == "__main__":  # the reader process; the demo itself is `zstore demo` (zstore.cli)
    if sys.argv[1:] != ["--reader"]:
        sys.exit("usage: python -m zstore.demo --reader (run the demo with `zstore demo`)")
    sys.exit(_reader_entry())
