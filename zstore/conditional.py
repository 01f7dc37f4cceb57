"""Compare-and-swap writes of small objects in a store, one backend per kind of store.

:func:`objects_for` picks the implementation from the store's capabilities
(:class:`~zstore.store.StoreSpec`'s ``is_local``, ``is_memory`` and
``atomic_conditional_writes``):

* S3: ``If-None-Match: *`` on create, ``If-Match: <etag>`` on replace and delete
  (AWS S3 since 2024, MinIO, moto), once a probe has shown that the server enforces
  them; on one that ignores them (``rclone serve s3``), check-then-write, with a warning.
* Local directories: every check-and-write holds an exclusive ``flock`` on the
  store directory, and objects are replaced by ``os.replace`` (atomic for
  readers). Safe between processes of one machine, not across NFS clients.
* ``memory://``: a process-wide lock.
* Anything else (GCS, Azure, HTTP ...): plain reads and writes, with no atomicity
  (``atomic`` is ``False``).

The write lease (:mod:`zstore.lease`) and the conditional commit of ``zarr.json``
are built on these.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

from .credentials import body_cut_short, request_error, store_errors_named
from .errors import folder_not_writable
from .retry import with_retries
from .store import StoreSpec

#: Name prefix of the scratch objects of :meth:`S3Objects.atomic`'s probe (one left by a
#: process killed between its requests does not make the location look taken).
PROBE_PREFIX = "zstore-cas-probe-"

Token = Any  # what identifies one version of an object: an ETag, or the bytes themselves


class ConditionalObjects:
    """Small objects under one store location, written with compare-and-swap.

    ``read`` returns ``(data, token)`` or ``None``; ``create`` returns the new
    token or ``None`` when the object exists; ``replace`` and ``delete`` act only
    if the object is still at ``token`` (``None`` / ``False`` otherwise). This
    base class has no atomicity: a check and the write that follows are two
    requests (``atomic`` is ``False``).
    """

    atomic = False

    def __init__(self, spec: StoreSpec):
        self.spec = spec

    def _path(self, name: str) -> tuple[Any, str]:
        fs, root = self.spec.filesystem()
        return fs, f"{root.rstrip('/')}/{name}"

    def read(self, name: str) -> tuple[bytes, Token] | None:
        """The object's bytes and token, ``None`` when missing."""
        fs, path = self._path(name)
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, data

    def create(self, name: str, data: bytes) -> Token | None:
        """Store a new object; ``None`` if one exists."""
        with self._locked():
            if self._read_unlocked(name) is not None:
                return None
            return self._write(name, data)

    def replace(self, name: str, data: bytes, token: Token) -> Token | None:
        """Overwrite the object if it is still at ``token``."""
        with self._locked():
            found = self._read_unlocked(name)
            if found is None or found[1] != token:
                return None
            return self._write(name, data)

    def delete(self, name: str, token: Token) -> bool:
        """Remove the object if it is still at ``token``."""
        with self._locked():
            found = self._read_unlocked(name)
            if found is None or found[1] != token:
                return False
            fs, path = self._path(name)
            fs.rm_file(path)
        return True

    # what subclasses with a lock override
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        yield

    def _read_unlocked(self, name: str) -> tuple[bytes, Token] | None:
        return self.read(name)

    def _write(self, name: str, data: bytes) -> Token:
        """Store ``data`` unconditionally; the new version's token."""
        fs, path = self._path(name)
        fs.pipe_file(path, data)
        return data


_MEMORY_LOCK = threading.RLock()


class MemoryObjects(ConditionalObjects):
    """``memory://``: one process, one lock."""

    atomic = True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with _MEMORY_LOCK:
            yield


class LocalObjects(ConditionalObjects):
    """A local directory: ``flock`` on the directory around each check-and-write."""

    atomic = True

    def read(self, name: str) -> tuple[bytes, Token] | None:
        try:
            with open(os.path.join(self.spec.url, name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, data

    def create(self, name: str, data: bytes) -> Token | None:
        self.spec.refuse_a_file(reading=False)  # the OS: "File exists" (the lease's folder)
        os.makedirs(self.spec.url, exist_ok=True)  # the lease comes before the group
        return super().create(name, data)

    def replace(self, name: str, data: bytes, token: Token) -> Token | None:
        try:
            return super().replace(name, data, token)
        except FileNotFoundError:  # the directory is gone (cleaned up)
            return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl

        fd = os.open(self.spec.url, os.O_RDONLY)  # never re-creates a deleted store
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _write(self, name: str, data: bytes) -> Token:
        path = os.path.join(self.spec.url, name)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except PermissionError as exc:
            raise folder_not_writable(self.spec.url, tmp) from exc
        os.replace(tmp, path)
        return data

    def delete(self, name: str, token: Token) -> bool:
        try:
            with self._locked():
                found = self.read(name)
                if found is None or found[1] != token:
                    return False
                os.remove(os.path.join(self.spec.url, name))
        except FileNotFoundError:
            return False
        return True


class S3Objects(ConditionalObjects):
    """S3: conditional requests (``If-None-Match`` / ``If-Match`` on the ETag).

    Not every S3 server enforces them: ``rclone serve s3`` and some gateways accept
    the headers and ignore them. The first conditional write to a server therefore
    checks that it refuses a second exclusive create of a scratch object (three small
    requests, once per endpoint and process). A server that does not is used with
    check-then-write, as any store without conditional writes (``atomic`` is then
    ``False``), with a warning naming it.
    """

    def _call(self, method: str, name: str, **kwargs) -> Any:
        from fsspec.asyn import sync

        fs, path = self._path(name)
        bucket, key, _ = fs.split_path(path)

        async def run():
            out = await fs._call_s3(method, Bucket=bucket, Key=key, **kwargs)
            if method == "get_object":
                async with out["Body"] as body:
                    out["Data"] = await body.read()
            return out

        with store_errors_named(self.spec.redacted()):
            result = sync(fs.loop, run)
        fs.invalidate_cache(path)
        return result

    @property
    def atomic(self) -> bool:
        """Whether this server enforces conditional writes (probed on first use)."""
        endpoint = self._endpoint()
        with _PROBE_LOCK:
            enforced = _ENFORCES_CONDITIONS.get(endpoint)
            if enforced is None:
                enforced = _ENFORCES_CONDITIONS[endpoint] = self._probe()
        return enforced

    def _endpoint(self) -> str:
        options = self.spec.storage_options
        return str(options.get("endpoint_url") or options.get("client_kwargs", {}).get("endpoint_url")
                   or "aws")

    def _probe(self) -> bool:
        name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            if self._create(name, b"probe") is None:
                return True  # a fresh name cannot exist: treat as enforced, nothing to learn
            enforced = self._create(name, b"probe") is None
        finally:
            with contextlib.suppress(Exception):
                fs, path = self._path(name)
                fs.rm_file(path)
        if not enforced:
            warnings.warn(
                f"the S3 server of {self.spec.redacted()} ignores conditional writes "
                "(If-None-Match / If-Match): zstore's write lease falls back to check-then-write "
                "there, which cannot stop two writers that start within one round trip of each "
                "other (docs/scaling.md §3). Use a server that enforces them (AWS S3, MinIO) "
                "for several writers.", RuntimeWarning, stacklevel=4)
        return enforced

    def read(self, name: str) -> tuple[bytes, Token] | None:
        """The object's bytes and ETag; a body cut short (a connection dropped in it, or a
        server such as rclone rewriting the object in place) is fetched again, and after
        the last attempt raises ``ConnectionError`` naming the store."""
        try:  # (s3fs's retries end before the body is read)
            out = with_retries(lambda: self._call("get_object", name), body_cut_short)
        except FileNotFoundError:
            return None
        except Exception as exc:
            if not body_cut_short(exc):
                raise
            where = self.spec.redacted()
            raise request_error(exc, where, f"cannot read {name} of {where}",
                                "check the connection to the server and try again") from exc
        return out["Data"], out["ETag"]

    def _write(self, name: str, data: bytes) -> Token:
        return self._call("put_object", name, Body=data)["ETag"]

    def _create(self, name: str, data: bytes) -> Token | None:
        try:
            return self._call("put_object", name, Body=data, IfNoneMatch="*")["ETag"]
        except OSError as exc:
            if isinstance(exc, FileExistsError) or _precondition_failed(exc):
                return None
            raise

    def create(self, name: str, data: bytes) -> Token | None:
        if not self.atomic:
            return super().create(name, data)
        token = self._create(name, data)
        return token if token is not None else self._landed(name, data)

    def replace(self, name: str, data: bytes, token: Token) -> Token | None:
        if not self.atomic:
            return super().replace(name, data, token)
        try:
            return self._call("put_object", name, Body=data, IfMatch=token)["ETag"]
        except OSError as exc:
            if _precondition_failed(exc) or isinstance(exc, FileNotFoundError):
                return self._landed(name, data)
            raise

    def _landed(self, name: str, data: bytes) -> Token | None:
        """After a refused conditional write of ``data``: the object's token if it holds
        exactly ``data``, else None. A write whose reply was lost (a reset after the server
        stored it) is retried by the client, and the retry is refused by the condition the
        first attempt changed: this write landed. (Every lease record and commit names
        its writer, so another writer's object is never equal.)"""
        found = self.read(name)
        return found[1] if found is not None and found[0] == data else None

    def delete(self, name: str, token: Token) -> bool:
        if not self.atomic:
            return super().delete(name, token)
        try:
            self._call("delete_object", name, IfMatch=token)
        except OSError as exc:
            if _precondition_failed(exc) or isinstance(exc, FileNotFoundError):
                return False
            raise
        return True


#: Per S3 endpoint: whether it enforces conditional writes (:meth:`S3Objects.atomic`).
_ENFORCES_CONDITIONS: dict[str, bool] = {}
_PROBE_LOCK = threading.Lock()


def _precondition_failed(exc: BaseException) -> bool:
    """Whether an s3fs error is a failed precondition (412) or a conditional conflict (409)."""
    response = getattr(exc.__cause__, "response", None) or {}
    code = response.get("Error", {}).get("Code")
    return code in ("PreconditionFailed", "ConditionalRequestConflict")


def objects_for(spec: StoreSpec) -> ConditionalObjects:
    """The compare-and-swap implementation for ``spec``'s store."""
    if spec.is_local:
        return LocalObjects(spec)
    if spec.is_memory:
        return MemoryObjects(spec)
    if spec.atomic_conditional_writes:
        return S3Objects(spec)
    return ConditionalObjects(spec)
