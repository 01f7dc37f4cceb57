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

SIGINT's handler is swapped for :func:`_hold_interrupt` while a block runs. Outside a block
that handler passes a Ctrl-C straight on to the one it replaced, so a Ctrl-C landing while
the swap is made or undone is raised once, not held for a later block (the swap may then
stay made: the handler goes on passing Ctrl-C on). A SIGTERM's exit wins over a Ctrl-C.
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
_interrupt: Any = None  # SIGINT's handler that _hold_interrupt replaced
_interrupted = False  # a SIGINT arrived inside the current block


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
    global _exiting, _received
    exit_now = SystemExit(128 + signum)  # (built first: a call runs pending signal handlers)
    _exiting = True
    _received = None
    raise exit_now


def _hold_interrupt(signum: int, frame: Any) -> None:
    """SIGINT's handler while blocks run: the first Ctrl-C inside a block is remembered;
    a second one, or one outside any block, goes to the handler it replaced at once; one
    while SIGTERM's exit is due or under way is dropped (the exit wins)."""
    global _interrupted
    if _exiting or _received is not None:
        return
    if _depth and not _interrupted:
        _interrupted = True
        if sys.stderr is not None:
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
    if not _depth:
        _interrupted = False
        handler = signal.getsignal(signal.SIGINT)
        if handler is not _hold_interrupt and callable(handler):  # (SIG_IGN, SIG_DFL: not
            _interrupt = handler                                   # Python's to run)
            signal.signal(signal.SIGINT, _hold_interrupt)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth:
            interrupted, _interrupted = _interrupted, False
            if signal.getsignal(signal.SIGINT) is _hold_interrupt:
                signal.signal(signal.SIGINT, _interrupt)
            if _received is not None:  # the exit wins (a Ctrl-C from here on: raised, and
                _exit(_received)       # the exit is still due at the next block's end)
            if interrupted:
                _interrupt(signal.SIGINT, None)
