"""StorageEnsemble: several storages read as one (SPEC §2.8), persistent as an index group.

TorchRL's semantics: ``len`` is the number of members, ``get`` takes
``{"buffer_ids": ..., "index": ...}`` and returns ``(buffer_id, sample)`` pairs
(each through its member's transform), indexing selects members, writing is
refused. The typical use across processes: every collector writes its own
storage under one prefix; trainers read them together.

With ``scratch_dir``, the ensemble is also written to a store: a Zarr group
whose ``zstore`` block lists its members (their paths relative to the
ensemble's URL when they live under it, absolute URLs otherwise)::

    s3://bucket/run/zarr.json      {"zstore": {"storage_class": "StorageEnsemble",
                                               "members": ["collector-0", "collector-1"], ...}}
    s3://bucket/run/collector-0/   a LazyMemmapStorage (its own group and lease)

``zstore.open("s3://bucket/run")`` then reopens every member with the same
``storage_options`` and mode. Transforms are code: they are not stored.
"""

from __future__ import annotations

import contextvars
import dataclasses
import textwrap
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from zarr.errors import GroupNotFoundError, NodeNotFoundError

from .. import autocommit
from .._registry import reopen
from ..cache import DEFAULT_CACHE_BYTES
from ..display import Summary
from ..errors import NotAZStoreError, StoreExistsError, StoreNotFoundError, ZStoreError
from ..group import ZSTORE_ATTR, new_group, open_plain_group, put_attrs
from ..layout import FORMAT_VERSION, check_format_version
from ..lease import DEFAULT_TTL
from ..store import StoreSpec
from .base import ClosedByWith, Storage

_INDEX_ERROR = ("Expected an index of type torch.Tensor, range, np.ndarray, int, slice or "
                "ellipsis, got {} instead.")
_WRITES_REFUSED = ("a StorageEnsemble only reads its members: write to one of them "
                   "(ensemble[i].{}(...)), or route rows to members with "
                   "ReplayBufferEnsemble(..., routing_key=...)")


class StorageEnsemble(ClosedByWith, Storage):
    """Read several storages as one (TorchRL's ``StorageEnsemble``), optionally persistent.

    Args:
        storages: the member storages.
        transforms: one callable (or ``None``) per member, applied to what
            :meth:`get` returns for that member.
        scratch_dir: where to record the ensemble (a path or any fsspec URL), so
            that ``zstore.open(scratch_dir)`` reopens it; every member must then
            be a committed storage at a URL. ``None``: in memory only.
        storage_options: fsspec options for ``scratch_dir`` (also used to reopen
            the members; never written to the store).

    >>> a = zstore.LazyMemmapStorage(10, scratch_dir="memory://doc-ens/a")
    >>> b = zstore.LazyMemmapStorage(10, scratch_dir="memory://doc-ens/b")
    >>> for s, v in ((a, 0.0), (b, 1.0)):
    ...     s.set(torch.arange(3), TensorDict(x=torch.full((3,), v), batch_size=[3])); s.flush()
    >>> ens = zstore.StorageEnsemble(a, b, scratch_dir="memory://doc-ens")
    >>> [(i, td["x"].tolist()) for i, td in zstore.open("memory://doc-ens", mode="r").get(
    ...     {"buffer_ids": [1, 0], "index": [torch.tensor([2]), torch.tensor([0])]})]
    [(1, [1.0]), (0, [0.0])]
    """

    _default_checkpointer = "StorageEnsembleCheckpointer"

    def __init__(self, *storages: Storage, transforms: Sequence[Any] | None = None,
                 scratch_dir: Any = None, storage_options: Mapping[str, Any] | None = None):
        self._rng_private = None
        self._storages = tuple(storages)
        self._transforms = transforms
        super().__init__(max_size=sum(storage.max_size for storage in storages))
        if transforms is not None and len(transforms) != len(storages):
            raise TypeError("transforms must have the same length as the storages provided.")
        self.spec: StoreSpec | None = None
        if scratch_dir is not None:
            self.spec = StoreSpec.parse(scratch_dir, storage_options)
            self._write_index()

    # -- TorchRL's StorageEnsemble -----------------------------------------------------------
    @property
    def _rng(self) -> torch.Generator | None:
        return self._rng_private

    @_rng.setter
    def _rng(self, value: torch.Generator | None) -> None:
        self._rng_private = value
        for storage in self._storages:
            storage._rng = value

    def extend(self, value: Any) -> None:
        """Refused (``RuntimeError``, as TorchRL's): write to a member (``ensemble[i]``) instead."""
        raise RuntimeError(_WRITES_REFUSED.format("extend"))

    def add(self, value: Any) -> None:
        """Refused (``RuntimeError``, as TorchRL's): write to a member (``ensemble[i]``) instead."""
        raise RuntimeError(_WRITES_REFUSED.format("add"))

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Refused (TorchRL's writes nothing and returns ``None``): write to a member instead."""
        raise NotImplementedError(_WRITES_REFUSED.format("set"))

    def get(self, item: Any) -> list[tuple[int, Any]]:
        """``[(buffer_id, member.get(index)), ...]`` for ``item["buffer_ids"]`` / ``item["index"]``."""
        results = []
        for buffer_id, sample in self._requests(item):
            buffer_id = buffer_id.item() if isinstance(buffer_id, torch.Tensor) else buffer_id
            results.append((buffer_id, self._member(buffer_id).get(sample)))
        if self._transforms is not None:
            results = [(i, result if self._transforms[i] is None else self._transforms[i](result))
                       for i, result in results]
        return results

    def _requests(self, item: Any) -> zip:
        """``item``'s ``(buffer_id, index)`` pairs; one index per buffer id, else ``ValueError``."""
        try:
            buffer_ids, index = item["buffer_ids"], item["index"]
        except (KeyError, TypeError, IndexError):
            raise TypeError(f"{type(self).__name__}.get takes a mapping with 'buffer_ids' and 'index' "
                            f"(what a SamplerEnsemble samples), got {type(item).__name__}") from None
        if len(buffer_ids) != len(index):
            raise ValueError(f"{len(buffer_ids)} buffer_ids but {len(index)} entries of index: give "
                             "one index (that member's rows) per buffer id")
        return zip(buffer_ids, index)

    def _member(self, buffer_id: Any) -> Storage:
        """Member ``buffer_id``, or ``IndexError`` naming it and the number of members."""
        n = len(self._storages)
        if not -n <= buffer_id < n:
            raise IndexError(f"member {buffer_id} is out of range: the ensemble has {n} members "
                             f"(ids 0 to {n - 1}, or {-n} to -1 from the end)")
        return self._storages[buffer_id]

    def __len__(self) -> int:
        """The number of member storages (TorchRL's meaning), not of items."""
        return len(self._storages)

    def summary(self) -> Summary:
        """Filled with the rows its members hold (``len()`` counts the members), each
        member's own summary a part."""
        parts = tuple(member.summary() for member in self._storages)
        return dataclasses.replace(super().summary(), length=sum(p.length for p in parts),
                                   parts=parts)

    def __getitem__(self, index: Any) -> Any:
        """An int selects a member; a slice, list, range, array or 1-D tensor a sub-ensemble;
        a tuple selects members with its first element and indexes inside them with the rest."""
        if isinstance(index, tuple):
            if index and index[0] is Ellipsis:
                index = (slice(None), *index[1:])
            result = self[index[0]]
            if len(index) == 1:
                return result
            if result is self:
                return [storage[index[1:]] for storage in self._storages]
            if isinstance(result, StorageEnsemble):
                return result[(slice(None), *index[1:])]
            return result[index[1:]]
        if index is Ellipsis or (isinstance(index, slice) and index == slice(None)):
            return self
        chosen = self._selection(index)
        if isinstance(chosen, int):
            return self._member(chosen)
        members = [self._member(i) for i in chosen]
        transforms = [None] * len(chosen) if self._transforms is None else \
            [self._transforms[i] for i in chosen]
        return StorageEnsemble(*members, transforms=transforms)

    def _selection(self, index: Any) -> int | list[int]:
        """The member ``index`` names (an int) or those it selects (a list): TorchRL's index
        kinds, integer scalars (numpy's, 0-d tensors) and boolean masks (one flag per member)."""
        if isinstance(index, slice):
            return list(range(len(self._storages)))[index]
        if isinstance(index, (int, np.integer)):
            return int(index)
        if isinstance(index, (list, range, np.ndarray)):
            index = torch.as_tensor(index)
        if not isinstance(index, torch.Tensor):
            raise IndexError(_INDEX_ERROR.format(type(index)))
        if index.ndim > 1:
            raise RuntimeError(f"Cannot index a {type(self)} with tensor indices that have "
                               "more than one dimension.")
        if index.is_floating_point():
            raise TypeError("A floating point index was received when an integer dtype was expected.")
        if index.ndim == 0:
            return int(index)
        if not len(index):
            raise IndexError(_INDEX_ERROR.format(type(index)))
        if index.dtype == torch.bool:
            if len(index) != len(self._storages):
                raise IndexError(f"a boolean mask of {len(index)} flags cannot select among "
                                 f"{len(self._storages)} members: give one flag per member")
            return index.nonzero().flatten().tolist()
        return index.tolist()

    def state_dict(self) -> dict[str, Any]:
        """``{"0": member0.state_dict(), "1": ...}``."""
        return OrderedDict((str(i), storage.state_dict()) for i, storage in enumerate(self._storages))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load each member from its entry of :meth:`state_dict`."""
        for i, storage in enumerate(self._storages):
            storage.load_state_dict(state_dict[str(i)])

    def _empty(self) -> None:
        for storage in self._storages:
            storage._empty()

    def __repr__(self) -> str:
        storages = textwrap.indent(f"storages={self._storages}", " " * 4)
        transforms = textwrap.indent(f"transforms={self._transforms}", " " * 4)
        where = "" if self.spec is None else f"    url={self.spec.redacted()},\n"
        return f"StorageEnsemble(\n{where}{storages}, \n{transforms})"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_rng_private"] = None  # generators are process-local, as in Storage
        return state

    # -- beyond TorchRL --------------------------------------------------------------------
    def flush(self) -> None:
        """Commit every member that has something to commit."""
        for storage in self._storages:
            if hasattr(storage, "flush"):
                storage.flush()

    def close(self) -> None:
        """Close every member that can be closed (commits, releases write leases)."""
        for storage in self._storages:
            if hasattr(storage, "close"):
                storage.close()

    # -- persistence: an index group ---------------------------------------------------------
    def _member_ref(self, i: int, storage: Storage) -> str:
        spec = getattr(storage, "spec", None)
        where = f"cannot record the ensemble at {self.spec.redacted()}: member {i} ({type(storage).__name__})"
        if not isinstance(spec, StoreSpec):
            raise TypeError(f"{where} does not live in a store; every member must be a storage "
                            "at a URL (LazyMemmapStorage, CompressedListStorage, StorageEnsemble)")
        if isinstance(storage, StorageEnsemble) and self.spec.url in _urls_within(storage):
            raise ValueError(f"{where} at {spec.redacted()} holds this ensemble, and an "
                             "ensemble cannot hold itself (reopening it would never end): "
                             "record the members that member holds instead")
        if autocommit.is_temporary(storage):
            raise ValueError(f"{where} is a temporary store deleted at exit ({spec.redacted()}); "
                             "give it a scratch_dir")
        if spec.is_memory and not self.spec.is_memory:
            raise ValueError(f"{where} lives in this process's memory ({spec.redacted()}), which "
                             "no other process, and no later run, can open; give it a path or "
                             "bucket URL, or record the ensemble in memory:// too")
        if hasattr(storage, "flush"):
            storage.flush()
        if not spec.exists():
            raise ValueError(f"{where} has nothing committed at {spec.redacted()} yet; write to "
                             "it and flush() before recording the ensemble")
        prefix = self.spec.url + "/"
        return spec.url.removeprefix(prefix)

    def _write_index(self) -> None:
        from .. import __version__

        spec = self.spec
        spec.require_writable("record a StorageEnsemble")
        spec.check_parent()
        block = {"format_version": FORMAT_VERSION, "storage_class": type(self).__name__,
                 "max_size": self.max_size,
                 "members": [self._member_ref(i, s) for i, s in enumerate(self._storages)],
                 "created": {"zstore_version": __version__}}
        store = spec.open()
        try:
            group = open_plain_group(store, mode="r+")
        except (GroupNotFoundError, NodeNotFoundError, FileNotFoundError):
            new_group(store, {ZSTORE_ATTR: block})
            return
        found = group.attrs.get(ZSTORE_ATTR)
        if not (isinstance(found, Mapping) and found.get("storage_class") == type(self).__name__):
            raise StoreExistsError(
                f"{spec.redacted()} already holds a Zarr group that is not a StorageEnsemble "
                f"({found.get('storage_class') if isinstance(found, Mapping) else 'no zstore block'}); "
                "choose another location")
        put_attrs(group, {**group.attrs.asdict(), ZSTORE_ATTR: block})  # (a user's kept)

    @classmethod
    def _from_group(cls, spec: StoreSpec, group, block: Mapping[str, Any], *,
                    cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host", device: Any = None,
                    lease_ttl: float | None = DEFAULT_TTL,
                    autocommit_seconds: float = 5.0) -> StorageEnsemble:
        """Reopen a recorded ensemble (used by :func:`zstore.open`): every member, same mode."""
        where = spec.redacted()
        check_format_version(block, where)
        members = block.get("members")
        if not isinstance(members, list) or not all(
                isinstance(m, str) and m and ".." not in m.split("/") for m in members):
            raise NotAZStoreError(f"{where}: malformed StorageEnsemble block (members {members!r})")
        opening = _OPENING.get()
        if spec.url in opening:
            raise _CycleError(
                f"{where}: this StorageEnsemble is its own member, through "
                f"{' -> '.join([*opening[opening.index(spec.url):], spec.url])}; record the "
                "ensembles again so that none holds itself")
        token = _OPENING.set((*opening, spec.url))
        try:
            self = cls(*(_reopened_member(spec, i, ref, cache_bytes=cache_bytes, cache=cache,
                                          device=device, lease_ttl=lease_ttl,
                                          autocommit_seconds=autocommit_seconds)
                         for i, ref in enumerate(members)))
        finally:
            _OPENING.reset(token)
        self.spec = spec
        return self


class _CycleError(NotAZStoreError):
    """An ensemble that holds itself, raised as it is through every ensemble being reopened."""


#: The URLs of the ensembles being reopened in this context, outermost first (a cycle guard).
_OPENING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("zstore_ensembles",
                                                                         default=())


def _urls_within(storage: Storage, seen: set[int] | None = None) -> set[str]:
    """The URLs of ``storage`` and, for an ensemble, of every member, however deep."""
    seen = set() if seen is None else seen
    if id(storage) in seen:
        return set()
    seen.add(id(storage))
    spec = getattr(storage, "spec", None)
    urls = {spec.url} if isinstance(spec, StoreSpec) else set()
    for member in storage._storages if isinstance(storage, StorageEnsemble) else ():
        urls |= _urls_within(member, seen)
    return urls


def _reopened_member(spec: StoreSpec, i: int, ref: str, **options: Any) -> Storage:
    """Member ``i`` of the ensemble at ``spec``, recorded as ``ref``, reopened with the
    ensemble's ``storage_options`` and mode; an error names the ensemble, the member and the
    way on, as the member's own exception type (its nearest builtin or zstore base)."""
    url = ref if "://" in ref or ref.startswith("/") else f"{spec.url}/{ref}"
    member = StoreSpec.parse(url, spec.storage_options, read_only=spec.read_only)
    try:
        return reopen(member, **options)
    except _CycleError:
        raise  # names the whole cycle already
    except (ZStoreError, OSError) as exc:
        if isinstance(exc, (StoreNotFoundError, NotAZStoreError)):
            fix = ("restore it, or record the ensemble again without it "
                   f"(zstore.StorageEnsemble(*members, scratch_dir={spec.url!r}))")
        else:
            fix = "members are reopened with the storage_options and mode given to zstore.open"
        kind = next(c for c in type(exc).__mro__ if c.__module__ in ("builtins", ZStoreError.__module__))
        raise kind(f"cannot reopen member {i} ({member.shown_url}) of the StorageEnsemble at "
                   f"{spec.shown_url}: {exc}; {fix}") from exc
