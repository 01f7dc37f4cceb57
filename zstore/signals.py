"""Signals as zstore handles them: SIGTERM exits through interpreter shutdown (which commits
every live storage), and both SIGTERM's exit and SIGINT's ``KeyboardInterrupt`` (Ctrl-C, a
notebook's stop button) are held off while the main thread replaces an object whose new
version it must remember (the lease, ``zarr.json``), or deletes a copy an interruption left
part way (an import's, a conversion's).

An exit or an interruption raised between such a replace and the bookkeeping after it left
the process believing in a version of the lease it no longer had: every later commit, the
exit's included, failed with ``LeaseError`` and the rows written since the last commit
were lost (1 kill in 6-20 landed there; 1 Ctrl-C in 10-30 interrupted flushes). Inside
:func:`shielded` the signal is remembered, and raised as the outermost block ends; a second
Ctrl-C inside it interrupts at once (a request that hangs stays interruptible).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

_depth = 0  # main-thread blocks entered and not yet left
_received: int | None = None  # the SIGTERM that arrived inside one
_exiting = False  # the exit is under way: another SIGTERM must not cut its commits short
_interrupt: Any = None  # SIGINT's own handler, while the outermost block holds it off
_interrupted = False  # a SIGINT arrived inside the block


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """The SIGTERM handler: exit with status ``128 + signum``, now or as the outermost
    :func:`shielded` block ends; a second SIGTERM during that exit is ignored."""
    global _received
    if _exiting:
        return
    if _depth:
        _received = signum
        return
    _exit(signum)


def _exit(signum: int) -> None:
    global _exiting
    _exiting = True
    raise SystemExit(128 + signum)


def _hold_interrupt(signum: int, frame: Any) -> None:
    """SIGINT's handler inside a block: remembered; the second one is handled at once."""
    global _interrupted
    if not _interrupted:
        _interrupted = True
        sys.stderr.write("zstore: finishing a write to the store before stopping (press "
                         "Ctrl-C again to stop at once)\n")
        return
    _interrupted = False
    _interrupt(signum, frame)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold SIGTERM's exit and SIGINT's interruption off until the block ends (the main
    thread's; signal handlers run only there, so other threads' blocks need none)."""
    global _depth, _received, _interrupt, _interrupted
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _depth and callable(handler := signal.getsignal(signal.SIGINT)):
        _interrupt = handler  # (not SIG_IGN or SIG_DFL: those Python never runs)
        signal.signal(signal.SIGINT, _hold_interrupt)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            handler, _interrupt = _interrupt, None
            interrupted, _interrupted = _interrupted, False
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
            if _received is not None:
                signum, _received = _received, None
                _exit(signum)
            if interrupted:
                handler(signal.SIGINT, None)
