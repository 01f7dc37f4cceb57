"""The tensor-storage checkpointers (TensorStorage, Flat, Nested), and ListStorage's refusal."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tensordict import TensorDict, is_tensor_collection

from zstore.layout import Schema

from ._base import StorageCheckpointerBase, _Configured
from ._buffer import dump_buffer, load_buffer
from ._dest import CheckpointError, Destination
from ._state import TensorState, require_fit, restore, shift_of
from ._ted import (
    DEFAULT_DONE_KEYS,
    META,
    Flat2TED,
    Nested2TED,
    TED2Flat,
    TED2Nested,
    expand,
)
from ._torchrl import is_torchrl_dir, load_torchrl_dir
from ._tree import read_tree, write_tree


class ListStorageCheckpointer(StorageCheckpointerBase):
    """ListStorage holds arbitrary Python objects: like TorchRL, it refuses dumps/loads."""

    def dumps(self, storage: Any, path: Any) -> None:
        raise NotImplementedError("ListStorage doesn't support serialization via `dumps` - `loads` API.")

    def loads(self, storage: Any, path: Any) -> None:
        raise NotImplementedError("ListStorage doesn't support serialization via `dumps` - `loads` API.")


class TensorStorageCheckpointer(_Configured):
    """Checkpoints of TensorStorage / LazyTensorStorage / LazyMemmapStorage at any URL.

    ``dumps(storage, url)`` writes a new generation below ``url`` — a zstore buffer
    of the filled rows, with the length and write cursor — then commits it (one
    object) and deletes the previous one; dumping again to the same place writes
    only the chunks changed since (the others are linked / copied server-side).
    ``loads`` restores the storage (with its capacity, length and cursor), also
    into a storage not yet initialised, and reads TorchRL's own checkpoints.
    With save/load hooks registered, the hooks' output is stored as a tree; as in
    TorchRL, a save hook may return a tensor or a pytree (loaded back without load
    hooks, as the storage's rows).

    Args:
        codec: compression preset of the checkpoint (default raw: fastest).
        chunks: rows per chunk (default: about 1 MiB per key locally, 4 MiB elsewhere).
        storage_options: fsspec options for URLs (or pass a ``zstore.StoreSpec``).
        progress: show a progress bar on a terminal for long transfers.
    """

    def _stage(self, storage: Any, dest: Destination) -> dict[str, Any]:
        if self._save_hooks:
            return self._dump_tree(storage, dest)
        return dump_buffer(storage, dest, codec=self.codec, chunks=self.chunks,
                           progress=self.progress, checkpointer=type(self).__name__)

    @staticmethod
    def _finish(storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        """Commit, delete the other generations, remember this one for incremental dumps."""
        _Configured._finish(storage, dest, record)
        if record["form"] == "buffer":
            storage.checkpoint_marks = {dest.url: (record["generation"], record["revision"])}

    def _dump_tree(self, storage: Any, dest: Destination) -> dict[str, Any]:
        state = TensorState.of(storage)
        rows = state.rows if state.is_full else state.high
        data = state.data(0, rows)
        shift = shift_of(state)
        for hook in self._save_hooks:
            if hasattr(hook, "shift"):
                hook.shift = shift
            if hasattr(hook, "is_full"):
                hook.is_full = state.is_full
            data = hook(data, path=dest.url)
        tree, leaves = _as_tree(data)
        gen = dest.new_generation()
        written = write_tree(dest.child(gen), tree, self.codec, self.progress)
        return {"checkpointer": type(self).__name__, "form": "tree", "generation": gen,
                "bytes_written": written,
                "length": state.length, "last_cursor": state.last_cursor,
                "max_size": state.max_size, "rows": state.rows, "ndim": state.ndim,
                "schema": state.schema.to_json(),
                "hooked": None if leaves is None else leaves.to_json()}

    def loads(self, storage: Any, path: Any) -> None:
        dest = self._dest(path)
        record = dest.read_commit()
        if record is None:
            self._load_uncommitted(storage, dest)
            return
        self._load_record(storage, dest, record)

    def _check_record(self, storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        """Refuse, reading nothing and changing nothing, a generation ``record`` names that
        this checkpointer cannot load into ``storage``: another form, or another capacity
        or ndim (a StorageEnsemble checks every member so before it loads the first)."""
        form = record.get("form")
        if form not in ("buffer", "tree"):
            raise CheckpointError(f"{dest.redacted()} holds a {record.get('checkpointer')} "
                                  f"checkpoint, which {type(self).__name__} cannot load into a "
                                  f"{type(storage).__name__}")
        if form == "buffer" and self._load_hooks:
            raise CheckpointError(
                f"{dest.redacted()} holds a {record.get('checkpointer', 'zstore')} checkpoint "
                f"written without save hooks, which this {type(self).__name__} (with load "
                "hooks) cannot load: load it with a TensorStorageCheckpointer")
        if not all(isinstance(record.get(name), int) for name in ("rows", "ndim", "max_size")):
            return  # (not recorded: the load checks them as it reads the generation)
        require_fit(storage, record["rows"], record["max_size"], record["ndim"], dest.redacted())

    def _load_record(self, storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        """Load the generation ``record`` names."""
        self._check_record(storage, dest, record)
        if record["form"] == "buffer":
            load_buffer(storage, dest, record, self.progress)
        else:
            self._load_tree(storage, dest, record)

    def _load_uncommitted(self, storage: Any, dest: Destination) -> None:
        if dest.holds_buffer():
            load_buffer(storage, dest, None, self.progress)
        elif is_torchrl_dir(dest):
            load_torchrl_dir(storage, dest)
        elif dest.url.endswith(".h5") or "checkpoint.h5" in dest.children():
            from ._h5 import H5StorageCheckpointer

            H5StorageCheckpointer(progress=self.progress).loads(storage, dest.spec)
        else:
            raise dest.uncommitted_error()

    def _load_tree(self, storage: Any, dest: Destination, record: Mapping[str, Any]) -> None:
        hooked = record.get("hooked")  # the schema of save hooks' tensor / pytree output
        if hooked is not None and self._load_hooks:
            raise CheckpointError(
                f"{dest.redacted()} holds a tensor or pytree that save hooks returned; load "
                "hooks cannot run on it (TorchRL: \"Loading hooks are not compatible with "
                "PyTree storages\"): load it with a checkpointer without load hooks")
        data = read_tree(dest.child(str(record["generation"])), self.progress)
        if hooked is not None:  # the storage's rows, as TorchRL loads them
            leaves = Schema.from_json(hooked)
            data = leaves.build({leaf.path: data.get(leaf.key) for leaf in leaves.leaves}, ())
            restore(storage, data, record, None, dest.redacted())
            return
        if self._load_hooks:
            for hook in self._load_hooks:
                data = hook(data, out=None)
        elif META in data:
            data = expand(data)
        else:
            raise CheckpointError(f"{dest.redacted()} was written with save hooks; register the "
                                  "matching load hooks to read it")
        schema = Schema.from_json(record["schema"]) if not self._load_hooks else None
        restore(storage, data, record, schema, dest.redacted())


def _as_tree(data: Any) -> tuple[Any, Schema | None]:
    """Save hooks' output as a tree: a tensor collection as it is; a tensor or a pytree of
    tensors (TorchRL saves those too) as a TensorDict of its leaves, with the schema that
    rebuilds it."""
    if is_tensor_collection(data):
        return data, None
    leaves = Schema.from_example(data)  # the whole output as one item: leaves keep every dim
    columns = leaves.columns(data, 0)
    tree = TensorDict()
    for leaf in leaves.leaves:
        tree.set(leaf.key, columns[leaf.path])
    return tree, leaves


class FlatStorageCheckpointer(TensorStorageCheckpointer):
    """TED storages in the lossless compact form (one copy of ``obs`` per step plus one
    per segment end); see :mod:`checkpoint._ted` for how it improves on TorchRL's."""

    _hooks = (TED2Flat, Flat2TED)

    def __init__(self, done_keys: Iterable[Any] | None = None,
                 reward_keys: Iterable[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**{k: v for k, v in kwargs.items()
                            if k in ("codec", "chunks", "storage_options", "progress")})
        hook_kw = {k: v for k, v in kwargs.items() if k in ("done_key", "shift_key", "is_full_key")}
        done_keys = DEFAULT_DONE_KEYS if done_keys is None else tuple(done_keys)
        reward_keys = ("reward",) if reward_keys is None else tuple(reward_keys)
        save, load = self._hooks
        self.register_save_hook(save(done_keys=done_keys, reward_keys=reward_keys, **hook_kw))
        self.register_load_hook(load(done_keys=done_keys, reward_keys=reward_keys))


class NestedStorageCheckpointer(FlatStorageCheckpointer):
    """As :class:`FlatStorageCheckpointer`, with per-segment lengths (trajectories)."""

    _hooks = (TED2Nested, Nested2TED)
