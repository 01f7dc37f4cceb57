"""A checkpoint destination: generations, the commit record, carry-over copies.

A destination URL holds generation sub-groups (``gen-<time>-<id>/``) and one
commit record, the destination's own ``zarr.json`` (a Zarr group whose
``zstore_checkpoint`` attribute names the current generation). A dump writes a
new generation, then rewrites the commit record (one object: ``os.replace`` on
local disk, one PUT on object stores), then deletes the other generations. A
crash before the commit leaves the previous generation current; readers trust
only the commit record.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zstore.credentials import store_errors_named
from zstore.errors import StoreNotFoundError, ZStoreError
from zstore.progress import progress
from zstore.group import CHECKPOINT_ATTR, refuse_inside_a_dataset
from zstore.store import StoreSpec

COMMIT_FILE = "zarr.json"
GEN_PREFIX = "gen-"
TRASH = ".trash-"
FORMAT_VERSION = 1

#: Test hook: called with a point name ("write", "copy", "commit", "committed") during dumps.
_FAULT: Callable[[str], None] | None = None


_DELETER: ThreadPoolExecutor | None = None


def _background_delete(path: str) -> None:
    """Delete a local directory tree on a background thread (joined at exit)."""
    global _DELETER
    if _DELETER is None:
        _DELETER = ThreadPoolExecutor(1, thread_name_prefix="zstore-ckpt-delete")
        atexit.register(_DELETER.shutdown, wait=True)
    _DELETER.submit(shutil.rmtree, path, ignore_errors=True)


def _forget_deleter() -> None:  # a forked child has no deletion thread: start afresh
    global _DELETER
    _DELETER = None


os.register_at_fork(after_in_child=_forget_deleter)


def settle() -> None:
    """Wait until background deletions of old generations are done."""
    if _DELETER is not None:
        _DELETER.submit(lambda: None).result()


def fault_point(name: str) -> None:
    """Give the fault-injection hook (tests only) a chance to act at ``name``."""
    if _FAULT is not None:
        _FAULT(name)


class CheckpointError(ZStoreError, RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the storage; names the URL."""


def as_spec(path: Any, storage_options: Mapping[str, Any] | None = None) -> StoreSpec:
    """A checkpoint location as a :class:`StoreSpec` (a path, a URL, or a spec)."""
    if isinstance(path, StoreSpec):
        return path
    return StoreSpec.parse(path, storage_options)


def progress_bar(total: int, desc: str, enabled: bool):
    """A byte progress bar shown after 2 s, in a terminal or notebook, when ``enabled``."""
    return progress(total, desc, enabled=None if enabled else False, unit="B", unit_scale=True,
                    delay=2.0, leave=False)


def refuse_newer_generation(generation: StoreSpec, unknown: list[str]) -> None:
    """Refuse loading a generation whose metadata holds fields this zstore does not know
    (``unknown``): a newer zstore wrote it, and a load would read its rows without them."""
    if unknown:
        raise CheckpointError(f"{generation.redacted()} holds metadata this zstore does not know "
                              f"({', '.join(unknown)}): a newer zstore wrote it. Upgrade zstore "
                              "(pip install -U zstore) to load it; nothing was loaded")


class Destination:
    """Where checkpoints of one storage go (see the module docstring)."""

    def __init__(self, spec: StoreSpec):
        self.spec = spec
        self.fs, self.root = spec.filesystem()
        self.url = spec.url

    # -- paths ----------------------------------------------------------------------------
    def child(self, name: str) -> StoreSpec:
        """The spec of ``name`` below the destination."""
        return StoreSpec(f"{self.url}/{name}", dict(self.spec.storage_options))

    def path_of(self, name: str) -> str:
        """The filesystem path of ``name`` below the destination (for ``self.fs``)."""
        return f"{self.root.rstrip('/')}/{name}"

    def redacted(self) -> str:
        """The URL (and options without credentials) for messages."""
        return self.spec.redacted()

    # -- the commit record ----------------------------------------------------------------
    def read_json(self, name: str) -> Any:
        """A JSON object below the destination, or None when absent."""
        self.fs.invalidate_cache()
        try:
            with store_errors_named(self.redacted()):
                raw = self.fs.cat_file(self.path_of(name))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"{self.redacted()}: {name} is not JSON ({exc})") from None

    def read_commit(self) -> dict[str, Any] | None:
        """The committed record, or None when no checkpoint was ever committed here."""
        data = self.read_json(COMMIT_FILE)
        if not isinstance(data, Mapping):
            return None
        attributes = data.get("attributes")
        record = attributes.get(CHECKPOINT_ATTR) if isinstance(attributes, Mapping) else None
        if record is None:
            return None
        if not isinstance(record, Mapping):
            raise CheckpointError(f"{self.redacted()}: the commit record ({COMMIT_FILE}) is "
                                  f"malformed: {CHECKPOINT_ATTR} is not an object")
        version = record.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CheckpointError(f"{self.redacted()}: the commit record ({COMMIT_FILE}) has no "
                                  f"valid format_version (got {version!r})")
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{self.redacted()}: checkpoint format {version} is not readable "
                                  f"by this zstore (reads up to {FORMAT_VERSION}): upgrade zstore "
                                  "(pip install -U zstore)")
        return dict(record)

    def uncommitted_error(self) -> CheckpointError:
        """The error for a load from a destination without a commit record: one whose first
        dump was interrupted (generations, no record), or one holding no checkpoint."""
        if any(name.startswith(GEN_PREFIX) for name in self.children()):
            return CheckpointError(f"{self.redacted()} holds an incomplete checkpoint: a dump "
                                   "was interrupted before its commit, and none was committed "
                                   "before")
        try:
            self.spec.check_parent()
        except StoreNotFoundError:  # the bucket itself is missing: say so
            return CheckpointError(f"no checkpoint at {self.redacted()}: its bucket does not "
                                   "exist")
        return CheckpointError(f"no checkpoint at {self.redacted()}")

    def holds_buffer(self) -> bool:
        """Whether the destination is a plain zstore buffer (a ``zstore`` block, no commit record)."""
        data = self.read_json(COMMIT_FILE)
        return isinstance(data, Mapping) and "zstore" in (data.get("attributes") or {})

    def write_json(self, name: str, payload: Any) -> None:
        """Write one JSON object atomically (temporary + rename locally, one PUT elsewhere)."""
        raw = json.dumps(payload).encode()
        if self.spec.is_local:
            target = Path(self.path_of(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.partial")
            tmp.write_bytes(raw)
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(self.path_of(name), raw)

    def commit(self, record: Mapping[str, Any]) -> None:
        """Make ``record`` (naming the new generation) the current checkpoint."""
        fault_point("commit")
        body = {"zarr_format": 3, "node_type": "group",
                "attributes": {CHECKPOINT_ATTR: {"format_version": FORMAT_VERSION, **record}}}
        self.write_json(COMMIT_FILE, body)
        fault_point("committed")

    # -- generations ----------------------------------------------------------------------
    @staticmethod
    def new_generation() -> str:
        """A fresh, unique generation name (sortable by time)."""
        return f"{GEN_PREFIX}{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"

    def children(self) -> list[str]:
        """Names directly below the destination ([] when it does not exist)."""
        self.fs.invalidate_cache()
        try:
            with store_errors_named(self.redacted()):
                entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def check_writable(self, allowed: tuple[str, ...] = ()) -> None:
        """Refuse a destination holding anything but zstore checkpoint generations
        (and names starting with one of ``allowed``)."""
        self.spec.require_writable("write a checkpoint")
        self.spec.check_parent()
        refuse_inside_a_dataset(self.spec, "write a checkpoint")
        if self.holds_buffer():
            raise CheckpointError(f"{self.redacted()} holds a zstore buffer, not a checkpoint; "
                                  "choose another destination")
        if self.spec.is_local and Path(self.url).is_file():
            raise CheckpointError(f"{self.redacted()} is a file; a checkpoint is a directory")
        foreign = [name for name in self.children()
                   if name != COMMIT_FILE and not name.startswith((GEN_PREFIX, ".", *allowed))]
        if foreign:
            raise CheckpointError(
                f"{self.redacted()} holds other files ({sorted(foreign)[:5]}); zstore writes "
                "checkpoints only to empty locations or over its own checkpoints")

    def remove_others(self, keep: str) -> None:
        """Delete every generation but ``keep`` (the old one, and leftovers of crashed dumps).

        Locally a generation is first renamed to ``.trash-<name>`` (one rename) and
        deleted by a background thread (finished at interpreter exit; a leftover is
        deleted by the next dump); readers never look at dot-names.
        """
        for name in self.children():
            if name.startswith(TRASH) or (name.startswith(GEN_PREFIX) and name != keep):
                self.remove(name)

    def remove(self, name: str) -> None:
        """Delete ``name`` below the destination, recursively."""
        path = self.path_of(name)
        if self.spec.is_local:
            trash = path if name.startswith(TRASH) else self.path_of(f"{TRASH}{name}")
            if trash != path:
                try:
                    os.rename(path, trash)
                except OSError:
                    trash = path
            _background_delete(trash)
        else:
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

    # -- carry-over -----------------------------------------------------------------------
    def copy_objects(self, pairs: Iterable[tuple[str, str]], link: bool = True) -> int:
        """Copy objects ``src -> dst`` (paths below the destination) without moving bytes
        through this process where the store allows it: hard links on local disk (copy
        fallback; always a copy with ``link=False``, for an object rewritten later),
        server-side copies on object stores. Missing sources (chunks never stored, i.e.
        all zero) are skipped. Returns the number of objects copied."""
        pairs = list(pairs)
        if not pairs:
            return 0

        if self.spec.is_local:
            return self._link_local(pairs, link)

        def one(pair: tuple[str, str]) -> int:
            fault_point("copy")
            try:
                # (copy would expand glob characters, which a key's path may hold)
                self.fs.cp_file(self.path_of(pair[0]), self.path_of(pair[1]))
            except FileNotFoundError:
                return 0
            return 1

        if self.spec.is_memory:
            return sum(map(one, pairs))
        if getattr(self.fs, "async_impl", False):  # one event loop, many copies in flight
            return self._copy_async(pairs)
        with ThreadPoolExecutor(16) as pool:
            return sum(pool.map(one, pairs))

    def _link_local(self, pairs: list[tuple[str, str]], link: bool) -> int:
        """Local :meth:`copy_objects`: the directories made once each, then a hard link (or
        a copy) per object; a missing source is skipped. (Serial: links on several threads
        contend on the filesystem's journal and were slower.)"""
        root = self.path_of("")
        paths = [(root + src, root + dst) for src, dst in pairs]
        for parent in {dst.rpartition("/")[0] for _, dst in paths}:
            os.makedirs(parent, exist_ok=True)
        copied = 0
        for src, dst in paths:
            fault_point("copy")
            try:
                if link:
                    os.link(src, dst)
                else:
                    shutil.copyfile(src, dst)
            except FileNotFoundError:
                continue
            except OSError:  # no hard links here (another filesystem, a limit): copy
                shutil.copyfile(src, dst)
            copied += 1
        return copied

    def _copy_async(self, pairs: list[tuple[str, str]]) -> int:
        from fsspec.asyn import _run_coros_in_chunks, sync

        for _ in pairs:
            fault_point("copy")
        coros = [self.fs._cp_file(self.path_of(src), self.path_of(dst)) for src, dst in pairs]
        results = sync(self.fs.loop, _run_coros_in_chunks, coros, batch_size=64,
                       return_exceptions=True)
        copied = 0
        for (src, _), result in zip(pairs, results):
            if isinstance(result, FileNotFoundError):
                continue
            if isinstance(result, BaseException):
                raise OSError(f"cannot copy {src} within {self.redacted()}: {result}") from result
            copied += 1
        return copied
