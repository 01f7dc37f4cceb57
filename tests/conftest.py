"""Shared fixtures: one storage test suite runs on memory://, a local directory and S3.

S3 is moto's real HTTP server on 127.0.0.1 (port 0), started once per session;
it enforces conditional writes like AWS. Nothing leaves the loopback interface.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
import uuid

import pytest

_counter = itertools.count()


@pytest.fixture(autouse=True)
def _tempfiles_under_pytest(tmp_path_factory, monkeypatch):
    """``tempfile`` (and child processes, through TMPDIR) writes below pytest's own
    temporary directory, which pytest prunes: the README's and the docs' examples use
    ``tempfile.mkdtemp()``, and must not leave buffers in /tmp on every run."""
    where = str(tmp_path_factory.mktemp("tempfile"))
    monkeypatch.setattr(tempfile, "tempdir", where)
    monkeypatch.setenv("TMPDIR", where)


def _loopback(kind: str, *args):
    """Start a :mod:`zstore.testing.s3` server, or skip when its package is missing."""
    from zstore.testing import s3

    try:
        return s3.MotoS3(*args) if kind == "moto" else s3.RcloneS3(*args)
    except s3.MissingPackage as exc:
        pytest.skip(str(exc))


@contextlib.contextmanager
def _committed_before_stopping(server):
    """``server``, whose storages left open by tests are committed before it stops (else the
    background commit, then the one at exit, fail on a closed port and say so)."""
    from zstore import autocommit

    with server:
        yield server
        autocommit.commit_pending()


def run_bound_by_file_modes(*argv: str) -> "subprocess.CompletedProcess":
    """``python ARGV`` in a process that file modes bind: as root, one without the
    capabilities that override them (root ignores modes otherwise); skips without setpriv."""
    import shutil
    import subprocess
    import sys

    command = [sys.executable, *argv]
    if os.getuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file modes cannot be enforced")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner",
                   *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on loopback (:class:`zstore.testing.s3.MotoS3`): yields its endpoint URL."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with _committed_before_stopping(_loopback("moto")) as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def rclone_s3(tmp_path_factory):
    """A second S3 implementation: ``rclone serve s3`` (Go, disk-backed) on loopback.

    Yields ``storage_options`` with the bucket ``zstore-rclone`` created
    (:class:`zstore.testing.s3.RcloneS3`, which limits botocore's response-checksum
    validation to the operations that require it, as rclone's ranged GETs need).
    """
    root = tmp_path_factory.mktemp("rclone-s3")
    with _committed_before_stopping(_loopback("rclone", root)) as server:
        server.filesystem().mkdir("zstore-rclone")
        yield server.storage_options


@pytest.fixture(scope="session")
def s3_options(s3_server):
    """``storage_options`` for s3fs talking to the loopback server."""
    return {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}


@pytest.fixture(scope="session")
def s3_bucket(s3_options):
    """A fresh bucket on the loopback server."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    name = f"zstore-test-{uuid.uuid4().hex[:8]}"
    fs.mkdir(name)
    return name


class Location:
    """A place to create a buffer: URL + storage options, unique per call of :meth:`new`."""

    def __init__(self, kind: str, base: str, options: dict):
        self.kind = kind
        self.base = base
        self.options = options

    def new(self, name: str = "rb") -> str:
        """A URL no buffer uses yet."""
        return f"{self.base}/{name}-{next(_counter)}-{uuid.uuid4().hex[:6]}"

    def memmap(self, capacity: int, **kwargs):
        """A ``zstore.LazyMemmapStorage`` here: at a new URL unless ``scratch_dir`` is given,
        with this location's storage options (its URL is then ``storage.scratch_dir``)."""
        import zstore

        kwargs.setdefault("scratch_dir", self.new())
        return zstore.LazyMemmapStorage(capacity, storage_options=self.options, **kwargs)

    def compressed(self, capacity: int, **kwargs):
        """A ``zstore.CompressedListStorage`` here, as :meth:`memmap` builds its storage."""
        import zstore

        kwargs.setdefault("scratch_dir", self.new())
        return zstore.CompressedListStorage(capacity, storage_options=self.options, **kwargs)

    def __repr__(self) -> str:
        return f"Location({self.kind})"


def denying_bucket(s3_options: dict, action: str = "s3:GetObject", objects: str = "*") -> str:
    """A new bucket holding ``rb/zarr.json`` whose policy refuses ``action`` on ``objects``."""
    import boto3
    import s3fs

    bucket = f"zstore-denied-{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/rb/zarr.json", b"{}")
    client = boto3.client("s3", endpoint_url=s3_options["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": action,
        "Resource": f"arn:aws:s3:::{bucket}/{objects}"}]}))
    return bucket


@pytest.fixture
def s3fs_transport(monkeypatch):
    """Pin the S3 transport to s3fs, whatever ``ZSTORE_S3_CLIENT`` says, for a test about s3fs
    itself: its wording, a fault injected into it."""
    monkeypatch.setenv("ZSTORE_S3_CLIENT", "fsspec")


#: The fixtures that talk to an S3 server on loopback.
_S3_FIXTURES = frozenset({"s3_server", "s3_options", "s3_bucket", "rclone_s3"})


def pytest_collection_modifyitems(items):
    """Mark ``s3`` every test that talks to an S3 server (``make test-obstore`` reruns them
    through the obstore transport): those using an S3 fixture, and those parametrised with
    an S3 place (``location="s3"``, ``kind="s3"``, ``"s3-rclone"``)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if _S3_FIXTURES & set(getattr(item, "fixturenames", ())) or \
                any(isinstance(value, str) and value.startswith("s3") for value in params.values()):
            item.add_marker(pytest.mark.s3)


#: Where every storage test runs; tests marked ``all_s3_servers`` also run on rclone's S3.
LOCATIONS = ["memory", "local", "s3"]


def pytest_generate_tests(metafunc):
    """Parametrise ``location``: memory / local / moto S3, plus rclone S3 when marked."""
    explicit = any("location" in str(marker.args[0]) for marker in
                   metafunc.definition.iter_markers("parametrize") if marker.args)
    if "location" in metafunc.fixturenames and not explicit:  # else the test chose its own
        kinds = LOCATIONS + (["s3-rclone"] if metafunc.definition.get_closest_marker(
            "all_s3_servers") else [])
        metafunc.parametrize("location", kinds, indirect=True)


@pytest.fixture
def location(request, tmp_path) -> Location:
    """Every storage test runs on memory://, a local directory and S3 on loopback (a test
    parametrised with ``None`` for some cases, an in-RAM storage's, gets ``None``)."""
    if request.param is None:
        return None
    if request.param == "s3-rclone":
        options = request.getfixturevalue("rclone_s3")
        return Location("s3", f"s3://zstore-rclone/{uuid.uuid4().hex[:8]}", options)
    if request.param == "memory":
        return Location("memory", f"memory://zstore-tests/{uuid.uuid4().hex[:8]}", {})
    if request.param == "local":
        return Location("local", str(tmp_path), {})
    bucket = request.getfixturevalue("s3_bucket")
    options = request.getfixturevalue("s3_options")
    return Location("s3", f"s3://{bucket}/{uuid.uuid4().hex[:8]}", options)
