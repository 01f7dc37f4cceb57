"""A faulty network between zstore and S3: retried, or a clear error — never garbage, never a
half-committed write.

The loopback proxy of :mod:`faultproxy` sits between s3fs and the moto S3
server. What retries is measured here: s3fs/botocore retry 503s, 500s,
resets and dropped bodies for every request; zstore itself re-fetches a chunk
whose payload arrives complete by its headers but fails to decode
(:mod:`zstore.retry`). Every check reads back through a client that bypasses
the proxy, so what is committed is seen as S3 holds it.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from faultproxy import FaultProxy, Rule
from tensordict import TensorDict

import zstore
from zstore import CorruptChunkError

SECRET = "do-not-print-this-secret"
# bounded botocore retries keep the persistent-failure cases short (s3fs adds its own 5)
RETRIES = {"config_kwargs": {"retries": {"max_attempts": 1}}}


@pytest.fixture(scope="module")
def proxy(s3_server):
    with FaultProxy(s3_server) as running:
        yield running


@pytest.fixture
def faulty(proxy, s3_options, s3_bucket):
    """(proxy, options through the proxy, direct options, a fresh URL)."""
    proxy.clear()
    proxy.injected.clear()
    options = dict(s3_options, endpoint_url=proxy.url, secret=SECRET, **RETRIES)
    direct = dict(s3_options)
    return proxy, options, direct, f"s3://{s3_bucket}/faults-{uuid.uuid4().hex[:8]}"


def rows(start: int, n: int) -> TensorDict:
    x = torch.arange(start, start + n)
    return TensorDict(x=x.float(), y=torch.stack([x, -x], -1), batch_size=[n])


def assert_rows(storage, start: int, n: int) -> None:
    got = storage[:]
    assert len(storage) == n
    assert got["x"].tolist() == list(range(start, start + n))
    assert got["y"][:, 1].tolist() == [-v for v in range(start, start + n)]


def no_secret(exc: BaseException) -> None:
    while exc is not None:
        assert SECRET not in str(exc) and SECRET not in repr(exc)
        exc = exc.__cause__ or exc.__context__


def write_directly(url: str, direct: dict, layout: str) -> None:
    """12 committed rows at ``url``, written without the proxy."""
    writer = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=direct,
                                      **LAYOUTS[layout])
    writer.set(torch.arange(12), rows(0, 12))
    writer.close()


LAYOUTS = {"chunks": {"codec": "zstd", "chunks": 4, "shards": 4},
           "shards": {"codec": "zstd+crc32c", "chunks": 4, "shards": 8}}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_transient_write_faults_are_retried(faulty, layout):
    proxy, options, direct, url = faulty
    proxy.add(Rule("slowdown", path=r"/x/c/", method="PUT", count=2),
              Rule("reset", path=r"/y/c/", method="PUT", count=1),
              Rule("reset_after", path=r"/x/c/", method="PUT", count=1),
              Rule("error500", path=r"zarr\.json$", method="PUT", count=1))
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options,
                                       **LAYOUTS[layout])
    storage.set(torch.arange(12), rows(0, 12))
    storage.flush()
    assert dict(proxy.injected) == {"slowdown": 2, "reset": 1, "reset_after": 1, "error500": 1}
    assert_rows(zstore.open(url, direct, mode="r"), 0, 12)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_transient_read_faults_are_retried_or_refetched(faulty, layout):
    proxy, options, direct, url = faulty
    write_directly(url, direct, layout)
    proxy.add(Rule("slowdown", path=r"/x/c/", method="GET", count=1),
              Rule("reset", path=r"/y/c/", method="GET", count=1),
              Rule("truncate", path=r"/x/c/", method="GET", count=1),
              Rule("truncate_lying", path=r"/y/c/", method="GET", count=1),  # zstore re-fetches
              Rule("error500", path=r"zarr\.json$", method="GET", count=1),
              Rule("latency", path=r"/c/", method="GET", count=2, delay=0.05))
    assert_rows(zstore.open(url, options, mode="r"), 0, 12)
    assert dict(proxy.injected) == {"slowdown": 1, "reset": 1, "truncate": 1, "truncate_lying": 1,
                                    "error500": 1, "latency": 2}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_damaged_bodies_never_decode_into_garbage(faulty, layout):
    """Every response cut short with a matching Content-Length: a CorruptChunkError naming the chunk."""
    proxy, options, direct, url = faulty
    write_directly(url, direct, layout)
    reader = zstore.open(url, options, mode="r")
    proxy.add(Rule("truncate_lying", path=r"/x/c/", method="GET", count=1000))
    with pytest.raises(CorruptChunkError) as info:
        reader.get(torch.arange(12))
    assert "'x'" in str(info.value) and "chunk" in str(info.value)
    assert proxy.injected["truncate_lying"] >= 3  # re-fetched before giving up
    no_secret(info.value)
    proxy.clear()
    assert_rows(reader, 0, 12)  # nothing bad was cached


@pytest.mark.parametrize("target", ["chunk", "commit"])
def test_a_failed_write_is_never_committed_and_writing_resumes(faulty, target):
    proxy, options, direct, url = faulty
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options,
                                       codec="zstd", chunks=4, shards=4)
    storage.set(torch.arange(4), rows(0, 4))
    storage.flush()
    path = r"/x/c/" if target == "chunk" else r"/zarr\.json$"
    proxy.add(Rule("slowdown", path=path, method="PUT", count=10_000))
    with pytest.raises(OSError) as info:  # completed chunks are stored by set(), the rest by flush()
        storage.set(torch.arange(4, 12), rows(4, 8))
        storage.flush()
    message = str(info.value)
    assert url in message and SECRET not in message
    assert ("'x'" in message) if target == "chunk" else ("zarr.json" in message)
    no_secret(info.value)
    assert_rows(zstore.open(url, direct, mode="r"), 0, 4)  # the last commit, unchanged
    proxy.clear()
    storage.set(torch.arange(4, 12), rows(4, 8), set_cursor=len(storage) == 4)
    storage.flush()
    assert_rows(zstore.open(url, direct, mode="r"), 0, 12)


def test_proxy_rules_fire_only_on_matches(proxy):
    rule = Rule("slowdown", path=r"/c/", method="PUT", count=2)
    assert not rule.take("GET", "/b/x/c/0")
    assert rule.take("PUT", "/b/x/c/0") and rule.take("PUT", "/b/x/c/1")
    assert not rule.take("PUT", "/b/x/c/2")
    with pytest.raises(ValueError, match="unknown fault"):
        Rule("explode")


def test_credentials_never_leak_into_reprs_errors_logs_or_the_store(faulty, caplog):
    """The secret in storage_options shows up nowhere: reprs, errors on every path, logs, objects."""
    import logging

    import s3fs

    proxy, options, direct, url = faulty
    caplog.set_level(logging.DEBUG)
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options,
                                       codec="zstd", chunks=4, shards=4)
    storage.set(torch.arange(6), rows(0, 6))
    storage.flush()
    texts = [repr(storage), str(storage), repr(storage.spec.redacted())]
    failures = [
        lambda: zstore.open(url.rsplit("/", 1)[0] + "/nothing-here", options),  # missing
        lambda: zstore.open("s3://zstore-no-such-bucket-9e1d/rb", options),  # missing bucket
        lambda: zstore.open(url, options, mode="r").set(0, rows(0, 1)[0]),  # read-only
        lambda: zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options)
        .set(torch.arange(2), rows(0, 2)),  # exists
        lambda: zstore.open(url, options).set(torch.arange(2), TensorDict(q=torch.zeros(2),
                                                                          batch_size=[2])),
    ]
    for fail in failures:
        with pytest.raises(Exception) as info:  # any error: its text is the point
            fail()
        no_secret(info.value)
        texts.append(str(info.value))
    proxy.add(Rule("error500", path=r"zarr\.json$", method="PUT", count=10_000))
    storage.set(torch.arange(6, 8), rows(6, 2))
    with pytest.raises(OSError) as info:
        storage.flush()
    no_secret(info.value)
    proxy.clear()
    storage.close()
    assert all(SECRET not in text for text in texts)
    assert all(SECRET not in record.getMessage() for record in caplog.records)
    fs = s3fs.S3FileSystem(**direct, skip_instance_cache=True)
    root = url.removeprefix("s3://")
    for path in fs.find(root):
        assert SECRET.encode() not in fs.cat_file(path), path


@pytest.mark.parametrize("lost", ["lease created", "lease renewed", "commit"])
def test_a_conditional_write_whose_reply_is_lost_is_known_as_landed(faulty, lost):
    """The server stores the write, the connection resets before its reply, the client
    retries, and the retry is refused by the condition the first attempt changed. The lease
    then read as "held by <this writer's own id>": the writer died for good, its unsaved
    rows lost and the store refused to a reopen for the lease's ttl; a lost commit reply
    raised "Nothing was committed" after the rows were committed (written again, they
    would be duplicated)."""
    proxy, options, direct, url = faulty
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options,
                                       autocommit_seconds=float("inf"))
    path = r"zarr\.json$" if lost == "commit" else r"zstore-lease"
    rule = Rule("reset_after", path=path, method="PUT", count=1)
    if lost == "lease created":
        proxy.add(rule)
    storage.set(torch.arange(4), rows(0, 4))
    storage.flush()
    if lost != "lease created":
        proxy.add(rule)
    storage.set(torch.arange(4, 12), rows(4, 8))
    storage.flush()
    assert proxy.injected["reset_after"] == 1
    assert_rows(zstore.open(url, direct, mode="r"), 0, 12)
    storage.set(torch.arange(12, 14), rows(12, 2))  # the writer goes on
    storage.close()
    assert_rows(zstore.open(url, direct, mode="r"), 0, 14)


@pytest.mark.parametrize("fault", ["slowdown", "error500"])
def test_a_read_the_server_keeps_failing_is_a_connection_error_not_damage(faulty, fault):
    """Before: a chunk GET the server kept answering 503/500 raised CorruptChunkError ("the
    data is at fault"), and zstore's re-fetch of damaged chunks ran the client's whole
    retry cycle three times over."""
    proxy, options, direct, url = faulty
    write_directly(url, direct, "chunks")
    reader = zstore.open(url, options, mode="r")
    proxy.add(Rule(fault, path=r"/x/c/", method="GET", count=10_000))
    with pytest.raises(ConnectionError, match=r"key 'x'.*the data is not at fault") as info:
        reader.get(torch.arange(12))
    assert not isinstance(info.value, CorruptChunkError)
    proxy.clear()
    assert_rows(reader, 0, 12)  # nothing bad was cached


def test_a_log_segment_damaged_in_transfer_is_fetched_again(faulty):
    """Before: a segment body cut short (its Content-Length matching) raised CorruptChunkError
    at once, where a chunk is fetched again."""
    proxy, options, direct, url = faulty
    writer = zstore.LazyMemmapStorage(64, scratch_dir=url, storage_options=direct, codec="zstd",
                                      chunks=32, tail_log=True, autocommit_seconds=float("inf"))
    writer.set(torch.arange(12), rows(0, 12))
    writer.flush()  # the rows are in log segments, their chunk not yet stored
    assert writer._meta.tail
    proxy.add(Rule("truncate_lying", path=r"/zstore-tail/", method="GET", count=1))
    assert_rows(zstore.open(url, options, mode="r"), 0, 12)
    assert proxy.injected["truncate_lying"] == 1
    writer.close()


def test_a_lease_renewal_the_server_keeps_failing_names_the_store(faulty, monkeypatch):
    """Before: a bare OSError('... injected by faultproxy') naming no store."""
    import time

    from zstore import lease

    proxy, options, direct, url = faulty
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=options,
                                       codec="zstd", chunks=4, shards=4, lease_ttl=30)
    storage.set(torch.arange(4), rows(0, 4))
    storage.flush()
    monkeypatch.setattr(lease, "clock", lambda: time.time() + 20)  # past half the ttl: renew
    proxy.add(Rule("slowdown", path=r"zstore-lease\.json$", method="PUT", count=10_000))
    with pytest.raises(ConnectionError, match=r"renew the write lease on s3://.*wrote nothing"):
        storage.set(torch.arange(4, 8), rows(4, 4))
    assert len(storage) == 4
    proxy.clear()
    storage.set(torch.arange(4, 8), rows(4, 4))
    storage.close()
    assert_rows(zstore.open(url, direct, mode="r"), 0, 8)


def test_a_checkpoint_read_the_server_keeps_failing_names_the_object(faulty):
    """Before: s3fs's bare OSError (or botocore's checksum error), naming no checkpoint."""
    proxy, options, direct, url = faulty
    source = zstore.LazyTensorStorage(16)
    source.set(torch.arange(12), rows(0, 12))
    source.dumps(zstore.StoreSpec.parse(url, direct))
    target = zstore.LazyTensorStorage(16)
    proxy.add(Rule("error500", path=r"/gen-[^/]*/x/c", method="GET", count=10_000))
    with pytest.raises(ConnectionError, match=r"cannot read .*/x/c.* of the checkpoint at s3://"):
        target.loads(zstore.StoreSpec.parse(url, options))
    proxy.clear()
    target.loads(zstore.StoreSpec.parse(url, options))
    assert_rows(target, 0, 12)


def test_a_torchrl_save_whose_state_reads_keep_failing_names_the_file(faulty):
    """Before: s3fs's bare OSError (botocore's checksum error for a damaged body)."""
    T = pytest.importorskip("torchrl.data")
    zt = pytest.importorskip("zstore.torchrl")

    proxy, options, direct, url = faulty

    def buffer(location_options):
        return T.TensorDictReplayBuffer(storage=zt.LazyMemmapStorage(
            16, scratch_dir=f"{url}-rb-{uuid.uuid4().hex[:6]}", storage_options=location_options))

    saved = buffer(direct)
    saved.extend(rows(0, 12))
    zt.dumps(saved, f"{url}-save", direct)
    fresh = buffer(options)
    proxy.add(Rule("error500", path=r"-save/writer/", method="GET", count=10_000))
    with pytest.raises(ConnectionError, match=r"cannot read writer/.* of the replay-buffer "
                                              r"checkpoint at s3://.*nothing was loaded"):
        zt.loads(fresh, f"{url}-save", options)
    assert len(fresh) == 0
    proxy.clear()
    zt.loads(fresh, f"{url}-save", options)
    assert len(fresh) == 12


def test_a_codec_s_oserror_is_damage_and_a_client_s_is_a_failed_request():
    """gzip's and bz2's decode errors are ``OSError``s without an errno: read as damage (and
    fetched again), not as a request that failed; s3fs's wording of a 5xx has one."""
    import errno
    import gzip

    from zstore.credentials import failed_request

    assert not failed_request(gzip.BadGzipFile("Not a gzipped file (b'\\x00\\x01')"))
    assert not failed_request(OSError("Invalid data stream"))  # bz2's
    assert failed_request(OSError(errno.EBUSY, "SlowDown"))
    assert failed_request(ConnectionResetError(errno.ECONNRESET, "reset by peer"))


def test_a_metadata_read_cut_short_is_read_again(faulty):
    """``rclone serve s3`` rewrites an object in place, and a read landing meanwhile gets it
    cut short: a reader opening a healthy buffer while its writer committed was told it was
    "not a zstore buffer: its zarr.json is not valid JSON" (1 open in 100-400 on rclone)."""
    proxy, options, direct, url = faulty
    write_directly(url, direct, "chunks")
    proxy.add(Rule("truncate_lying", path=r"/zarr\.json$", method="GET", count=1))
    assert_rows(zstore.open(url, options, mode="r"), 0, 12)
    assert proxy.injected["truncate_lying"] == 1


def test_a_lease_read_cut_short_is_read_again_then_named(faulty):
    """A second writer whose read of the live lease was cut short (a dropped connection, or
    rclone rewriting it) got aiohttp's bare ``ClientPayloadError`` from ``set()``, naming no
    store: it reads it again (and is refused, the lease being held), and a read that keeps
    failing raises ``ConnectionError`` naming the store."""
    proxy, options, direct, url = faulty
    first = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=direct)
    first.set(torch.arange(4), rows(0, 4))
    first.flush()
    proxy.add(Rule("truncate", path=r"/zstore-lease\.json$", method="GET", count=1))
    second = zstore.open(url, options)
    with pytest.raises(zstore.LeaseError, match="is being written by"):
        second.set(torch.arange(4, 8), rows(4, 4))
    assert proxy.injected["truncate"] == 1
    proxy.add(Rule("truncate", path=r"/zstore-lease\.json$", method="GET", count=1000))
    with pytest.raises(ConnectionError, match=rf"cannot read zstore-lease\.json of {url} .*: the "
                                              r"request failed after the client's retries"):
        second.set(torch.arange(4, 8), rows(4, 4))
    proxy.clear()
    first.close()
    assert_rows(zstore.open(url, direct, mode="r"), 0, 4)
