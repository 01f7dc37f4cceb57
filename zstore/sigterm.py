"""SIGTERM as zstore handles it: an exit through interpreter shutdown (which commits every
live storage), held off while the main thread replaces an object whose new version it must
remember (the lease, ``zarr.json``).

``SystemExit`` raised between such a replace and the bookkeeping after it left the process
believing in a version of the lease it no longer had: the exit's commits then failed with
``LeaseError`` and the rows written since the last commit were lost (1 kill in 6-20 landed
there). Inside :func:`shielded` the signal is remembered, and the exit raised as the
outermost block ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_depth = 0  # main-thread blocks entered and not yet left
_received: int | None = None  # the signal that arrived inside one
_exiting = False  # the exit is under way: another SIGTERM must not cut its commits short


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


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold SIGTERM's exit off until the block ends (the main thread's; the handler runs
    only there, so other threads' blocks need none)."""
    global _depth, _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _received is not None:
            signum, _received = _received, None
            _exit(signum)
