"""Simulate many collectors and trainers sharing one S3 bucket (docs/scaling.md).

Writer processes each own a LazyMemmapStorage under one prefix (``collector-<i>``) and
commit after every batch; reader processes open the prefix as a StorageEnsemble and
sample random batches, reopening it every ``--refresh`` batches to see new commits.
S3 is moto's ThreadedMotoServer on 127.0.0.1 (port 0), started here: nothing leaves
the machine, and the server's CPU is shared with the simulated nodes, so absolute
rates are a floor; ratios between rows are what the run measures.

For every writer count the run is done twice, side by side: with the single-writer
lease and conditional commits (the default) and without (``lease_ttl=None``, plain
commits), so the cost of the lease shows as a ratio.

    python benchmarks/sim_scaling.py --quick
    python benchmarks/sim_scaling.py --writers 1 2 4 --readers 2 --batches 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zstore  # noqa: E402
from zstore.demo import loopback_s3  # noqa: E402

OBS = 17  # proprioceptive observations


def transitions(writer: int, start: int, n: int) -> TensorDict:
    index = torch.arange(start, start + n)
    obs = torch.randn(n, OBS)
    return TensorDict(obs=obs, action=torch.randn(n, 6), reward=torch.randn(n, 1),
                      done=torch.zeros(n, 1, dtype=torch.bool),
                      meta=torch.stack([torch.full_like(index, writer), index], 1),
                      next=TensorDict(obs=obs + 0.01, batch_size=[n]), batch_size=[n])


def writer_main(w, url, options, args, lease, ready, go, out) -> None:
    storage = zstore.LazyMemmapStorage(args.batches * args.batch_rows, scratch_dir=url,
                                       storage_options=options, codec="zstd",
                                       lease_ttl=60.0 if lease else None, autocommit_seconds=1e9)
    storage.set(torch.arange(args.batch_rows), transitions(w, 0, args.batch_rows))
    storage.flush()
    ready.wait()
    go.wait()
    commits = []
    start = time.perf_counter()
    for b in range(1, args.batches):
        rows = torch.arange(b * args.batch_rows, (b + 1) * args.batch_rows)
        storage.set(rows, transitions(w, int(rows[0]), args.batch_rows))
        t = time.perf_counter()
        storage.flush()
        commits.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    storage.close()
    out.put(("writer", w, (args.batches - 1) * args.batch_rows, elapsed, commits))


def reader_main(r, prefix, options, args, go, done, out) -> None:
    generator = torch.Generator().manual_seed(r)
    go.wait()
    sampled, batches, stale = 0, 0, 0
    start = time.perf_counter()
    ensemble = zstore.open(prefix, options, mode="r")
    while not done.is_set() or batches < args.min_reader_batches:
        if batches % args.refresh == 0 and batches:
            ensemble = zstore.open(prefix, options, mode="r")
        member = int(torch.randint(len(ensemble), (1,), generator=generator))
        n = len(ensemble[member])
        index = torch.randint(n, (args.sample_batch,), generator=generator)
        got = ensemble.get({"buffer_ids": [member], "index": [index]})[0][1]
        if not torch.equal(got["meta"][:, 1], index) or not (got["meta"][:, 0] == member).all():
            stale += 1  # a wrong row: must never happen
        sampled += len(index)
        batches += 1
    out.put(("reader", r, sampled, time.perf_counter() - start, stale))


def run(n_writers: int, args, options: dict, bucket: str, lease: bool) -> dict:
    ctx = mp.get_context("fork")
    prefix = f"s3://{bucket}/sim-{uuid.uuid4().hex[:8]}"
    urls = [f"{prefix}/collector-{w}" for w in range(n_writers)]
    ready, go = ctx.Barrier(n_writers + 1), ctx.Barrier(n_writers + args.readers + 1)
    done, out = ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=writer_main, args=(w, urls[w], options, args, lease, ready, go, out))
               for w in range(n_writers)]
    for p in writers:
        p.start()
    ready.wait()
    zstore.StorageEnsemble(*(zstore.open(u, options, mode="r") for u in urls),
                           scratch_dir=prefix, storage_options=options)
    readers = [ctx.Process(target=reader_main, args=(r, prefix, options, args, go, done, out))
               for r in range(args.readers)]
    for p in readers:
        p.start()
    go.wait()
    start = time.perf_counter()
    reports = [out.get() for _ in writers]
    wall = time.perf_counter() - start
    done.set()
    reports += [out.get() for _ in readers]
    for p in writers + readers:
        p.join()
    commits = [c for rep in reports if rep[0] == "writer" for c in rep[4]]
    written = sum(rep[2] for rep in reports if rep[0] == "writer")
    reader_reps = [rep for rep in reports if rep[0] == "reader"]
    return {
        "writers": n_writers, "readers": args.readers, "lease": lease,
        "written_per_s": written / wall,
        "sampled_per_s": sum(rep[2] / rep[3] for rep in reader_reps),
        "commit_ms_median": 1e3 * statistics.median(commits),
        "commit_ms_p90": 1e3 * statistics.quantiles(commits, n=10)[-1],
        "wrong_rows": sum(rep[4] for rep in reader_reps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30, help="commits per writer")
    parser.add_argument("--batch-rows", type=int, default=256, help="transitions per commit")
    parser.add_argument("--sample-batch", type=int, default=256)
    parser.add_argument("--refresh", type=int, default=8, help="batches between reopenings")
    parser.add_argument("--min-reader-batches", type=int, default=40,
                        help="batches each reader samples at least (it keeps going while writers write)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration (medians)")
    parser.add_argument("--quick", action="store_true", help="small run: 1 and 2 writers, 10 commits")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "sim_scaling.json"))
    args = parser.parse_args()
    if args.quick:
        args.writers, args.batches = [1, 2], 10

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # s3fs sessions left open at exit
    server = contextlib.ExitStack()
    root, options = server.enter_context(loopback_s3())
    bucket = root.removeprefix("s3://")

    results = []
    print(f"{'writers':>7} {'lease':>5} {'written/s':>10} {'sampled/s':>10} "
          f"{'commit ms (median / p90)':>25} {'wrong rows':>10}")
    for n in args.writers:
        pair = {}
        runs = {True: [], False: []}
        for repeat in range(args.repeats):  # alternate the order: drift hits both alike
            for lease in ((True, False) if repeat % 2 == 0 else (False, True)):
                runs[lease].append(run(n, args, options, bucket, lease))
        for lease in (True, False):
            row = {key: (statistics.median(r[key] for r in runs[lease])
                         if isinstance(runs[lease][0][key], float) else runs[lease][0][key])
                   for key in runs[lease][0]}
            row["wrong_rows"] = sum(r["wrong_rows"] for r in runs[lease])
            row["repeats"] = args.repeats
            pair[lease] = row
            results.append(row)
            print(f"{n:>7} {'yes' if lease else 'no':>5} {row['written_per_s']:>10.0f} "
                  f"{row['sampled_per_s']:>10.0f} {row['commit_ms_median']:>13.1f} / "
                  f"{row['commit_ms_p90']:<9.1f} {row['wrong_rows']:>10}")
        print(f"        lease / no lease: commit latency x{pair[True]['commit_ms_median'] / pair[False]['commit_ms_median']:.2f}, "
              f"written/s x{pair[True]['written_per_s'] / pair[False]['written_per_s']:.2f}")
    server.close()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                           "results": results}, indent=1))
    print(f"wrote {args.json}")
    return 1 if any(r["wrong_rows"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
