"""The life of a process's persistent storages: committed at exit, reset in a forked
child, and their temporary stores deleted once no storage of the process holds them.

A storage registers itself with :func:`track` while it is open. At interpreter exit every
tracked storage is closed (a last commit); in a child created by ``fork`` each one falls back
to what its parent last committed (``_forget_uncommitted``), since the parent's uncommitted
rows, cache and file handles are not the child's.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from typing import Any

from .._pools import at_exit_while_pools_work
from ..store import StoreSpec, defer_memory_work, delete_in_background, wait_for_deletions

_LIVE: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # -> its process


def track(storage: Any) -> None:
    """Close ``storage`` at exit, and reset it in forked children, while it is open."""
    _LIVE[storage] = os.getpid()


def untrack(storage: Any) -> None:
    """Stop tracking ``storage`` (closed, cleaned up, or replaced by an unpickled copy)."""
    _LIVE.pop(storage, None)


def _close_live_storages() -> None:
    """Close every open storage of this process at exit: its last commit, its log segments
    folded into its chunks and its lease released (a compressed chunk's fold decodes on the
    shared pool). A forked child leaves its parent's storages alone: they are the parent's,
    lease and clients included. multiprocessing runs these hooks as its children end; they
    close nothing there, as before the hooks ran there (a child's storage is its writer's to
    close, or its parent's: the group's lease holder commits for it)."""
    if multiprocessing.parent_process() is not None:
        return
    for storage, owner in list(_LIVE.items()):
        if owner != os.getpid() or getattr(storage, "_inner_table", False):
            continue  # (an inner table is its container's to commit, under the container's
            # lease: closed on its own once that was released, it wrote over later writers)
        try:
            storage.close()
        except Exception:  # noqa: BLE001 - exit must go on; nothing more can be done here
            pass


at_exit_while_pools_work(_close_live_storages)


def _forget_parent_state() -> None:
    """In a forked child: every storage falls back to what its parent last committed."""
    for storage in list(_LIVE):
        storage._forget_uncommitted()


os.register_at_fork(after_in_child=_forget_parent_state)


def delete_store(spec: StoreSpec) -> None:
    """Delete a scratch store, best effort."""
    try:
        spec.delete()
    except Exception:  # noqa: BLE001 - best effort clean-up of a temporary store
        pass


_exiting = False


def collect_store(spec: StoreSpec) -> None:
    """A finalizer's :func:`delete_store`. A collection runs on whatever thread allocates,
    in the middle of anything: a ``memory://`` store is deleted at the next safe point
    (:func:`zstore.store.defer_memory_work`: it may be mid-iteration), a remote one on a
    thread of its own (:func:`zstore.store.delete_in_background`: on the thread of fsspec's
    event loop its requests could never run, and on a server's own thread, an in-process
    test server's, they waited for it for good), a local folder at once. At exit every
    deletion ends before the process does."""
    if spec.is_memory:
        defer_memory_work(lambda: delete_store(spec))
    elif spec.is_local or _exiting:
        delete_store(spec)
    else:
        delete_in_background(spec, lambda: delete_store(spec))


def _finish_deletions_at_exit() -> None:
    """From here on a collected store is deleted by the collecting thread (threads started
    now would not be waited for)."""
    global _exiting
    _exiting = True
    wait_for_deletions()


at_exit_while_pools_work(_finish_deletions_at_exit)


class TemporaryStore:
    """Deletes a temporary store (:func:`collect_store`) once every storage of this process
    that holds it is collected: the one that created it, and copies unpickled from it here
    (``copy.deepcopy``, a pickle round trip), which reopen the same store."""

    def __init__(self, spec: StoreSpec):
        self._finalizer = weakref.finalize(self, collect_store, spec)

    def detach(self) -> None:
        """Never delete the store (it was deleted, or is no longer temporary)."""
        self._finalizer.detach()


_TEMPORARY: "weakref.WeakValueDictionary[str, TemporaryStore]" = weakref.WeakValueDictionary()


def temporary_store(spec: StoreSpec) -> TemporaryStore:
    """A new :class:`TemporaryStore` for ``spec``, which storages unpickled in this process
    then share (:func:`shared_temporary_store`)."""
    _TEMPORARY[spec.url] = owner = TemporaryStore(spec)
    return owner


def shared_temporary_store(spec: StoreSpec) -> TemporaryStore | None:
    """The :class:`TemporaryStore` of ``spec`` when a live storage of this process created
    it as a temporary store; ``None`` otherwise (then it is not this copy's to delete)."""
    owner = _TEMPORARY.get(spec.url)
    return owner if owner is not None and owner._finalizer.alive else None
