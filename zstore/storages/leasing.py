"""The single-writer lease of a persistent storage: taken before its first write, then fenced.

``LazyMemmapStorage`` and ``CompressedListStorage`` share this protocol
(:class:`LeasedWriter`); what differs between them is only where their commit lives,
which they say through three hooks:

1. before any write, :meth:`LeasedWriter._hold_lease` takes the store's lease
   (:func:`zstore.lease.writer_lease`: one per process and store);
2. a storage that has just taken it, and that has a commit, reads the committed state
   again (``_reload_committed``: another writer may have committed since it was opened)
   and remembers the version of ``zarr.json`` it read;
3. it then commits that state under its own name (``_fence``), so a former holder's
   next commit fails.

The lease is released by ``close()`` / ``cleanup()`` / ``seal()``, and after garbage
collection on a background thread.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..lease import writer_lease
from ..store import StoreSpec


class LeasedWriter:
    """Mixin: the lease protocol of the module docstring; the storage supplies the hooks."""

    _lease: Any = None  # a zstore.lease.WriterLease, or None (read-only, or lease_ttl=None)
    _lease_finalizer: weakref.finalize | None = None

    def _open_lease(self, spec: StoreSpec, lease_ttl: float | None) -> None:
        """This storage's handle on the process's lease of ``spec`` (``None`` for a
        read-only spec or ``lease_ttl=None``), released when the storage is collected."""
        self._lease = None if spec.read_only or lease_ttl is None else writer_lease(spec, lease_ttl)
        self._lease_finalizer = (None if self._lease is None
                                 else weakref.finalize(self, self._lease.release_later))

    def _hold_lease(self) -> bool:
        """Hold the write lease before writing; on taking it, reload what is committed and
        fence it (module docstring). Whether it reloaded the committed state."""
        if self._lease is None or self._refuses_writes():
            return False  # a read-only buffer refuses the write itself, and nothing is taken
        if not self._lease.ensure() or not self._has_commit():
            return False
        self._lease.read_metadata()
        self._reload_committed()
        self._fence()
        return True

    def take_write_lease(self) -> bool:
        """Hold the write lease now, as the next write would. Whether taking it reloaded a
        committed length or cursor other than this storage's (another writer moved them
        since it was opened): a writer then continues from
        :func:`zstore.writers.resume_point` again, not from the cursor it had."""
        def committed() -> tuple[int, int | None]:
            return len(self), getattr(self, "_last_cursor_index", None)

        if self._holds_lease:  # held already (every write after the first): nothing to reload
            return False
        with self._commit_lock:
            before = committed()
            return self._hold_lease() and committed() != before

    def _claim_writes(self) -> None:
        """After a write: this storage is the process's writer of the store
        (:meth:`zstore.lease.WriterLease.claim`)."""
        if self._lease is not None:
            self._lease.claim()

    @property
    def _holds_lease(self) -> bool:
        """Whether this storage commits as its store's writer: it takes no lease, or its lease
        is active and held."""
        return self._lease is None or (self._lease.active and self._lease.held)

    def _release_lease(self) -> None:
        """Give the lease back (the last storage of the process using it deletes it)."""
        if self._lease is not None:
            self._lease.release()

    # -- the hooks ---------------------------------------------------------------------------
    def _refuses_writes(self) -> bool:
        """Whether the store is marked read-only (then no lease is taken)."""
        return False

    def _has_commit(self) -> bool:
        """Whether this storage has opened or made a commit (else there is nothing to reload)."""
        raise NotImplementedError

    def _reload_committed(self) -> None:
        """Read the committed state from the store again."""
        raise NotImplementedError

    def _fence(self) -> None:
        """Commit the current state under this writer's name."""
        raise NotImplementedError
