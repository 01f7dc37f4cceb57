"""Sealing: turn a written LazyMemmapStorage into a published, read-only dataset, in place.

Steps, in this order (the commit is the last write, as everywhere in zstore):

1. flush the storage: every row stored, length and cursor committed;
2. compute the episode index from the TED done flags and store it as Zarr
   arrays (:mod:`zstore.storages.episode_index`);
3. consolidate the group's metadata into its root ``zarr.json``, so a reader
   opens the dataset with one metadata read;
4. commit the ``zstore`` block with ``sealed`` and ``read_only`` set, the
   episode count in ``extra["episodes"]``; this rewrite of the root
   ``zarr.json`` keeps the consolidated metadata.

A crash before step 4 leaves the buffer unsealed and writable (its data
untouched); sealing again redoes every step. ``LazyMemmapStorage.seal()`` runs
:func:`seal_storage`; :func:`zstore.seal` (:mod:`zstore.dataset.sealing`) opens a
buffer by URL and seals it.
"""

from __future__ import annotations

from ..codecs import CodecSpec
from .episode_index import INDEX_PATH, compute_index, write_index
from ..errors import NotAZStoreError, ReadOnlyError
from ..group import commit, consolidate

#: Codec of the episode index arrays (small; checksummed like published data).
INDEX_CODEC = CodecSpec.parse("zstd+crc32c")


def seal_storage(storage) -> int:
    """Seal a writable :class:`~zstore.LazyMemmapStorage` in place; returns the episode count."""
    where = storage.spec.redacted()
    if storage._meta is not None and storage._meta.sealed:
        raise ReadOnlyError(f"cannot seal {where}: it is already a sealed dataset")
    storage.spec.require_writable("seal the buffer")
    if not storage.initialized:
        raise NotAZStoreError(f"cannot seal {where}: nothing was written to it")
    if storage._meta.read_only:
        raise ReadOnlyError(f"cannot seal {where}: the buffer is marked read-only")
    if len(storage) == 0:  # arrays created, no row committed (emptied, or an import killed)
        raise NotAZStoreError(
            f"cannot seal {where}: it holds no rows (length 0), so there is nothing to publish; "
            "write rows first (an import or `zstore convert` that was interrupted left it: "
            "delete it and run it again)")
    storage._hold_lease()  # sealing is a write: one writer at a time
    storage.flush()
    meta = storage._meta
    group = storage._group
    index = compute_index(group, meta, meta.length, meta.last_cursor)
    write_index(group, meta, index, INDEX_CODEC)
    lease = storage._lease  # held since the flush (None where a store has no lease)
    group = consolidate(group, lease)
    meta.sealed = meta.read_only = True
    meta.extra = {**meta.extra, "episodes": {"count": len(index), "path": INDEX_PATH}}
    commit(group, meta, lease, where)
    storage._group = group
    storage.table.read_only = True
    storage.spec = storage.spec.as_read_only(sealed=True)
    storage._release_lease()  # a dataset has no writer
    return len(index)
