"""Small helpers for running zstore buffers in Ray actors (docs/scaling.md §5).

zstore adds no scheduler and no transport: Ray places the actors, the store is
the only thing they share. What is here:

* :func:`storage_factory`: a picklable callable that creates a buffer at a URL, or
  reopens the one committed there (its rows, length and cursor). Give it to
  TorchRL's ``RayReplayBuffer`` (``storage=``) or call it in any actor, so that a
  restarted actor carries on from the last commit.
* :func:`replay_buffer`: TorchRL's ``RayReplayBuffer`` over such a factory, with a
  writer that resumes at the committed cursor; :func:`commit` and :func:`close` commit
  what its actor holds (``RayReplayBuffer.close()`` alone is a SIGKILL).
* :func:`open_member`: a collector's own storage ``<prefix>/collector-<i>``, its
  single-writer lease taken at once (a second writer fails there, not at a write).
* :func:`ensemble`: every member under a prefix read as one
  :class:`PrefixEnsemble`; :meth:`PrefixEnsemble.refresh` picks up new commits
  and new members.

``import zstore.ray`` does not import Ray; :func:`replay_buffer` does.
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import functools
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .api import open as _open
from .errors import LeaseError, NotAZStoreError, SchemaError, StoreNotFoundError
from .group import existing_buffer
from .lease import DEFAULT_TTL
from .storages import LazyMemmapStorage, StorageEnsemble
from .store import StoreSpec

__all__ = ["PrefixEnsemble", "close", "commit", "ensemble", "member_url", "open_member",
           "replay_buffer", "storage_factory", "take_lease"]

#: Member names :func:`ensemble` picks up by default (what :func:`member_url` makes).
MEMBER_PATTERN = "collector-*"


#: The buffers :func:`replay_buffer` built that are still referenced, for :func:`_commit_left_open`.
_LEFT_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: The store of each buffer :func:`replay_buffer` built (for errors).
_BUILT_AT: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
#: The storages :func:`open_member` opened in this process that are still referenced, by URL.
_MEMBERS_OPEN: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def require_ray() -> Any:
    """Import Ray, or say how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"this needs Ray: pip install 'zstore[ray]' ({exc})") from exc
    return ray


def member_url(prefix: str, index: int | str) -> str:
    """``<prefix>/collector-<index>``: the URL of collector ``index``'s own storage."""
    return f"{str(prefix).rstrip('/')}/collector-{index}"


def _create_or_open(url: str, capacity: int, storage_options: Mapping[str, Any] | None,
                    torchrl: bool, autocommit_seconds: float, lease_ttl: float | None,
                    options: Mapping[str, Any]) -> Any:
    spec = StoreSpec.parse(url, storage_options)
    found = existing_buffer(spec)
    if found is None:
        cls = LazyMemmapStorage
        if torchrl:
            from .torchrl import LazyMemmapStorage as cls
        # existsok: another process may create it between our look and our first write
        return cls(capacity, scratch_dir=url, storage_options=storage_options, existsok=True,
                   autocommit_seconds=autocommit_seconds, lease_ttl=lease_ttl, **options)
    meta = found[1]
    if meta.max_size != capacity:
        raise SchemaError(f"{spec.redacted()} holds a buffer of {meta.max_size} cells, not "
                         f"{capacity}: pass its capacity, or use another URL")
    storage = _open(url, storage_options, mode="r+", lease_ttl=lease_ttl,
                    **{k: options[k] for k in ("cache_bytes", "cache", "device") if k in options})
    if torchrl:  # zstore.torchrl.open, which takes no lease_ttl
        from .torchrl import torchrl_class

        storage.__class__ = torchrl_class(type(storage))
    storage.autocommit_seconds = autocommit_seconds
    return storage


def storage_factory(url: str, capacity: int, *, storage_options: Mapping[str, Any] | None = None,
                    torchrl: bool = True, autocommit_seconds: float = 5.0,
                    lease_ttl: float | None = DEFAULT_TTL, **options: Any) -> functools.partial:
    """A picklable callable returning the buffer at ``url``: created on first use, reopened after.

    Reopened means what :func:`zstore.open` gives: the committed rows, length and cursor
    (as ``existsok=True`` adopts them when the storage is built). With ``torchrl=True``
    the storage is TorchRL's twin class (:mod:`zstore.torchrl`), which ``RayReplayBuffer``
    needs; pair it with :class:`zstore.torchrl.RoundRobinWriter` to continue at the
    committed cursor.
    ``options`` (``codec``, ``chunks``, ``cache_bytes`` ...) apply when it is created;
    a reopened buffer keeps its own layout. A different ``capacity`` from the stored
    buffer's is refused.

    >>> factory = storage_factory("s3://bucket/rb", 1_000_000, storage_options=opts)  # doctest: +SKIP
    >>> rb = RayReplayBuffer(storage=factory, writer=zstore.torchrl.RoundRobinWriter)  # doctest: +SKIP
    """
    return functools.partial(_create_or_open, str(url), int(capacity),
                             dict(storage_options or {}), torchrl, autocommit_seconds, lease_ttl,
                             options)


def take_lease(storage: Any, *, wait: float = 0.0, poll: float = 0.5) -> Any:
    """Take ``storage``'s single-writer lease now, waiting up to ``wait`` seconds for a
    holder's lease to expire (a collector restarted on another node waits at most one
    ttl; on the same machine a dead holder's lease is taken at once).

    Raises :class:`~zstore.errors.LeaseError` when another writer still holds it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            storage._hold_lease()
            return storage
        except LeaseError:
            if time.monotonic() + poll > deadline:
                raise
            time.sleep(poll)


def open_member(prefix: str, index: int | str, capacity: int, *,
                storage_options: Mapping[str, Any] | None = None, wait: float = 0.0,
                **options: Any) -> Any:
    """Collector ``index``'s own storage under ``prefix`` (created or reopened, see
    :func:`storage_factory`; ``torchrl=False`` by default here), holding its lease.

    Call it inside the collector's actor: the lease belongs to that process, so a second
    writer (another actor, a restart while this one lives) gets
    :class:`~zstore.errors.LeaseError` here. So does a second open of the member in the
    same process while the first storage is still open (Ray runs a worker's next task in
    the same process: storage objects of one process share its lease, and would overwrite
    each other's uncommitted rows). ``wait``: see :func:`take_lease`."""
    options.setdefault("torchrl", False)
    url = member_url(prefix, index)
    earlier = _MEMBERS_OPEN.get(url)
    if earlier is not None and not earlier._closed:
        raise LeaseError(
            f"{earlier.spec.redacted()}: another storage object of this process still writes "
            "this member (a task or method that opened it and did not close it: Ray runs a "
            "worker's next task in the same process). Close that one first, or keep the "
            "member in one actor")
    storage = take_lease(storage_factory(url, capacity, storage_options=storage_options,
                                         **options)(), wait=wait)
    _MEMBERS_OPEN[url] = storage
    return storage


def replay_buffer(url: str, capacity: int, *, storage_options: Mapping[str, Any] | None = None,
                  autocommit_seconds: float = 5.0, lease_ttl: float | None = DEFAULT_TTL,
                  storage_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """TorchRL's ``RayReplayBuffer`` whose actor keeps its rows at ``url``.

    A buffer built again over the same URL (after ``ray.kill``, a lost node, a new job)
    reopens the committed rows and writes on at the committed cursor. A driver that ends
    without :func:`close` commits what the actor holds as it exits, or as it calls
    ``ray.shutdown()``, which this wraps to commit first. ``memory://`` is
    refused: it lives in the actor's process only. ``kwargs`` go to ``RayReplayBuffer``
    (``batch_size``, ``sampler``, ``remote_config`` ...); ``storage_kwargs`` to the
    storage (``codec``, ``chunks`` ...)."""
    spec = _actor_spec(url, storage_options)
    require_ray()
    from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer

    from .torchrl import RoundRobinWriter

    kwargs.setdefault("writer", RoundRobinWriter)
    kwargs.setdefault("delayed_init", True)  # see _open_in_actor
    factory = storage_factory(url, capacity, storage_options=storage_options,
                              autocommit_seconds=autocommit_seconds, lease_ttl=lease_ttl,
                              **dict(storage_kwargs or {}))
    buffer = _open_in_actor(RayReplayBuffer(storage=factory, **kwargs), spec)
    _LEFT_OPEN.add(buffer)
    _BUILT_AT[buffer] = spec.redacted()
    # Ray kills a job's actors when its driver exits: commit first. Exit hooks run newest
    # first, and Ray registers its own at each ray.init: hence one hook, registered anew
    atexit.unregister(_commit_left_open)
    atexit.register(_commit_left_open)
    _commit_before_shutdown(require_ray())
    return buffer


def _commit_before_shutdown(ray: Any) -> None:
    """Make ``ray.shutdown()`` commit the buffers left open first (once per process): a
    driver ending with it, as Ray's examples do, disconnected before the exit hook ran, and
    its actors died with their uncommitted rows."""
    shutdown = ray.shutdown
    if getattr(shutdown, "_commits_zstore_buffers", False):
        return

    @functools.wraps(shutdown)
    def committing_shutdown(*args: Any, **kwargs: Any) -> Any:
        _commit_left_open()
        return shutdown(*args, **kwargs)

    committing_shutdown._commits_zstore_buffers = True
    ray.shutdown = committing_shutdown


def _actor_spec(url: str, storage_options: Mapping[str, Any] | None) -> StoreSpec:
    """The store of a buffer kept by a Ray actor: refused if ``memory://``."""
    spec = StoreSpec.parse(url, storage_options)
    if spec.is_memory:
        raise ValueError(f"{spec.redacted()} lives in one process, so the actor's rows would "
                         "be lost with it and seen by no other process: use a local "
                         "directory or an s3:// URL")
    return spec


def _open_in_actor(buffer: Any, spec: StoreSpec) -> Any:
    """Open ``buffer``'s storage in its actor now; on failure end the actor and raise the
    store's error. (A storage failing in the actor, in its constructor or in a method, kills
    the actor with an unrelated internal error, reported at its next use: hence
    ``delayed_init``, and the error returned, not raised, by :func:`_opening_error`.)"""
    ray = require_ray()
    try:
        error = ray.get(buffer._rb.__ray_call__.remote(_opening_error))
    except ray.exceptions.RayActorError as exc:  # built with delayed_init=False
        error = exc
    if error is not None:
        buffer.close()
        error.add_note(f"zstore.ray.replay_buffer: its actor could not open {spec.redacted()} "
                       "and was ended: check the URL, storage_options and capacity, and that "
                       "the store is reachable from the actor's node")
        raise error
    return buffer


def _opening_error(replay_buffer: Any) -> Exception | None:
    """In the actor: open the storage (its first use); the error it raised, if any."""
    try:
        len(replay_buffer)
    except Exception as exc:  # noqa: BLE001 - handed to the driver, which raises it
        return exc
    return None


def _in_actor(replay_buffer: Any, close: bool) -> int:
    storage = replay_buffer.storage
    (storage.close if close else storage.flush)()
    return len(storage)


def _client_actor(buffer: Any) -> Any:
    """The actor behind ``buffer`` if it is a ``RayReplayBuffer.client()``, else ``None``."""
    return vars(buffer).get("_actor")


def _actor(buffer: Any) -> Any:
    """The actor behind ``buffer``: a ``RayReplayBuffer`` not closed yet, or one of its
    ``client()``s (what a task or another actor is handed)."""
    actor = _client_actor(buffer)
    if actor is not None:
        return actor
    if not buffer.is_alive:
        raise RuntimeError("this RayReplayBuffer is closed (its rows are committed in its "
                           "store): build zstore.ray.replay_buffer over its URL to write on")
    return buffer._rb


def _call_in_actor(buffer: Any, close: bool) -> int:
    """:func:`_in_actor` in ``buffer``'s actor. Ray's error for an actor that died (killed, its
    node lost) gets a note naming the store, what is lost and the way on (its type stays)."""
    ray = require_ray()
    try:
        return ray.get(_actor(buffer).__ray_call__.remote(_in_actor, close))
    except ray.exceptions.RayActorError as exc:
        url = _BUILT_AT.get(buffer, "its store")
        exc.add_note(f"zstore: the actor keeping {url} died: its rows written since its last "
                     "commit are lost, and the store keeps that commit. Build "
                     "zstore.ray.replay_buffer over the URL again to read and write on")
        raise


def commit(buffer: Any) -> int:
    """Commit what a ``RayReplayBuffer``'s actor has written (readers elsewhere then see
    it) without waiting for its ``autocommit_seconds``; returns the committed length.
    ``buffer`` may be the ``RayReplayBuffer`` or one of its ``client()``s."""
    return _call_in_actor(buffer, False)


def close(buffer: Any) -> int | None:
    """Commit, release the lease, then end a ``RayReplayBuffer``'s actor; returns the
    committed length (``None`` when it was closed already: nothing left to commit).

    ``RayReplayBuffer.close()`` alone kills the actor (``ray.kill``, SIGKILL): rows of its
    last ``autocommit_seconds`` are lost, and the next writer on another node waits one
    lease ttl (on the same machine a dead holder's lease is taken at once)."""
    if _client_actor(buffer) is not None:
        raise TypeError("a RayReplayBuffer's client() cannot close it: close the buffer "
                        "where it was built (zstore.ray.commit(client) commits its rows)")
    if not buffer.is_alive:
        return None
    length = _call_in_actor(buffer, True)
    buffer.close()
    return length


def _commit_left_open() -> None:
    """Commit the buffers a driver leaves open (the ``atexit`` hook of :func:`replay_buffer`,
    and the first step of ``ray.shutdown()`` once one was built)."""
    ray = require_ray()
    if not ray.is_initialized():
        return
    for buffer in list(_LEFT_OPEN):
        if buffer.is_alive:
            with contextlib.suppress(ray.exceptions.RayActorError):  # killed: nothing to commit
                commit(buffer)


class PrefixEnsemble(StorageEnsemble):
    """The committed buffers under one prefix, read as one :class:`~zstore.StorageEnsemble`.

    Members are the directories directly under ``prefix`` whose name matches ``pattern``
    and that hold a committed buffer, in name order, opened read-only. Like any reader it
    sees the commits made before it opened them; :meth:`refresh` lists the prefix again
    and reopens every member (new commits, new members). Member ids (``buffer_ids``) are
    positions in :attr:`names`: they can change when a member appears, so keep the names.
    """

    def __init__(self, prefix: str, storage_options: Mapping[str, Any] | None = None, *,
                 pattern: str = MEMBER_PATTERN, **open_kwargs: Any):
        self.prefix = StoreSpec.parse(prefix, storage_options, read_only=True)
        self.pattern = pattern
        self._open_kwargs = open_kwargs
        self.names: list[str] = []
        super().__init__()
        self.refresh()

    def _list(self) -> list[str]:
        fs, root = self.prefix.filesystem()
        fs.invalidate_cache(root)  # s3fs caches listings: a refresh must see new members
        try:
            entries = fs.ls(root, detail=True)
        except FileNotFoundError:
            return []
        names = (entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries
                 if entry.get("type") == "directory")
        return sorted(name for name in names if fnmatch.fnmatchcase(name, self.pattern))

    def refresh(self) -> "PrefixEnsemble":
        """List the prefix and reopen every committed member; returns ``self``."""
        storages, names = [], []
        for name in self._list():
            try:
                storages.append(_open(f"{self.prefix.url}/{name}", self.prefix.storage_options,
                                      mode="r", **self._open_kwargs))
            except (StoreNotFoundError, NotAZStoreError):
                continue  # created but not committed yet (or not a buffer): not a member yet
            names.append(name)
        self._storages, self.names = tuple(storages), names
        self.max_size = sum(storage.max_size for storage in storages)
        return self

    def lengths(self) -> list[int]:
        """The committed length of each member (as of the last :meth:`refresh`)."""
        return [len(storage) for storage in self._storages]

    def sample(self, batch_size: int, generator: torch.Generator | None = None, *,
               return_index: bool = False) -> Any:
        """``batch_size`` rows drawn uniformly over all committed rows of all members,
        grouped by member (each member's rows as its ``get`` returns them).

        ``return_index=True``: ``(rows, buffer_ids, index)``, the member and row of each."""
        lengths = torch.tensor(self.lengths(), dtype=torch.long)
        ends = lengths.cumsum(0)
        if not len(lengths) or int(ends[-1]) == 0:
            raise RuntimeError(f"nothing is committed under {self.prefix.redacted()} yet "
                               f"(members: {self.names or 'none'}); refresh() later")
        flat = torch.randint(int(ends[-1]), (batch_size,), generator=generator).sort().values
        member = torch.bucketize(flat, ends, right=True)
        index = flat - (ends - lengths)[member]
        chosen = member.unique().tolist()
        got = self.get({"buffer_ids": chosen, "index": [index[member == m] for m in chosen]})
        rows = torch.cat([sample for _, sample in got])
        return (rows, member, index) if return_index else rows

    def __repr__(self) -> str:
        return f"PrefixEnsemble({self.prefix.redacted()}, members={self.names})"


def ensemble(prefix: str, storage_options: Mapping[str, Any] | None = None, *,
             pattern: str = MEMBER_PATTERN, **open_kwargs: Any) -> PrefixEnsemble:
    """The members under ``prefix`` as one read-only :class:`PrefixEnsemble`
    (``refresh()`` it to see new commits and members). ``open_kwargs`` go to
    :func:`zstore.open` (``cache_bytes``, ``cache``, ``device``)."""
    return PrefixEnsemble(prefix, storage_options, pattern=pattern, **open_kwargs)
