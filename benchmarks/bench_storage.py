"""Side-by-side benchmark: zstore storages vs TorchRL storages vs plain zarr-python.

Run (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_storage.py                 # default sizes, a few minutes
    python benchmarks/bench_storage.py --quick         # small sizes: smoke test (~30 s)
    python benchmarks/bench_storage.py --repeats 30 --json benchmarks/results/run.json

Backends, all measured in one process and interleaved round by round (every
backend gets the same index tensor in the same round):

* zstore ``LazyMemmapStorage`` on local disk (default settings: memory-mapped),
  on ``memory://`` and on S3 (moto's ``ThreadedMotoServer`` on 127.0.0.1,
  started by this script); reads from a fresh ``zstore.open`` (cold: first
  batch after open) and from a cache holding every chunk (warm);
* TorchRL's ``LazyTensorStorage`` (RAM), ``LazyMemmapStorage`` (local scratch
  dir) and ``CompressedListStorage``, through their own API
  (``storage.set`` / ``storage.get``; ``ReplayBuffer.add`` for single adds);
* plain zarr-python ``array.oindex[sorted_idx]`` over the same data and the
  same chunking (local copy; zstore's own groups on memory:// and S3).

See ``benchmarks/README.md`` for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import zarr  # noqa: E402
import zstore  # noqa: E402
from zstore.testing.s3 import MotoS3  # noqa: E402

MB = 1 << 20
BATCH = 256
WINDOWS, WINDOW_LEN = 8, 32
EXTEND_BATCH = 1000


# ----------------------------------------------------------------------------- data
def atari_frames(n_frames: int, gen: torch.Generator) -> torch.Tensor:
    """Grey 84x84 frames: a scrolling textured background, a bouncing ball, two paddles."""
    yy, xx = torch.meshgrid(torch.arange(84), torch.arange(84), indexing="ij")
    texture = (40 + 25 * torch.sin(xx / 5.0) * torch.cos(yy / 7.0)
               + 12 * ((xx // 6 + yy // 6) % 2) + 6 * torch.rand(84, 84, generator=gen))
    frames = torch.empty(n_frames, 84, 84, dtype=torch.uint8)
    t_all = torch.arange(n_frames, dtype=torch.float32)
    for start in range(0, n_frames, 2048):
        t = t_all[start:start + 2048]
        scroll = (t * 0.5).long() % 84
        rows = (yy[None] + scroll[:, None, None]) % 84
        img = texture[rows, xx[None].expand_as(rows)].clone()
        # bouncing ball (triangle waves), radius 3
        bx = 6 + (72 * (1 - torch.abs(((t * 1.3) % 144) / 72 - 1)))
        by = 6 + (72 * (1 - torch.abs(((t * 0.9) % 144) / 72 - 1)))
        ball = (xx[None] - bx[:, None, None]) ** 2 + (yy[None] - by[:, None, None]) ** 2 < 9
        img[ball] = 230
        # paddles: left follows the ball with lag, right oscillates
        py_left = (by - 6 + 4 * torch.sin(t / 9)).clamp(0, 72)
        py_right = 36 + 30 * torch.sin(t / 23)
        for px, py in ((4, py_left), (78, py_right)):
            pad = ((xx[None] >= px) & (xx[None] < px + 3)
                   & (yy[None] >= py[:, None, None]) & (yy[None] < py[:, None, None] + 12))
            img[pad] = 180
        # score bar at the top
        img[:, :4, :] = 90
        frames[start:start + len(t)] = img.clamp(0, 255).to(torch.uint8)
    return frames


def episode_ends(n: int, gen: torch.Generator, low: int, high: int) -> torch.Tensor:
    """Boolean [n]: True at the last step of each episode (lengths uniform in [low, high))."""
    done = torch.zeros(n, dtype=torch.bool)
    pos = -1
    while True:
        pos += int(torch.randint(low, high, (1,), generator=gen))
        if pos >= n:
            break
        done[pos] = True
    done[-1] = True
    return done


def make_atari(n: int, seed: int = 0) -> TensorDict:
    """Atari-like transitions: 4-stacked uint8 frames, int64 action, float reward, flags."""
    gen = torch.Generator().manual_seed(seed)
    frames = atari_frames(n + 4, gen)
    stacks = frames.unfold(0, 4, 1).permute(0, 3, 1, 2)  # [n+1, 4, 84, 84]
    done = episode_ends(n, gen, 200, 1000)
    terminated = done & (torch.rand(n, generator=gen) < 0.7)
    return TensorDict({
        "pixels": stacks[:n].contiguous(),
        "action": torch.randint(0, 6, (n,), generator=gen),
        "reward": (torch.rand(n, generator=gen) < 0.05).float(),
        "done": done,
        "terminated": terminated,
        "next": {"pixels": stacks[1:n + 1].contiguous()},
    }, batch_size=[n])


def make_proprio(n: int, seed: int = 0) -> TensorDict:
    """Proprioceptive transitions: smooth float32 observations [64], actions [8]."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(n + 1, dtype=torch.float32)[:, None]
    freq = 0.01 + 0.2 * torch.rand(1, 64, generator=gen)
    phase = 6.28 * torch.rand(1, 64, generator=gen)
    obs = torch.sin(freq * t + phase) + 0.01 * torch.randn(n + 1, 64, generator=gen)
    act = torch.tanh(torch.sin(0.05 * t[:n] + torch.arange(8.0)) + 0.3 * torch.randn(n, 8, generator=gen))
    done = episode_ends(n, gen, 500, 1500)
    return TensorDict({
        "observation": obs[:n].clone(),
        "action": act.float(),
        "reward": (-(obs[1:, :8] ** 2).sum(-1)).float(),
        "done": done,
        "terminated": done & (torch.rand(n, generator=gen) < 0.5),
        "next": {"observation": obs[1:].clone()},
    }, batch_size=[n])


WORKLOADS: dict[str, Callable[[int, int], TensorDict]] = {"atari": make_atari, "proprio": make_proprio}


def row_bytes(td: TensorDict) -> int:
    """Bytes of one transition (all leaves)."""
    return sum(v[0].numel() * v.element_size() for v in td.values(True, True))


def leaf_paths(td: TensorDict) -> dict[str, tuple]:
    """{zarr path: nested key} of every leaf."""
    return {"/".join((k,) if isinstance(k, str) else k): k for k in td.keys(True, True)}


# ----------------------------------------------------------------------------- backends
class ZStoreBackend:
    """zstore.LazyMemmapStorage written through a RoundRobinWriter."""

    def __init__(self, name: str, url: str, options: dict, capacity: int, **kwargs: Any):
        self.name, self.url, self.options = name, url, options
        self.storage = zstore.LazyMemmapStorage(capacity, scratch_dir=url, storage_options=options,
                                                **kwargs)
        self.writer = zstore.RoundRobinWriter()
        self.writer.register_storage(self.storage)

    def extend(self, td: TensorDict) -> None:
        self.writer.extend(td)

    def add(self, td: TensorDict) -> None:
        self.writer.add(td)

    def finish(self) -> None:
        self.storage.flush()

    def close(self) -> None:
        self.storage.close()


class TorchRLBackend:
    """A TorchRL storage: ``set`` for extend, ``ReplayBuffer.add`` for add, ``get`` for reads."""

    def __init__(self, name: str, factory: Callable[[], Any], capacity: int):
        self.name, self.capacity = name, capacity
        self.storage = factory()
        self.cursor = 0
        self.rb = None

    def extend(self, td: TensorDict) -> None:
        index = torch.arange(self.cursor, self.cursor + len(td)) % self.capacity
        self.storage.set(index, td)
        self.cursor += len(td)

    def add(self, td: TensorDict) -> None:
        if self.rb is None:
            from torchrl.data import ReplayBuffer

            self.rb = ReplayBuffer(storage=self.storage, batch_size=BATCH)
        self.rb.add(td)

    def get(self, idx: torch.Tensor) -> Any:
        out = self.storage.get(idx)
        if isinstance(out, list):  # CompressedListStorage: stack, as ReplayBuffer's collate does
            out = torch.stack(out)
        return out

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class ZarrWriteBackend:
    """Plain zarr-python arrays written by slice assignment (local copy for the reads)."""

    def __init__(self, name: str, root: str, example: TensorDict, capacity: int,
                 chunk_rows: dict[str, int]):
        self.name = name
        self.group = zarr.open_group(root, mode="w")
        self.paths = leaf_paths(example)
        self.arrays = {}
        for path, key in self.paths.items():
            v = example[key]
            self.arrays[path] = self.group.create_array(
                path, shape=(capacity, *v.shape[1:]), chunks=(chunk_rows[path], *v.shape[1:]),
                dtype=v.numpy().dtype, compressors=None, fill_value=0)
        self.cursor = 0

    def extend(self, td: TensorDict) -> None:
        a, b = self.cursor, self.cursor + len(td)
        for path, key in self.paths.items():
            self.arrays[path][a:b] = td[key].numpy()
        self.cursor = b

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_zarr_arrays(url: str, options: dict, paths: dict[str, tuple]) -> dict[str, Any]:
    """The arrays of a zarr group (zstore's, or the local copy), opened read-only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(url, mode="r", storage_options=options or None)
    return {path: group[path] for path in paths}


def zarr_read(arrays: dict[str, Any], idx: torch.Tensor) -> dict[str, np.ndarray]:
    """Plain zarr fancy indexing: ``oindex`` with sorted unique indices, every array."""
    sorted_idx = np.unique(idx.numpy())
    return {path: arr.oindex[sorted_idx] for path, arr in arrays.items()}


# ----------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summarize(times: list[float], items_per_op: int, bytes_per_item: int, amortized: bool,
              extra_total: float = 0.0) -> dict[str, Any]:
    """Median / mean / quartiles of per-op seconds and the throughput they imply."""
    if not times:
        return {}
    total = sum(times) + extra_total
    mean = total / len(times)
    median = statistics.median(times)
    q = np.percentile(times, [25, 75]) if len(times) > 1 else [times[0], times[0]]
    per_op = mean if amortized else median
    return {
        "n": len(times), "median_s": median, "mean_s": mean, "p25_s": float(q[0]),
        "p75_s": float(q[1]), "min_s": min(times), "extra_s": extra_total,
        "per_op_s": per_op, "per_op_kind": "mean" if amortized else "median",
        "items_per_s": items_per_op / per_op if per_op > 0 else math.inf,
        "mb_per_s": items_per_op * bytes_per_item / per_op / MB if per_op > 0 else math.inf,
    }


def check_equal(name: str, out: Any, ref: TensorDict, idx: torch.Tensor, paths: dict,
                errors: list[str], sorted_numpy: bool = False) -> None:
    """Compare a sample against the reference rows; record mismatches (never hide them)."""
    if sorted_numpy:
        idx = torch.as_tensor(np.unique(idx.numpy()))
    expected = ref[idx]
    for path, key in paths.items():
        got = out[path] if sorted_numpy else out[key]
        got = torch.as_tensor(np.asarray(got)) if sorted_numpy else got
        want = expected[key]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype or not torch.equal(got, want):
            errors.append(f"{name}: key {path!r} differs from the reference "
                          f"(shape {tuple(got.shape)} vs {tuple(want.shape)}, dtype {got.dtype} vs "
                          f"{want.dtype})")


# ----------------------------------------------------------------------------- phases
def make_writers(data: TensorDict, where: dict, s3: MotoS3 | None, tag: str, capacity: int,
                 s3_shard_rows: int | None, with_zarr: bool) -> list[Any]:
    """Fresh storages of every backend, keyed by name."""
    from torchrl.data import CompressedListStorage, LazyMemmapStorage, LazyTensorStorage

    local = where["tmp"]
    out: list[Any] = [
        ZStoreBackend("zstore local", f"{local}/zs-{tag}", {}, capacity),
        ZStoreBackend("zstore memory://", f"memory://zstore-bench/{tag}-{uuid.uuid4().hex[:6]}", {},
                      capacity),
    ]
    if s3 is not None:
        kw: dict[str, Any] = {}
        if s3_shard_rows is not None:  # 0: unsharded, with zstore's default chunk per key
            chunk_rows = default_chunks(data, capacity)
            kw = {"chunks": chunk_rows,
                  "shards": s3_shard_rows or chunk_rows}
        out.append(ZStoreBackend("zstore s3", f"s3://{s3.new_bucket('zstore-bench')}/{tag}",
                                 s3.storage_options, capacity, **kw))
    out += [
        TorchRLBackend("torchrl LazyTensor", lambda: LazyTensorStorage(capacity), capacity),
        TorchRLBackend("torchrl LazyMemmap",
                       lambda: LazyMemmapStorage(capacity, scratch_dir=f"{local}/trl-{tag}"), capacity),
        TorchRLBackend("torchrl CompressedList", lambda: CompressedListStorage(capacity), capacity),
    ]
    if with_zarr:
        out.append(ZarrWriteBackend("zarr local", f"{local}/zarr-{tag}", data[:1], capacity,
                                    default_chunks(data, capacity)))
    return out


def default_chunks(td: TensorDict, capacity: int) -> dict[str, int]:
    """zstore's default rows per chunk of every key (about 1 MiB of that key)."""
    return {path: zstore.codecs.default_chunk_rows(td[key][0].numel() * td[key].element_size(),
                                                   capacity)
            for path, key in leaf_paths(td[:1]).items()}


def row_width(td: TensorDict) -> int:
    """Bytes per row of the widest leaf (what zstore sizes chunks by)."""
    return max(v[0].numel() * v.element_size() for v in td.values(True, True))


def bench_writes(backends: list[Any], batches, size: int, rb: int, op: str) -> dict[str, dict]:
    """Time ``backend.<op>(batch)`` for every batch, interleaved backend by backend, the
    order rotating each batch (whoever writes first after another's writes pays the
    kernel's page reclaim); the final flush is added to the total (writes are spiky
    when a chunk fills)."""
    times: dict[str, list[float]] = {b.name: [] for b in backends}
    for i, batch in enumerate(batches):
        shift = i % len(backends)
        for b in backends[shift:] + backends[:shift]:
            write = getattr(b, op)
            times[b.name].append(timed(lambda: write(batch))[0])
    out = {}
    for b in backends:
        flush_s = timed(b.finish)[0]
        out[b.name] = summarize(times[b.name], size, rb, amortized=True, extra_total=flush_s)
    return out


def bench_extend(data: TensorDict, backends: list[Any]) -> dict[str, dict]:
    """Fill every backend in batches of EXTEND_BATCH."""
    batches = (data[start:start + EXTEND_BATCH] for start in range(0, len(data), EXTEND_BATCH))
    return bench_writes(backends, batches, EXTEND_BATCH, row_bytes(data), "extend")


def bench_add(data: TensorDict, backends: list[Any], n_add: int) -> dict[str, dict]:
    """Single-transition adds."""
    return bench_writes(backends, (data[i] for i in range(n_add)), 1, row_bytes(data), "add")


def quiesce() -> None:
    """Start a timed phase from a settled machine: garbage collected, and no dirty pages
    left by the previous phase for the kernel to write back (and throttle writers with)
    while this one is timed."""
    gc.collect()
    os.sync()


def random_index(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, n, (BATCH,), generator=gen)


def slice_index(n: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, n - WINDOW_LEN, (WINDOWS,), generator=gen)
    return (starts[:, None] + torch.arange(WINDOW_LEN)).reshape(-1)


INDEXERS = {"sample random": random_index, "sample slices": slice_index}


def warm_up(storage: Any, n: int, piece: int = 4096) -> float:
    """Prefetch every row into the cache (in pieces); returns seconds."""
    t0 = time.perf_counter()
    for part in torch.arange(n).split(piece):
        storage.prefetch(part)
    storage.get(torch.arange(max(0, n - 1), n))
    return time.perf_counter() - t0


def bench_reads(data: TensorDict, readers: dict[str, Callable], slow: set[str], repeats: int,
                slow_repeats: int, seed: int, errors: list[str]) -> dict[str, dict]:
    """Interleaved rounds: every reader gets the same index in the same round, the order
    rotating round by round (a reader always timed right after the same other one would
    always find the allocator and the CPU caches in the state that one leaves).

    As in ``timeit``, the garbage collector is off while reads are timed (it collects
    between rounds): otherwise a reader would pay for collecting whatever the readers
    before it left behind."""
    n, rb, paths = len(data), row_bytes(data), leaf_paths(data)
    out = {}
    order = list(readers.items())
    for op, make_index in INDEXERS.items():
        gen = torch.Generator().manual_seed(seed)
        times: dict[str, list[float]] = {name: [] for name in readers}
        for r in range(repeats + 1):  # round 0 is a warm-up (not timed) and the correctness check
            idx = make_index(n, gen)
            shift = r % len(order)
            gc.collect(1)  # the young garbage of the last round (a full collection takes
            gc.disable()  # seconds beside 200k CompressedList items); off for the round
            for name, read in order[shift:] + order[:shift]:
                if name in slow and r >= slow_repeats:
                    continue
                dt, got = timed(lambda: read(idx))
                if r == 0:
                    check_equal(f"{op} / {name}", got, data, idx, paths, errors,
                                sorted_numpy=name.startswith("zarr"))
                    if name in slow:  # slow readers have no cache: round 0 counts too
                        times[name].append(dt)
                else:
                    times[name].append(dt)
                del got
            gc.enable()
        out[op] = {name: summarize(t, BATCH, rb, amortized=False) for name, t in times.items() if t}
    return out


def bench_cold(data: TensorDict, url: str, options: dict, label: str, cache_bytes: int,
               repeats: int, seed: int, errors: list[str]) -> tuple[dict[str, dict], dict]:
    """First batch after a fresh ``zstore.open``: open time, sample time, chunk loads."""
    n, rb, paths = len(data), row_bytes(data), leaf_paths(data)
    results, details = {}, {}
    for op, make_index in INDEXERS.items():
        gen = torch.Generator().manual_seed(seed + 1)
        times, opens, stats = [], [], []
        for r in range(repeats):
            idx = make_index(n, gen)
            gc.collect()
            t_open, storage = timed(lambda: zstore.open(url, options, cache_bytes=cache_bytes))
            dt, got = timed(lambda: storage.get(idx))
            if r == 0:
                check_equal(f"{op} / {label} cold", got, data, idx, paths, errors)
            s = storage.cache_stats
            stats.append({"loads": s.loads, "loaded_bytes": s.loaded_bytes, "misses": s.misses,
                          "hits": s.hits, "resident_bytes": s.resident_bytes,
                          "requests": s.requests, "fetched_bytes": s.fetched_bytes,
                          "peak_in_flight": s.peak_in_flight})
            times.append(dt)
            opens.append(t_open)
            storage.close()
            del storage, got
        results[op] = summarize(times, BATCH, rb, amortized=False)
        med_loads = statistics.median(x["loads"] for x in stats)
        med_bytes = statistics.median(x["loaded_bytes"] for x in stats)
        details[op] = {"open_s_median": statistics.median(opens), "loads_median": med_loads,
                       "loaded_bytes_median": med_bytes,
                       "requests_median": statistics.median(x["requests"] for x in stats),
                       "fetched_mb_per_s": statistics.median(x["fetched_bytes"] for x in stats)
                       / MB / results[op]["median_s"],
                       "peak_in_flight": max(x["peak_in_flight"] for x in stats),
                       "loaded_mb_per_s": med_bytes / MB / results[op]["median_s"], "per_repeat": stats}
    return results, details


def evict_page_cache(root: str) -> None:
    """Drop the (clean, unmapped) pages of every file under ``root`` from the page cache."""
    os.sync()
    for path in Path(root).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_disk_cold(data: TensorDict, zstore_url: str, torchrl_dir: str, repeats: int, seed: int,
                    errors: list[str], keep_open: bool = False) -> dict[str, dict]:
    """Samples from local disk with nothing in the page cache: the buffer as a read-only
    ``zstore.open`` against TorchRL's memmap folder reopened with ``TensorDict.load_memmap``.
    The page cache is dropped before every batch, in alternating order. Both are reopened
    after the eviction in every round ("disk-cold": the first batch of a reader) or, with
    ``keep_open``, opened once and sampled batch after batch ("disk-open": a dataset larger
    than RAM in training; pages an earlier batch mapped stay mapped, for both)."""
    n, rb, paths = len(data), row_bytes(data), leaf_paths(data)
    suffix = "disk-open" if keep_open else "disk-cold"
    readers = {
        f"zstore local {suffix}": (zstore_url, lambda: zstore.open(zstore_url, mode="r"),
                                   lambda st, idx: st.get(idx)),
        f"torchrl LazyMemmap {suffix}": (torchrl_dir, lambda: TensorDict.load_memmap(torchrl_dir),
                                         lambda td, idx: td[idx]),
    }
    out = {}
    for op, make_index in INDEXERS.items():
        gen = torch.Generator().manual_seed(seed + 2)
        times: dict[str, list[float]] = {name: [] for name in readers}
        kept = {name: reopen() for name, (_, reopen, _) in readers.items()} if keep_open else {}
        for r in range(repeats):
            idx = make_index(n, gen)
            order = list(readers.items())
            for name, (root, reopen, read) in order[r % 2:] + order[:r % 2]:
                gc.collect()
                evict_page_cache(root)
                source = kept[name] if keep_open else reopen()
                dt, got = timed(lambda source=source: read(source, idx))
                if r == 0:
                    check_equal(f"{op} / {name}", got, data, idx, paths, errors)
                times[name].append(dt)
                del source, got
        del kept
        out[op] = {name: summarize(t, BATCH, rb, amortized=False) for name, t in times.items()}
    return out


def s3_ceiling(s3: MotoS3, url: str, cap_mb: float, chunk_bytes: int, n_ranges: int) -> dict:
    """The server's own speed: concurrent whole-object GETs (fs.cat) of the buffer's chunk
    objects, and concurrent ranged GETs of chunk-sized byte ranges."""
    prefix = url.split("://", 1)[1]
    fs = s3.filesystem()
    sizes = {p: info["size"] for p, info in fs.find(prefix, detail=True).items()
             if not p.endswith("zarr.json")}
    keys = sorted((p for p in sizes if sizes[p] >= chunk_bytes // 2), key=lambda p: -sizes[p])
    chosen, total = [], 0
    for k in keys:
        if total + sizes[k] > cap_mb * MB and chosen:
            break
        chosen.append(k)
        total += sizes[k]
    fs.invalidate_cache()
    dt, blobs = timed(lambda: fs.cat(chosen))
    got = sum(len(v) for v in blobs.values())
    del blobs
    out = {"objects": len(chosen), "bytes": got, "seconds": dt, "mb_per_s": got / MB / dt,
           "object_mb_median": statistics.median(sizes[k] for k in chosen) / MB}
    big = [k for k in keys if sizes[k] >= chunk_bytes]
    if big:
        rng = np.random.default_rng(0)
        paths = [big[i % len(big)] for i in range(n_ranges)]
        starts = [int(rng.integers(0, max(1, sizes[p] - chunk_bytes))) for p in paths]
        ends = [s + chunk_bytes for s in starts]
        dt, parts = timed(lambda: fs.cat_ranges(paths, starts, ends))
        out["ranged"] = {"requests": n_ranges, "range_bytes": chunk_bytes, "seconds": dt,
                         "mb_per_s": n_ranges * chunk_bytes / MB / dt, "requests_per_s": n_ranges / dt}
    return out


# ----------------------------------------------------------------------------- one workload
def run_workload(name: str, n: int, args: argparse.Namespace, s3: MotoS3 | None,
                 tmp: str, errors: list[str]) -> dict[str, Any]:
    print(f"\n### {name}: generating {n} transitions ...", flush=True)
    t0 = time.perf_counter()
    data = WORKLOADS[name](n, args.seed)
    rb = row_bytes(data)
    print(f"    {n} x {rb} B = {n * rb / MB:.0f} MB in {time.perf_counter() - t0:.1f} s", flush=True)
    paths = leaf_paths(data)
    result: dict[str, Any] = {"n": n, "row_bytes": rb, "total_mb": n * rb / MB, "ops": {}}
    where = {"tmp": tmp}

    # -- extend ---------------------------------------------------------------------------
    print("    extend ...", flush=True)
    writers = make_writers(data, where, s3, f"{name}-x", n, args.s3_shard_rows, with_zarr=True)
    quiesce()
    result["ops"]["extend (1000)"] = bench_extend(data, writers)
    urls = {w.name: w.url for w in writers if isinstance(w, ZStoreBackend)}
    layout = {}
    for w in writers:
        if isinstance(w, ZStoreBackend):
            meta = w.storage._meta
            widest = max(meta.schema.leaves, key=lambda leaf: leaf.row_bytes).path
            chunk_rows, shard_rows = meta.layout[widest]
            layout[w.name] = {"chunk_rows": chunk_rows, "shard_rows": shard_rows,
                              "per_key": {p: list(c) for p, c in meta.layout.items()},
                              "codec": str(meta.codec)}
    result["layout"] = layout
    trl_readers = {w.name: w.get for w in writers if isinstance(w, TorchRLBackend)}
    # like TorchRL's, zstore's local storage is sampled through the object that wrote it
    # (its map is already faulted in); a fresh zstore.open of it is measured separately
    local_writer = next(w for w in writers if w.name == "zstore local")
    local_writer.storage.flush()
    trl_readers["zstore local (mmap)"] = local_writer.storage.get
    for w in writers:
        if isinstance(w, ZStoreBackend) and w is not local_writer:
            w.close()
    keep = [w for w in writers if isinstance(w, TorchRLBackend) or w is local_writer]
    del writers
    quiesce()

    # -- add ------------------------------------------------------------------------------
    print(f"    add x {args.n_add} ...", flush=True)
    adders = make_writers(data, where, s3, f"{name}-a", n, args.s3_shard_rows, with_zarr=False)
    result["ops"]["add (1)"] = bench_add(data, adders, args.n_add)
    for a in adders:
        if isinstance(a, ZStoreBackend):
            a.storage.cleanup()
    del adders
    gc.collect()

    # -- reads ------------------------------------------------------------------------------
    fit = int(n * rb * 1.25) + 64 * MB
    readers: dict[str, Callable] = {}
    opened = {}
    local = zstore.open(urls["zstore local"], mode="r")
    opened["zstore local"] = local
    readers["zstore local reopened"] = local.get
    trl_reopened = TensorDict.load_memmap(f"{tmp}/trl-{name}-x")  # what another process maps
    readers["torchrl LazyMemmap reopened"] = lambda idx: trl_reopened[idx]
    warm_s, before = {}, {}
    for label, key, opts in (("memory://", "zstore memory://", {}),
                             ("s3", "zstore s3", s3.storage_options if s3 else None)):
        if key not in urls:
            continue
        st = zstore.open(urls[key], opts, cache_bytes=fit)
        print(f"    warming zstore {label} cache ...", flush=True)
        warm_s[label] = warm_up(st, n)
        before[key] = dataclasses.replace(st.cache_stats)
        opened[key] = st
        readers[f"zstore {label} warm"] = st.get
    result["warm_up"] = {k: {"seconds": v, "mb_per_s": n * rb / MB / v} for k, v in warm_s.items()}
    readers.update(trl_readers)
    zarr_sources = {"zarr local": (f"{tmp}/zarr-{name}-x", {}),
                    "zarr memory://": (urls["zstore memory://"], {})}
    if "zstore s3" in urls:
        zarr_sources["zarr s3"] = (urls["zstore s3"], s3.storage_options)
    for label, (url, opts) in zarr_sources.items():
        arrays = open_zarr_arrays(url, opts, paths)
        readers[label] = lambda idx, arrays=arrays: zarr_read(arrays, idx)
    slow = {"zarr s3"}
    quiesce()
    print(f"    sampling ({args.repeats} rounds) ...", flush=True)
    result["ops"].update(bench_reads(data, readers, slow, args.repeats, args.slow_repeats,
                                     args.seed, errors))
    # the same two memory maps with nothing else in the rotation: no other reader's memory
    # traffic (zarr's decodes above all) between their batches
    print(f"    sampling head to head ({args.repeats} rounds) ...", flush=True)
    pair = {name: readers[name] for name in ("zstore local (mmap)", "torchrl LazyMemmap")}
    for op, rows in bench_reads(data, pair, set(), args.repeats, 0, args.seed + 2, errors).items():
        result["ops"][op.replace("sample", "pair")] = rows
    for key, st in opened.items():
        stats = st.cache_stats
        if stats is not None and key in before:  # counters of the sampling rounds only
            hits, misses = stats.hits - before[key].hits, stats.misses - before[key].misses
            result.setdefault("warm_cache_stats", {})[key] = {
                "hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses),
                "resident_mb": stats.resident_bytes / MB}
        st.close()
    local_writer.close()  # its maps would keep its pages in the page cache (disk-cold below)
    del readers, opened, keep, trl_readers, local_writer, pair, trl_reopened  # (disk-cold)
    gc.collect()

    # -- cold -------------------------------------------------------------------------------
    result["cold"] = {}
    cold_sources = [("memory://", urls["zstore memory://"], {})]
    if "zstore s3" in urls:
        cold_sources.append(("s3", urls["zstore s3"], s3.storage_options))
    for label, url, opts in cold_sources:
        print(f"    cold reads zstore {label} ...", flush=True)
        reps = args.slow_repeats if label == "s3" else min(args.repeats, 5)
        res, det = bench_cold(data, url, opts, label, fit, reps, args.seed, errors)
        for op, r in res.items():
            result["ops"][op][f"zstore {label} cold"] = r
        result["cold"][label] = det
    print("    cold reads from local disk (page cache evicted) ...", flush=True)
    for keep_open in (False, True):
        for op, r in bench_disk_cold(data, urls["zstore local"], f"{tmp}/trl-{name}-x",
                                     min(args.repeats, 5) * (2 if keep_open else 1), args.seed,
                                     errors, keep_open).items():
            result["ops"][op].update(r)
    if s3 is not None:
        print("    S3 ceiling (plain s3fs GETs) ...", flush=True)
        chunk_bytes = layout["zstore s3"]["chunk_rows"] * row_width(data)
        n_ranges = int(min(256, max(16, result["cold"]["s3"]["sample random"]["loads_median"])))
        result["s3_ceiling"] = s3_ceiling(s3, urls["zstore s3"], args.ceiling_mb, chunk_bytes,
                                          n_ranges)
    # -- clean up ---------------------------------------------------------------------------
    for url in urls.values():
        with contextlib.suppress(Exception):
            zstore.StoreSpec.parse(url, s3.storage_options if (s3 and url.startswith("s3")) else None).delete()
    del data
    gc.collect()
    return result


# ----------------------------------------------------------------------------- report
ZSTORE_ROWS = ("zstore local", "zstore local (mmap)", "zstore local reopened",
               "zstore local disk-cold", "zstore local disk-open", "zstore memory://",
               "zstore memory:// warm",
               "zstore memory:// cold", "zstore s3", "zstore s3 warm", "zstore s3 cold")
ALTERNATIVES = ("torchrl LazyTensor", "torchrl LazyMemmap", "torchrl LazyMemmap reopened",
                "torchrl LazyMemmap disk-cold", "torchrl LazyMemmap disk-open",
                "torchrl CompressedList", "zarr local", "zarr memory://", "zarr s3")
SHORT = {"torchrl LazyTensor": "trl-Tensor", "torchrl LazyMemmap": "trl-Memmap",
         "torchrl LazyMemmap reopened": "trl-MmReop",
         "torchrl LazyMemmap disk-cold": "trl-MmDisk", "torchrl LazyMemmap disk-open": "trl-MmOpen",
         "torchrl CompressedList": "trl-Compr", "zarr local": "zarr-local",
         "zarr memory://": "zarr-mem", "zarr s3": "zarr-s3"}


def add_ratios(results: dict[str, Any]) -> None:
    """ratio[zstore row][alternative] = alternative per-op time / zstore per-op time (>1: zstore faster)."""
    for wl in results["workloads"].values():
        wl["ratios"] = {}
        for op, rows in wl["ops"].items():
            table = {}
            for z in ZSTORE_ROWS:
                if z not in rows:
                    continue
                table[z] = {alt: rows[alt]["per_op_s"] / rows[z]["per_op_s"]
                            for alt in ALTERNATIVES if alt in rows}
            wl["ratios"][op] = table


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:8.2f} s "
    if s >= 1e-3:
        return f"{s * 1e3:8.2f} ms"
    return f"{s * 1e6:8.1f} us"


def print_report(results: dict[str, Any]) -> None:
    print("\n" + "=" * 100)
    cfg = results["config"]
    print(f"zstore storage benchmark  |  {cfg['host']}  |  torch {cfg['torch']}, torchrl "
          f"{cfg['torchrl']}, zarr {cfg['zarr']}, zstore {cfg['zstore']}  |  repeats {cfg['repeats']}")
    print("per-op: median for reads, mean (total incl. final flush / ops) for extend and add")
    for wname, wl in results["workloads"].items():
        print(f"\n## {wname}: {wl['n']} transitions x {wl['row_bytes']} B = {wl['total_mb']:.0f} MB   "
              f"layout (widest key): " + ", ".join(f"{k}: chunk {v['chunk_rows']} rows, shard {v['shard_rows']}"
                                      for k, v in wl["layout"].items()))
        head = f"{'operation':<16} {'backend':<24} {'per-op':>11} {'median':>11} {'p25-p75 (ms)':>17} " \
               f"{'items/s':>10} {'MB/s':>8} {'n':>4}"
        print(head)
        print("-" * len(head))
        for op, rows in wl["ops"].items():
            for bname, r in rows.items():
                iqr = f"{r['p25_s'] * 1e3:.2f}-{r['p75_s'] * 1e3:.2f}"
                print(f"{op:<16} {bname:<24} {fmt_time(r['per_op_s'])} {fmt_time(r['median_s'])} "
                      f"{iqr:>17} {r['items_per_s']:>10.0f} {r['mb_per_s']:>8.1f} {r['n']:>4}")
            print()
        print(f"ratios (alternative time / zstore time; >1 = zstore faster) — {wname}")
        cols = [a for a in ALTERNATIVES]
        head = f"{'operation':<16} {'zstore':<22}" + "".join(f"{SHORT[a]:>12}" for a in cols)
        print(head)
        print("-" * len(head))
        for op, table in wl["ratios"].items():
            for z, ratios in table.items():
                cells = "".join(f"{ratios[a]:>12.2f}" if a in ratios else f"{'-':>12}" for a in cols)
                print(f"{op:<16} {z:<22}{cells}")
        for label, det in wl.get("cold", {}).items():
            for op, d in det.items():
                print(f"cold {label:<9} {op:<14}: open {d['open_s_median'] * 1e3:.1f} ms, "
                      f"{d['loads_median']:.0f} chunk loads, {d['loaded_bytes_median'] / MB:.1f} MB "
                      f"decoded, {d['loaded_mb_per_s']:.1f} MB/s; {d['requests_median']:.0f} "
                      f"requests, up to {d['peak_in_flight']} in flight, "
                      f"{d['fetched_mb_per_s']:.1f} MB/s fetched")
        for key, c in wl.get("warm_cache_stats", {}).items():
            print(f"warm cache {key}: {c['hits']} hits, {c['misses']} misses during sampling "
                  f"(hit rate {c['hit_rate']:.3f}), {c['resident_mb']:.0f} MB resident")
        for label, w in wl.get("warm_up", {}).items():
            print(f"warm-up (prefetch every row) zstore {label}: {w['seconds']:.2f} s, "
                  f"{w['mb_per_s']:.1f} MB/s")
        if "s3_ceiling" in wl:
            c = wl["s3_ceiling"]
            print(f"S3 ceiling: fs.cat of {c['objects']} objects ({c['object_mb_median']:.1f} MB "
                  f"median), {c['bytes'] / MB:.0f} MB in {c['seconds']:.2f} s = "
                  f"{c['mb_per_s']:.1f} MB/s")
            if "ranged" in c:
                g = c["ranged"]
                print(f"S3 ranged GETs: {g['requests']} x {g['range_bytes'] / MB:.2f} MB ranges in "
                      f"{g['seconds']:.2f} s = {g['mb_per_s']:.1f} MB/s, "
                      f"{g['requests_per_s']:.0f} requests/s")
    if results["errors"]:
        print("\nCORRECTNESS ERRORS:")
        for e in results["errors"]:
            print("  " + e)
    else:
        print("\nall samples matched the reference data")
    print(f"wall time: {results['wall_s']:.1f} s")


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="timed sampling rounds (default 20; quick 5)")
    p.add_argument("--slow-repeats", type=int, default=None,
                   help="rounds for S3 cold reads and plain zarr on S3 (default 2)")
    p.add_argument("--atari", type=int, default=None, help="Atari transitions (default 20000)")
    p.add_argument("--proprio", type=int, default=None, help="proprio transitions (default 200000)")
    p.add_argument("--n-add", type=int, default=None, help="single adds per backend (default 2000)")
    p.add_argument("--workloads", default="atari,proprio", help="comma-separated subset")
    p.add_argument("--no-s3", action="store_true", help="skip the moto S3 backends")
    p.add_argument("--s3-shard-rows", type=int, default=-1,
                   help="rows per S3 shard object: -1 = zstore's default (about 32 MiB shards "
                        "per key), 0 = unsharded (one object per chunk), N = N rows")
    p.add_argument("--ceiling-mb", type=float, default=256, help="bytes fetched for the S3 ceiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where local stores go (default: system temp)")
    p.add_argument("--json", default=str(HERE / "results" / "latest.json"), help="JSON output path")
    args = p.parse_args(argv)
    q = args.quick
    args.repeats = args.repeats or (5 if q else 20)
    args.slow_repeats = args.slow_repeats or 2
    args.atari = args.atari or (1500 if q else 20_000)
    args.proprio = args.proprio or (20_000 if q else 200_000)
    args.n_add = args.n_add or (200 if q else 2000)
    args.s3_shard_rows = None if args.s3_shard_rows == -1 else args.s3_shard_rows
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torchrl

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="zstore-bench-", dir=args.tmpdir)
    if not args.no_s3:
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"})
    s3 = None if args.no_s3 else MotoS3()  # zstore.testing.s3: moto on 127.0.0.1
    errors: list[str] = []
    results: dict[str, Any] = {
        "config": {
            "argv": sys.argv[1:], "quick": args.quick, "repeats": args.repeats,
            "slow_repeats": args.slow_repeats, "n_add": args.n_add, "batch": BATCH,
            "slices": f"{WINDOWS}x{WINDOW_LEN}", "extend_batch": EXTEND_BATCH,
            "s3_shard_rows": args.s3_shard_rows, "host": f"{platform.node()} {os.cpu_count()} cpus",
            "python": platform.python_version(), "torch": torch.__version__,
            "torchrl": torchrl.__version__, "zarr": zarr.__version__, "zstore": zstore.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "workloads": {}, "errors": errors,
    }
    sizes = {"atari": args.atari, "proprio": args.proprio}
    try:
        for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            results["workloads"][name] = run_workload(name, sizes[name], args, s3, tmp, errors)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if s3 is not None:
            s3.stop()
    results["wall_s"] = time.perf_counter() - t_start
    add_ratios(results)
    print_report(results)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"JSON written to {out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
