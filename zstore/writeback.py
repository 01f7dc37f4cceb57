"""Write-behind: chunk and shard writes stay in flight while the caller goes on.

A :class:`~zstore.blocks.BlockGroup` hands each encoded write unit (a chunk or a
whole shard, already copied out of the cache) to :class:`WriteBehind`, which
starts it on zarr's I/O loop and returns. The caller keeps filling the buffer
while the upload runs — on an object store, collection and upload overlap.

Rules that keep the commit protocol intact:

* ``drain()`` waits for every write in flight; the storage drains before it
  commits, and before it reads anything back from the store;
* two writes of the same unit never overlap: the second waits for the first,
  so the store always ends with the newest bytes;
* at most ``limit_bytes`` of data wait in flight (the oldest is awaited first);
* a failed write keeps its data and is started again before any later write
  of its unit, so nothing is lost to a transient failure. ``drain()`` retries
  failed writes once more and raises if one still fails: the commit that
  follows a drain can never cover a lost write. A backlog of failed writes
  larger than ``limit_bytes`` makes ``submit`` raise as well.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from concurrent.futures import Future
from dataclasses import dataclass

from zarr.core.sync import _get_loop

from .signals import shielded

#: Bytes of encoded data a group keeps in flight before ``submit`` waits.
DEFAULT_LIMIT_BYTES = 64 << 20


@dataclass
class _Write:
    start: Callable[[], Coroutine]  # a new coroutine doing the whole write, each call
    nbytes: int
    units: frozenset
    future: Future | None = None


class WriteBehind:
    """Writes running on zarr's I/O loop, bounded in bytes, ordered per unit."""

    def __init__(self, where: str, limit_bytes: int = DEFAULT_LIMIT_BYTES,
                 keepalive: Callable[[], None] | None = None):
        self.where = where
        self.keepalive = keepalive  # called before each write starts (a lease's renewal)
        self.limit_bytes = limit_bytes
        self._pending: deque[_Write] = deque()
        self._failed: list[_Write] = []
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """Writes started and not yet awaited."""
        return len(self._pending)

    def submit(self, start: Callable[[], Coroutine], nbytes: int,
               units: frozenset[Hashable]) -> None:
        """Start ``start()`` (a write of ``nbytes`` covering ``units``) and return.

        Raises when a failed write of an overlapping unit fails again, or when
        failed writes pile up beyond ``limit_bytes``.
        """
        # a failed write of units this one rewrites whole is superseded: it was built from
        # the cache (a read from the store would have drained, and raised, first)
        self._failed = [w for w in self._failed if not w.units <= units]
        restarted = {id(write) for write in self._failed}
        self._restart_failed()
        while self._pending and (self._bytes(self._pending) + nbytes > self.limit_bytes
                                 or any(units & w.units for w in self._pending)):
            write = self._pending[0]
            self._await_oldest()
            if self._failed and self._failed[-1] is write and write.units & units:
                if id(write) in restarted:
                    self._raise()
                restarted.add(id(write))
                self._restart_failed()  # once more, still before this write
            if self._bytes(self._failed) > self.limit_bytes:
                self._raise()
        self._start(_Write(start, nbytes, units))

    def drain(self) -> None:
        """Wait for every write in flight, retry failed ones once; raise if one still fails."""
        for attempt in range(2):
            while self._pending:
                self._await_oldest()
            if not self._failed:
                self._error = None
                return
            if attempt == 0:
                self._restart_failed()
        self._raise()

    # -- internals ----------------------------------------------------------------------
    @staticmethod
    def _bytes(writes) -> int:
        return sum(w.nbytes for w in writes)

    def _start(self, write: _Write) -> None:
        if self.keepalive is not None:
            self.keepalive()
        with shielded():  # (a Ctrl-C in between: the write ran on, unwatched, or was lost)
            write.future = asyncio.run_coroutine_threadsafe(write.start(), _get_loop())
            self._pending.append(write)
            if write in self._failed:  # restarted: in flight now, and failed no more
                self._failed.remove(write)

    def _restart_failed(self) -> None:
        """Start failed writes again (oldest first): before any later write of their units.
        Each leaves the failed ones as it starts: an interruption (a Ctrl-C, a lease renewal
        that fails) leaves the others there, to be started by the next submit or drain."""
        for write in list(self._failed):
            self._start(write)

    def _await_oldest(self) -> None:
        """Wait for the oldest write in flight. It stays in flight until it has ended: a
        Ctrl-C during the wait leaves it there, for the next drain to wait for (popped
        first, it went on unwatched, and a later write of its unit could land before it)."""
        write = self._pending[0]
        try:
            write.future.result()
        except Exception as exc:  # noqa: BLE001 - kept with its data, retried, then raised
            self._failed.append(write)
            self._error = exc
        self._pending.popleft()

    def _raise(self) -> None:
        raise OSError(
            f"writing to {self.where} failed ({len(self._failed)} write(s) still failing after "
            f"a retry): {self._error}. Nothing was committed since; the rows are kept: call "
            "flush() again to retry, or reopen the store to go back to its last commit"
        ) from self._error
