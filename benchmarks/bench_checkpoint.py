"""Side-by-side benchmark: zstore checkpoints vs TorchRL's checkpointers.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_checkpoint.py                # 1M transitions, a few minutes
    python benchmarks/bench_checkpoint.py --n 100000     # smoke test

Workload: ``--n`` proprioceptive TED transitions (float32 ``obs[64]``,
``("next", "obs")[64]``, ``action[8]``, ``("next", "reward")``, ``("next", "done"
/ "terminated" / "truncated")``), episodes of ~1000 steps, in a full in-RAM
``LazyTensorStorage`` of each library. Measured in one process, medians of
``--repeats`` runs, interleaved:

* full ``dumps`` / ``loads``: zstore's TensorStorageCheckpointer (local disk) vs
  TorchRL's TensorStorageCheckpointer; and loads followed by a read of one byte of every
  page (zstore's local loads map the chunk files: the paging-in happens on first use);
* H5: zstore's H5StorageCheckpointer vs TorchRL's (dumps, loads);
* incremental: a second ``dumps`` to the same destination after 1% new data
  (bytes written and time, relative to the full dump that preceded it);

every timed dump and load starts from a quiesced machine (``os.sync()``, old
generations deleted), so that dirty pages left by an earlier step do not throttle it;
* S3 (moto's ThreadedMotoServer on 127.0.0.1, started here): full dump,
  incremental dump and load.

Prints a table and writes JSON to ``benchmarks/results/bench_checkpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import checkpoint
import zstore
from zstore import StoreSpec

MB = 1 << 20


def transitions(n: int, seed: int = 0) -> TensorDict:
    """``n`` TED transitions, episodes of ~1000 steps, next obs = following obs."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n + 1, 64, generator=g)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[999::1000] = True
    return TensorDict(
        obs=obs[:-1], action=torch.randn(n, 8, generator=g),
        next=TensorDict(obs=obs[1:].clone(), reward=torch.randn(n, 1, generator=g), done=done,
                        terminated=done.clone(), truncated=torch.zeros_like(done), batch_size=[n]),
        batch_size=[n])


def median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs (``setup`` untimed before each)."""
    return statistics.median(timed(fn, setup) for _ in range(repeats))


def timed(fn: Callable[[], object], setup: Callable[[], None] | None = None) -> float:
    if setup is not None:
        setup()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def quiesce() -> None:
    """Start a timed dump from a clean page cache: no dirty pages left by earlier steps to
    throttle its writes, no background deletion of an old generation running."""
    checkpoint._dest.settle()
    os.sync()


def side_by_side(pairs: dict[str, tuple[Callable, Callable | None]], repeats: int) -> dict[str, float]:
    """Medians of ``{name: (fn, setup)}``, run round-robin so that noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(repeats):
        for name, (fn, setup) in pairs.items():
            times[name].append(timed(fn, setup))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_checkpoint.json"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    from torchrl.data import H5StorageCheckpointer as TH5
    from torchrl.data import LazyTensorStorage as TLazy

    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.tmpdir))
    n = args.n
    data = transitions(n)
    ours = zstore.LazyTensorStorage(n)
    ours.set(torch.arange(n), data)
    theirs = TLazy(n)
    theirs.set(torch.arange(n), data)
    raw_bytes = sum(v.numel() * v.element_size() for v in data.values(True, True))
    results: dict[str, float] = {"raw_mb": raw_bytes / MB}

    def fresh(name: str) -> Callable[[], None]:
        def setup() -> None:
            shutil.rmtree(root / name, ignore_errors=True)
            quiesce()
        return setup

    # -- full dumps / loads, local --------------------------------------------------------
    results.update(side_by_side({
        "dump_zstore_s": (lambda: ours.dumps(root / "z"), fresh("z")),
        "dump_torchrl_s": (lambda: theirs.dumps(root / "t"), fresh("t"))}, args.repeats))
    results.update(side_by_side({
        "load_zstore_s": (lambda: zstore.LazyTensorStorage(n).loads(root / "z"), quiesce),
        "load_torchrl_s": (lambda: TLazy(n).loads(root / "t"), quiesce)}, args.repeats))

    def load_and_touch(storage, path) -> None:
        """A load, then one byte read from every page of the data: what a load left to do
        (zstore maps the chunk files and pages them in on first use) is paid here."""
        storage.loads(path)
        for value in storage._storage.values(True, True):
            value.reshape(-1).view(torch.uint8)[::4096].sum()

    results.update(side_by_side({
        "load_touch_zstore_s": (lambda: load_and_touch(zstore.LazyTensorStorage(n), root / "z"),
                                quiesce),
        "load_touch_torchrl_s": (lambda: load_and_touch(TLazy(n), root / "t"), quiesce)},
        args.repeats))
    check = zstore.LazyTensorStorage(n)
    check.loads(root / "z")
    assert (check.get(slice(None)) == data).all(), "zstore loaded different data"

    # -- H5 -----------------------------------------------------------------------------------
    ours.checkpointer = checkpoint.H5StorageCheckpointer()
    theirs.checkpointer = TH5()
    theirs._last_cursor = n - 1
    results.update(side_by_side({
        "h5_dump_zstore_s": (lambda: ours.dumps(root / "zh5"), fresh("zh5")),
        "h5_dump_torchrl_s": (lambda: theirs.dumps(root / "th5"), fresh("th5"))}, args.repeats))

    def load_ours_h5():
        s = zstore.LazyTensorStorage(n)
        s.checkpointer = checkpoint.H5StorageCheckpointer()
        s.loads(root / "zh5")
        return s

    def load_theirs_h5():
        s = TLazy(n)
        s.checkpointer = TH5()
        s.loads(root / "th5")

    results.update(side_by_side({"h5_load_zstore_s": (load_ours_h5, None),
                                 "h5_load_torchrl_s": (load_theirs_h5, None)}, args.repeats))
    assert (load_ours_h5().get(slice(None)) == data).all(), "zstore H5 loaded different data"
    ours.checkpointer = checkpoint.TensorStorageCheckpointer()

    # -- incremental: 1% new data ---------------------------------------------------------------
    new = transitions(n // 100, seed=1)

    def incremental(new_dest: Callable[[], object]) -> tuple[float, float, dict, dict]:
        """Median times of a full dump to a new destination and of the next dump there after
        1% new rows, both timed from a quiesced machine; and the two commit records. Each
        destination is deleted after its two dumps, so every full dump starts from the same
        page cache (the same state as the side-by-side full dumps above)."""
        full_times, times, fulls, incs = [], [], [], []
        for r in range(args.repeats):
            target = new_dest()
            full_times.append(timed(lambda: ours.dumps(target), quiesce))
            fulls.append(record(target))
            start = (r * 7919 * (n // 100)) % (n - n // 100)  # a different region each time
            ours.set(torch.arange(start, start + n // 100), new)
            times.append(timed(lambda: ours.dumps(target), quiesce))
            incs.append(record(target))
            checkpoint._dest.as_spec(target).delete()
        assert all(i["incremental"] for i in incs) and not any(f["incremental"] for f in fulls)
        return statistics.median(full_times), statistics.median(times), fulls[-1], incs[-1]

    def record(target) -> dict:
        return checkpoint._dest.Destination(checkpoint._dest.as_spec(target)).read_commit()

    t_full, t_inc, full_rec, inc_rec = incremental(lambda: root / f"inc-{uuid.uuid4().hex[:8]}")
    results["incremental_full_dump_s"] = t_full
    results["incremental_dump_s"] = t_inc
    results["incremental_bytes_ratio"] = inc_rec["bytes_written"] / full_rec["bytes_written"]
    results["incremental_time_ratio"] = t_inc / t_full

    # -- S3 on loopback -----------------------------------------------------------------------
    if not args.no_s3:
        from zstore.testing.s3 import moto_s3

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        with moto_s3() as server:
            options, bucket = server.storage_options, server.new_bucket("bench")

            def s3_dest():
                return StoreSpec.parse(f"s3://{bucket}/{uuid.uuid4().hex[:8]}", options)

            dests = []
            results["s3_dump_zstore_s"] = median_time(lambda: ours.dumps(dests[-1]), args.repeats,
                                                      lambda: dests.append(s3_dest()))
            results["s3_load_zstore_s"] = median_time(lambda: zstore.LazyTensorStorage(n).loads(dests[-1]),
                                                      args.repeats)
            t_full, t_inc, full_rec, inc_rec = incremental(s3_dest)
            results["s3_incremental_dump_s"] = t_inc
            results["s3_incremental_bytes_ratio"] = inc_rec["bytes_written"] / full_rec["bytes_written"]
            results["s3_incremental_time_ratio"] = t_inc / t_full
    shutil.rmtree(root, ignore_errors=True)

    rows = [
        ("full dumps, local", "dump_zstore_s", "dump_torchrl_s"),
        ("full loads, local", "load_zstore_s", "load_torchrl_s"),
        ("loads + a read of every page", "load_touch_zstore_s", "load_touch_torchrl_s"),
        ("H5 dumps", "h5_dump_zstore_s", "h5_dump_torchrl_s"),
        ("H5 loads", "h5_load_zstore_s", "h5_load_torchrl_s"),
    ]
    print(f"\n{n:,} transitions, {results['raw_mb']:.0f} MiB raw; medians of {args.repeats}\n")
    print(f"| {'operation':<30} | {'zstore s':>9} | {'TorchRL s':>9} | {'TorchRL / zstore':>16} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|{'-' * 18}|")
    for label, z, t in rows:
        print(f"| {label:<30} | {results[z]:9.2f} | {results[t]:9.2f} | {results[t] / results[z]:15.2f}x |")
    print(f"| {'incremental dumps (1% new)':<30} | {results['incremental_dump_s']:9.2f} | {'-':>9} | "
          f"{'-':>16} |")
    print(f"\nincremental dump, local: {results['incremental_bytes_ratio']:.1%} of a full dump's bytes, "
          f"{results['incremental_time_ratio']:.1%} of its time ({results['incremental_dump_s']:.3f} s "
          f"vs {results['incremental_full_dump_s']:.3f} s, both from a quiesced page cache)")
    if "s3_dump_zstore_s" in results:
        print(f"S3 (moto, loopback): full dump {results['s3_dump_zstore_s']:.2f} s, load "
              f"{results['s3_load_zstore_s']:.2f} s, incremental dump {results['s3_incremental_dump_s']:.2f} s "
              f"({results['s3_incremental_bytes_ratio']:.1%} of the bytes, "
              f"{results['s3_incremental_time_ratio']:.1%} of the time)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"n": n, "repeats": args.repeats, "machine": platform.platform(),
                               "cpus": os.cpu_count(), "results": results}, indent=2))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
