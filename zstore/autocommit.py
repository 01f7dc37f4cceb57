"""Background commits: what a storage wrote is committed within its ``autocommit_seconds``.

A buffer written in a burst and then left idle (a collector waiting on its
environment, a ``RayReplayBuffer`` actor between calls) must not depend on a
next write to become durable. One daemon thread per process watches the
storages that hold uncommitted writes and commits each one once its oldest
uncommitted write is ``autocommit_seconds`` old. It never waits for a writer:
a storage in the middle of a write is skipped and tried again at the next tick,
and the writer's own next write commits it if that comes first.

At interpreter exit every storage still uncommitted is committed;
:func:`commit_on_sigterm` makes SIGTERM (what ``kill``, Kubernetes and Ray send
first) exit through that path too, instead of dying with nothing committed.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable, Protocol

from ._pools import at_exit_while_pools_work
from .signals import exit_on_sigterm

_log = logging.getLogger(__name__)

#: The longest the thread sleeps between checks while anything is uncommitted (seconds).
MAX_TICK = 1.0

_monotonic = time.monotonic


def commit_interval(seconds: float) -> float:
    """``autocommit_seconds`` as a float, refused unless a number of seconds ``>= 0`` (NaN
    would never come due; ``math.inf``: no timed commit)."""
    try:
        interval = float(seconds) if not isinstance(seconds, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        interval = math.nan
    if not interval >= 0:
        raise ValueError(f"autocommit_seconds must be a number of seconds >= 0 (math.inf: no "
                         f"timed commit), got {seconds!r}")
    return interval


class Committable(Protocol):
    """What the committer needs of a storage (and its ``spec``, a :class:`zstore.StoreSpec`)."""

    def _commit_due_at(self) -> float | None:
        """``time.monotonic()`` at which its oldest uncommitted write is due; ``None``: clean."""

    def _commit_if_idle(self) -> bool:
        """Commit unless a write is in progress; ``False`` when it was busy."""

    def _commit_at_exit(self) -> None:
        """The last commit of the process (``flush()``, or more: see :class:`CommitClock`)."""


class CommitClock:
    """Mixin of a storage with ``autocommit_seconds``, ``flush()`` and a write lease
    (``_lease``, or ``None``): it tracks the oldest uncommitted write and lets the
    background thread commit it. Writes, reads and commits hold ``_commit_lock``;
    ``flush()`` calls :meth:`_mark_clean` once committed."""

    _autocommit_seconds: float = 5.0
    _uncommitted: bool = False
    _dirty_since: float = 0.0
    #: ``_dirty_since + autocommit_seconds`` while uncommitted: the writer's due-check is
    #: one comparison with ``time.monotonic()``
    _commit_deadline: float = math.inf

    @property
    def autocommit_seconds(self) -> float:
        """How long an uncommitted write may wait for its commit (seconds; ``inf``: never)."""
        return self._autocommit_seconds

    @autocommit_seconds.setter
    def autocommit_seconds(self, value: float) -> None:
        self._autocommit_seconds = value = commit_interval(value)
        self._commit_deadline = self._dirty_since + value  # a change applies to what is dirty

    def _start_clock(self) -> None:
        """Fresh clock state (construction, reopening, unpickling)."""
        self._uncommitted = False
        self._dirty_since = 0.0  # time.monotonic() of the oldest uncommitted write
        self._commit_deadline = self._autocommit_seconds
        self._commit_lock = threading.RLock()  # a write, a read or a commit at a time

    def _committable(self) -> bool:
        """Whether there is anything open to commit (not closed, deleted or never created)."""
        return True

    def _mark_dirty(self) -> None:
        """Record an uncommitted write; the first one since a commit starts the clock."""
        if self._uncommitted:
            return
        self._uncommitted = True
        self._dirty_since = now = time.monotonic()
        self._commit_deadline = now + self._autocommit_seconds
        schedule(self)  # with an infinite window too: the exit commit finds it there
        commit_on_sigterm()

    def _mark_clean(self) -> None:
        self._uncommitted = False
        with _wake:  # committed: no longer held (a dropped storage may now be collected)
            _unsaved.discard(self)

    def _has_uncommitted(self) -> bool:
        """Whether anything written is not committed yet (a storage whose writes other
        processes share says so for them too)."""
        return self._uncommitted

    def _commit_at_exit(self) -> None:
        """The commit of this storage as its process exits: a ``flush()``."""
        self.flush()

    def _commit_due(self) -> bool:
        """Whether the oldest uncommitted write is ``autocommit_seconds`` old (the writer's
        own next write then commits at once). A storage's ``set`` inlines this test."""
        return self._uncommitted and _monotonic() >= self._commit_deadline

    def _commit_due_at(self) -> float | None:
        """When the oldest uncommitted write is due for its commit (``None``: nothing is)."""
        if not self._uncommitted or not self._committable():
            return None
        return self._commit_deadline

    def _commit_if_idle(self) -> bool:
        """The background commit: flush unless a write or read holds the storage (then
        ``False``); a storage that lost or released its lease is left to its writer."""
        if not self._commit_lock.acquire(blocking=False):
            return False
        try:
            if _exiting:
                return True  # the exit commit has taken over (and skips memory:// stores)
            lease = self._lease
            if lease is not None and not (lease.active and lease.held):
                return True  # released or lost: only the writer's own next write may act
            if self._has_uncommitted() and self._committable():
                self.flush()
            return True
        finally:
            self._commit_lock.release()


#: storages with uncommitted writes: those whose store outlives them are held here until
#: committed (a buffer dropped without flush() or close() still commits its rows); a
#: temporary one, deleted with its object, is only watched
_pending: "weakref.WeakSet[Committable]" = weakref.WeakSet()
_unsaved: "set[Committable]" = set()
_wake = threading.Condition()
_thread: threading.Thread | None = None
_exiting = False  # set at exit: the background thread starts no commit from then on


def is_temporary(storage: Any) -> bool:
    """Whether ``storage``'s store is deleted with it (no ``scratch_dir`` given, or
    ``auto_cleanup=True``)."""
    return bool(getattr(storage, "auto_cleanup", False) or getattr(storage, "_owned", False))


def _watched() -> "list[Committable]":
    with _wake:  # (re-entrant) schedule() and the background thread change both sets
        return [*_unsaved, *_pending]


def _forget(storage: Committable) -> None:
    _unsaved.discard(storage)
    _pending.discard(storage)


def schedule(storage: Committable) -> None:
    """Watch ``storage`` from its first uncommitted write on (cheap; call it on each one)."""
    global _thread
    with _wake:
        (_pending if is_temporary(storage) else _unsaved).add(storage)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="zstore-autocommit", daemon=True)
            _thread.start()
        _wake.notify()


def _run() -> None:
    while True:
        with _wake:  # held only to look: commits run outside it, so schedule() never waits
            due, delay = _sweep(time.monotonic())
            if not due:
                _wake.wait(timeout=delay)
                continue
        while due:  # no name keeps the last one while the thread sleeps: a storage its
            _commit(due.pop(0))  # program dropped is collected, its lease released, once committed


def _sweep(now: float) -> "tuple[list[Committable], float | None]":
    """The storages due now, and how long to sleep until the next one (``None``: none)."""
    due, soonest = [], None
    for storage in _watched():
        at = storage._commit_due_at()
        if at is None:
            _forget(storage)
        elif at <= now:
            due.append(storage)
        elif math.isfinite(at):  # an infinite window waits for flush(), exit or SIGTERM
            soonest = at if soonest is None else min(soonest, at)
    return due, None if soonest is None else min(MAX_TICK, soonest - now)


def _commit(storage: Committable) -> None:
    """Commit one due storage. A busy one is looked at again shortly; a failing one is
    left to its writer (the store's client has retried already), whose next write or
    ``flush()`` retries the commit and raises the error where the caller sees it."""
    try:
        if storage._commit_if_idle():
            due = storage._commit_due_at()
            if due is not None and due <= time.monotonic():  # still due: left to its writer
                with _wake:  # (its lease released or lost), whose next write or flush acts;
                    _forget(storage)  # watched, it was tried at every turn of this loop
            return
        time.sleep(MAX_TICK / 10)  # mid-write: look again shortly (a back-off, not a wait)
    except Exception as exc:  # noqa: BLE001 - reported to the writer by its next flush()
        with _wake:
            _forget(storage)
        _log.warning("zstore: background commit of %s failed (%s: %s); %s",
                     storage.spec.redacted(), type(exc).__name__, exc,
                     "its next write or flush() raises it" if type(exc).__name__ == "LeaseError"
                     else "the next write or flush() retries it")


def _commit_pending_at_exit() -> None:
    """Commit what is still uncommitted when the interpreter exits (SIGTERM included).

    From here on the background thread starts no commit, and one in flight ends before this
    returns: the pools it uploads through shut down next (a ``memory://`` store's commit
    then failed with a warning, though that store ends with the process)."""
    global _exiting
    _exiting = True
    _commit_watched(lambda storage: storage._commit_at_exit(), " at exit")


def commit_pending(when: str = "") -> None:
    """Commit now what every storage of this process still holds uncommitted, as exit does
    (before the server of its store goes away, say); a commit that fails is logged, and its
    storage's next ``flush()`` tries again."""
    _commit_watched(lambda storage: storage.flush(), when)


def _commit_watched(commit: Callable[[Any], None], when: str) -> None:
    """``commit(storage)`` for every watched storage, logging a failure and going on."""
    for storage in _watched():
        if storage.spec.is_memory:  # nothing to commit: the store ends with the process,
            with storage._commit_lock:  # but a background commit in flight ends first
                pass
            continue
        try:
            commit(storage)
        except Exception as exc:  # noqa: BLE001 - exit must go on; nothing more can be done
            _log.warning("zstore: commit of %s%s failed (%s: %s)",
                         storage.spec.redacted(), when, type(exc).__name__, exc)


at_exit_while_pools_work(_commit_pending_at_exit)


def _forget_thread() -> None:
    """In a forked child the parent's thread does not exist; the next write starts one."""
    global _thread, _wake
    _thread = None
    _wake = threading.Condition()
    _pending.clear()
    _unsaved.clear()


os.register_at_fork(after_in_child=_forget_thread)


def commit_on_sigterm() -> bool:
    """Make SIGTERM exit through interpreter shutdown, which commits every live storage.

    Installed only from the main thread and only over the default handler (a
    program's own SIGTERM handler is left alone). Returns whether it was installed.
    The process then exits with status 143 (128 + SIGTERM), as a shell reports it.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return signal.getsignal(signal.SIGTERM) is exit_on_sigterm
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    return True
