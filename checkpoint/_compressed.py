"""CompressedListStorageCheckpointer: a CompressedListStorage's compressed chunks, copied.

A CompressedListStorage already lives as Zarr arrays plus a JSON root block
(format.md §9). A dump flushes it and copies those objects into a new
generation of the destination (server-side where source and destination share
a store), then commits; a load copies them into the storage's own location and
reopens them. Nothing is decompressed or recompressed, nothing is pickled.

Incremental dumps. The storage's inner tables (zstore buffers: the items table,
each ragged key's index and values) stamp every written row with a write
revision. A dump remembers, on the storage, per destination: the generation it
wrote, each table object with its revision, and the listing entry (size plus
ETag / mtime / inode / creation time) of every object it copied. The next dump
to that destination carries a chunk (or shard) object over from that generation
(``Destination.copy_objects``: a hard link locally, a server-side copy on object
stores) only when all of these hold:

* the commit record still names that generation (no other writer came in between);
* the object belongs to the same table object (a table recreated — a key turned
  ragged, values compacted, the storage emptied, reopened or loaded — restarts
  its revisions, so all its objects are copied), and no row of its chunk was
  written since;
* its listing entry is what it was at the last dump (a write from outside this
  storage object, e.g. another process, changes the ETag / mtime), and the
  previous generation holds it with the same size.

Every other object — metadata included — is copied from the storage. Hard
links are safe: a generation's files are never rewritten (a new generation
gets new files, linked or copied), and the storage's own files are only ever
copied, never linked, so a chunk the storage rewrites (in place, should a store
ever write that way) cannot reach a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from zstore.format_version import unknown_fields
from zstore.row_objects import chunk_key
from zstore.lease import LEASE_NAME
from zstore.storages.compressed import BLOCK_FIELDS
from zstore.storages.checkpoint_contract import CompressedCheckpointable
from zstore.store import StoreSpec

from ._base import _Configured
from ._buffer import _changed_chunks
from ._chunks import DAMAGED, missing_chunk_error
from ._dest import CheckpointError, Destination, fault_point, refuse_newer_generation
from ._state import changed_rows
from ._torchrl import is_torchrl_dir

#: The commit record's listing of a generation's objects, ``{relative path: bytes}``.
FILES = "files"

#: Listing fields that change when an object is rewritten (S3, local disk, memory://).
_SIGNATURE_FIELDS = ("ETag", "mtime", "ino", "created", "LastModified")


def _needed(storage: Any, files: dict[str, Any]) -> dict[str, Any]:
    """The objects of ``files`` (a :func:`listing` of ``storage``'s location) that its commit
    names: the root's, the tables' and their parents' metadata. A table left behind (one a
    later commit deletes, or an older zstore's) is not copied: an older reader of the
    checkpoint paired it with the new tables, and read wrong items."""
    tables = [f"{path}/" for path in storage.checkpoint_tables()]
    def needed(name: str) -> bool:
        folder = name.rpartition("/")[0]
        return name.startswith(tuple(tables)) or (
            name.rpartition("/")[2] == "zarr.json"
            and (not folder or any(table.startswith(f"{folder}/") for table in tables)))

    return {name: info for name, info in files.items() if needed(name)}


def listing(spec: StoreSpec) -> dict[str, Mapping[str, Any]]:
    """``{relative path: fsspec-style info}`` of the objects below ``spec`` (no lease, no
    partials); local directories are walked directly (fsspec's ``find`` is several times
    slower there)."""
    if not spec.is_local:
        found = spec.objects()
    else:
        found = {}
        for folder, _, names in os.walk(spec.url):
            for name in names:
                path = os.path.join(folder, name)
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    found[os.path.relpath(path, spec.url).replace(os.sep, "/")] = {
                        "size": st.st_size, "mtime": st.st_mtime_ns,
                        "ino": st.st_ino, "created": st.st_ctime_ns}
    return {rel: info for rel, info in found.items()
            if rel and rel != LEASE_NAME and not rel.rsplit("/", 1)[-1].endswith(".partial")}


def signature(info: Mapping[str, Any]) -> tuple:
    """What identifies one version of an object in a listing: its size and version fields."""
    return (int(info["size"]), *(str(info.get(name)) for name in _SIGNATURE_FIELDS))


def copy_files(src: StoreSpec, dst: StoreSpec, names: list[str]) -> None:
    """Copy the objects ``names`` (relative paths) from below ``src`` to below ``dst``
    (server-side where both are the same store)."""
    src_fs, src_root = src.filesystem()
    dst_fs, dst_root = dst.filesystem()
    same = type(src_fs) is type(dst_fs) and src.storage_options == dst.storage_options

    def one(name: str) -> None:
        source, target = f"{src_root.rstrip('/')}/{name}", f"{dst_root.rstrip('/')}/{name}"
        dst_fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        if same:
            src_fs.cp_file(source, target)  # (copy would expand a key's glob characters)
        else:
            dst_fs.pipe_file(target, src_fs.cat_file(source))
        fault_point("write")

    if src.is_memory or dst.is_memory or src.is_local:
        for name in names:
            one(name)
    else:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, names))


def _require_files(gen: StoreSpec, recorded: Mapping[str, int] | None,
                   held: Mapping[str, Mapping[str, Any]]) -> None:
    """:class:`CheckpointError` naming the first object the commit record lists (``None``:
    a generation committed before records listed them) that ``gen`` lacks or holds cut."""
    where = gen.url.rstrip("/")
    for name, size in (recorded or {}).items():
        if name not in held:
            raise missing_chunk_error(f"{where}/{name}")
        if int(held[name]["size"]) != size:
            raise CheckpointError(f"object {where}/{name} holds {held[name]['size']} bytes, "
                                  f"expected {size}: {DAMAGED}")


class TableMark(NamedTuple):
    """One inner table as it was at a dump (or load)."""

    table: weakref.ref          # the table object
    revs: weakref.ref | None    # its row-revision tensor (None: no row written yet)
    revision: int               # its write revision
    created: bool               # whether its arrays existed


@dataclasses.dataclass
class Mark:
    """What a storage remembers of its last dump to (or load from) one destination."""

    generation: str
    tables: dict[str, TableMark]
    #: relative path -> listing signature of every object the generation took from the storage
    objects: dict[str, tuple]


def _mark(storage: CompressedCheckpointable, generation: str,
          files: Mapping[str, Mapping[str, Any]]) -> Mark:
    tables = {}
    for name, part in storage.checkpoint_tables().items():
        revs = part.checkpoint_revisions
        tables[name] = TableMark(weakref.ref(part), None if revs is None else weakref.ref(revs),
                                 part.checkpoint_revision, _created(part))
    return Mark(generation, tables, {name: signature(info) for name, info in files.items()})


def _created(part: Any) -> bool:
    return part.checkpoint_meta is not None and part.initialized


def _unchanged(part: Any, name: str, known: TableMark, files: Mapping[str, Any]) -> set[str]:
    """The objects of table ``part`` (at ``name``) among ``files`` unchanged since ``known``:
    chunks / shards none of whose rows was written since, and the arrays' metadata (a
    zstore buffer writes it once, creating the arrays; only the table's own ``zarr.json``,
    its commit, changes)."""
    if not (known.created and _created(part)):
        return set()
    meta = part.checkpoint_meta
    rows = changed_rows(part.checkpoint_revisions, known.revision)
    if rows is None:  # no row written since the table was opened
        rows = np.zeros(0, dtype=np.int64)
    out = {key for key in files if key.startswith(f"{name}/") and key.endswith("/zarr.json")
           and key != f"{name}/zarr.json"}
    for leaf in meta.schema.leaves:
        chunk, shard = meta.layout[leaf.path]
        block = shard or chunk
        changed = _changed_chunks(rows, block, -(-meta.rows // block))
        ndim = 1 + len(leaf.shape)
        for i in np.flatnonzero(~changed).tolist():
            key = f"{name}/{chunk_key(leaf.path, ndim, i)}"
            if key in files:
                out.add(key)
    return out


def _carry_over(storage: CompressedCheckpointable, dest: Destination,
                previous: Mapping[str, Any] | None,
                files: Mapping[str, Mapping[str, Any]]) -> tuple[str, set[str]] | None:
    """(previous generation, objects to carry over from it) when ``storage`` can dump
    incrementally onto it, else None (see the module docstring)."""
    mark = storage.checkpoint_marks.get(dest.url)
    if mark is None or previous is None or previous.get("form") != "compressed" \
            or previous.get("generation") != mark.generation:
        return None
    old = listing(dest.child(mark.generation))
    if "zarr.json" not in old:
        return None
    carry = set()
    for name, part in storage.checkpoint_tables().items():
        known = mark.tables.get(name)
        if known is None or known.table() is not part:
            continue
        if known.revs is not None and known.revs() is not part.checkpoint_revisions:
            continue  # the revisions were reset: nothing of this table is known
        carry |= _unchanged(part, name, known, files)
    return mark.generation, {
        name for name in carry
        if name in old and int(old[name]["size"]) == int(files[name]["size"])
        and mark.objects.get(name) == signature(files[name])}


class CompressedListStorageCheckpointer(_Configured):
    """Checkpoints of :class:`zstore.CompressedListStorage` at any URL (atomic, JSON + Zarr).

    A second dump to the same destination copies only the objects that changed
    since and carries the others over (hard links locally, server-side copies on
    object stores); see the module docstring for when.
    """

    def _stage(self, storage: Any, dest: Destination) -> dict[str, Any]:
        """Write a new generation at ``dest`` (not yet committed); return its commit record.

        The storage's mark for ``dest`` names the new generation at once: should the
        commit not happen, the commit record names another generation and the next
        dump copies everything.
        """
        if not len(storage):
            raise RuntimeError("Cannot save an empty or non-initialized CompressedListStorage.")
        storage.flush()
        files = _needed(storage, listing(storage.spec))
        base = _carry_over(storage, dest, dest.read_commit(), files)
        carried = set() if base is None else base[1]
        gen = dest.new_generation()
        written = sorted(set(files) - carried)
        copy_files(storage.spec, dest.child(gen), written)
        if base is not None:
            dest.copy_objects((f"{base[0]}/{name}", f"{gen}/{name}") for name in sorted(carried))
        storage.checkpoint_marks[dest.url] = _mark(storage, gen, files)
        return {"checkpointer": type(self).__name__, "form": "compressed", "generation": gen,
                "length": len(storage), "max_size": storage.max_size,
                "incremental": base is not None,
                "bytes_written": sum(int(files[name]["size"]) for name in written),
                # every object and its size: a load refuses a generation that lost or cut one
                # (Zarr reads a missing chunk as zeros; all-zero chunks are never stored)
                FILES: {name: int(info["size"]) for name, info in sorted(files.items())}}

    def loads(self, storage: Any, path: Any) -> None:
        dest = self._dest(path)
        record = dest.read_commit()
        if record is None:
            raise self._uncommitted_error(dest)
        self._load_record(storage, dest, record)

    @staticmethod
    def _uncommitted_error(dest: Destination) -> CheckpointError:
        """What a destination without a commit record holds instead, and the way on."""
        if dest.holds_buffer():
            return CheckpointError(f"{dest.redacted()} holds a zstore buffer, not a "
                                   "CompressedListStorage checkpoint: open it with "
                                   "zstore.open(url)")
        if is_torchrl_dir(dest):
            return CheckpointError(f"{dest.redacted()} holds a checkpoint of TorchRL's tensor "
                                   "storage, not of a CompressedListStorage: load it into a "
                                   "LazyTensorStorage or LazyMemmapStorage")
        if dest.read_json("data_indices.json") is not None:  # TorchRL's own compressed dump
            return CheckpointError(
                f"{dest.redacted()} holds a checkpoint of TorchRL's own CompressedListStorage, "
                "which zstore's does not read: load it into TorchRL's, then pass its "
                "state_dict() to this storage's load_state_dict()")
        return dest.uncommitted_error()

    def _check_record(self, storage: Any, dest: Destination, record: Mapping[str, Any]) -> list:
        """Refuse, changing nothing, a generation ``record`` names that cannot load into
        ``storage`` (another form, another capacity, an object lost or cut short); else
        the objects it holds (a StorageEnsemble checks every member before it loads one)."""
        if record.get("form") != "compressed":
            raise CheckpointError(f"{dest.redacted()} holds a {record.get('checkpointer')} "
                                  "checkpoint, not a CompressedListStorage one")
        gen = dest.child(str(record["generation"]))
        block = storage.checkpoint_block(gen)
        if block is None:
            raise CheckpointError(f"{gen.redacted()}: the committed generation is missing")
        refuse_newer_generation(gen, unknown_fields(block, BLOCK_FIELDS))
        if int(block["max_size"]) != storage.max_size:
            raise CheckpointError(f"{dest.redacted()} holds a CompressedListStorage of max_size "
                                  f"{block['max_size']}; this storage has max_size {storage.max_size}")
        held = listing(gen)
        _require_files(gen, record.get(FILES), held)
        return held

    def _load_record(self, storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        held = self._check_record(storage, dest, record)
        name = str(record["generation"])
        gen = dest.child(name)

        def fill() -> None:  # the storage's location, emptied: the generation's objects
            leftovers = listing(storage.spec)  # all but the lease, which the storage keeps
            if leftovers:
                fs, root = storage.spec.filesystem()
                fs.rm([f"{root.rstrip('/')}/{name}" for name in leftovers])
            copy_files(gen, storage.spec, sorted(held))

        storage.checkpoint_replace(fill)
        storage.checkpoint_marks = {dest.url: _mark(storage, name, listing(storage.spec))}
