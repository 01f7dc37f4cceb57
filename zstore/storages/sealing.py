"""Sealing: turn a written LazyMemmapStorage into a published, read-only dataset, in place.

Steps, in this order (the commit is the last write, as everywhere in zstore):

1. flush the storage: every row stored in its chunk or shard (none left in
   log segments, :mod:`zstore.tail`), length and cursor committed;
2. store the all-zero chunk or shard objects of the rows that Zarr skipped, so
   that the dataset holds every object of its rows and a reader can refuse a
   missing one (a partial copy) instead of reading zeros;
3. compute the episode index from the TED done flags and store it as Zarr
   arrays (:mod:`zstore.storages.episode_index`), every chunk stored too;
4. consolidate the group's metadata into its root ``zarr.json``, so a reader
   opens the dataset with one metadata read;
5. commit the ``zstore`` block with ``sealed`` and ``read_only`` set, the
   episode count in ``extra["episodes"]`` and ``extra["all_chunks_stored"]``;
   this rewrite of the root ``zarr.json`` keeps the consolidated metadata.

A crash before step 5 leaves the buffer unsealed and writable (its data
untouched); sealing again redoes every step. ``LazyMemmapStorage.seal()`` runs
:func:`seal_storage`; :func:`zstore.seal` (:mod:`zstore.dataset.sealing`) opens a
buffer by URL and seals it.
"""

from __future__ import annotations


import zarr

from ..codecs import CodecSpec
from .episode_index import INDEX_PATH, compute_index, write_index
from ..errors import InvalidKeyError, NotAZStoreError, ReadOnlyError
from ..group import commit, consolidate
from ..layout import StoreMeta
from ..row_objects import ALL_CHUNKS_STORED, key_separator, row_object_keys
from ..signals import shielded

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
    taken = [leaf.path for leaf in storage._meta.schema.leaves
             if leaf.path.split("/")[0] == INDEX_PATH]
    if taken:  # (a buffer written before new buffers refused the name)
        raise InvalidKeyError(f"cannot seal {where}: its key {taken[0]!r} is where a dataset "
                              f"keeps its episode index; write its rows with the key renamed to a "
                              f"new buffer, and seal that one")
    storage._hold_lease()  # sealing is a write: one writer at a time
    with storage._commit_lock:  # every row in its chunk: a dataset holds no log segments,
        storage._flush(consolidate=True)  # Zarr alone reads it (and the index is made from it)
    with shielded():  # a Ctrl-C waits for the metadata: its writes would go on without it
        meta = storage._meta
        group = storage._group
        _store_skipped_objects(group, meta, storage.spec.objects())
        index = compute_index(group, meta, meta.length, meta.last_cursor)
        write_index(group, meta, index, INDEX_CODEC)
        lease = storage._lease  # held since the flush (None where a store has no lease)
        group = consolidate(group, lease)
        meta.sealed = meta.read_only = True
        meta.extra = {**meta.extra, "episodes": {"count": len(index), "path": INDEX_PATH},
                      ALL_CHUNKS_STORED: True}
        commit(group, meta, lease, where)
        storage._group = group
        storage.table.read_only = True
        storage.spec = storage.spec.as_read_only(sealed=True)
        storage._release_lease()  # a dataset has no writer
    return len(index)


def _store_skipped_objects(group: zarr.Group, meta: StoreMeta, stored) -> None:
    """Store, as zeros, every chunk or shard object of rows below ``high_water`` that is
    not among ``stored`` (keys of the store's objects): Zarr skips all-zero ones."""
    for leaf in meta.schema.leaves:
        array = group[leaf.path]
        chunk_rows, shard_rows = meta.layout[leaf.path]
        per_object = shard_rows or chunk_rows
        keys = row_object_keys(leaf.path, array.shape, key_separator(array.metadata.to_dict())
                               or "/", meta.high_water, per_object)
        every = array.with_config({"write_empty_chunks": True})
        for i, key in enumerate(keys):
            if key not in stored:
                every[i * per_object:min((i + 1) * per_object, meta.rows)] = 0
