"""The life of a process's persistent storages: committed at exit, reset in a forked
child, and their temporary stores deleted.

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
from ..store import StoreSpec, defer_memory_work

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
        if owner != os.getpid():
            continue
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


def collect_store(spec: StoreSpec) -> None:
    """A finalizer's :func:`delete_store`: a ``memory://`` store is deleted at the next safe
    point, as a collection may run this mid-iteration (see :func:`zstore.store.defer_memory_work`)."""
    if spec.is_memory:
        defer_memory_work(lambda: delete_store(spec))
    else:
        delete_store(spec)
