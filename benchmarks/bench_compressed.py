"""zstore CompressedListStorage vs TorchRL's CompressedListStorage on Atari-like frame stacks.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_compressed.py              # 5000 transitions, ~2 min on 2 cores
    python benchmarks/bench_compressed.py --n 2000 --repeats 5
    python benchmarks/bench_compressed.py --checkpoint-only --proprio-n 1000000 --s3 200000 --repeats 5
    python benchmarks/bench_compressed.py --cold-only --n 3000 --repeats 9
    python benchmarks/bench_compressed.py --n 40000 --repeats 7 --beyond-cache 1024 256

Both storages use their defaults. Data: ``make_atari`` from ``bench_storage.py``
(4-frame stacks of a scrolling textured background with a bouncing ball and
paddles, plus ``next/pixels``, action, reward, done flags). Measured, medians of
``--repeats`` rounds: stored bytes (and the ratio to raw), extend in batches of
1000 (``storage.set(range, batch)``), random sampling of 256 through
``storage.get`` and, for TorchRL, through ``ReplayBuffer(batch_size=256).sample()``;
for zstore through ``get`` + :func:`zstore.stack_items` (its collate). Also the
flat case TorchRL compresses best: items that are plain ``pixels`` tensors.
Checkpoints (zstore only; TorchRL's CompressedListStorageCheckpointer always
writes everything): a full ``dumps`` of a filled storage to a fresh local
directory, then 1% new items and a second ``dumps`` to the same directory
(incremental); bytes written and time of the second relative to the full one,
for the Atari transitions (which compress ~100x: a small checkpoint of many
small objects) and ``--proprio-n`` proprioceptive ones (``make_proprio``: float
observations that barely compress; with ``--s3 N``, N of them to moto's S3
server on loopback too). ``--checkpoint-only`` runs just this (and writes
benchmarks/results/compressed_checkpoint.json). Cold sampling (``--cold-only`` runs just
this): per round, the same 256 random transitions through TorchRL's ``get`` +
``torch.stack``, and through zstore's ``get`` + ``stack_items`` *cold* (the first read
after a fresh ``zstore.open``: every chunk touched fetched, checked and decoded) and
*warm* (repeated); beside them the *decode limit*: crc32c + zstd of exactly the
chunks that cold read touched, into resident buffers, on 1 and on 2 threads, and on 2
threads into fresh memory (a new slab, as a cold cache's, whose pages the decode faults in).
``--beyond-cache MIB ...`` runs only this: sampling with each of those zstore cache sizes, in
its steady state (after as many warm-up batches as measured ones), once the decoded items
outgrow the cache; beside it TorchRL's ``get`` + ``torch.stack`` of the same batches.
Writes benchmarks/results/compressed.json (or compressed_cold.json, compressed_checkpoint.json,
compressed_beyond_cache.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import zstore  # noqa: E402
from bench_storage import make_atari, make_proprio  # noqa: E402

BATCH, EXTEND = 256, 1000


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fill(storage, data) -> float:
    """Extend in batches of EXTEND; mean seconds per batch."""
    times = []
    for start in range(0, len(data), EXTEND):
        stop = min(len(data), start + EXTEND)
        times.append(timed(lambda: storage.set(range(start, stop), data[start:stop])))
    return statistics.mean(times)


def stored_bytes(storage) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return storage.bytes()


def run(kind: str, data, repeats: int, seed: int) -> dict:
    from torchrl.data import CompressedListStorage as TorchRLCompressed
    from torchrl.data import ReplayBuffer

    leaves = [data] if isinstance(data, torch.Tensor) else data.values(True, True)
    raw = sum(v.numel() * v.element_size() for v in leaves)
    rows = {}
    for name in ("torchrl", "zstore"):
        extend, sizes = [], []
        for _ in range(max(1, repeats // 3)):
            cls = TorchRLCompressed if name == "torchrl" else zstore.CompressedListStorage
            storage = cls(len(data))
            extend.append(fill(storage, data))
            sizes.append(stored_bytes(storage))
        gen = torch.Generator().manual_seed(seed)
        get_t, sample_t = [], []
        rb = ReplayBuffer(storage=storage, batch_size=BATCH) if name == "torchrl" else None
        for r in range(repeats + 1):
            idx = torch.randint(0, len(data), (BATCH,), generator=gen)
            if name == "torchrl":
                t_get = timed(lambda: torch.stack(storage.get(idx)))
                t_sample = timed(rb.sample)
            else:
                t_get = timed(lambda: zstore.stack_items(storage.get(idx)))
                t_sample = t_get
                if r == 0:
                    got = zstore.stack_items(storage.get(idx))
                    assert (got == data[idx]).all(), "zstore sample differs from the data"
            if r:  # round 0 warms up
                get_t.append(t_get)
                sample_t.append(t_sample)
        rows[name] = {"stored_bytes": statistics.median(sizes), "ratio_to_raw": raw / statistics.median(sizes),
                      "extend_1000_s": statistics.median(extend), "get_256_s": statistics.median(get_t),
                      "sample_256_s": statistics.median(sample_t),
                      "sample_items_per_s": BATCH / statistics.median(sample_t)}
    t, z = rows["torchrl"], rows["zstore"]
    rows["zstore_vs_torchrl"] = {"size": t["stored_bytes"] / z["stored_bytes"],
                                 "sample": t["sample_256_s"] / z["sample_256_s"],
                                 "get": t["get_256_s"] / z["get_256_s"],
                                 "extend": t["extend_1000_s"] / z["extend_1000_s"]}
    rows["raw_bytes"] = raw
    return rows


def _touched_chunks(reader) -> list[tuple[list, bytes, int]]:
    """(decoders, stored payload, decoded bytes) of every chunk in ``reader``'s items cache."""
    from zarr.core.sync import sync

    from zstore.chunkio import _WHOLE, Throttle

    chunks = []
    for group in reader._table.table.groups:
        blocks = group.cache.block_of[group.cache.block_of >= 0].tolist()
        for col in group.readers.values():
            for block in blocks:
                payload = sync(col._get(group.store, col._key(block), _WHOLE, Throttle()))
                chunks.append((col.decoders, bytes(payload), col.block_nbytes))
    return chunks


def _decode_all(chunks, outs: list[np.ndarray], pool) -> None:
    """What the cold read had to decode: checksum, then zstd into a resident buffer."""
    def one(i: int) -> None:
        decoders, data, nbytes = chunks[i]
        for decode in decoders[:-1]:
            data = decode(data)
        decoders[-1](data, out=outs[i][:nbytes])

    list(pool.map(one, range(len(chunks)))) if pool else [one(i) for i in range(len(chunks))]


def _fresh_outs(n: int, width: int) -> list[np.ndarray]:
    """``n`` destinations of ``width`` bytes in one new slab, as a cold cache's (its pages not
    yet faulted in, advised for huge pages where the cache's slabs are: ``_pages.HUGE_PAGES``)."""
    from zstore._pages import host_empty

    slab = host_empty((n * width,), torch.uint8).numpy()
    return [slab[i * width:(i + 1) * width] for i in range(n)]


def cold_rows(data, repeats: int, seed: int) -> dict:
    """Cold and warm ``get`` + collate of 256, TorchRL's beside them, and the decode limit of
    the chunks each cold read touched (1 and 2 threads); medians of ``repeats`` rounds."""
    from torchrl.data import CompressedListStorage as TorchRLCompressed

    url = f"memory://zstore-bench-compressed/{uuid.uuid4().hex}"
    ours, theirs = zstore.CompressedListStorage(len(data), scratch_dir=url), TorchRLCompressed(len(data))
    fill(ours, data)
    fill(theirs, data)
    ours.close()
    gen = torch.Generator().manual_seed(seed)
    pool = ThreadPoolExecutor(2)
    outs: list[np.ndarray] = []  # resident destinations, one per touched chunk, reused
    times = {k: [] for k in ("torchrl", "cold", "warm", "decode_1", "decode_2", "decode_fresh")}
    touched = []
    for r in range(repeats + 1):  # round 0 warms up
        idx = torch.randint(0, len(data), (BATCH,), generator=gen)
        t_torchrl = timed(lambda: torch.stack(theirs.get(idx)))
        gc.collect()
        reader = zstore.open(url, mode="r")
        t_cold = timed(lambda: zstore.stack_items(reader.get(idx)))
        t_warm = timed(lambda: zstore.stack_items(reader.get(idx)))
        chunks = _touched_chunks(reader)
        width = max(n for _, _, n in chunks)
        if len(outs) < len(chunks) or outs[0].nbytes < width:
            outs[:] = [np.ones(width, np.uint8) for _ in chunks]
        t_1 = timed(lambda: _decode_all(chunks, outs, None))
        t_2 = timed(lambda: _decode_all(chunks, outs, pool))
        t_fresh = timed(lambda: _decode_all(chunks, _fresh_outs(len(chunks), width), pool))
        reader.close()
        if r:
            for name, t in zip(times, (t_torchrl, t_cold, t_warm, t_1, t_2, t_fresh)):
                times[name].append(t)
            touched.append((len(chunks), sum(n for _, _, n in chunks)))
    pool.shutdown()
    out = {f"{k}_s": statistics.median(v) for k, v in times.items()}
    out["chunks_touched"], out["decoded_bytes"] = touched[len(touched) // 2]
    out["torchrl_vs_cold"] = out["torchrl_s"] / out["cold_s"]
    out["torchrl_vs_warm"] = out["torchrl_s"] / out["warm_s"]
    out["cold_vs_decode_2"] = out["cold_s"] / out["decode_2_s"]
    out["cold_vs_decode_fresh"] = out["cold_s"] / out["decode_fresh_s"]
    out["decode_1_vs_2"] = out["decode_1_s"] / out["decode_2_s"]
    return out


def beyond_cache_rows(data, repeats: int, seed: int, caches_mib: list[int],
                      chunks: int | None = None) -> dict:
    """Sampling once the decoded items outgrow zstore's cache: per ``cache_bytes``, the same
    random 256-item batches through TorchRL's ``get`` + ``torch.stack`` and zstore's ``get``
    + ``stack_items``, after ``repeats`` warm-up batches (the cache in its steady state);
    medians of ``repeats`` batches. A cache smaller than one batch's chunks reads in rounds.
    ``chunks``: zstore's items per chunk (default: its own choice, ~1 MiB chunks)."""
    from torchrl.data import CompressedListStorage as TorchRLCompressed

    reference = TorchRLCompressed(len(data))
    fill(reference, data)
    out = {}
    for mib in caches_mib:
        storage = zstore.CompressedListStorage(len(data), cache_bytes=mib << 20, chunks=chunks)
        fill(storage, data)
        gen = torch.Generator().manual_seed(seed)
        times = {"torchrl": [], "zstore": []}
        for r in range(2 * repeats):
            idx = torch.randint(0, len(data), (BATCH,), generator=gen)
            if r == repeats:
                before = storage.cache_stats
            t_zstore = timed(lambda: zstore.stack_items(storage.get(idx)))
            t_torchrl = timed(lambda: torch.stack(reference.get(idx)))
            if r >= repeats:
                times["zstore"].append(t_zstore)
                times["torchrl"].append(t_torchrl)
        row = {f"{k}_s": statistics.median(v) for k, v in times.items()}
        after = storage.cache_stats
        hits, misses = after.hits - before.hits, after.misses - before.misses
        row["hit_rate"] = hits / max(1, hits + misses)  # rows served cached, measured batches
        row["torchrl_vs_zstore"] = row["torchrl_s"] / row["zstore_s"]
        out[f"{mib} MiB"] = row
        storage.close()
    return out


def dump_rows(data, repeats: int, base: str | None = None, options: dict | None = None) -> dict:
    """Full dump vs a second dump after 1% new items (both after a flush, so they time the
    checkpoint only), below ``base`` (default: a local temporary directory); medians of
    ``repeats``."""
    from checkpoint._dest import Destination, settle

    n, new = len(data), max(1, len(data) // 100)
    storage = zstore.CompressedListStorage(n + new * repeats)
    fill(storage, data)
    full_s, inc_s, full_b, inc_b = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            dest = zstore.StoreSpec.parse(f"{base or tmp}/ck-{r}", options)
            storage.flush()
            full_s.append(timed(partial(storage.dumps, dest)))
            full_b.append(Destination(dest).read_commit()["bytes_written"])
            at = len(storage)
            storage.set(range(at, at + new), data[r * new:(r + 1) * new])
            storage.flush()
            inc_s.append(timed(partial(storage.dumps, dest)))
            record = Destination(dest).read_commit()
            assert record["incremental"], "the second dump was not incremental"
            inc_b.append(record["bytes_written"])
            settle()
    full = {"s": statistics.median(full_s), "bytes": statistics.median(full_b)}
    inc = {"s": statistics.median(inc_s), "bytes": statistics.median(inc_b)}
    return {"items": n, "new_items": new, "full_dump": full, "second_dump": inc,
            "second_vs_full": {"bytes": inc["bytes"] / full["bytes"], "time": inc["s"] / full["s"]}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="transitions")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None,
                        help="default: results/compressed.json (compressed_checkpoint.json "
                             "with --checkpoint-only)")
    parser.add_argument("--checkpoint-only", action="store_true", help="only the dumps")
    parser.add_argument("--cold-only", action="store_true", help="only the cold sampling rows")
    parser.add_argument("--beyond-cache", type=int, nargs="+", metavar="MIB", default=None,
                        help="only sampling with these zstore cache sizes (MiB), e.g. smaller "
                             "than the decoded items")
    parser.add_argument("--chunks", type=int, default=None,
                        help="zstore's items per chunk for --beyond-cache (default: its own)")
    parser.add_argument("--proprio-n", type=int, default=100_000,
                        help="proprioceptive transitions for the dumps")
    parser.add_argument("--s3", type=int, default=0, metavar="N",
                        help="also dump N proprioceptive transitions to moto's S3 on loopback")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    td = make_atari(args.n, args.seed)
    results = {"n": args.n, "repeats": args.repeats, "torch": torch.__version__, "workloads": {},
               "checkpoint": {}}
    if args.beyond_cache:
        results["beyond_cache"] = beyond_cache_rows(td, args.repeats, args.seed, args.beyond_cache,
                                                    args.chunks)
        for cache, row in results["beyond_cache"].items():
            print(f"cache {cache:>9}: zstore {row['zstore_s'] * 1e3:7.1f} ms (hit rate "
                  f"{row['hit_rate']:.0%}), TorchRL {row['torchrl_s'] * 1e3:7.1f} ms: "
                  f"{row['torchrl_vs_zstore']:.2f}x")
        Path(args.json or HERE / "results" / "compressed_beyond_cache.json").write_text(
            json.dumps(results, indent=2))
        return 0
    if not args.checkpoint_only:
        results["cold_sampling"] = cold_rows(td, args.repeats, args.seed)
    if not (args.checkpoint_only or args.cold_only):
        results["workloads"] = {
            "transitions (TensorDict)": run("td", td, args.repeats, args.seed),
            "flat pixels (tensor)": run("flat", td["pixels"], args.repeats, args.seed)}
    if not args.cold_only:
        results["checkpoint"] = {"atari": dump_rows(td, args.repeats),
                                 "proprio": dump_rows(make_proprio(args.proprio_n, args.seed),
                                                      args.repeats)}
    if args.s3 and not args.cold_only:
        from zstore.demo import loopback_s3

        with loopback_s3() as (bucket, options):
            results["checkpoint"]["proprio, S3 (moto)"] = dump_rows(
                make_proprio(args.s3, args.seed), args.repeats, bucket, options)
    if results["workloads"]:
        print(f"{'workload':26} {'backend':8} {'stored MB':>10} {'x raw':>7} {'extend 1000':>12} "
              f"{'get 256':>9} {'sample 256':>11} {'items/s':>9}")
    for workload, rows in results["workloads"].items():
        for name in ("torchrl", "zstore"):
            r = rows[name]
            print(f"{workload:26} {name:8} {r['stored_bytes'] / 2**20:10.2f} {r['ratio_to_raw']:7.1f} "
                  f"{r['extend_1000_s'] * 1e3:10.1f}ms {r['get_256_s'] * 1e3:7.1f}ms "
                  f"{r['sample_256_s'] * 1e3:9.1f}ms {r['sample_items_per_s']:9.0f}")
        ratio = rows["zstore_vs_torchrl"]
        print(f"{workload:26} zstore/torchrl: {ratio['size']:.1f}x smaller, sample {ratio['sample']:.1f}x, "
              f"get {ratio['get']:.1f}x, extend {ratio['extend']:.1f}x faster")
    cold = results.get("cold_sampling")
    if cold:
        print(f"cold sampling of 256 ({cold['chunks_touched']} chunks, "
              f"{cold['decoded_bytes'] / 2**20:.0f} MiB decoded):")
        for label, key in (("TorchRL get + torch.stack", "torchrl_s"),
                           ("zstore get + stack_items, cold", "cold_s"),
                           ("zstore get + stack_items, warm", "warm_s"),
                           ("decode limit, 1 thread", "decode_1_s"),
                           ("decode limit, 2 threads", "decode_2_s"),
                           ("decode into fresh memory, 2 thr.", "decode_fresh_s")):
            print(f"  {label:32} {cold[key] * 1e3:8.2f} ms")
        print(f"  TorchRL / zstore: cold {cold['torchrl_vs_cold']:.2f}x, warm "
              f"{cold['torchrl_vs_warm']:.1f}x; cold / decode limit (2 threads) "
              f"{cold['cold_vs_decode_2']:.2f}x, / into fresh memory "
              f"{cold['cold_vs_decode_fresh']:.2f}x; decode 1 thread / 2 threads "
              f"{cold['decode_1_vs_2']:.2f}x")
    for workload, ck in results["checkpoint"].items():
        print(f"dumps of {ck['items']} {workload} transitions: full {ck['full_dump']['s']:.3f} s "
              f"({ck['full_dump']['bytes'] / 2**20:.1f} MiB); after {ck['new_items']} new items "
              f"{ck['second_dump']['s']:.3f} s ({ck['second_dump']['bytes'] / 2**20:.2f} MiB): "
              f"{100 * ck['second_vs_full']['bytes']:.1f}% of the bytes in "
              f"{100 * ck['second_vs_full']['time']:.0f}% of the time")
    if args.json is None:
        name = ("compressed_checkpoint.json" if args.checkpoint_only
                else "compressed_cold.json" if args.cold_only else "compressed.json")
        args.json = str(HERE / "results" / name)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
