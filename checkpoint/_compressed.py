"""CompressedListStorageCheckpointer: a CompressedListStorage's compressed chunks, copied.

A CompressedListStorage already lives as Zarr arrays plus a JSON root block
(format.md §9). A dump flushes it and copies those objects into a new
generation of the destination (server-side where source and destination share
a store), then commits; a load copies them into the storage's own location and
reopens them. Nothing is decompressed or recompressed, nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zstore.storages.compressed import _open_root, _root_block
from zstore.store import StoreSpec

from ._dest import CheckpointError, Destination, fault_point
from ._tensor import _Configured


def copy_tree(src: StoreSpec, dst: StoreSpec) -> int:
    """Copy every object below ``src`` to the same relative path below ``dst``."""
    src_fs, src_root = src.filesystem()
    dst_fs, dst_root = dst.filesystem()
    src_fs.invalidate_cache()
    try:
        files = [f for f in src_fs.find(src_root) if not f.rsplit("/", 1)[-1].endswith(".partial")]
    except FileNotFoundError:
        files = []
    same = type(src_fs) is type(dst_fs) and src.storage_options == dst.storage_options

    def one(path: str) -> None:
        target = f"{dst_root.rstrip('/')}/{path[len(src_root.rstrip('/')):].lstrip('/')}"
        if same:
            dst_fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            src_fs.copy(path, target)
        else:
            dst_fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            dst_fs.pipe_file(target, src_fs.cat_file(path))
        fault_point("write")

    if src.protocol == "memory" or dst.protocol == "memory" or src.is_local:
        for path in files:
            one(path)
    else:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, files))
    return len(files)


class CompressedListStorageCheckpointer(_Configured):
    """Checkpoints of :class:`zstore.CompressedListStorage` at any URL (atomic, JSON + Zarr)."""

    def dumps(self, storage: Any, path: Any) -> None:
        dest = self._dest(path)
        dest.check_writable()
        record = self._stage(storage, dest)
        dest.commit(record)
        dest.remove_others(keep=record["generation"])

    def _stage(self, storage: Any, dest: Destination) -> dict[str, Any]:
        if not len(storage):
            raise RuntimeError("Cannot save an empty or non-initialized CompressedListStorage.")
        storage.flush()
        gen = dest.new_generation()
        copy_tree(storage.spec, dest.child(gen))
        return {"checkpointer": type(self).__name__, "form": "compressed", "generation": gen,
                "length": len(storage), "max_size": storage.max_size}

    @staticmethod
    def _finish(storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        dest.commit(record)
        dest.remove_others(keep=record["generation"])

    def loads(self, storage: Any, path: Any) -> None:
        dest = self._dest(path)
        record = dest.read_commit()
        if record is None:
            raise CheckpointError(f"no committed checkpoint at {dest.redacted()}")
        self._load_record(storage, dest, record)

    def _load_record(self, storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        if record.get("form") != "compressed":
            raise CheckpointError(f"{dest.redacted()} holds a {record.get('checkpointer')} "
                                  "checkpoint, not a CompressedListStorage one")
        gen = dest.child(str(record["generation"]))
        block = _root_block(gen)
        if block is None:
            raise CheckpointError(f"{gen.redacted()}: the committed generation is missing")
        if int(block["max_size"]) != storage.max_size:
            raise CheckpointError(f"{dest.redacted()} holds a CompressedListStorage of max_size "
                                  f"{block['max_size']}; this storage has max_size {storage.max_size}")
        storage.spec.require_writable("load a checkpoint")
        storage._drop_arrays()
        storage._reset()
        if storage.spec.exists():
            storage.spec.delete()
        copy_tree(gen, storage.spec)
        storage._root = _open_root(storage.spec)
        storage._restore(_root_block(storage.spec))
