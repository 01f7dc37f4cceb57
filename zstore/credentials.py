"""Errors about credentials and reaching a store, the same whichever client met them:
botocore's missing credentials become :class:`~zstore.errors.NoCredentialsError`, a server's
refusal of them a ``PermissionError``, and a server that cannot be reached a
``ConnectionError``; each names the store and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .errors import NoCredentialsError, ZStoreError


def no_credentials_error(where: str, detail: str = "") -> NoCredentialsError:
    """The error for a store at ``where`` that no credential source could serve."""
    return NoCredentialsError(
        f"no credentials to access {where}: pass storage_options key= and secret= (or "
        "anon=True for a public bucket), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        + (f" ({detail})" if detail else ""))


#: What to check when an S3 server refuses a request's credentials.
CHECK_CREDENTIALS = ("check storage_options key= and secret= (or AWS_ACCESS_KEY_ID and "
                     "AWS_SECRET_ACCESS_KEY) and the bucket's policy")


def credentials_error(exc: BaseException, where: str) -> PermissionError | None:
    """zstore's error for ``exc``, raised reaching the store at ``where``, when it is about
    credentials: :class:`NoCredentialsError` when botocore found none (``exc`` or an error it
    comes from), a ``PermissionError`` naming the store and what to check when the server
    refused them; ``None`` for any other error and for zstore's own."""
    if isinstance(exc, ZStoreError):
        return None
    error: BaseException | None = exc
    while error is not None:
        if type(error).__module__.startswith("botocore") and type(error).__name__ in (
                "NoCredentialsError", "PartialCredentialsError"):
            return no_credentials_error(where, str(error))
        error = error.__cause__ or error.__context__
    if isinstance(exc, PermissionError):
        if exc.filename:  # the operating system's, about a local file: not credentials
            return None
        why = str(exc).removeprefix(f"{where}: ").rstrip(".: ")
        return PermissionError(f"{where}: {why}; {CHECK_CREDENTIALS}")
    return None


#: What to check when a store's server cannot be reached.
CHECK_ENDPOINT = ("check the server's address (for S3, storage_options endpoint_url or "
                  "AWS_ENDPOINT_URL; else the host and port in the URL), that the server is "
                  "running, and that this machine can reach it")

#: Errors of clients that never reached the server: ``(module prefix, class name)``.
_UNREACHABLE = {("botocore", "EndpointConnectionError"), ("botocore", "ConnectTimeoutError"),
                ("aiohttp", "ClientConnectorError"), ("builtins", "ConnectionRefusedError")}
#: Errors of a TLS handshake that failed (an https:// endpoint on a plain HTTP server).
_TLS_FAILED = {("botocore", "SSLError"), ("ssl", "SSLError"), ("ssl", "SSLCertVerificationError"),
               ("aiohttp", "ClientConnectorSSLError"), ("aiohttp", "ClientSSLError"),
               ("aiohttp", "ClientConnectorCertificateError")}


#: Errors of a response body damaged in transfer (a flipped byte botocore's checksum caught):
#: fetched again, as a payload that fails to decode is.
_DAMAGED = {("botocore", "FlexibleChecksumError"), ("botocore", "ChecksumError")}
#: Where the errors of a request that failed come from (the HTTP clients).
_CLIENTS = {"aiohttp", "botocore", "aiobotocore", "obstore", "urllib3", "http"}


def damaged_in_transfer(exc: BaseException) -> bool:
    """Whether ``exc`` says a response body arrived damaged (not the object stored)."""
    return (type(exc).__module__.split(".")[0], type(exc).__name__) in _DAMAGED


def body_cut_short(exc: BaseException) -> bool:
    """Whether ``exc`` says a response body ended before its ``Content-Length`` (a dropped
    connection; a server rewriting the object in place): aiohttp's ``ClientPayloadError``."""
    return (type(exc).__module__.split(".")[0], type(exc).__name__) == ("aiohttp",
                                                                       "ClientPayloadError")


def failed_request(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a remote read, is its request's failure (a server error
    after the client's retries, a connection cut mid-body), not bad data: an ``OSError``
    with an errno (s3fs's wording of a 5xx; a codec's ``OSError``, gzip's or bz2's, has
    none) or an error of an HTTP client."""
    return ((isinstance(exc, OSError) and exc.errno is not None)
            or type(exc).__module__.split(".")[0] in _CLIENTS)


def request_error(exc: BaseException, where: str, doing: str, then: str, *,
                  remote: bool = True, refetched: bool = False) -> Exception | None:
    """zstore's error for ``exc``, raised by a request to the store at ``where`` while
    ``doing`` (named first in the message): :func:`credentials_error` or
    :func:`unreachable_error`; else, for a request that failed after the client's retries,
    a ``ConnectionError`` saying so, then ``then`` (what to do); ``None`` for any other
    error (zstore's own; a local file's, which names it). A failed request is a
    ``ConnectionError`` or ``TimeoutError``, or any error of a ``remote`` store's client;
    for a reader that fetches a damaged body again (``refetched``), only
    :func:`failed_request` of those (a damaged body and bad data: ``None``)."""
    if isinstance(exc, ZStoreError) or (refetched and damaged_in_transfer(exc)):
        return None
    error: Exception | None = named_store_error(exc, where)
    if error is None and (isinstance(exc, (ConnectionError, TimeoutError))
                          or (remote and (not refetched or failed_request(exc)))):
        error = ConnectionError(f"{doing}: the request failed after the client's retries "
                                f"({type(exc).__name__}: {exc}); {then}")
    if error is not None:
        error.__cause__ = exc
    return error


def unreachable_error(exc: BaseException, where: str) -> ConnectionError | None:
    """A ``ConnectionError`` naming the store at ``where`` and what to check when ``exc`` (or
    an error it comes from) says its server could not be reached; ``None`` otherwise."""
    chain, error = [], exc
    while error is not None and not isinstance(error, ZStoreError):
        chain.append(error)
        error = error.__cause__ or error.__context__
    kinds = [(type(error).__module__.split(".")[0], type(error).__name__) for error in chain]
    for error, kind in zip(chain, kinds):  # a failed handshake first: it is wrapped as unreachable
        if kind in _TLS_FAILED:
            return ConnectionError(
                f"{where}: the TLS handshake with its server failed ({type(error).__name__}: "
                f"{error}); an https:// endpoint_url naming a server that speaks plain HTTP "
                "fails so (write http://), as does a certificate this machine does not trust")
    for error, kind in zip(chain, kinds):
        if kind in _UNREACHABLE:
            return ConnectionError(f"{where}: its server cannot be reached "
                                   f"({type(error).__name__}: {error}); {CHECK_ENDPOINT}")
    return None


def named_store_error(exc: BaseException, where: str) -> Exception | None:
    """:func:`credentials_error` or :func:`unreachable_error` of ``exc`` (about the store at
    ``where``): ``None`` when it is neither."""
    return credentials_error(exc, where) or unreachable_error(exc, where)


@contextlib.contextmanager
def store_errors_named(where: str) -> Iterator[None]:
    """Raise :func:`named_store_error` (about the store at ``where``) in place of the errors
    of the block that it covers."""
    try:
        yield
    except Exception as exc:
        error = named_store_error(exc, where)
        if error is None:
            raise
        raise error from exc
