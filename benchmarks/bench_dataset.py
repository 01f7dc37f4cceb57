"""Sealed datasets ten times larger than the cache: time to first batch, sampling, cache memory.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_dataset.py                  # 160k steps (84 MiB), 8 MiB cache
    python benchmarks/bench_dataset.py --rows 40000 --cache-mib 2 --repeats 5 --no-s3

One TED dataset (``observation`` / ``("next", "observation")`` float32 [64]
random walks, ``action`` [8], reward and done flags; episodes of 50-500 steps)
is published three ways and opened with :func:`zstore.open_dataset`:

* ``local mmap`` — local, raw (one chunk per key, memory-mapped; no cache): the baseline;
* ``local zstd`` — local, ``zstd+crc32c``, ``--chunks`` rows per chunk, through the
  hot-chunk cache;
* ``s3 zstd`` — the same on moto's S3 server, started on 127.0.0.1 (port 0) by this
  script, sharded as zstore does on object stores.

Measured (medians of ``--repeats``): *time to first batch* — ``open_dataset`` plus
the first ``sample(256)``, on a fresh open each round; the first
``sample_slices(32, 16)`` after it; warm ``sample(256)`` and
``sample_slices(32, 16)``; and the cache's memory from ``CacheStats``: the
slabs allocated (``capacity_bytes``) and the most bytes resident at once over
all batches, against the ``--cache-mib`` budget. Ratios are to ``local mmap``.
Writes benchmarks/results/dataset.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zstore
from zstore.demo import fmt_time, loopback_s3
from zstore.display import format_bytes as fmt_bytes

BATCH, SLICES, SLICE_LEN = 256, 32, 16


def make_data(rows: int, seed: int = 0) -> TensorDict:
    """TED steps: random-walk observations, episodes of 50-500 steps (the last one open)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 500, (rows // 50 + 1,), generator=g)
    ends = torch.cumsum(lengths, 0) - 1
    ends = ends[ends < rows - 1]
    done = torch.zeros(rows, 1, dtype=torch.bool)
    done[ends] = True
    walk = torch.cumsum(torch.randn(rows + 1, 64, generator=g) * 0.01, 0)
    term = done & (torch.rand(rows, 1, generator=g) < 0.5)
    return TensorDict({
        "observation": walk[:-1].clone(), "action": torch.randn(rows, 8, generator=g),
        ("next", "observation"): walk[1:].clone(),
        ("next", "reward"): torch.randn(rows, 1, generator=g),
        ("next", "done"): done, ("next", "terminated"): term, ("next", "truncated"): done & ~term,
    }, batch_size=[rows])


def publish(data: TensorDict, url: str, options: dict, codec, chunks: int | None) -> None:
    storage = zstore.LazyMemmapStorage(len(data), scratch_dir=url, storage_options=options,
                                       codec=codec, chunks=chunks)
    for start in range(0, len(data), 32768):
        stop = min(start + 32768, len(data))
        storage.set(torch.arange(start, stop), data[start:stop])
    storage.seal()
    storage.close()


def measure(url: str, options: dict, cache_bytes: int, repeats: int, data: TensorDict) -> dict:
    first, first_slices = [], []
    for round_ in range(repeats):
        start = time.perf_counter()
        ds = zstore.open_dataset(url, options, cache_bytes=cache_bytes)
        batch = ds.sample(BATCH, generator=torch.Generator().manual_seed(round_))
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        ds.sample_slices(SLICES, SLICE_LEN, generator=torch.Generator().manual_seed(round_))
        first_slices.append(time.perf_counter() - start)
        ds.close()
    ds = zstore.open_dataset(url, options, cache_bytes=cache_bytes)
    g = torch.Generator().manual_seed(123)
    warm, warm_slices, peak = [], [], 0
    for _ in range(repeats * 5):
        start = time.perf_counter()
        batch = ds.sample(BATCH, generator=g)
        warm.append(time.perf_counter() - start)
        start = time.perf_counter()
        ds.sample_slices(SLICES, SLICE_LEN, generator=g)
        warm_slices.append(time.perf_counter() - start)
        stats = ds.cache_stats
        peak = max(peak, stats.resident_bytes if stats else 0)
    rows = batch["observation"][:, 0]
    assert torch.isin(rows, data["observation"][:, 0]).all(), "sampled rows are not in the data"
    stats = ds.cache_stats
    ds.close()
    return {"first_batch": statistics.median(first), "first_slices": statistics.median(first_slices),
            "warm_batch": statistics.median(warm), "warm_slices": statistics.median(warm_slices),
            "cache_capacity": stats.capacity_bytes if stats else 0, "cache_peak": peak,
            "loaded": stats.loaded_bytes if stats else 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=160_000)
    parser.add_argument("--cache-mib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=512,
                        help="rows per chunk of the compressed datasets (default: %(default)s); "
                             "each key group holds at least one block, so ~1 MiB chunks overrun "
                             "small budgets")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--json", default=str(HERE / "results" / "dataset.json"))
    args = parser.parse_args(argv)
    budget = int(args.cache_mib * (1 << 20))
    data = make_data(args.rows)
    raw = args.rows * sum(v[0].numel() * v.element_size()
                          for v in data.values(include_nested=True, leaves_only=True))
    print(f"dataset: {args.rows:,} steps, {fmt_bytes(raw)} raw = {raw / budget:.1f}x the "
          f"{fmt_bytes(budget)} cache budget")
    tmp = Path(tempfile.mkdtemp(prefix="zstore-bench-ds-"))
    results = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        targets = [("local mmap", str(tmp / "raw"), {}, None, None),
                   ("local zstd", str(tmp / "zstd"), {}, "zstd+crc32c", args.chunks)]
        if not args.no_s3:
            base, options = stack.enter_context(loopback_s3())
            targets.append(("s3 zstd", f"{base}/dataset", options, "zstd+crc32c", args.chunks))
        for name, url, options, codec, chunks in targets:
            publish(data, url, options, codec, chunks)
            results[name] = measure(url, options, budget, args.repeats, data)
    base = results["local mmap"]
    print(f"\n{'':<12}{'first batch':>13}{'first slices':>14}{'warm batch':>12}{'warm slices':>13}"
          f"{'cache slabs':>13}{'peak resident':>15}")
    for name, r in results.items():
        print(f"{name:<12}{fmt_time(r['first_batch']):>13}{fmt_time(r['first_slices']):>14}"
              f"{fmt_time(r['warm_batch']):>12}{fmt_time(r['warm_slices']):>13}"
              f"{fmt_bytes(r['cache_capacity']):>13}{fmt_bytes(r['cache_peak']):>15}")
    print("\nratios to local mmap (lower is faster)")
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{r[k] / base[k]:>13.1f}x" for k in
                                      ("first_batch", "first_slices", "warm_batch", "warm_slices")))
    over = [name for name, r in results.items() if r["cache_capacity"] > budget]
    print(f"\ncache within the {fmt_bytes(budget)} budget: "
          f"{'yes' if not over else 'NO: ' + ', '.join(over)}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": args.rows, "raw_bytes": raw,
                                           "cache_budget": budget, "results": results}, indent=2))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
