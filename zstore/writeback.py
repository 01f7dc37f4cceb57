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
* a failed write is sticky: every later ``submit`` / ``drain`` raises it, so a
  commit can never follow a lost write. The storage must be reopened, which
  shows its last committed state (as after a crash).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine, Hashable
from concurrent.futures import Future

from zarr.core.sync import _get_loop

#: Bytes of encoded data a group keeps in flight before ``submit`` waits.
DEFAULT_LIMIT_BYTES = 64 << 20


class WriteBehind:
    """Writes running on zarr's I/O loop, bounded in bytes, ordered per unit."""

    def __init__(self, where: str, limit_bytes: int = DEFAULT_LIMIT_BYTES):
        self.where = where
        self.limit_bytes = limit_bytes
        self._pending: deque[tuple[Future, int, frozenset]] = deque()
        self._bytes = 0
        self._failure: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """Writes started and not yet awaited."""
        return len(self._pending)

    def submit(self, write: Coroutine, nbytes: int, units: frozenset[Hashable]) -> None:
        """Start ``write`` (``nbytes`` of data covering ``units``) and return."""
        self._raise_failure(write)
        while self._pending and (self._bytes + nbytes > self.limit_bytes
                                 or any(units & entry[2] for entry in self._pending)):
            self._await_oldest()
            self._raise_failure(write)
        future = asyncio.run_coroutine_threadsafe(write, _get_loop())
        self._pending.append((future, nbytes, units))
        self._bytes += nbytes

    def drain(self) -> None:
        """Wait for every write in flight; raise the first failure."""
        while self._pending:
            self._await_oldest()
        self._raise_failure()

    def _await_oldest(self) -> None:
        future, nbytes, _ = self._pending.popleft()
        self._bytes -= nbytes
        try:
            future.result()
        except BaseException as exc:  # noqa: BLE001 - kept and raised by every later call
            if self._failure is None:
                self._failure = exc

    def _raise_failure(self, write: Coroutine | None = None) -> None:
        if self._failure is None:
            return
        if write is not None:
            write.close()  # never started: no "coroutine was never awaited" warning
        raise OSError(
            f"an earlier write to {self.where} failed, so nothing more is committed there: "
            f"{self._failure}. Rows written since the last commit are lost; reopen the store "
            "with zstore.open(url) to continue from its last committed state"
        ) from self._failure
