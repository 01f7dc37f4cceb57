"""A fault-injecting HTTP proxy on 127.0.0.1, in front of the moto S3 server (stdlib only).

Point s3fs's ``endpoint_url`` at :attr:`FaultProxy.url` instead of the S3
server. Requests are forwarded unchanged until a :class:`Rule` matches one
(by method and a regular expression on the path, for its next ``count``
matches); the rule's fault then replaces or damages the exchange:

========================  ===================================================
``"slowdown"``            503 ``SlowDown`` (S3's throttling), not forwarded
``"error500"``            500 ``InternalError``, not forwarded
``"reset"``               the connection is reset (RST) before forwarding
``"reset_after"``         forwarded (the write happens), then reset: the
                          client never sees the answer
``"latency"``             forwarded after ``delay`` seconds
``"truncate"``            forwarded; the body is cut in half and the
                          connection closed (``Content-Length`` unchanged:
                          what a dropped connection looks like)
``"truncate_lying"``      forwarded; the body is cut in half and
                          ``Content-Length`` rewritten to match (a broken
                          middlebox: only a checksum or size check catches it)
========================  ===================================================

Every injected fault is counted in :attr:`FaultProxy.injected`, and every request logged
in :attr:`FaultProxy.log`: :func:`logged` gives a test its storage options through a
proxy and the requests seen (:class:`Requests`), whatever client sent them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("slowdown", "error500", "reset", "reset_after", "latency", "truncate", "truncate_lying")
_ERROR_BODY = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
               "<Message>injected by faultproxy</Message></Error>")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@dataclasses.dataclass
class Rule:
    """Inject ``fault`` into the next ``count`` requests whose method and path match."""

    fault: str
    path: str = ".*"
    method: str = ".*"
    count: int = 1
    delay: float = 0.0

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; choose one of {FAULTS}")
        self._path = re.compile(self.path)
        self._method = re.compile(self.method)

    def take(self, method: str, path: str) -> bool:
        """Whether this rule fires for the request (and use up one of its count)."""
        if self.count > 0 and self._method.fullmatch(method) and self._path.search(path):
            self.count -= 1
            return True
        return False


class FaultProxy:
    """A threaded HTTP proxy to ``upstream`` (``http://host:port``) that injects faults.

    >>> with FaultProxy(s3_endpoint) as proxy:  # doctest: +SKIP
    ...     proxy.add(Rule("slowdown", path=r"/c/", method="PUT", count=3))
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://").rstrip("/")
        self.rules: list[Rule] = []
        self.injected: Counter = Counter()
        self.requests: Counter = Counter()
        #: (method, path without the query) of every request, in arrival order
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, *rules: Rule) -> None:
        """Arm more rules (checked in order; the first that fires wins)."""
        with self.lock:
            self.rules.extend(rules)

    def clear(self) -> None:
        """Disarm every rule."""
        with self.lock:
            self.rules.clear()

    def _pick(self, method: str, path: str) -> Rule | None:
        with self.lock:
            self.requests[method] += 1
            self.log.append((method, path.split("?", 1)[0]))
            for rule in self.rules:
                if rule.take(method, path):
                    self.injected[rule.fault] += 1
                    return rule
        return None

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends RST, as a dropped connection does
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _error(self, status: int, code: str) -> None:
        body = _ERROR_BODY.format(code=code).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(self.owner.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body if body else None, headers=headers)
            answer = upstream.getresponse()
            return answer.status, answer.getheaders(), answer.read()
        finally:
            upstream.close()

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        rule = self.owner._pick(self.command, self.path)
        fault = rule.fault if rule else None
        if fault == "slowdown":
            return self._error(503, "SlowDown")
        if fault == "error500":
            return self._error(500, "InternalError")
        if fault == "reset":
            return self._reset()
        if fault == "latency":
            time.sleep(rule.delay)
        status, headers, payload = self._forward(body)
        if fault == "reset_after":
            return self._reset()
        sent = payload
        if fault in ("truncate", "truncate_lying") and self.command != "HEAD" and len(payload) > 1:
            sent = payload[: len(payload) // 2]
        self.send_response(status)
        for name, value in headers:
            if name.lower() in _HOP_HEADERS or name.lower() == "content-length":
                continue
            self.send_header(name, value)
        claimed = len(sent) if fault == "truncate_lying" else len(payload)
        self.send_header("Content-Length", str(claimed))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(sent)
        if fault == "truncate":
            self.wfile.flush()
            self._reset()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle


class Requests:
    """Storage options through a proxy in front of the location's server, and what it saw:
    every request of every transport (s3fs, obstore), not one client's calls."""

    def __init__(self, proxy: FaultProxy, options: dict, bucket: str):
        self.proxy, self.options, self._bucket = proxy, options, bucket

    def clear(self) -> None:
        """Forget the requests so far."""
        self.proxy.log.clear()

    def seen(self) -> list[tuple[str, str]]:
        """(method, object key) of each request since :meth:`clear`."""
        prefix = f"/{self._bucket}/"
        return [(method, path.removeprefix(prefix)) for method, path in list(self.proxy.log)]

    def gets(self) -> list[str]:
        """The object key of each GET since :meth:`clear`."""
        return [key for method, key in self.seen() if method == "GET"]


@contextlib.contextmanager
def logged(options: dict, bucket: str) -> Iterator[Requests]:
    """:class:`Requests` of a proxy in front of ``options``' endpoint, for ``bucket``."""
    with FaultProxy(options["endpoint_url"]) as proxy:
        yield Requests(proxy, {**options, "endpoint_url": proxy.url}, bucket)
