"""Shared fixtures: one storage test suite runs on memory://, a local directory and S3.

S3 is moto's real HTTP server on 127.0.0.1 (port 0), started once per session;
it enforces conditional writes like AWS. Nothing leaves the loopback interface.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid

import pytest

_counter = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on loopback: yields its endpoint URL."""
    moto_server = pytest.importorskip("moto.server")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


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

    def __repr__(self) -> str:
        return f"Location({self.kind})"


@pytest.fixture(params=["memory", "local", "s3"])
def location(request, tmp_path) -> Location:
    """Every storage test runs on memory://, a local directory and S3 on loopback."""
    if request.param == "memory":
        return Location("memory", f"memory://zstore-tests/{uuid.uuid4().hex[:8]}", {})
    if request.param == "local":
        return Location("local", str(tmp_path), {})
    bucket = request.getfixturevalue("s3_bucket")
    options = request.getfixturevalue("s3_options")
    return Location("s3", f"s3://{bucket}/{uuid.uuid4().hex[:8]}", options)
