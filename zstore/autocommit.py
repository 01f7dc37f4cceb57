"""Background commits: what a storage wrote is committed within its ``autocommit_seconds``.

A buffer written in a burst and then left idle (a collector waiting on its
environment, a ``RayReplayBuffer`` actor between calls) must not depend on a
next write to become durable. One daemon thread per process watches the
storages that hold uncommitted writes and commits each one once its oldest
uncommitted write is ``autocommit_seconds`` old. It never waits for a writer:
a storage in the middle of a write is skipped and tried again at the next tick,
and the writer's own next write commits it if that comes first.

At interpreter exit every live storage is closed (committed) by its own module;
:func:`commit_on_sigterm` makes SIGTERM (what ``kill``, Kubernetes and Ray send
first) exit through that path too, instead of dying with nothing committed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from typing import Any, Protocol

_log = logging.getLogger(__name__)

#: The longest the thread sleeps between checks while anything is uncommitted (seconds).
MAX_TICK = 1.0


class Committable(Protocol):
    """What the committer needs of a storage."""

    def _commit_due_at(self) -> float | None:
        """``time.monotonic()`` at which its oldest uncommitted write is due; ``None``: clean."""

    def _commit_if_idle(self) -> bool:
        """Commit unless a write is in progress; ``False`` when it was busy."""


_pending: "weakref.WeakSet[Committable]" = weakref.WeakSet()
_wake = threading.Condition()
_thread: threading.Thread | None = None


def schedule(storage: Committable) -> None:
    """Watch ``storage`` from its first uncommitted write on (cheap; call it on each one)."""
    global _thread
    with _wake:
        _pending.add(storage)
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
        for storage in due:
            _commit(storage)


def _sweep(now: float) -> "tuple[list[Committable], float | None]":
    """The storages due now, and how long to sleep until the next one (``None``: none)."""
    due, soonest = [], None
    for storage in list(_pending):
        at = storage._commit_due_at()
        if at is None:
            _pending.discard(storage)
        elif at <= now:
            due.append(storage)
        else:
            soonest = at if soonest is None else min(soonest, at)
    return due, None if soonest is None else min(MAX_TICK, soonest - now)


def _commit(storage: Committable) -> None:
    """Commit one due storage. A busy one is looked at again shortly; a failing one is
    left to its writer (the store's client has retried already), whose next write or
    ``flush()`` retries the commit and raises the error where the caller sees it."""
    try:
        if storage._commit_if_idle():
            return
        time.sleep(MAX_TICK / 10)  # mid-write: look again shortly (a back-off, not a wait)
    except Exception as exc:  # noqa: BLE001 - reported to the writer by its next flush()
        with _wake:
            _pending.discard(storage)
        _log.warning("zstore: background commit of %r failed (%s: %s); the next write or "
                     "flush() retries it", storage, type(exc).__name__, exc)


def _forget_thread() -> None:
    """In a forked child the parent's thread does not exist; the next write starts one."""
    global _thread, _wake
    _thread = None
    _wake = threading.Condition()
    _pending.clear()


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
        return signal.getsignal(signal.SIGTERM) is _exit_on_sigterm
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return True


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
