"""Thread pools a process shares: started on first use, forgotten in a forked child.

A forked child has none of its parent's threads, so a pool it inherited would take
work that no thread ever runs: :class:`SharedPool` starts a fresh one there.
"""

from __future__ import annotations

import atexit
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def at_exit_while_pools_work(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the main thread ends, before ``concurrent.futures`` shuts its
    executors down: by the time plain ``atexit`` handlers run they refuse new work, and
    stores upload and decode through them. Handlers registered later run first."""
    getattr(threading, "_register_atexit", atexit.register)(fn)


class SharedPool:
    """One ``ThreadPoolExecutor`` per process, of ``workers()`` threads named ``name``."""

    def __init__(self, name: str, workers: Callable[[], int]):
        self.name = name
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        """The process's pool, started on the first call."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.workers(), thread_name_prefix=self.name)
        return self._pool

    def _forget(self) -> None:
        """In a forked child: the parent's threads do not exist there."""
        self._pool, self._lock = None, threading.Lock()
