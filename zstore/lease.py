"""The single-writer lease of a store, and the conditional commit of its ``zarr.json``.

A writable persistent storage takes a **lease** before its first write: a small
JSON object ``zstore-lease.json`` next to the group's ``zarr.json``::

    {"version": 1, "owner": "host/pid/uuid", "host": ..., "pid": ..., "boot_id": ...,
     "pid_ns": ..., "acquired": <unix s>, "renewed": <unix s>, "ttl": <s>}

* It is created with an exclusive create, so of two writers only one wins; the
  other gets :class:`~zstore.errors.LeaseError` naming the URL and the holder.
* The holder renews it (a conditional replace) on every commit, and before a
  write once half the ttl has passed; it deletes it on ``close()``, ``cleanup()``
  and interpreter exit, and after garbage collection (on a background thread).
* A lease not renewed for ``ttl`` seconds (by the clock of whoever looks) is
  **stale**: the next writer takes it over automatically, with a warning. So
  is, at once, a lease whose holder was a process of the same machine (same
  host name and boot id) and pid namespace that no longer runs: a job restarted
  after a crash on the same machine does not wait for the ttl. A holder in
  another container of the machine (another pid namespace, whose pids mean
  other processes) is never judged gone: its lease is taken only once stale. The
  taker then rewrites ``zarr.json`` (naming itself), so a former holder that
  wakes up cannot commit any more: its conditional commit fails.
* Readers (``mode="r"``) never look at the lease.

Compare-and-swap per backend: :mod:`zstore.conditional`.

``clock`` (``time.time``) is module state so tests can drive staleness with
explicit timestamps.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
import uuid
import weakref
import warnings
from collections.abc import Callable
from typing import Any

from .conditional import Token, objects_for
from .credentials import request_error
from .errors import LeaseError
from .processes import boot_id, gone_here, here, pid_namespace
from .rebase import rebased
from .signals import shielded
from .store import StoreSpec, defer_memory_work, run_deferred

LEASE_NAME = "zstore-lease.json"
METADATA_NAME = "zarr.json"
WRITER_ATTR = "zstore_writer"
DEFAULT_TTL = 60.0

#: Wall-clock time in seconds (replaced by tests to drive lease expiry explicitly).
clock: Callable[[], float] = time.time


def _checked_ttl(ttl: float) -> float:
    if not (isinstance(ttl, (int, float)) and ttl > 0):
        raise ValueError(f"lease_ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


def _owner_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"


def _describe(holder: dict[str, Any], now: float) -> str:
    # (at least 0: ``now`` was read before the request that found a lease renewed meanwhile)
    age = max(0.0, now - float(holder.get("renewed", 0.0)))
    return (f"{holder.get('owner', '<unknown>')} (renewed {age:.1f} s ago, "
            f"ttl {float(holder.get('ttl', 0.0)):g} s)")


def _judge(data: bytes, now: float) -> tuple[dict[str, Any], float, bool]:
    """The holder a lease record names, the seconds left before it may be taken over (below
    0: stale), and whether it was a process of this machine that no longer runs."""
    try:
        holder = json.loads(data)
        left = float(holder["renewed"]) + float(holder["ttl"]) - now
    except (ValueError, KeyError, TypeError):
        holder, left = {"owner": "<unreadable lease>"}, float("-inf")
    dead = gone_here(holder.get("host"), holder.get("boot_id"), holder.get("pid"),
                     holder.get("pid_ns"))
    return holder, left, dead


def _held(spec: StoreSpec, holder: dict[str, Any], left: float, now: float) -> LeaseError:
    """The refusal of a write where the live ``holder`` holds the lease."""
    mine = holder.get("pid") == os.getpid() and here(holder.get("host"), holder.get("boot_id"),
                                                     holder.get("pid_ns"))
    return LeaseError(
        f"{spec.redacted()} is being written by {_describe(holder, now)}"
        + (", another storage of this process: write through that one, or close() it (one "
           "dropped unclosed commits at exit, or now: zstore.autocommit.commit_pending())"
           if mine else "")
        + ": one writer per store. Open it with mode='r' to read; a lease not renewed for its "
        "ttl is taken over automatically by the next writer (this one: in "
        f"{left:.1f} s, if its holder renews it no more).")


def refuse_while_held(spec: StoreSpec) -> None:
    """:class:`LeaseError` when a live writer (one of this process's storages included)
    holds the lease at ``spec``: what a creation asks before it takes over what a creation
    killed before its first commit left there. One read."""
    found = objects_for(spec).read(LEASE_NAME)
    if found is not None:
        now = clock()
        holder, left, dead = _judge(found[0], now)
        if left >= 0 and not dead:
            raise _held(spec, holder, left, now)


class Lease:
    """The write lease of one store, held by one owner (``host/pid/uuid``).

    Acquired lazily by :meth:`ensure` (before a write), renewed by
    :meth:`renew` (on commit), dropped by :meth:`release`. After a fork the
    child does not hold its parent's lease: it must acquire its own (and is
    refused while the parent lives), and its ``release`` leaves the parent's
    lease alone. Storages do not make their own: they share the process's
    lease of a store through :func:`writer_lease`.
    """

    def __init__(self, spec: StoreSpec, ttl: float = DEFAULT_TTL):
        self.spec = spec
        self.ttl = _checked_ttl(ttl)
        self.objects = objects_for(spec)
        self.owner = _owner_id()
        self._pid = os.getpid()
        self._token: Token | None = None
        self._renewed = self._acquired = 0.0
        self._lost = False  # a renewal found another holder: nothing more may be stored
        self._metadata_token: Token | None = None
        self._metadata_base: bytes | None = None  # the version of that token
        self._lock = threading.RLock()
        self.users = 0  # storages of this process using it (see WriterLease)
        self.turn = 0  # bumped each time another storage of this process writes (WriterLease)

    @property
    def held(self) -> bool:
        """Whether this process holds the lease (as far as it knows)."""
        return self._token is not None and self._pid == os.getpid()

    def _record(self, now: float, acquired: float) -> bytes:
        return json.dumps({"version": 1, "owner": self.owner, "host": socket.gethostname(),
                           "pid": os.getpid(), "boot_id": boot_id(), "pid_ns": pid_namespace(),
                           "acquired": acquired, "renewed": now, "ttl": self.ttl}).encode()

    def ensure(self) -> bool:
        """Hold the lease before writing: acquire it, or renew it once half its ttl is gone.

        Returns ``True`` when it was just acquired: the caller then reloads the
        committed state and rewrites ``zarr.json`` under its name (the fence).
        """
        with self._lock, shielded():
            if self._pid != os.getpid():  # a forked child: nothing of the parent's is ours
                self._pid = os.getpid()
                self._token = self._metadata_token = None
                self._lost = False
            if not self.held:
                self._refuse_if_lost()  # (re-taking it would drop what was written since)
                self._acquire()
                return True
            if clock() - self._renewed > self.ttl / 2:
                self.renew()
            return False

    def _acquire(self) -> None:
        self.owner = _owner_id()  # a new id per acquisition: its fence differs from any old commit
        now = clock()
        try:
            token = self.objects.create(LEASE_NAME, self._record(now, now))
        except FileNotFoundError:
            self.spec.check_parent()  # a missing bucket: StoreNotFoundError naming it
            raise
        if token is None:
            found = self.objects.read(LEASE_NAME)
            if found is None:  # released between our create and read: try once more
                token = self.objects.create(LEASE_NAME, self._record(now, now))
            else:
                token = self._take_over(found, now)
        if token is None:
            raise LeaseError(f"cannot take the write lease on {self.spec.redacted()}: another "
                             "writer took it at the same moment")
        self._token, self._renewed, self._acquired = token, now, now
        self._lost = False

    def _take_over(self, found: tuple[bytes, Token], now: float) -> Token | None:
        data, token = found
        holder, left, dead = _judge(data, now)
        if left >= 0 and not dead:
            raise _held(self.spec, holder, left, now)
        taken = self.objects.replace(LEASE_NAME, self._record(now, now), token)
        if taken is not None and dead:
            warnings.warn(f"took over the write lease on {self.spec.redacted()} from "
                          f"{_describe(holder, now)}: that process no longer runs on this "
                          "machine", stacklevel=4)
        elif taken is not None:
            warnings.warn(f"took over the stale write lease on {self.spec.redacted()} from "
                          f"{_describe(holder, now)}", stacklevel=4)
        return taken

    def keep_alive(self) -> None:
        """As a store starts: renew the lease once half its ttl is gone (a long write keeps
        it); :class:`LeaseError` if it was lost. A released lease is left alone."""
        self._refuse_if_lost()
        if self.held and clock() - self._renewed > self.ttl / 2:
            self.renew()

    def renewal_due_in(self) -> float:
        """Seconds until :meth:`keep_alive` renews the lease (half its ttl after the last
        renewal; 0 or less: now)."""
        return self._renewed + self.ttl / 2 - clock()

    def ensure_fresh(self) -> None:
        """:class:`LeaseError` if the lease was lost, or if this process holds it but has not
        renewed it for its ttl: another writer may have taken it meanwhile (this process
        was paused, or starved), so nothing more may be stored. Local: no request."""
        self._refuse_if_lost()
        age = clock() - self._renewed
        if self.held and age > self.ttl:
            raise LeaseError(
                f"the write lease on {self.spec.redacted()} was last renewed {age:.1f} s ago, "
                f"past its ttl of {self.ttl:g} s: another writer may hold it now, so this writer "
                "stores nothing more. Reopen the store to continue from what is committed.")

    def _refuse_if_lost(self) -> None:
        if self._lost and self._pid == os.getpid():
            raise LeaseError(f"this writer lost the write lease on {self.spec.redacted()}: it "
                             "stores nothing more. Reopen the store to continue from what is "
                             "committed.")

    def renew(self) -> None:
        """Push ``renewed`` forward; :class:`LeaseError` if the lease was lost."""
        with self._lock, shielded():
            if not self.held:
                raise LeaseError(f"this writer does not hold the write lease on "
                                 f"{self.spec.redacted()}: it lost it, or never wrote")
            now = clock()
            try:
                token = self.objects.replace(LEASE_NAME, self._record(now, self._acquired),
                                             self._token)
            except OSError as exc:  # (s3fs's words for a 5xx name no store)
                where = self.spec.redacted()
                error = request_error(exc, where, f"cannot renew the write lease on {where}",
                                      "this write was refused and wrote nothing: write again "
                                      "once the server answers", remote=self.spec.is_remote)
                if error is None:
                    raise
                raise error from exc
            if token is None:
                self._token = self._metadata_token = None
                self._lost = True
                raise LeaseError(self._lost_message(self.objects.read(LEASE_NAME), now))
            self._token, self._renewed = token, now

    def _lost_message(self, found: tuple[bytes, Token] | None, now: float) -> str:
        if found is None:
            holder = "nobody (the lease was deleted)"
        else:
            try:
                holder = _describe(json.loads(found[0]), now)
            except ValueError:
                holder = "<unreadable lease>"
        return (f"lost the write lease on {self.spec.redacted()}: it is now held by {holder}. "
                "Rows written since the last commit are not committed; reopen the store to "
                "continue from what is committed.")

    def release(self) -> None:
        """Delete the lease object if this process still holds it (idempotent)."""
        with self._lock, shielded():
            if not self.held:
                return
            token, self._token, self._metadata_token = self._token, None, None
            with contextlib.suppress(Exception):  # the store may be gone (cleanup, exit)
                self.objects.delete(LEASE_NAME, token)

    # -- the conditional commit -----------------------------------------------------------
    def forget_if_gone(self) -> None:
        """Stop counting on holding the lease when its object is gone from the store (deleted
        with it, e.g. by ``shutil.rmtree`` while a storage still used it): the next
        :meth:`ensure` takes it anew, and the next commit creates ``zarr.json`` afresh."""
        with self._lock:
            if self.held and self.objects.read(LEASE_NAME) is None:
                self._token = self._metadata_token = None

    def read_metadata(self) -> bytes | None:
        """Read ``zarr.json`` and remember its token: the version later commits replace."""
        found = self.objects.read(METADATA_NAME)
        self._metadata_token = None if found is None else found[1]
        self._metadata_base = None if found is None else found[0]
        return None if found is None else found[0]

    def write_metadata(self, data: bytes, owned: tuple[str, ...] = ()) -> bytes:
        """Replace ``zarr.json`` if it is still the version this writer last read or wrote,
        or, while this writer holds the lease, rebase ``data`` on the version another hand
        wrote (:mod:`zstore.rebase`: a user's attribute is kept, the ``owned`` ones are
        ``data``'s); what was stored.

        The caller renews the lease before storing the data it commits, so a
        writer that lost the lease fails before writing; the conditional
        replace stops one that lost it in between, and keeps refusing it.
        """
        with self._lock, shielded():
            if not self.held:
                raise LeaseError(f"cannot commit to {self.spec.redacted()}: this writer does not "
                                 "hold its write lease")
            if self._metadata_token is None:
                self.read_metadata()
            if self._metadata_token is None:
                token = self.objects.create(METADATA_NAME, data)
            else:
                token = self.objects.replace(METADATA_NAME, data, self._metadata_token)
                if token is None:
                    data, token = self._rebase(data, owned)
            if token is None:
                raise LeaseError(
                    f"commit refused on {self.spec.redacted()}: its zarr.json was changed by "
                    "another writer since this one last committed (it lost the write lease). "
                    "Nothing was committed; reopen the store to continue.")
            self._metadata_token, self._metadata_base = token, data
            return data

    def _rebase(self, data: bytes, owned: tuple[str, ...]) -> tuple[bytes, Token | None]:
        """``data`` stored over the version that replaced this writer's, rebased on it while
        this writer still holds the lease (so no writer committed it: :mod:`zstore.rebase`):
        what was stored and its token (``None``: refused, the lease is another's)."""
        found = self.objects.read(METADATA_NAME)
        record = self.objects.read(LEASE_NAME)
        if found is None or self._metadata_base is None or record is None \
                or _judge(record[0], clock())[0].get("owner") != self.owner:
            return data, None
        current, token = found
        merged = rebased(self._metadata_base, data, current, (*owned, WRITER_ATTR))
        if merged is None:
            return data, None
        return merged, self.objects.replace(METADATA_NAME, merged, token)


#: The process's lease of each store some storage object still uses (an entry goes with
#: the last of them: kept for every URL ever written, they grew without bound)
_PROCESS_LEASES: "weakref.WeakValueDictionary[str, Lease]" = weakref.WeakValueDictionary()
_PROCESS_LOCK = threading.Lock()


class WriterLease:
    """One storage's use of its process's lease on a store.

    All storage objects of one process writing the same URL share one lease
    (as they share the process's files): the lease keeps *other processes*
    out. It is released when the last of them is closed or collected. Within
    the process the last of them to write rows is the writer (:meth:`claim`):
    one that wrote before it is refused from then on (:attr:`superseded`), as a
    former holder of the lease is in another process.
    """

    def __init__(self, lease: Lease):
        self.lease = lease
        self.active = False
        self.turn = 0  # the lease's ``turn`` when this storage last claimed it; 0: never

    def ensure(self) -> bool:
        """Hold the lease before a write; ``True`` when the process has just acquired it, or
        this storage writes under it for the first time: another storage of this process may
        have committed since this one read the store, so it reloads the committed state."""
        _start_releaser()
        run_deferred()
        with self.lease._lock:
            self._refuse_if_superseded()
            if not self.active:
                self.lease.forget_if_gone()
            fresh = self.lease.ensure()
            if not self.active:
                self.active = True
                self.lease.users += 1
                return True
            return fresh

    def claim(self) -> None:
        """This storage has written rows (called after each write; a comparison unless it
        is the first since another storage of the process wrote): it is the process's
        writer of the store from now on, and any other one that wrote is :attr:`superseded`.
        A write refused before it stored anything claims nothing."""
        if self.turn != self.lease.turn or not self.turn:
            with self.lease._lock:
                self.lease.turn += 1
                self.turn = self.lease.turn

    @property
    def superseded(self) -> bool:
        """Whether another storage of this process wrote rows after this one did: this one
        stores and commits nothing more."""
        return self.active and self.turn != 0 and self.turn != self.lease.turn

    def _refuse_if_superseded(self) -> None:
        """:class:`LeaseError` when :attr:`superseded`."""
        if self.superseded:
            raise LeaseError(
                f"cannot write {self.lease.spec.redacted()} through this storage: another storage "
                "object of this process has written it since this one did, and a store has one "
                "writer (this one's rows would overwrite that one's committed rows, and its commit "
                "that one's length; its rows since its last commit are dropped). Write through "
                "that one, or reopen the store (zstore.open(url)) to write from what is committed")

    def renew(self) -> None:
        """:meth:`Lease.renew`, refused once superseded (:meth:`_refuse_if_superseded`)."""
        self._refuse_if_superseded()
        self.lease.renew()

    def keep_alive(self) -> None:
        """:meth:`Lease.keep_alive`, refused once superseded."""
        self._refuse_if_superseded()
        self.lease.keep_alive()

    def ensure_fresh(self) -> None:
        """:meth:`Lease.ensure_fresh`, refused once superseded."""
        self._refuse_if_superseded()
        self.lease.ensure_fresh()

    def release(self) -> None:
        """Stop using the lease; the last user of the process releases it."""
        with self.lease._lock:
            if not self.active:
                return
            self.active = False
            self.lease.users -= 1
            if self.lease.users <= 0:
                self.lease.release()

    def release_later(self) -> None:
        """:meth:`release` on a background thread: for garbage collection, which may run on
        any thread (an HTTP server's, an event loop's) where waiting for I/O can deadlock.

        A ``memory://`` store is a plain dict shared by every thread, which another
        thread — or a collection in the middle of a listing — must not change under an
        iteration: its release waits for this process's next lease operation instead.
        """
        if not self.active:
            return  # released already (close()): nothing to wait for
        if self.lease.spec.is_memory:
            defer_memory_work(self.release)
        else:
            _PENDING.put(self)

    def __getattr__(self, name: str) -> Any:  # held, owner, renew, read/write_metadata
        return getattr(self.lease, name)


_PENDING: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe inside a finalizer
_RELEASER: dict[int, threading.Thread] = {}  # by process id: a forked child starts its own


def _start_releaser() -> None:
    if _RELEASER.get(os.getpid()) is None:
        thread = threading.Thread(target=_release_pending, name="zstore-lease-release", daemon=True)
        _RELEASER[os.getpid()] = thread
        thread.start()


def _release_pending() -> None:
    while True:
        handle = _PENDING.get()
        with contextlib.suppress(Exception):
            handle.release()


def writer_lease(spec: StoreSpec, ttl: float = DEFAULT_TTL) -> WriterLease:
    """A storage's handle on this process's lease of ``spec`` (created on first use)."""
    with _PROCESS_LOCK:
        lease = _PROCESS_LEASES.get(spec.url)
        if lease is None or lease.spec != spec or lease._lost:  # (a reopen after a loss)
            lease = _PROCESS_LEASES[spec.url] = Lease(spec, ttl)
        elif not lease.held:
            lease.ttl = _checked_ttl(ttl)  # the next acquisition uses it
        return WriterLease(lease)
