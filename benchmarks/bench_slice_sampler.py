"""TorchRL's ``SliceSampler`` over TorchRL's storage and over zstore's, side by side.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_slice_sampler.py                  # 100,000 rows, 30 repeats
    python benchmarks/bench_slice_sampler.py --rows 20000 --repeats 10   # quick

One ``TensorDictReplayBuffer(sampler=SliceSampler(slice_len=32, end_key=("next", "done")))``
per backend, all holding the same rows (133 floats and two flags a row, episodes of 200 to
1,000 steps): TorchRL's ``LazyMemmapStorage`` (local scratch dir) and
``zstore.torchrl.LazyMemmapStorage`` raw and zstd, on a local directory, ``memory://`` and
S3 (moto on loopback, ``zstore.testing.s3.moto_s3``). Each round times one ``rb.sample()``
(256 rows) of every backend, in rotated order, under the same seed; every round also checks
that each backend drew the same indices as TorchRL's storage. Reported: the median over the
rounds and its ratio to TorchRL's. zstore's buffers are committed (``flush()``) before
the timings. ``--json`` writes the figures.

Torch runs on ``--threads`` threads (default 1): on a small shared machine, TorchRL's
boundary search (``nonzero`` over 100,000 flags) on two OpenMP threads waits milliseconds
for a busy core, which drowns what is measured here.
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
import uuid
from pathlib import Path

import torch
from tensordict import TensorDict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from torchrl.data import LazyMemmapStorage as TorchRLMemmap  # noqa: E402
from torchrl.data import SliceSampler, TensorDictReplayBuffer  # noqa: E402

import zstore.torchrl as zt  # noqa: E402
from zstore.testing.s3 import moto_s3  # noqa: E402

BATCH, SLICE_LEN, EXTEND = 256, 32, 10_000


def transitions(n: int, seed: int = 0) -> TensorDict:
    """``n`` steps: observation [64], next observation [64], action [4], reward: 133 floats."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 1000, (n // 200 + 1,), generator=gen)
    done = torch.zeros(n, dtype=torch.bool)
    ends = lengths.cumsum(0) - 1
    done[ends[ends < n]] = True
    obs = torch.randn(n + 1, 64, generator=gen)
    return TensorDict({
        "observation": obs[:n].clone(), "action": torch.randn(n, 4, generator=gen),
        ("next", "observation"): obs[1:].clone(),
        ("next", "reward"): torch.randn(n, 1, generator=gen),
        ("next", "done"): done.unsqueeze(-1), ("next", "terminated"): done.unsqueeze(-1),
    }, batch_size=[n])


def buffer(storage) -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(storage=storage, batch_size=BATCH,
                                  sampler=SliceSampler(slice_len=SLICE_LEN, end_key=("next", "done")))


def sample(rb: TensorDictReplayBuffer, seed: int) -> tuple[float, torch.Tensor]:
    """Seconds one ``rb.sample()`` takes under ``seed``, and the indices it drew."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    _, info = rb.sample(return_info=True)
    seconds, index = time.perf_counter() - start, info["index"]
    return seconds, torch.stack(index) if isinstance(index, tuple) else index


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows in every buffer")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) rows")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    root = Path(tempfile.mkdtemp(prefix="zstore-slice-"))
    data = transitions(args.rows)
    with contextlib.ExitStack() as stack:
        places = {"local": (str(root), None), "memory": (f"memory://bench-{uuid.uuid4().hex[:6]}", None)}
        if not args.no_s3:
            server = stack.enter_context(moto_s3())
            places["s3"] = (f"s3://{server.new_bucket()}", server.storage_options)
        buffers = {"torchrl LazyMemmapStorage, local": buffer(
            TorchRLMemmap(args.rows, scratch_dir=root / "torchrl"))}
        for where, (base, options) in places.items():
            for codec in (None, "zstd"):
                url = f"{base}/{codec or 'raw'}-{uuid.uuid4().hex[:6]}"
                buffers[f"zstore {codec or 'raw'}, {where}"] = buffer(zt.LazyMemmapStorage(
                    args.rows, scratch_dir=url, storage_options=options, codec=codec))
        for name, rb in buffers.items():
            print(f"writing {args.rows} rows: {name}", flush=True)
            for lo in range(0, args.rows, EXTEND):
                rb.extend(data[lo:lo + EXTEND])
            if name.startswith("zstore"):
                rb.storage.flush()  # commit now: no background upload during the timings
            sample(rb, -1)  # a first sample: lazy set-up out of the timings

        times: dict[str, list[float]] = {name: [] for name in buffers}
        names = list(buffers)
        for r in range(args.repeats):
            drawn = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                seconds, drawn[name] = sample(buffers[name], r)
                times[name].append(seconds)
            for name in names[1:]:
                assert torch.equal(drawn[name], drawn[names[0]]), f"{name}: other indices than TorchRL"
        for rb in list(buffers.values())[1:]:
            rb.storage.close()  # commit, before the S3 server stops

    base = statistics.median(times[names[0]])
    print(f"\n{args.rows} rows x 133 floats, TorchRL SliceSampler(slice_len={SLICE_LEN}, "
          f"end_key=('next', 'done')), {BATCH}-row samples; medians of {args.repeats}, interleaved, "
          f"{args.threads} torch thread(s)")
    print(f"{'storage':<38} {'sample()':>10} {'vs TorchRL':>11}")
    results = {}
    for name in names:
        median = statistics.median(times[name])
        results[name] = {"median_s": median, "ratio_to_torchrl": median / base}
        print(f"{name:<38} {median * 1e3:7.2f} ms {median / base:10.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
