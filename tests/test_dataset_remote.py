"""A dataset published to S3 (loopback) and one served by `python -m http.server` are opened and
sampled by a second process, which cannot write to them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.dataset import open_dataset

ROOT = Path(__file__).resolve().parents[1]

_READER = r"""
import json, sys, torch, zstore
answers = []
for request in json.loads(sys.argv[1]):
    ds = zstore.open_dataset(request["url"], request["options"], cache_bytes=1 << 14)
    batch = ds.sample(64, generator=torch.Generator().manual_seed(1))
    slices = ds.sample_slices(8, 4, generator=torch.Generator().manual_seed(2))
    try:
        ds.set(0, batch[0])
        refused = None
    except zstore.ReadOnlyError as exc:
        refused = str(exc)
    fs, root = zstore.StoreSpec.parse(request["url"], request["options"]).filesystem()
    try:  # straight to the store, past zstore
        fs.pipe_file(f"{root}/intruder-{len(answers)}", b"x")
        store_refused = False
    except Exception:  # noqa: BLE001 - S3 says PermissionError, HTTP servers say 4xx/5xx
        store_refused = True
    answers.append({"store_refused": store_refused, "len": len(ds), "episodes": ds.num_episodes,
                    "obs": batch["obs"].flatten().tolist(),
                    "slices": slices["obs"].flatten().tolist(),
                    "ids": slices["traj"].tolist(), "refused": refused})
print(json.dumps(answers))
"""


def _data(n: int = 600) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    done = torch.rand(n, 1, generator=g) < 0.05
    traj = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), done[:-1, 0].long()]), 0)
    return TensorDict({"obs": torch.arange(n, dtype=torch.float32).unsqueeze(-1), "traj": traj,
                       ("next", "reward"): torch.randn(n, 1, generator=g),
                       ("next", "done"): done}, batch_size=[n])


def _publish(url: str, options: dict, **kwargs) -> None:
    storage = zstore.LazyMemmapStorage(600, scratch_dir=url, storage_options=options,
                                       codec="zstd+crc32c", chunks=50, **kwargs)
    storage.set(torch.arange(600), _data())
    storage.seal()
    storage.close()


def _read_in_another_process(requests: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no credentials
    proc = subprocess.run([sys.executable, "-c", _READER, json.dumps(requests)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _check(answer: dict, url: str, options: dict, store_refuses: bool) -> None:
    here = open_dataset(url, options)
    assert answer["len"] == 600 and answer["episodes"] == here.num_episodes > 10
    assert answer["obs"] == here.sample(64, generator=torch.Generator().manual_seed(1))["obs"]\
        .flatten().tolist()
    slices = here.sample_slices(8, 4, generator=torch.Generator().manual_seed(2))
    assert answer["slices"] == slices["obs"].flatten().tolist()
    ids = torch.tensor(answer["ids"])
    assert (ids == ids[:, :1]).all()  # windows inside one episode
    assert answer["refused"] is not None and "doesn't allow writing" in answer["refused"]
    assert answer["store_refused"] == store_refuses
    here.close()


def _serve(directory) -> tuple[subprocess.Popen, str]:
    """``python -m http.server`` in a subprocess on 127.0.0.1 (free port): it and its URL."""
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "--directory",
         str(directory), "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (http://...) ..."
    return server, f"http://127.0.0.1:{int(line.split(' port ')[1].split()[0])}"


@pytest.fixture
def http_server(tmp_path):
    """``python -m http.server`` in a subprocess on 127.0.0.1 (free port), serving ``tmp_path``."""
    server, base = _serve(tmp_path)
    yield tmp_path, base
    server.terminate()
    server.wait(timeout=30)


@pytest.mark.s3
def test_s3_and_http_datasets_read_by_another_process(s3_options, http_server):
    import s3fs

    bucket = f"zstore-public-{os.getpid()}"
    s3fs.S3FileSystem(**s3_options, skip_instance_cache=True).mkdir(bucket)
    s3_url = f"s3://{bucket}/published"
    # published through s3fs, whose s3_additional_kwargs set the objects' ACL
    _publish(s3_url, {**s3_options, "transport": "fsspec",
                      "s3_additional_kwargs": {"ACL": "public-read"}})
    root, base = http_server
    _publish(str(root / "published"), {})
    # the S3 readers have no credentials (anonymous, unsigned requests), through each
    # transport installed; HTTP is read-only
    transports = ["fsspec"] + (["obstore"] if importlib.util.find_spec("obstore") else [])
    answers = _read_in_another_process(
        [{"url": s3_url, "options": {"endpoint_url": s3_options["endpoint_url"], "anon": True,
                                     "transport": transport}} for transport in transports]
        + [{"url": f"{base}/published", "options": {}}])
    # moto does not refuse anonymous writes as S3 would: only zstore's refusal is checked there
    for s3_answer in answers[:-1]:
        _check(s3_answer, s3_url, s3_options, store_refuses=False)
    _check(answers[-1], f"{base}/published", {}, store_refuses=True)


def _unwarned_name() -> str:
    """A dataset name no other test used: the warning about a server that ignores Range comes
    once per store URL and process, and a later test's server may get an earlier one's port."""
    return f"sharded-{uuid.uuid4().hex[:8]}"


def test_a_sharded_dataset_over_a_server_that_ignores_ranges(http_server):
    """``python -m http.server`` answers a ranged read with the whole object: the rows read
    are still exactly the stored ones (they failed a checksum, or were wrong, before), and a
    warning names the cost and the fix."""
    root, base = http_server
    name = _unwarned_name()
    _publish(str(root / name), {}, shards=200)
    want = open_dataset(str(root / name))
    ds = open_dataset(f"{base}/{name}")
    rows = torch.tensor([450, 3, 599, 201])  # one chunk of a shard: ranged reads
    with pytest.warns(RuntimeWarning, match=r"ignores Range requests.*honours Range"):
        got = ds.get(rows)
    for key in ("obs", "traj", ("next", "reward"), ("next", "done")):
        assert torch.equal(got[key], want.get(rows)[key]), key
    assert torch.equal(ds.get(torch.arange(600))["obs"], want.get(torch.arange(600))["obs"])


def test_keys_a_url_would_misread_are_read_over_http(http_server):
    """A key holding ``?``, ``#`` or ``%`` went into its objects' URLs as it was: a query, a
    fragment or an escape, so every read over HTTP missed its objects (and blamed a store
    copied in part). Each key is now percent-encoded into the URL."""
    root, base = http_server
    names = ["obs?x", "h#x", "p%20x", "a b", "cámara"]
    data = TensorDict({**{name: torch.arange(6.0) * (i + 1) for i, name in enumerate(names)},
                       ("next", "done"): torch.tensor([0, 0, 1, 0, 0, 1]).bool().unsqueeze(-1)},
                      batch_size=[6])
    storage = zstore.LazyMemmapStorage(6, scratch_dir=str(root / "odd"))
    storage.set(torch.arange(6), data)
    storage.seal()
    storage.close()
    got = open_dataset(f"{base}/odd").get(torch.arange(6))
    for name in names:
        assert torch.equal(got[name], data[name]), name


def test_reads_over_http_keep_few_requests_in_flight(tmp_path):
    """zstore sent up to 64 requests at once to an HTTP store: ``python -m http.server``
    queues 5 connections and drops the rest, which the client retries after 1, 3, 7 s, so
    reading 2,048 rows took 14-28 s instead of 0.2 s. Reads over HTTP now keep at most
    ``store.HTTP_IN_FLIGHT`` requests in flight (counted here at the server)."""
    import functools
    import http.server
    import threading

    from zstore.store import HTTP_IN_FLIGHT

    data = TensorDict({"obs": torch.arange(2048.0).unsqueeze(-1), "act": torch.arange(2048),
                       ("next", "done"): (torch.arange(2048) % 16 == 15).unsqueeze(-1)},
                      batch_size=[2048])
    storage = zstore.LazyMemmapStorage(2048, scratch_dir=str(tmp_path / "ds"), chunks=16)
    storage.set(torch.arange(2048), data)
    storage.seal()
    storage.close()
    active, peak, lock = [0], [0], threading.Lock()

    class Counting(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                super().do_GET()
            finally:
                with lock:
                    active[0] -= 1

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 1024  # none dropped: every request the client sends is counted

    server = Server(("127.0.0.1", 0), functools.partial(Counting, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = open_dataset(f"http://127.0.0.1:{server.server_address[1]}/ds").get(torch.arange(2048))
    finally:
        server.shutdown()
        server.server_close()
    assert torch.equal(got["obs"], data["obs"]) and torch.equal(got["act"], data["act"])
    assert 1 <= peak[0] <= HTTP_IN_FLIGHT, peak[0]


@pytest.mark.s3
def test_open_dataset_names_the_store_and_the_fix_on_transport_errors(s3_bucket, s3_options):
    """A refused read and an unreachable endpoint are worded as zstore.open words them: the
    store named, and what to check."""
    url = f"s3://{s3_bucket}/errors"
    _publish(url, s3_options)
    cases = [({"endpoint_url": s3_options["endpoint_url"], "anon": True}, PermissionError,
              "check storage_options key= and secret="),
             ({"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s",
               "config_kwargs": {"retries": {"max_attempts": 1}}}, OSError, "127.0.0.1:1")]
    for options, kind, fix in cases:
        with pytest.raises(kind) as opened:
            zstore.open(url, options, mode="r")
        with pytest.raises(kind) as info:
            open_dataset(url, options)
        message = str(info.value)
        assert message.startswith(f"cannot read {url} ") and fix in message, message
        assert url in str(opened.value) and fix in str(opened.value)


@pytest.mark.s3
def test_a_missing_bucket_or_none_is_named(s3_bucket, s3_options):
    """A URL in a bucket that does not exist read "no zarr.json there" (open_dataset) or
    "the location does not exist" (zstore.open), as a wrong path in a bucket that exists
    does; ``s3://`` alone read "no zstore buffer at s3:"."""
    missing = f"s3://{s3_bucket}-absent/published"
    with pytest.raises(zstore.StoreNotFoundError,
                       match=f"no dataset at {missing} .*: its bucket does not exist; check"):
        open_dataset(missing, s3_options)
    with pytest.raises(zstore.StoreNotFoundError,
                       match=f"no zstore buffer at {missing} .*: its bucket does not exist; check"):
        zstore.open(missing, s3_options, mode="r")
    with pytest.raises(zstore.StoreNotFoundError, match="no zarr.json there"):
        open_dataset(f"s3://{s3_bucket}/never-written", s3_options)
    with pytest.raises(zstore.StoreNotFoundError, match="the location does not exist"):
        zstore.open(f"s3://{s3_bucket}/never-written", s3_options, mode="r")
    for url in ("s3://", "s3:///"):
        with pytest.raises(zstore.InvalidURLError, match=f"'{url}' names no bucket: write it as "
                                                         "s3://BUCKET/PATH"):
            zstore.open(url, s3_options, mode="r")
    # memory:// alone was the local folder "memory:", created in the working directory
    with pytest.raises(zstore.InvalidURLError, match="'memory://' names no location: write it "
                                                     "as memory://NAME/PATH"):
        zstore.LazyMemmapStorage(4, scratch_dir="memory://")


def test_the_ignored_range_warning_comes_once_per_store(http_server):
    """Under a filter that shows every warning, a sampling loop over a sharded dataset served
    by ``python -m http.server`` warns once (it warned on every read of a new shard or size,
    then once for each of the store's arrays), naming the store, the cost and the fix."""
    root, base = http_server
    name = _unwarned_name()
    _publish(str(root / name), {}, shards=200)
    ds = open_dataset(f"{base}/{name}", cache_bytes=1 << 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(5):
            ds.sample(64, generator=torch.Generator().manual_seed(seed))
        ds.sample_slices(8, 4)
    texts = [str(w.message) for w in caught if "ignores Range requests" in str(w.message)]
    assert len(texts) == 1, texts  # not one for each of obs, traj, reward, done
    assert texts[0].startswith(f"{base}/{name}: the server answered") \
        and "honours Range" in texts[0], texts
    ds.close()


@pytest.mark.s3
def test_a_server_gone_after_the_open_is_a_connection_error_not_damage(tmp_path):
    """Rows read after the HTTP server stopped raised ``CorruptChunkError`` ("cannot read
    chunks"), which a caller handling damaged data would act on; now a ``ConnectionError``
    naming the store and what to check."""
    name = _unwarned_name()
    _publish(str(tmp_path / name), {})
    server, base = _serve(tmp_path)
    try:
        ds = open_dataset(f"{base}/{name}", cache_bytes=1 << 14)
        assert ds.get(torch.tensor([0, 1]))["obs"].flatten().tolist() == [0.0, 1.0]
    finally:
        server.terminate()
        server.wait(timeout=30)
    with pytest.raises(ConnectionError, match="server cannot be reached") as info:
        ds.get(torch.tensor([550, 599]))
    assert not isinstance(info.value, zstore.CorruptChunkError)
    assert base in str(info.value)


@pytest.mark.s3
def test_a_bucket_the_principal_may_not_list_is_not_called_missing(s3_bucket, s3_options,
                                                                    monkeypatch):
    """AWS answers HeadBucket with 403 to a principal without s3:ListBucket (object-only
    grants); moto grants everything, so that answer is made here. s3fs's ``exists`` reads
    a refusal as absence: a wrong path then read "its bucket does not exist"."""
    import botocore.exceptions
    import s3fs

    real = s3fs.S3FileSystem._call_s3

    async def refusing(self, method, *args, **kwargs):
        if method in ("head_bucket", "get_bucket_location", "list_objects_v2"):
            raise botocore.exceptions.ClientError(
                {"Error": {"Code": "403", "Message": "Forbidden"}}, method)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", refusing)
    url = f"s3://{s3_bucket}/typo-{os.getpid()}"
    with pytest.raises(zstore.StoreNotFoundError) as info:
        open_dataset(url, s3_options)
    assert "no zarr.json there" in str(info.value) and "bucket" not in str(info.value)


@pytest.mark.parametrize("fault", ["error500", "truncate"])
def test_a_transient_http_failure_is_read_again(http_server, fault):
    """fsspec's HTTP filesystem retries no request: zstore reads a failed chunk request
    again there (a 500, a connection cut mid-body), where a client that retries (s3fs,
    obstore) has already done so."""
    from faultproxy import FaultProxy, Rule

    root, base = http_server
    name = _unwarned_name()
    _publish(str(root / name), {})
    want = open_dataset(str(root / name)).get(torch.arange(600))
    with FaultProxy(base) as proxy:
        ds = open_dataset(f"{proxy.url}/{name}")
        proxy.add(Rule(fault, path=r"/obs/c", method="GET", count=1))
        got = ds.get(torch.arange(600))
        assert proxy.injected[fault] == 1
    assert torch.equal(got["obs"], want["obs"])
