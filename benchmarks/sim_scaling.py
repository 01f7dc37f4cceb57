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

With ``--ray`` the same roles are Ray actors on a local Ray cluster (``pip install
'zstore[ray]'``): collectors own ``collector-<i>`` through :func:`zstore.ray.open_member`,
learners read the prefix through :func:`zstore.ray.ensemble` (``refresh()`` every
``--refresh`` batches) and sample uniformly over all committed rows, for every
combination of ``--writers`` and ``--learners`` (lease on).

    python benchmarks/sim_scaling.py --quick
    python benchmarks/sim_scaling.py --writers 1 2 4 --readers 2 --batches 40
    python benchmarks/sim_scaling.py --ray --writers 1 2 4 --learners 1 2 --batches 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path

import s3fs
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


def ray_actors():
    """The collector, learner and stop-flag actor classes (Ray is imported here only)."""
    import ray

    from zstore import ray as zray

    @ray.remote(num_cpus=0)
    class Collector:
        def __init__(self, prefix, w, options, args):
            self.w, self.args = w, args
            self.storage = zray.open_member(prefix, w, args.batches * args.batch_rows,
                                            storage_options=options, codec="zstd",
                                            autocommit_seconds=math.inf)
            self.storage.set(torch.arange(args.batch_rows), transitions(w, 0, args.batch_rows))
            self.storage.flush()  # one batch committed before the learners start

        def run(self):
            n, commits = self.args.batch_rows, []
            start = time.perf_counter()
            for b in range(1, self.args.batches):
                self.storage.set(torch.arange(b * n, (b + 1) * n), transitions(self.w, b * n, n))
                t = time.perf_counter()
                self.storage.flush()
                commits.append(time.perf_counter() - t)
            elapsed = time.perf_counter() - start
            self.storage.close()
            return (self.args.batches - 1) * n, elapsed, commits

    @ray.remote(num_cpus=0)
    class Learner:
        def __init__(self, prefix, options, seed):
            self.ensemble = zray.ensemble(prefix, options)
            self.generator = torch.Generator().manual_seed(seed)

        def run(self, stop, args):
            sampled, batches, wrong = 0, 0, 0
            start = time.perf_counter()
            while batches < args.min_reader_batches or not ray.get(stop.is_set.remote()):
                if batches % args.refresh == 0 and batches:
                    self.ensemble.refresh()
                td, member, index = self.ensemble.sample(args.sample_batch, self.generator,
                                                         return_index=True)
                writer = torch.tensor([int(name.rsplit("-", 1)[1])
                                       for name in self.ensemble.names])[member]
                if not (torch.equal(td["meta"][:, 0], writer)
                        and torch.equal(td["meta"][:, 1], index)):
                    wrong += 1  # a wrong row: must never happen
                sampled += len(index)
                batches += 1
            return sampled, time.perf_counter() - start, wrong

    @ray.remote(num_cpus=0)
    class Flag:
        def __init__(self):
            self.value = False

        def set(self):
            self.value = True

        def is_set(self):
            return self.value

    return Collector, Learner, Flag


def run_ray(n_writers: int, n_learners: int, args, options: dict, bucket: str, actors) -> dict:
    import ray

    Collector, Learner, Flag = actors
    prefix = f"s3://{bucket}/ray-{uuid.uuid4().hex[:8]}"
    collectors = [Collector.remote(prefix, w, options, args) for w in range(n_writers)]
    ray.get([c.__ray_ready__.remote() for c in collectors])
    learners = [Learner.remote(prefix, options, r) for r in range(n_learners)]
    stop = Flag.remote()
    ray.get([a.__ray_ready__.remote() for a in learners + [stop]])
    start = time.perf_counter()
    sampling = [learner.run.remote(stop, args) for learner in learners]
    written = ray.get([c.run.remote() for c in collectors])
    wall = time.perf_counter() - start
    ray.get(stop.set.remote())
    sampled = ray.get(sampling)
    for actor in collectors + learners + [stop]:
        ray.kill(actor)
    commits = [c for rep in written for c in rep[2]]
    stored = s3fs.S3FileSystem(**options, skip_instance_cache=True).du(prefix)
    return {
        "collectors": n_writers, "learners": n_learners,
        "written_per_s": sum(rep[0] for rep in written) / wall,
        "stored_mb_per_s": stored / wall / 1e6,  # what the server took in: chunks and commits
        "sampled_per_s": sum(rep[0] / rep[1] for rep in sampled),
        "commit_ms_median": 1e3 * statistics.median(commits),
        "commit_ms_p90": 1e3 * statistics.quantiles(commits, n=10)[-1],
        "wrong_rows": sum(rep[2] for rep in sampled),
    }


def ray_main(args, options: dict, bucket: str) -> list[dict]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    actors = ray_actors()
    results = []
    print(f"{'collectors':>10} {'learners':>8} {'written/s':>10} {'sampled/s':>10} "
          f"{'stored MB/s':>11} {'commit ms (median / p90)':>25} {'wrong rows':>10}")
    for n in args.writers:
        for m in args.learners:
            runs = [run_ray(n, m, args, options, bucket, actors) for _ in range(args.repeats)]
            row = {key: statistics.median(r[key] for r in runs) if isinstance(runs[0][key], float)
                   else runs[0][key] for key in runs[0]}
            row["wrong_rows"] = sum(r["wrong_rows"] for r in runs)
            row["repeats"] = args.repeats
            results.append(row)
            print(f"{n:>10} {m:>8} {row['written_per_s']:>10.0f} {row['sampled_per_s']:>10.0f} "
                  f"{row['stored_mb_per_s']:>11.2f} {row['commit_ms_median']:>13.1f} / {row['commit_ms_p90']:<9.1f} "
                  f"{row['wrong_rows']:>10}", flush=True)
    ray.shutdown()
    return results


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
    parser.add_argument("--ray", action="store_true",
                        help="collectors and learners as Ray actors (zstore.ray), lease on")
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2],
                        help="learner counts to combine with --writers (with --ray)")
    parser.add_argument("--json", default=None,
                        help="where to write the results (default: results/sim_scaling[_ray].json)")
    args = parser.parse_args()
    if args.quick:
        args.writers, args.batches = [1, 2], 10
    if args.json is None:
        args.json = str(Path(__file__).parent / "results" /
                        ("sim_scaling_ray.json" if args.ray else "sim_scaling.json"))

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # s3fs sessions left open at exit
    server = contextlib.ExitStack()
    root, options = server.enter_context(loopback_s3())
    bucket = root.removeprefix("s3://")

    if args.ray:
        results = ray_main(args, options, bucket)
        server.close()
        return write_results(args, results)
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
    return write_results(args, results)


def write_results(args, results: list[dict]) -> int:
    """Write ``results`` (and the arguments) to ``args.json``; 1 if any row was wrong."""
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                           "results": results}, indent=1))
    print(f"wrote {args.json}")
    return 1 if any(r["wrong_rows"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
