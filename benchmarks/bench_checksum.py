"""Read cost of the default crc32c checksum: ``codec="zstd+nocrc"`` vs ``codec="zstd"``.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_checksum.py                    # about a minute on 2 cores
    python benchmarks/bench_checksum.py --atari 2000 --proprio 50000 --repeats 5

Both buffers live on ``memory://`` (no I/O: the checksum's share is the largest
it can be). Workloads from ``bench_storage.py``: Atari-like rows (``pixels``
uint8 ``[4, 84, 84]``, action, reward, flags; ``next`` dropped) and proprio-like
rows (``make_proprio``: 137 float32 plus flags). Per round, the two codecs
interleaved, the same 256 random rows: *cold*, the first ``get`` after a fresh
``zstore.open`` (empty cache: every chunk fetched, checked and decoded), and
*warm*, the same ``get`` repeated (chunks cached: nothing to check). Medians of
``--repeats`` rounds, and the crc / nocrc ratio. As a noise-free bound, also the
stored bytes a cold read checks and the time crc32c alone takes over them (in
1 MiB pieces, copied as the reader does).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import uuid
from pathlib import Path

import google_crc32c
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import zstore  # noqa: E402
from bench_storage import BATCH, make_atari, make_proprio, random_index, timed  # noqa: E402

CODECS = ("zstd+nocrc", "zstd")
CACHE_BYTES = 2 << 30  # holds every chunk a batch touches: warm reads never reload


def write(data, codec: str) -> str:
    """A committed memory:// buffer holding ``data``; its URL."""
    url = f"memory://zstore-bench-checksum/{uuid.uuid4().hex}"
    storage = zstore.LazyMemmapStorage(len(data), scratch_dir=url, codec=codec)
    for part in torch.arange(len(data)).split(4096):
        storage.set(part, data[part])
    storage.close()
    return url


def crc_seconds(nbytes: int, piece: int = 1 << 20) -> float:
    """Seconds crc32c takes over ``nbytes`` in ``piece``-sized chunks (median of 5)."""
    buffer = memoryview(bytes(piece))
    pieces = range(-(-nbytes // piece))
    return statistics.median(timed(lambda: [google_crc32c.value(bytes(buffer)) for _ in pieces])[0]
                             for _ in range(5))


def run(name: str, data, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    """Median seconds of a cold and a warm 256-row read per codec, and the bytes a cold
    read checks (``"checked"``)."""
    urls = {codec: write(data, codec) for codec in CODECS}
    times = {codec: {"cold": [], "warm": [], "checked": []} for codec in CODECS}
    gen = torch.Generator().manual_seed(seed)
    for r in range(repeats + 1):  # round 0 warms up the process and checks the rows
        idx = random_index(len(data), gen)
        for codec in CODECS if r % 2 else CODECS[::-1]:
            gc.collect()
            reader = zstore.open(urls[codec], mode="r", cache_bytes=CACHE_BYTES)
            cold, got = timed(lambda: reader.get(idx))
            warm, _ = timed(lambda: reader.get(idx))
            if r == 0:
                assert (got == data[idx]).all(), f"{name} / {codec}: rows differ"
            else:
                times[codec]["cold"].append(cold)
                times[codec]["warm"].append(warm)
                times[codec]["checked"].append(reader.cache_stats.fetched_bytes)
            reader.close()
    return {codec: {phase: statistics.median(t) for phase, t in by.items()}
            for codec, by in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--atari", type=int, default=5000, help="Atari-like rows")
    parser.add_argument("--proprio", type=int, default=100_000, help="proprio-like rows")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    workloads = {"atari": lambda: make_atari(args.atari, args.seed).exclude("next"),
                 "proprio": lambda: make_proprio(args.proprio, args.seed)}
    print(f"{BATCH} random rows from memory://, medians of {args.repeats} rounds")
    print(f"{'workload':<9}{'read':<6}{'zstd+nocrc':>12}{'zstd (crc)':>12}{'crc/nocrc':>11}")
    for name, make in workloads.items():
        medians = run(name, make(), args.repeats, args.seed)
        for phase in ("cold", "warm"):
            plain, crc = (medians[codec][phase] for codec in CODECS)
            print(f"{name:<9}{phase:<6}{plain * 1e3:>10.2f}ms{crc * 1e3:>10.2f}ms{crc / plain:>10.2f}x")
        checked = int(medians["zstd"]["checked"])
        alone = crc_seconds(checked)
        print(f"{'':<9}a cold read checks {checked / 2**20:.1f} MiB: crc32c alone {alone * 1e3:.2f} ms, "
              f"{alone / medians['zstd+nocrc']['cold']:.1%} of the nocrc cold read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
