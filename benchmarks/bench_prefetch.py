"""Sample-ahead in a training loop: what the trainer waits for, with and without prefetch.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_prefetch.py                     # Atari 20k (1.1 GB), 20 ms steps
    python benchmarks/bench_prefetch.py --step-ms 5 --steps 60

A training loop alternates ``batch = rb.sample()`` with a training step. The step is
simulated as ``--step-ms`` of idle CPU (a GPU update, while the host waits), so work
started in the background can use the cores meanwhile. The dataset is larger than the
page cache lets it be: the cache of its files is dropped before each loop, and every
batch reads 256 rows never read before (drawn without replacement), so every page a
batch needs comes from the disk unless it was asked for ahead. Side by side, in
alternating order, each measured ``--repeats`` times:

* ``zstore``: a read-only ``zstore.open`` of the local buffer in ``zstore.ReplayBuffer``,
  with ``prefetch=0`` and ``prefetch=1`` (the next batch is drawn when a batch is
  returned, and its pages are asked of the disk, ``MADV_WILLNEED``, while the step runs);
* ``torchrl``: TorchRL's ``ReplayBuffer`` over a ``TensorStorage`` of the same data
  in tensordict's memmap folder (``TensorDict.load_memmap``), ``SamplerWithoutReplacement``,
  with ``prefetch=0`` and ``prefetch=1`` (its prefetch runs ``sample()`` ahead on a thread).

Reported: the median and mean time ``sample()`` takes (what the trainer waits for) and
the loop's time per step, medians over the repeats. One more zstore batch after each
loop is checked against the memmap folder. Writes benchmarks/results/prefetch.json.
"""

from __future__ import annotations

import argparse
import gc
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
sys.path.insert(0, str(HERE))

import zstore
from bench_storage import evict_page_cache, make_atari
from zstore.samplers import Sampler

BATCH = 256


class PermutationSampler(Sampler):
    """Batches of rows drawn without replacement: consecutive pieces of one permutation."""

    def __init__(self, n: int, seed: int):
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.next = 0

    def sample(self, storage, batch_size, generator=None):
        rows = self.order[self.next:self.next + batch_size]
        self.next += batch_size
        return rows


def zstore_loop(url: str, reference: str, n: int, prefetch: int, steps: int, step_s: float,
                seed: int):
    reader = zstore.open(url, mode="r")
    rb = zstore.ReplayBuffer(reader, sampler=PermutationSampler(n, seed),
                             writer=zstore.ImmutableDatasetWriter(), batch_size=BATCH,
                             prefetch=prefetch)
    try:
        result = run_loop(rb.sample, steps, step_s)
        batch, info = rb.sample(return_info=True)  # after the timed loop: checked
        expected = TensorDict.load_memmap(reference)[info["index"]]
        for key in expected.keys(True, True):
            if not torch.equal(batch[key], expected[key]):
                raise AssertionError(f"zstore prefetch={prefetch}: key {key} differs")
        return result
    finally:
        reader.close()


def torchrl_loop(folder: str, n: int, prefetch: int, steps: int, step_s: float, seed: int):
    from torchrl.data import ReplayBuffer, SamplerWithoutReplacement, TensorStorage

    torch.manual_seed(seed)
    rb = ReplayBuffer(storage=TensorStorage(TensorDict.load_memmap(folder)),
                      sampler=SamplerWithoutReplacement(), batch_size=BATCH,
                      prefetch=prefetch or None)
    return run_loop(rb.sample, steps, step_s)


def run_loop(sample, steps: int, step_s: float) -> dict:
    """``steps`` rounds of sample + an idle step; seconds each sample() took, and per step."""
    waits = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = sample()
        waits.append(time.perf_counter() - t0)
        assert len(batch) == BATCH
        time.sleep(step_s)  # the training step: the GPU works, the host waits
    per_step = (time.perf_counter() - start) / steps
    return {"median_wait_s": statistics.median(waits), "mean_wait_s": statistics.mean(waits),
            "per_step_s": per_step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20000, help="Atari transitions (default 20000)")
    p.add_argument("--steps", type=int, default=30, help="batches per loop (default 30)")
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated step (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="loops per configuration")
    p.add_argument("--tmpdir", default=None, help="where the datasets go (a disk, not tmpfs)")
    p.add_argument("--json", default=str(HERE / "results" / "prefetch.json"))
    args = p.parse_args()
    if (args.steps + 2) * BATCH > args.n:  # the timed batches, one drawn ahead, one checked
        p.error(f"(--steps + 2) x {BATCH} rows must not exceed --n (rows are drawn without "
                "replacement)")

    root = Path(tempfile.mkdtemp(prefix="zstore-prefetch-", dir=args.tmpdir))
    print(f"writing {args.n} Atari transitions ...", flush=True)
    data = make_atari(args.n)
    url, folder = str(root / "zstore"), str(root / "torchrl")
    storage = zstore.LazyMemmapStorage(args.n, scratch_dir=url)
    storage.set(torch.arange(args.n), data)
    storage.close()
    data.memmap(folder)
    row_mb = sum(v.numel() * v.element_size() for v in data[0].values(True, True)) / 1e6
    del data, storage
    gc.collect()

    step_s = args.step_ms / 1000
    loops = {
        ("zstore", 0): lambda seed: zstore_loop(url, folder, args.n, 0, args.steps, step_s, seed),
        ("zstore", 1): lambda seed: zstore_loop(url, folder, args.n, 1, args.steps, step_s, seed),
        ("torchrl", 0): lambda seed: torchrl_loop(folder, args.n, 0, args.steps, step_s, seed),
        ("torchrl", 1): lambda seed: torchrl_loop(folder, args.n, 1, args.steps, step_s, seed),
    }
    runs: dict = {key: [] for key in loops}
    for r in range(args.repeats):
        order = list(loops.items())
        for key, loop in order[r % len(order):] + order[:r % len(order)]:
            evict_page_cache(str(root))
            print(f"  round {r}: {key[0]} prefetch={key[1]} ...", flush=True)
            runs[key].append(loop(seed=r))
            gc.collect()

    results = {f"{lib} prefetch={k}": {field: statistics.median(run[field] for run in rs)
                                       for field in rs[0]} for (lib, k), rs in runs.items()}
    print(f"\n{args.n} Atari transitions ({row_mb:.3f} MB each) on local disk, page cache "
          f"dropped; {args.steps} batches of {BATCH} fresh rows per loop, {args.step_ms:g} ms "
          f"steps; medians of {args.repeats} loops")
    print(f"{'reader':<22} {'sample() median':>16} {'sample() mean':>14} {'per step':>10}")
    for name, r in results.items():
        print(f"{name:<22} {r['median_wait_s'] * 1e3:13.2f} ms {r['mean_wait_s'] * 1e3:11.2f} ms "
              f"{r['per_step_s'] * 1e3:7.2f} ms")
    base = results["torchrl prefetch=0"]["mean_wait_s"]
    for name in ("zstore prefetch=0", "zstore prefetch=1", "torchrl prefetch=1"):
        print(f"mean wait, torchrl prefetch=0 / {name}: {base / results[name]['mean_wait_s']:.1f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"JSON written to {args.json}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
