"""The long reliability runs: every kill point, many faults, many fuzz and property cases.

Run from the repository root, in the project's virtual environment::

    python benchmarks/reliability_long.py                  # everything, ~30-60 min on 2 busy cores
    python benchmarks/reliability_long.py --only crash --kinds s3
    python benchmarks/reliability_long.py --fault-rounds 50 --fuzz-examples 300 --property-examples 100

Parts (``--only``): ``crash`` runs every kill point of ``tests/crashkit.py``'s
scenario on each store kind (CI runs all local ones but only a spread of the
S3 ones); ``faults`` runs rounds of random network faults (``tests/faultproxy.py``)
under a writer that extends, flushes and reopens, checking every round against a
model; ``fuzz`` and ``properties`` rerun ``tests/test_fuzz.py`` and
``tests/test_properties.py`` with more hypothesis examples; ``overhead``
measures the unarmed crash point and the cost of a kill-point child (forkserver
fork vs a fresh interpreter). Prints a summary and writes
``benchmarks/results/reliability.json``. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import timeit
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import crashkit
import torch
from faultproxy import FAULTS, FaultProxy, Rule

import zstore
from zstore import _faults
from zstore.demo import loopback_s3


def run_crash(kinds, s3) -> dict:
    out = {}
    for kind in kinds:
        if kind == "s3":
            base, options = f"{s3[0]}/crash", s3[1]
        else:
            base, options = tempfile.mkdtemp(prefix=f"zstore-crash-{kind}-"), {}
        start = time.perf_counter()
        campaign = crashkit.run_campaign(kind, base, options)
        out[kind] = {"kill_points": len(campaign.points), "survived": len(campaign.outcomes),
                     "failures": campaign.failures, "seconds": round(time.perf_counter() - start, 1),
                     "outcomes": sorted(set(campaign.outcomes.values()))}
        print(f"crash {kind}: {len(campaign.outcomes)}/{len(campaign.points)} kill points survived "
              f"in {out[kind]['seconds']} s; failures: {len(campaign.failures)}", flush=True)
    return out


def run_faults(rounds: int, s3, seed: int) -> dict:
    """Random faults under extend / flush / reopen; every round checked against the model."""
    rng = random.Random(seed)
    root, direct = s3
    errors, wrong, clean = [], 0, 0
    with FaultProxy(direct["endpoint_url"]) as proxy:
        options = dict(direct, endpoint_url=proxy.url,
                       config_kwargs={"retries": {"max_attempts": 2}})
        url = f"{root}/faults-{uuid.uuid4().hex[:8]}"
        storage = zstore.LazyMemmapStorage(64, scratch_dir=url, storage_options=options,
                                           codec="zstd+crc32c", chunks=4, shards=8,
                                           autocommit_seconds=1e9)
        committed = []  # codes of the committed rows, in order (the buffer never wraps: reset)
        pending = []
        for round_ in range(rounds):
            proxy.clear()
            for _ in range(rng.randint(1, 3)):
                proxy.add(Rule(rng.choice(FAULTS), path=rng.choice([r"/c/", r"zarr\.json$"]),
                               method=rng.choice(["GET", "PUT"]),
                               count=rng.choice([1, 2, 3, 10_000]), delay=0.02))
            n = rng.randint(1, 9)
            if len(committed) + len(pending) + n > 64:
                proxy.clear()
                storage.cleanup()
                url = f"{root}/faults-{uuid.uuid4().hex[:8]}"
                storage = zstore.LazyMemmapStorage(64, scratch_dir=url, storage_options=options,
                                                   codec="zstd+crc32c", chunks=4, shards=8,
                                                   autocommit_seconds=1e9)
                committed, pending = [], []
                continue
            start = len(committed) + len(pending)
            codes = list(range(1000 * round_, 1000 * round_ + n))
            acceptable = [committed]  # a failed commit may still have landed (reset after the PUT)
            try:
                storage.set(torch.arange(start, start + n), crashkit.coded(torch.tensor(codes)))
                pending += codes
                storage.flush()
                committed += pending
                pending = []
                clean += 1
            except (OSError, zstore.ZStoreError) as exc:
                acceptable.append(committed + pending)
                if url.split("/")[3] not in str(exc):
                    errors.append(f"round {round_}: error does not name the store: {exc}")
            proxy.clear()
            try:
                reader = zstore.open(url, direct, mode="r")  # what S3 really holds
            except (zstore.NotAZStoreError, zstore.StoreNotFoundError):
                if committed:
                    errors.append(f"round {round_}: a committed store cannot be opened")
                continue  # the creation failed: nothing was committed
            got = crashkit.decode(reader[:]) if len(reader) else {}
            seen = [values.tolist() for values in got.values()] or [[]]
            if not any(all(column == state for column in seen) for state in acceptable):
                wrong += 1
                errors.append(f"round {round_}: committed {len(committed)} rows, reader sees "
                              f"{len(reader)}")
            elif len(seen[0]) > len(committed):  # the failed commit had landed
                committed += pending
                pending = []
            if rng.random() < 0.2:  # reopen the writer: it resumes at the commit
                storage.close()
                committed += pending
                pending = []
                storage = zstore.open(url, options)
                storage.autocommit_seconds = 1e9
        injected = dict(proxy.injected)
    print(f"faults: {sum(injected.values())} injected over {rounds} rounds "
          f"({clean} rounds committed cleanly), wrong states: {wrong}, errors: {len(errors)}",
          flush=True)
    return {"rounds": rounds, "injected": injected, "clean_rounds": clean, "wrong": wrong,
            "errors": errors[:20]}


def run_pytest(path: str, env_name: str, examples: int) -> dict:
    env = dict(os.environ, **{env_name: str(examples)})
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    print(f"{path} with {examples} examples per test: {tail}", flush=True)
    return {"examples_per_test": examples, "returncode": done.returncode, "summary": tail,
            "seconds": round(time.perf_counter() - start, 1)}


def run_overhead() -> dict:
    calls = 1_000_000
    unarmed = timeit.timeit(lambda: _faults.crash_point("commit.before"), number=calls) / calls
    empty = timeit.timeit(lambda: None, number=calls) / calls
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import zstore"], cwd=ROOT, check=True)
    fresh = time.perf_counter() - start
    ctx = crashkit._context()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        child = ctx.Process(target=int)
        child.start()
        child.join()
        times.append(time.perf_counter() - start)
    forked = sorted(times)[2]
    print(f"unarmed crash point: {1e9 * (unarmed - empty):.0f} ns over an empty call; "
          f"child: fresh interpreter importing zstore {fresh:.2f} s, forkserver child "
          f"{1e3 * forked:.0f} ms ({fresh / forked:.0f}x)", flush=True)
    return {"crash_point_ns": 1e9 * (unarmed - empty), "fresh_import_s": fresh,
            "forkserver_child_s": forked}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["overhead", "crash", "faults", "fuzz",
                                                       "properties"])
    parser.add_argument("--kinds", nargs="*", default=list(crashkit.LAYOUTS))
    parser.add_argument("--fault-rounds", type=int, default=200)
    parser.add_argument("--fuzz-examples", type=int, default=2000)
    parser.add_argument("--property-examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "reliability.json"))
    args = parser.parse_args()
    stack = contextlib.ExitStack()  # the S3 server lives until the report is written
    s3 = stack.enter_context(loopback_s3()) if {"crash", "faults"} & set(args.only) else None
    report: dict = {}
    if "overhead" in args.only:
        report["overhead"] = run_overhead()
    if "crash" in args.only:
        report["crash"] = run_crash(args.kinds, s3)
    if "faults" in args.only:
        report["faults"] = run_faults(args.fault_rounds, s3, args.seed)
    if "fuzz" in args.only:
        report["fuzz"] = run_pytest("tests/test_fuzz.py", "ZSTORE_FUZZ_EXAMPLES", args.fuzz_examples)
    if "properties" in args.only:
        report["properties"] = run_pytest("tests/test_properties.py", "ZSTORE_PROPERTY_EXAMPLES",
                                          args.property_examples)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    stack.close()
    failed = (any(c["failures"] for c in report.get("crash", {}).values())
              or report.get("faults", {}).get("errors")
              or any(report.get(p, {}).get("returncode") for p in ("fuzz", "properties")))
    print(f"wrote {args.json}; {'FAILURES' if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
