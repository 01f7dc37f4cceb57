"""Name -> class lookups: the storage classes that reopen a store, and the checkpointers.

* :data:`STORAGE_CLASSES`: each persistent storage class by the ``storage_class`` name
  its ``zstore`` block records, filled by :mod:`zstore.storages`
  (:func:`register_storage_class`). :func:`reopen` opens a store with the class it
  names; :func:`zstore.open` and a :class:`~zstore.StorageEnsemble` reopening its
  members both call it.
* :func:`make_checkpointer`: ``zstore.storages`` must not import the ``checkpoint``
  package when it is imported (``checkpoint`` imports ``zstore``). Storages name
  their default checkpointer; the class is looked up here the first time one is
  needed. This is the one import that points up (tools/import_graph.py allows it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .autocommit import commit_interval
from .cache import byte_budget
from .errors import NotAZStoreError
from .group import ZSTORE_ATTR, open_zarr_group, read_meta
from .store import StoreSpec

#: Storage classes that can be reopened from a store, by the name recorded in its metadata.
STORAGE_CLASSES: dict[str, type] = {}


def register_storage_class(*classes: type) -> None:
    """Let :func:`reopen` open stores whose ``storage_class`` is one of ``classes``' names."""
    for cls in classes:
        STORAGE_CLASSES[cls.__name__] = cls


def reopen(spec: StoreSpec, *, cache_bytes: int, cache: str, device: Any,
           lease_ttl: float | None, autocommit_seconds: float = 5.0) -> Any:
    """The buffer at ``spec``, reopened with the class its ``zstore`` block names."""
    byte_budget(cache_bytes)  # (refused before any request)
    commit_interval(autocommit_seconds)
    group = open_zarr_group(spec)
    block = group.attrs.get(ZSTORE_ATTR)
    name = block.get("storage_class") if isinstance(block, Mapping) else None
    if hasattr(STORAGE_CLASSES.get(name), "_from_group"):  # a container of buffers
        return STORAGE_CLASSES[name]._from_group(spec, group, dict(block), cache_bytes=cache_bytes,
                                                 cache=cache, device=device, lease_ttl=lease_ttl,
                                                 autocommit_seconds=autocommit_seconds)
    meta = read_meta(group, spec.redacted())
    try:
        cls = STORAGE_CLASSES[meta.storage_class]
    except KeyError:
        raise NotAZStoreError(
            f"{spec.redacted()} records storage class {meta.storage_class!r}, which this zstore "
            f"cannot open (known: {sorted(STORAGE_CLASSES)})") from None
    return cls._from_store(spec, group, meta, cache_bytes=cache_bytes, cache=cache, device=device,
                           lease_ttl=lease_ttl, autocommit_seconds=autocommit_seconds)


def make_checkpointer(name: str) -> Any:
    """Instantiate the checkpointer class ``name`` from the ``checkpoint`` package."""
    module = importlib.import_module("checkpoint")
    try:
        cls = getattr(module, name)
    except AttributeError:
        raise NotImplementedError(
            f"checkpointer {name!r} is not available in this version of zstore; "
            "use the storage's flush() and zstore.open(url) to persist and reopen it"
        ) from None
    return cls()
