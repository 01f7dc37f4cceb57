"""S3 data transports (zstore.store): s3fs through zarr's FsspecStore, obstore through ObjectStore.

The choice (``storage_options["transport"]``, ``$ZSTORE_S3_CLIENT``) is tested without a
server; on moto the two transports must read the same bytes, and a buffer written through one
must read back through the other.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import socket
import sys
import threading
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore

import zstore
from zstore.errors import BackendNotInstalledError
from zstore.store import TRANSPORT_ENV, StoreSpec


def _has_obstore() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


needs_obstore = pytest.mark.skipif(
    not _has_obstore(),
    reason="obstore is not installed (pip install 'zstore[s3fast]'): the obstore transport "
           "cannot be compared with s3fs")


@pytest.fixture(autouse=True)
def _no_env_choice(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)


def test_default_is_fsspec_and_the_option_or_env_chooses(monkeypatch):
    assert StoreSpec.parse("s3://b/rb").transport == "fsspec"
    assert StoreSpec.parse("s3://b/rb", {"transport": "obstore"}).transport == "obstore"
    monkeypatch.setenv(TRANSPORT_ENV, "obstore")
    assert StoreSpec.parse("s3a://b/rb").transport == "obstore"
    assert StoreSpec.parse("s3://b/rb", {"transport": "fsspec"}).transport == "fsspec"  # option wins
    assert StoreSpec.parse("memory://rb").transport == "fsspec"  # only S3 has a choice
    assert StoreSpec.parse("gs://b/rb").transport == "fsspec"


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="unknown S3 transport 'curl'"):
        StoreSpec.parse("s3://b/rb", {"transport": "curl"}).transport


def test_the_option_travels_but_never_reaches_fsspec():
    pytest.importorskip("s3fs")
    spec = StoreSpec.parse("s3://b/rb", {"transport": "fsspec", "anon": True})
    assert StoreSpec.from_json(spec.to_json()).transport == "fsspec"
    fs, path = spec.filesystem()
    assert path == "b/rb" and "transport" not in fs.storage_options
    assert isinstance(spec.open(), FsspecStore)


def test_missing_obstore_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    with pytest.raises(BackendNotInstalledError, match=r"zstore\[s3fast\]"):
        StoreSpec.parse("s3://b/rb", {"transport": "obstore"}).open()


@needs_obstore
def test_options_obstore_cannot_honour_are_refused():
    spec = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "requester_pays": True,
                                         "config_kwargs": {"max_pool_connections": 5}})
    with pytest.raises(ValueError, match=r"requester_pays.*config_kwargs.max_pool_connections"):
        spec.open()


@needs_obstore
def test_s3fs_options_map_onto_obstore():
    from zarr.storage import ObjectStore

    spec = StoreSpec.parse("s3://b/rb", {
        "transport": "obstore", "key": "k", "secret": "s", "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1"},
        "config_kwargs": {"connect_timeout": 10, "retries": {"mode": "standard",
                                                             "total_max_attempts": 3}}},
        read_only=True)
    store = spec.open()
    assert isinstance(store, ObjectStore) and store.read_only
    config = store.store.config
    assert config["endpoint"] == "http://127.0.0.1:9" and config["region"] == "eu-west-1"
    assert config["access_key_id"] == "k" and store.store.prefix == "rb"
    assert store.store.retry_config["max_retries"] == 2  # 3 attempts, the first included


@needs_obstore
@pytest.mark.parametrize("retries, expected", [({"max_attempts": 1}, 1), ({"max_attempts": 0}, 0),
                                               ({"total_max_attempts": 4}, 3),
                                               ({"total_max_attempts": 2, "max_attempts": 7}, 1)])
def test_botocore_retry_counts_mean_the_same_retries_in_obstore(retries, expected):
    """botocore's ``max_attempts`` counts retries after the first request, its
    ``total_max_attempts`` counts the first one too and wins (botocore's config docs)."""
    spec = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "key": "k", "secret": "s",
                                         "config_kwargs": {"retries": retries}})
    assert spec.open().store.retry_config["max_retries"] == expected


@needs_obstore
def test_botocore_credentials_in_client_kwargs_map_onto_obstore():
    """s3fs passes ``client_kwargs`` to botocore, whose credential names obstore reads too."""
    spec = StoreSpec.parse("s3://b/rb", {
        "transport": "obstore", "endpoint_url": "http://127.0.0.1:9",
        "client_kwargs": {"aws_access_key_id": "k", "aws_secret_access_key": "s",
                          "aws_session_token": "t"}}, read_only=True)
    config = spec.open().store.config
    assert (config["access_key_id"], config["secret_access_key"], config["session_token"]) == \
        ("k", "s", "t")
    both = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "key": "mine", "secret": "s",
                                         "endpoint_url": "http://127.0.0.1:9",
                                         "client_kwargs": {"aws_access_key_id": "k"}})
    assert both.open().store.config["access_key_id"] == "mine"  # s3fs's own option wins


@needs_obstore
def test_obstore_errors_are_the_ones_s3fs_raises():
    """A read or a write to a server that cannot be reached is a ConnectionError naming the
    store, on one line (obstore's own error appends a multi-line Rust debug dump)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "key": "k", "secret": "s",
                                         "endpoint_url": f"http://127.0.0.1:{port}",
                                         "config_kwargs": {"retries": {"max_attempts": 1}}})
    store = spec.open()
    buffer = default_buffer_prototype().buffer.from_bytes(b"x")
    for attempt in (lambda: store.get("zarr.json", default_buffer_prototype()),
                    lambda: store.get("c/0", default_buffer_prototype(), RangeByteRequest(0, 8)),
                    lambda: store.set("c/0", buffer)):
        with pytest.raises(ConnectionError) as caught:
            sync(attempt())
        message = str(caught.value)
        assert message.startswith(f"{spec.redacted()}: ") and "\n" not in message, message
        assert "error sending request" in message
        assert type(caught.value.__cause__).__module__.startswith("obstore")


@needs_obstore
def test_an_obstore_client_is_built_once_per_settings(monkeypatch):
    """Building obstore's client costs more than the rest of an open: opens with the same
    settings share one; another location, credential or ``AWS_*`` variable builds another."""
    def opened(url: str, **extra: str):
        options = {"transport": "obstore", "key": "k", "secret": "s",
                   "endpoint_url": "http://127.0.0.1:9", **extra}
        return StoreSpec.parse(url, options, read_only=True).open()

    first = opened("s3://b/rb")
    assert opened("s3://b/rb").store is first.store
    assert opened("s3://b/rb").read_only and not StoreSpec.parse(
        "s3://b/rb", {"transport": "obstore", "key": "k", "secret": "s",
                      "endpoint_url": "http://127.0.0.1:9"}).open().read_only
    assert opened("s3://b/other").store is not first.store
    assert opened("s3://b/rb", secret="t").store is not first.store
    monkeypatch.setenv("AWS_SESSION_TOKEN", "x")
    assert opened("s3://b/rb").store is not first.store



# -- credentials: botocore's chain, as s3fs ---------------------------------------------------
@pytest.fixture
def aws_files(tmp_path, monkeypatch):
    """No credentials in the environment; AWS config and credentials files of our own holding
    the profile ``zs`` (moto's key, region eu-west-1); the metadata service off."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    credentials.write_text("[zs]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    config.write_text("[profile zs]\nregion = eu-west-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


@needs_obstore
def test_obstore_takes_a_profile_s_credentials_and_region(aws_files):
    spec = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "profile": "zs"}, read_only=True)
    store = spec.open().store
    assert store.config["region"] == "eu-west-1"
    credential = store.credential_provider()
    assert (credential["access_key_id"], credential["secret_access_key"]) == ("testing", "testing")
    assert credential["expires_at"] is None  # a file's key does not expire
    given = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "profile": "zs",
                                          "region": "ap-south-1"}, read_only=True)
    assert given.open().store.config["region"] == "ap-south-1"  # the option wins
    with pytest.raises(ValueError, match="nosuch.*name a profile"):
        StoreSpec.parse("s3://b/rb", {"transport": "obstore", "profile": "nosuch"}).open()


@needs_obstore
def test_refreshed_credentials_expire_and_pickle_as_their_profile(aws_files, monkeypatch):
    """A ``credential_process`` profile gives temporary credentials: obstore is told when to
    ask again, and the provider pickles (botocore's refreshing credentials hold a lock) as
    its profile, resolved again where it is unpickled."""
    script = aws_files / "issue.py"
    script.write_text("import json\nprint(json.dumps({'Version': 1, 'AccessKeyId': 'temp', "
                      "'SecretAccessKey': 's', 'SessionToken': 'tok', "
                      "'Expiration': '2099-01-01T00:00:00Z'}))\n")
    (aws_files / "config").write_text(f"[profile proc]\ncredential_process = {sys.executable} "
                                      f"{script}\n")
    store = StoreSpec.parse("s3://b/rb", {"transport": "obstore", "profile": "proc",
                                          "endpoint_url": "http://127.0.0.1:9"}).open().store
    provider = store.credential_provider
    first = provider()
    assert (first["access_key_id"], first["token"]) == ("temp", "tok")
    assert first["expires_at"] is not None  # refreshed: obstore asks again
    again = pickle.loads(pickle.dumps(provider))()
    assert (again["access_key_id"], again["token"]) == ("temp", "tok")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # unpickled where there are none
    lost = pickle.loads(pickle.dumps(provider))
    with pytest.raises(zstore.NoCredentialsError, match="no credentials to access s3://b/rb"):
        lost()


@pytest.mark.s3
@needs_obstore
def test_obstore_reads_with_the_credentials_s3fs_finds(aws_files, s3_options, s3_bucket,
                                                        monkeypatch):
    """A buffer readable through s3fs with a profile (``profile=`` or ``$AWS_PROFILE``) reads
    the same rows through obstore, which on its own looks for neither."""
    url = f"s3://{s3_bucket}/profile-{uuid.uuid4().hex[:6]}"
    data = _rows(1200, seed=3)
    _write(url, s3_options, data, capacity=2000)
    endpoint = {"endpoint_url": s3_options["endpoint_url"]}
    choices = [{"profile": "zs"}, {}]
    monkeypatch.setenv("AWS_PROFILE", "zs")  # the second reads through the variable
    for transport in ("fsspec", "obstore"):
        for choice in choices:
            reader = zstore.open(url, {**endpoint, **choice, "transport": transport}, mode="r")
            assert (reader.get(torch.arange(1200)) == data).all(), (transport, choice)


class _CountingHandler(BaseHTTPRequestHandler):
    """Answers every request 404 and counts it (a stand-in instance metadata service)."""

    seen: list[str] = []

    def _answer(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = _answer

    def log_message(self, *args) -> None:
        pass


@needs_obstore
def test_no_credentials_fail_at_once_without_the_disabled_metadata_service(aws_files,
                                                                            monkeypatch):
    """With no credentials anywhere and ``AWS_EC2_METADATA_DISABLED=true``, the obstore
    transport says so at once, as s3fs does: obstore alone asks the metadata service anyway
    (ten retries, 4.3 s without one)."""
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CountingHandler)
    _CountingHandler.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        metadata = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", metadata)  # obstore's name for it
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", metadata)  # botocore's
        url = f"s3://nobucket/{uuid.uuid4().hex[:6]}"
        with pytest.raises(zstore.NoCredentialsError, match="no credentials to access "
                           f"{url}.*AWS_ACCESS_KEY_ID"):
            zstore.open(url, {"transport": "obstore", "endpoint_url": "http://127.0.0.1:9"},
                        mode="r")
        assert _CountingHandler.seen == []
    finally:
        server.shutdown()
        server.server_close()

# -- on moto ----------------------------------------------------------------------------------
def _rows(n: int, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({
        "pixels": torch.randint(0, 256, (n, 4, 21, 21), dtype=torch.uint8, generator=gen),
        "reward": torch.randn(n, generator=gen),
    }, [n])


def _options(s3_options: dict, transport: str) -> dict:
    return {**s3_options, "transport": transport}


@pytest.mark.s3
@needs_obstore
def test_both_transports_read_the_same_bytes(s3_options, s3_bucket):
    url = f"s3://{s3_bucket}/same-{uuid.uuid4().hex[:6]}"
    payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    writer = StoreSpec.parse(url, _options(s3_options, "fsspec")).open()
    sync(writer.set("blob", default_buffer_prototype().buffer.from_bytes(payload)))
    stores = {t: StoreSpec.parse(url, _options(s3_options, t), read_only=True).open()
              for t in ("fsspec", "obstore")}
    prototype = default_buffer_prototype()
    for byte_range in (None, RangeByteRequest(0, 1), RangeByteRequest(12_345, (2 << 20) + 7)):
        got = {t: sync(store.get("blob", prototype, byte_range=byte_range)).to_bytes()
               for t, store in stores.items()}
        expected = payload if byte_range is None else payload[byte_range.start:byte_range.end]
        assert got["fsspec"] == got["obstore"] == expected
    assert all(sync(store.get("missing", prototype)) is None for store in stores.values())
    sync(writer.set("empty", prototype.buffer.from_bytes(b"")))  # no byte 0 to range from
    assert all(sync(store.get("empty", prototype)).to_bytes() == b"" for store in stores.values())


def _write(url: str, options: dict, data: TensorDict, capacity: int) -> None:
    storage = zstore.LazyMemmapStorage(capacity, scratch_dir=url, storage_options=options)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(data[:1000])
    writer.extend(data[1000:])  # a partly written shard: a log segment in the commit
    storage.flush()
    storage.close()


@pytest.mark.s3
def test_opening_through_s3fs_sends_no_head(s3_options, s3_bucket, monkeypatch):
    import s3fs

    url = f"s3://{s3_bucket}/open-{uuid.uuid4().hex[:6]}"
    _write(url, s3_options, _rows(1200, seed=3), 2000)
    calls = []
    original = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        calls.append(method if isinstance(method, str) else method.__name__)
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    reader = zstore.open(url, s3_options, mode="r")
    assert torch.equal(reader[torch.arange(3)]["reward"], _rows(1200, seed=3)["reward"][:3])
    assert "head_object" not in calls and calls.count("get_object") >= 3


@pytest.mark.s3
@needs_obstore
@pytest.mark.parametrize("written, read", [("fsspec", "obstore"), ("obstore", "fsspec")])
def test_a_buffer_written_through_one_reads_through_the_other(s3_options, s3_bucket, written, read):
    url = f"s3://{s3_bucket}/rb-{uuid.uuid4().hex[:6]}"
    data = _rows(1500, seed=1)
    _write(url, _options(s3_options, written), data, 2000)
    reader = zstore.open(url, _options(s3_options, read), mode="r")
    assert isinstance(reader.spec.open(), FsspecStore) == (read == "fsspec")
    idx = torch.randperm(1500, generator=torch.Generator().manual_seed(2))[:300]
    got = reader[idx]
    assert torch.equal(got["pixels"], data["pixels"][idx])
    assert torch.equal(got["reward"], data["reward"][idx])
    assert torch.equal(reader[torch.arange(1500)]["pixels"], data["pixels"])


@pytest.mark.s3
@needs_obstore
def test_obstore_reads_a_server_that_answers_ranges_whole(rclone_s3, s3_options, s3_bucket):
    """``rclone serve s3`` answers a ranged GET ``200`` with a ``Content-Range``, which obstore
    refuses: the obstore transport then sends ranged reads through s3fs, and reads whole
    objects itself. On moto (``206``, as S3) nothing goes through s3fs."""
    data = _rows(1500, seed=4)
    for options, base, answers_whole in ((rclone_s3, "s3://zstore-rclone", True),
                                         (s3_options, f"s3://{s3_bucket}", False)):
        url = f"{base}/ranges-{uuid.uuid4().hex[:6]}"
        storage = zstore.LazyMemmapStorage(2000, scratch_dir=url, chunks=50, shards=500,
                                           storage_options=_options(options, "obstore"))
        storage.set(torch.arange(1500), data)
        storage.close()
        reader = zstore.open(url, _options(options, "obstore"), mode="r")
        idx = torch.tensor([3, 700, 1499])  # a few rows of three shards: index and ranges
        got = reader[idx]
        assert torch.equal(got["pixels"], data["pixels"][idx])
        assert torch.equal(got["reward"], data["reward"][idx])
        assert torch.equal(reader[torch.arange(1500)]["pixels"], data["pixels"])
        store = reader.table.groups[0].store
        assert isinstance(store, zstore.store._ObjectStoreS3)
        assert (store._ranged is not None) == answers_whole
        # the process remembers the server: a later open ranges through s3fs from the start
        again = zstore.open(url, _options(options, "obstore"), mode="r")
        assert again.table.groups[0].store._ranges_through_s3fs() == answers_whole
        assert torch.equal(again[idx]["pixels"], data["pixels"][idx])


def _read_in_forked_child(reader, url: str, options: dict, data: TensorDict) -> bool:
    """In a forked child: the inherited reader and a new open both read ``data`` back (a
    SIGALRM ends a child whose request never returns). One torch thread, as in a DataLoader
    worker: torch's own thread pool does not survive fork either."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's handler would wait
    signal.alarm(120)
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = torch.equal(reader[torch.arange(len(data))]["pixels"], data["pixels"])
        again = zstore.open(url, options, mode="r")
        ok = ok and torch.equal(again[torch.arange(len(data))]["reward"], data["reward"])
        ok = ok and isinstance(again.spec.open(), FsspecStore)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return ok and len(said) == 1 and "'spawn' or 'forkserver'" in said[0]


@pytest.mark.s3
@needs_obstore
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_after_obstore_was_used_reads_through_s3fs(s3_options, s3_bucket):
    """obstore's runtime threads do not survive fork: a forked child's obstore request never
    returns. A child of a process that used obstore (a DataLoader worker, a collector)
    reads through s3fs instead, and says so once; the parent keeps obstore."""
    url = f"s3://{s3_bucket}/fork-{uuid.uuid4().hex[:6]}"
    options = _options(s3_options, "obstore")
    data = _rows(1200, seed=3)
    _write(url, options, data, 1500)
    reader = zstore.open(url, options, mode="r")
    assert torch.equal(reader[torch.arange(10)]["pixels"], data["pixels"][:10])  # obstore ran
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            ok = _read_in_forked_child(reader, url, options, data)
        except BaseException:  # noqa: BLE001 - any failure in the child is a failed check
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not isinstance(zstore.open(url, options, mode="r").spec.open(), FsspecStore)


#: Both S3 transports, for a behaviour that must not depend on the client.
BOTH = ["fsspec", pytest.param("obstore", marks=needs_obstore)]


@pytest.mark.parametrize("transport", BOTH)
def test_region_means_the_same_through_both_transports(s3_options, s3_bucket, transport):
    """s3fs has no ``region`` option: it was refused as "not a zstore buffer" (a TypeError)."""
    options = {**s3_options, "region": "us-east-1", "transport": transport}
    url = f"s3://{s3_bucket}/region-{uuid.uuid4().hex[:8]}"
    writer = zstore.LazyMemmapStorage(10, scratch_dir=url, storage_options=options)
    writer.set(torch.arange(3), TensorDict(x=torch.arange(3), batch_size=[3]))
    writer.flush()
    assert zstore.open(url, options, mode="r").get(torch.arange(3))["x"].tolist() == [0, 1, 2]
    writer.close()


@pytest.mark.parametrize("transport", BOTH)
def test_a_refused_lease_write_names_the_store_and_the_fix(rclone_s3, transport):
    """A wrong secret (rclone checks signatures) was a bare PermissionError from the lease."""
    url = f"s3://zstore-rclone/wrong-secret-{uuid.uuid4().hex[:8]}"
    options = {**rclone_s3, "secret": "WRONG-SECRET-4f1c", "transport": transport}
    storage = zstore.LazyMemmapStorage(10, scratch_dir=url, storage_options=options)
    with pytest.raises(PermissionError, match="key= and secret=") as info:
        storage.set(torch.arange(2), TensorDict(x=torch.arange(2), batch_size=[2]))
    assert url in str(info.value) and "WRONG-SECRET-4f1c" not in str(info.value)


@needs_obstore
def test_an_error_obstore_leaves_unclassified_is_one_line_with_the_servers_code(rclone_s3):
    """rclone refuses unsigned requests (``anon=True``) with a 400. obstore's GenericError
    came through whole: the server's XML on the next lines and a 20-line Rust debug dump."""
    url = f"s3://zstore-rclone/unsigned-{uuid.uuid4().hex[:8]}"
    writer = zstore.LazyMemmapStorage(10, scratch_dir=url, storage_options=rclone_s3)
    writer.set(torch.arange(2), TensorDict(x=torch.arange(2), batch_size=[2]))
    writer.close()
    options = {"endpoint_url": rclone_s3["endpoint_url"], "anon": True, "transport": "obstore"}
    with pytest.raises(OSError) as info:
        zstore.open(url, options, mode="r")
    message = str(info.value)
    assert "\n" not in message and "Debug" not in message, message
    assert message.startswith(url) and message.endswith(
        "400 Bad Request: UnsupportedAlgorithm (Encountered an unsupported algorithm.)"), message


@pytest.mark.parametrize("transport", BOTH)
def test_missing_credentials_name_the_store_and_the_fix(s3_server, s3_bucket, transport,
                                                        monkeypatch, tmp_path):
    """s3fs's missing credentials were an OSError (``zstore.open``) and botocore's bare
    NoCredentialsError (a checkpoint load): both are zstore's, as the obstore transport's."""
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    options = {"endpoint_url": s3_server, "skip_instance_cache": True, "transport": transport}
    url = f"s3://{s3_bucket}/no-credentials"
    with pytest.raises(zstore.NoCredentialsError, match="key= and secret=") as info:
        zstore.open(url, options, mode="r")
    assert url in str(info.value)
    with pytest.raises(zstore.NoCredentialsError, match="key= and secret=") as info:
        zstore.LazyMemmapStorage(10).loads(StoreSpec.parse(f"{url}-ckpt", options))
    assert f"{url}-ckpt" in str(info.value)
    storage = zstore.LazyTensorStorage(10)  # a dump: botocore's bare error until 2026-12-07
    storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 3), batch_size=[2]))
    with pytest.raises(zstore.NoCredentialsError, match="key= and secret=") as info:
        storage.dumps(StoreSpec.parse(f"{url}-dump", options))
    assert f"{url}-dump" in str(info.value)


@pytest.mark.parametrize("transport", BOTH)
def test_half_a_key_pair_names_the_store_and_the_fix(s3_server, s3_bucket, transport,
                                                      monkeypatch, tmp_path):
    """A key without its secret raised obstore's bare ``GenericError`` ("Missing
    SecretAccessKey", then its Rust debug dump, naming no store) where s3fs names both."""
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    options = {"endpoint_url": s3_server, "skip_instance_cache": True, "transport": transport,
               "key": "only-the-key"}
    url = f"s3://{s3_bucket}/half-a-pair-{transport}"
    with pytest.raises(zstore.NoCredentialsError, match="key= and secret=") as info:
        zstore.open(url, options, mode="r")
    assert url in str(info.value) and "Debug" not in str(info.value)


@pytest.mark.parametrize("transport", BOTH)
def test_an_endpoint_given_in_the_environment_is_used_as_given(s3_options, s3_bucket, transport,
                                                               monkeypatch):
    """``AWS_ENDPOINT_URL=http://...`` (a local MinIO or moto) worked through s3fs; obstore
    read it too but refused plain HTTP ("HTTP error: builder error")."""
    options = {k: v for k, v in s3_options.items() if k != "endpoint_url"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_options["endpoint_url"])
    url = f"s3://{s3_bucket}/endpoint-env-{transport}-{uuid.uuid4().hex[:8]}"
    writer = zstore.LazyMemmapStorage(10, scratch_dir=url,
                                      storage_options={**options, "transport": transport})
    writer.set(torch.arange(3), TensorDict(x=torch.arange(3), batch_size=[3]))
    writer.close()
    assert zstore.open(url, {**options, "transport": transport}, mode="r")[:]["x"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("transport", BOTH)
def test_the_callers_nested_options_are_left_alone(s3_options, s3_bucket, transport):
    """botocore changed a ``config_kwargs["retries"]`` dict it was given in place."""
    options = {**s3_options, "transport": transport,
               "config_kwargs": {"retries": {"total_max_attempts": 3}}}
    before = copy.deepcopy(options)
    url = f"s3://{s3_bucket}/options-{uuid.uuid4().hex[:8]}"
    writer = zstore.LazyMemmapStorage(10, scratch_dir=url, storage_options=options)
    writer.set(torch.arange(3), TensorDict(x=torch.arange(3), batch_size=[3]))
    writer.flush()
    assert len(zstore.open(url, options, mode="r")) == 3
    writer.close()
    assert options == before
