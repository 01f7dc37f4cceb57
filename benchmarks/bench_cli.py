"""Start-up time of the ``zstore`` command: ``--help``, ``ls`` and ``info`` of local buffers.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_cli.py                # 5 runs of each command
    python benchmarks/bench_cli.py --repeats 9

Writes a small buffer (1000 rows) and a sealed copy of it to a temporary directory,
then times each command as a fresh process (the ``zstore`` console script beside
this interpreter, else ``python -m zstore``), wall clock from spawn to exit, and
prints the median, min and max over ``--repeats`` runs. One untimed run of each
comes first (cold file cache). Figures: docs/performance.md ("CLI start-up").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _zstore_command() -> list[str]:
    script = Path(sys.executable).with_name("zstore")
    return [str(script)] if script.exists() else [sys.executable, "-m", "zstore"]


def _write_buffers(root: Path) -> tuple[Path, Path]:
    """A 1000-row TED buffer and a sealed copy under ``root``."""
    import torch
    from tensordict import TensorDict

    import zstore

    buffer, dataset = root / "rb", root / "sets" / "ds"
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=str(buffer))
    done = torch.zeros(1000, 1, dtype=torch.bool)
    done[99::100] = True
    storage.set(torch.arange(1000), TensorDict(
        {"observation": torch.randn(1000, 8), "action": torch.randn(1000, 2),
         ("next", "reward"): torch.randn(1000, 1), ("next", "done"): done}, batch_size=[1000]))
    storage.close()
    from zstore.dataset.convert import convert

    convert(buffer, dataset, seal=True, progress=False)
    return buffer, dataset


def _time(argv: list[str], repeats: int) -> list[float]:
    subprocess.run(argv, check=True, capture_output=True)  # warm-up, not timed
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per command")
    args = parser.parse_args()
    zstore = _zstore_command()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        buffer, dataset = _write_buffers(root)
        cases = [("zstore --help", ["--help"]), ("zstore ls DIR", ["ls", str(root)]),
                 ("zstore info BUFFER", ["info", str(buffer)]),
                 ("zstore info DATASET", ["info", str(dataset)]),
                 ("zstore info --json BUFFER", ["info", "--json", str(buffer)])]
        print(f"{'command':<28}{'median':>9}{'min':>9}{'max':>9}   ({args.repeats} runs)")
        for name, argv in cases:
            times = _time(zstore + argv, args.repeats)
            print(f"{name:<28}{statistics.median(times):>8.2f}s{min(times):>8.2f}s"
                  f"{max(times):>8.2f}s")


if __name__ == "__main__":
    main()
