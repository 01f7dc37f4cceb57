"""TensorStorage and LazyTensorStorage: fixed-capacity storages of tensors (SPEC §2.5, §2.6).

:class:`TensorStorage` holds the TorchRL semantics every tensor storage shares
(length counting, last cursor, ``shape``, ``ndim > 1`` rounding, ``contains``,
conditional patches). Where the rows live is delegated to four hooks —
``_init``, ``_read``, ``_write`` and ``_container_shape`` — which the in-RAM
classes implement here and :class:`~zstore.LazyMemmapStorage` implements on Zarr.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import warnings
import weakref
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    TensorDict,
    is_tensor_collection,
    is_tensorclass,
)
from torch.utils import _pytree as pytree

from ..display import KeyRow, Summary, dtype_name, tensor_leaves
from ..errors import SchemaError
from ..layout import Schema
from ..sharing import InitRendezvous, count_rows, counter
from ..text import TEXT_BYTES, holds_value, is_text, non_tensor_leaves, widest
from .base import Storage, capacity, refuse_spawn_sharing
from .checkpoint_contract import TensorExport
from .row_index import is_int, is_negative, without_new_axes
from .row_stamps import RowStamps
from .shared_rows import create_shared_rows, open_shared_rows


def _first_leaf(data: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data
    if is_tensor_collection(data):
        return data
    leaves = pytree.tree_leaves(data)
    if not leaves:
        raise ValueError("the storage holds no tensor")
    return leaves[0]


def lead_shape(data: Any, n: int) -> tuple[int, ...]:
    """The first ``n`` dims of a tensor, tensor collection or pytree."""
    if is_tensor_collection(data):
        return tuple(data.batch_size[:n])
    return tuple(_first_leaf(data).shape[:n])


def _stack(data: list) -> Any:
    try:
        if all(isinstance(x, torch.Tensor) for x in data):
            return torch.stack(data)
        if all(is_tensor_collection(x) for x in data):
            return torch.stack(data) if not isinstance(data[0], LazyStackedTensorDict) \
                else LazyStackedTensorDict.lazy_stack(data)
        return pytree.tree_map(lambda *xs: torch.stack(xs), data[0], *data[1:])
    except Exception as exc:
        raise RuntimeError(
            "Stacking the elements of the list resulted in an error. Storages expect items "
            "that can be stacked; to store a compact pytree, pass a tuple instead of a list."
        ) from exc


def _resolve_device(device: Any) -> Any:
    if device is None or device == "auto":
        return device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class TensorStorage(Storage):
    """A storage over a preallocated container: a tensor, a TensorDict, a tensorclass or a pytree.

    Args:
        storage: the container (its first dim is the capacity), or ``None``
            for lazily initialised subclasses.
        max_size: capacity; must match ``storage``'s first dim when both are given.
        device: where the data lives; ``"auto"`` takes the container's device.
        ndim: number of leading dims that index cells (``2`` for ``[time, env]``).

    >>> s = TensorStorage(torch.zeros(4, 2))
    >>> len(s), s.get(1).shape
    (4, torch.Size([2]))
    """

    supports_conditional_update = True
    _default_checkpointer = "TensorStorageCheckpointer"
    _len_value = counter("length", also=("written",))  # set whole: the count starts there
    _write_rev = counter("write_rev")
    #: TorchRL's ``shared_init``: who creates the rows (:class:`.sharing.InitRendezvous`)
    _rendezvous: InitRendezvous | None = None
    #: whether the per-row write stamps are in shared memory with the counters
    _revisions_shared = False

    @property
    def _shares_init(self) -> bool:
        """Whether the storage was made with ``shared_init=True``."""
        return self._rendezvous is not None

    def __init__(self, storage: Any, max_size: int | None = None, *, device: Any = "cpu",
                 ndim: int = 1, compilable: bool = False):
        if storage is None and max_size is None:
            raise ValueError("Expected storage to be non-null.")
        if max_size is not None:
            max_size = capacity(type(self).__name__, max_size)
        if isinstance(ndim, bool) or not hasattr(ndim, "__index__") or ndim < 1:
            raise ValueError(f"{type(self).__name__}: ndim={ndim!r}: give the number of leading "
                             f"dimensions the storage indexes, a whole number >= 1 (1: rows)")
        ndim = int(ndim)
        if storage is None and max_size < 1:  # (else refused at the first write, unnamed)
            raise ValueError(f"{type(self).__name__}: max_size={max_size} holds no row; "
                             "give the capacity, a positive number of cells")
        if storage is not None:
            first = lead_shape(storage, ndim)
            if max_size is not None and max_size != first[0]:
                raise ValueError(
                    f"The max-size and the storage shape mismatch: got max_size={max_size} for a "
                    f"storage of shape {first}."
                )
            max_size = math.prod(first)
        super().__init__(max_size, compilable=compilable)
        self.ndim = ndim
        self.initialized = storage is not None
        self._storage = storage
        self._len_value = int(max_size) if storage is not None else 0
        self._last_cursor = None
        # per-row write revisions: checkpoints know which chunks changed without hashing
        self._row_rev: RowStamps | None = None
        self._write_rev = 0
        self.checkpoint_marks: dict[str, tuple[str, int]] = {}  # checkpoint_contract.py
        if device == "auto" and storage is not None:
            device = _first_leaf(storage).device
        self.device = _resolve_device(device)

    # -- sizes ----------------------------------------------------------------------------
    @property
    def _len(self) -> int:
        return self._len_value

    @_len.setter
    def _len(self, value: int) -> None:
        self._len_value = int(value)

    def __len__(self) -> int:
        return self._len_value

    def _container_shape(self) -> tuple[int, ...]:
        """The first ``ndim`` dims of the (initialised) container."""
        return lead_shape(self._storage, self.ndim)

    @property
    def _total_shape(self) -> torch.Size | None:
        """The container's first ``ndim`` dims; ``None`` before the first write (as TorchRL)."""
        if not self.initialized:
            return None
        return torch.Size(self._container_shape())

    @property
    def _lanes(self) -> int:
        return math.prod(self._container_shape()[1:])

    @property
    def _len_along_dim0(self) -> int | None:
        """Filled rows; before the first write ``0`` (``ndim == 1``) or ``None`` (``ndim > 1``:
        the lanes per row are not known yet), as TorchRL."""
        if not self.initialized:
            return 0 if self.ndim == 1 else None
        return -(-self._len_value // self._lanes)

    @property
    def shape(self) -> torch.Size | None:
        """``None`` when uninitialised; ``[filled rows, *lanes]`` (all rows when full)."""
        if not self.initialized:
            return None
        total = self._total_shape
        if self._is_full:
            return total
        return torch.Size([self._len_along_dim0, *total[1:]])

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        if self.ndim == 1:
            return self.max_size
        if self.initialized:
            return -(-self.max_size // self._lanes)
        if single_data is not None:
            lanes = math.prod(lead_shape(single_data, self.ndim - 1))
        elif batched_data is not None:
            lanes = math.prod(lead_shape(batched_data, self.ndim)[1:])
        else:
            raise ValueError("single_data or batched_data must be passed.")
        return -(-self.max_size // lanes)

    def _rows_for(self, example: Any) -> int:
        """Rows to allocate for ``example`` (rounds ``max_size`` up to whole rows when ndim > 1)."""
        lanes = math.prod(lead_shape(example, self.ndim - 1)) if self.ndim > 1 else 1
        rows = -(-self.max_size // lanes)
        self.max_size = rows * lanes
        return rows

    # -- hooks for subclasses -------------------------------------------------------------
    def _init(self, example: Any, text_bytes: int = 0) -> None:
        """Allocate for rows like ``example``; ``text_bytes``: the text cells the rows to
        come need (:mod:`zstore.text`; a storage that keeps strings as they are ignores it)."""
        raise TypeError(
            f"{type(self).__name__} must be initialized during construction: pass a container, "
            "or use LazyTensorStorage / LazyMemmapStorage"
        )

    def _read(self, index: Any) -> Any:
        container = self._storage
        if not self._is_full:
            n = self._len_along_dim0
            container = map_leaves(container, lambda x: x[:n])
        if isinstance(index, torch.Tensor) and self.device is not None and self.device != "auto":
            index = index.to(_first_leaf(container).device)
        return map_leaves(container, lambda x: x[index])

    def _write(self, cursor: Any, data: Any) -> None:
        container = self._storage
        device = _first_leaf(container).device
        if isinstance(cursor, torch.Tensor) and getattr(device, "type", None) != "meta":
            cursor = cursor.to(device)  # (not to meta: the positions are checked first)
        if is_tensor_collection(container) and is_tensor_collection(data):
            if isinstance(cursor, list) and cursor and all(isinstance(c, list) for c in cursor):
                cursor = torch.tensor(cursor)  # (what a TensorDict takes it for; torch: a tuple)
            held = set(container.keys(include_nested=True, leaves_only=True))
            keys = list(data.keys(include_nested=True, leaves_only=True))
            if not isinstance(container, LazyStackedTensorDict):  # (rows that may be ragged)
                value_of = _stacked_stand_in if isinstance(data, LazyStackedTensorDict) else \
                    type(data).get  # (a lazy stack is written item-wise: its values, unstacked)
                _refuse_misfits(cursor, [(container.get(key), value_of(data, key), key)
                                         for key in keys if key in held])
            _refuse_regrouping(held, [key for key in keys if key not in held])
            for key in (k for k in keys if k not in held):  # a key the rows lack: zeros where
                value = data.get(key)                       # unwritten, as TorchRL's
                lead = 0 if is_int(cursor) else 1
                container.set(key, torch.zeros((*self._container_shape(), *value.shape[lead + self.ndim - 1:]),
                                               dtype=value.dtype, device=_first_leaf(container).device))
            container[cursor] = data
        elif is_tensor_collection(container):  # a number or tensor: into every leaf, broadcast
            container[cursor] = data
        elif isinstance(container, torch.Tensor):
            container[cursor] = data
        else:
            leaves, _ = pytree.tree_flatten_with_path(container)
            _refuse_misfits(cursor, [(leaf, value, pytree.keystr(path)) for (path, leaf), value in
                                     zip(leaves, pytree.tree_leaves(data))])
            pytree.tree_map(lambda leaf, value: leaf.__setitem__(cursor, value), container, data)

    # -- the contract ---------------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        if isinstance(data, list):
            data = _stack(data)
        news, cursor = without_new_axes(cursor, self._index_dims)
        if news:  # the new dims of 1 the cursor adds: data for them holds one element each
            data = map_leaves(data, lambda x: _without_leading_ones(x, news))
        single = is_int(cursor)
        if not self.initialized:
            self._init(data if single else map_leaves(data, lambda x: x[0]), widest(data))
        with self._counts.lock:  # shared with other processes (.sharing): one write at a time
            self._write(cursor, data)
            self._mark_rows(cursor)
            if set_cursor:
                self._set_last_cursor(cursor)
                n = self.ndim - 1 if single else self.ndim
                # TorchRL counts writes; a writer that moved its cursor past a refused batch
                # must still reach the rows it writes after it: len covers the last one (a
                # position counted from the end is no writer's: it reaches nothing)
                reached = 0 if is_negative(cursor) else \
                    (self._last_cursor_value + 1) * (self._lanes if self.ndim > 1 else 1)
                count_rows(self._counts, math.prod(lead_shape(data, n)), reached, self.max_size)
            self._bump_mutation_revision()

    def get(self, index: Any) -> Any:
        if not self.initialized:
            self._join_shared_init()
            if not self.initialized:
                raise RuntimeError("Cannot get elements out of a non-initialized storage.")
        news, index = without_new_axes(index, self._index_dims)
        found = self._read(index)
        return map_leaves(found, lambda x: x[(None,) * news]) if news else found

    def _index_dims(self) -> int | None:
        """How many dims every stored value has, over which a leading ``...`` of an index
        spans (:func:`.row_index.without_new_axes`); ``None``: the container indexes it."""
        return None

    def _join_shared_init(self) -> None:
        """Before a read of a storage not initialised here: open the rows another process
        created, where there can be such rows (a lazy storage with ``shared_init``)."""

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_sharing_uninitialized()
        if get_spawning_popen() is not None:
            self._share_with_processes()
        return super().__getstate__()

    def _share_with_processes(self) -> None:
        """Pickled for a process that multiprocessing starts: from now on the counters live in
        shared memory (:mod:`.sharing`), and torch moves the container's tensors there as it
        pickles them, so every process writes and reads the same rows, as in TorchRL."""
        self._use_shared_counters(self._counts.to_shared())
        if self.initialized:  # the per-row write stamps, in shared memory too (checkpoints)
            if self._row_rev is None:
                self._row_rev = RowStamps(self._container_shape()[0])
            self._row_rev = self._row_rev.shared()
            self._revisions_shared = True

    def _use_shared_counters(self, counts: Any) -> None:
        """From now on the counters are ``counts``, shared with other processes."""
        self._counts = counts

    def _refuse_sharing_uninitialized(self) -> None:
        """A spawned process cannot share a storage that has no rows yet (as in TorchRL),
        unless it was made with ``shared_init=True``."""
        if not self.initialized and not self._shares_init:
            refuse_spawn_sharing(
                self, "Cowardly refusing to share a storage of type {cls} between processes if "
                "it has not been initialized yet.", "Write its first rows before starting the "
                "process: the new process then shares them (a URL storage reopens its store).")

    def _mark_rows(self, cursor: Any) -> None:
        """Stamp the rows ``cursor`` wrote with a new write revision (read by checkpoints)."""
        rows = self._container_shape()[0]
        if self._row_rev is None or self._row_rev.rows != rows:
            self._row_rev = RowStamps(rows)
            self.checkpoint_marks = {}
        counts = self._counts
        counts.write_rev = revision = counts.write_rev + 1
        if type(cursor) is int and -rows <= cursor < rows:  # add()'s hot path
            self._row_rev.stamp_row(cursor, revision)
            return
        first = cursor[0] if isinstance(cursor, tuple) else cursor
        if first is Ellipsis:  # (left to the container): it may span every row
            first = slice(None)
        if not isinstance(first, (int, slice, range, np.integer)):
            first = torch.as_tensor(first).to("cpu")
            if first.dtype == torch.bool and first.ndim > 1:
                first = first.nonzero(as_tuple=True)[0]
        self._row_rev.stamp(first, revision)

    # -- package-internal: the checkpoint contract (checkpoint_contract.py) ---------------
    def checkpoint_ready(self) -> bool:
        """Whether it holds rows a dump can read: initialised here, or (``shared_init``)
        rows another process created, which it maps now as a read would."""
        if not self.initialized:
            self._join_shared_init()
        return self.initialized

    def checkpoint_export(self) -> TensorExport:
        """The rows and counters a dump reads: the in-RAM container's columns."""
        container = self._storage
        schema = Schema.from_example(map_leaves(container, lambda x: x[0]), self.ndim,
                                     max(TEXT_BYTES, widest(container)))
        columns = schema.columns(container, 1)
        rows = self._container_shape()[0]
        written = rows if self._row_rev is None else self._row_rev.last_written() + 1
        return TensorExport(schema, rows, self._last_cursor_value, written,
                            lambda lo, hi: {path: value[lo:hi] for path, value in columns.items()},
                            columns, in_place=True)

    def checkpoint_allocate(self, example: Any, text_bytes: int = 0) -> None:
        """Allocate the container for rows like ``example`` (the lazy first-write init)."""
        self._init(example, text_bytes)

    def checkpoint_shape(self) -> tuple[int, ...]:
        """The allocated container's ``(rows, *lanes)``."""
        return tuple(self._container_shape())

    def checkpoint_write(self, lo: int, rows: Any) -> None:
        """Write the batch ``rows`` at rows ``lo, lo + 1, ...``; counters and revisions stay."""
        n = lead_shape(rows, 1)[0]
        if n:
            self._write(slice(lo, lo + n), rows)

    def checkpoint_restored(self, length: int, last_cursor: int, loaded: int) -> None:
        """Set the counters after a load: rows ``[0, loaded)`` are the checkpoint's (stamped
        with a new revision), later rows as never written."""
        self._len_value = int(length)
        self._last_cursor_value = int(last_cursor)
        self._last_cursor = int(last_cursor) if last_cursor >= 0 else None
        self._mark_rows(slice(0, loaded))
        self._row_rev.clear_from(loaded)

    @property
    def checkpoint_revision(self) -> int:
        """The write revision of the last write (rows stamped above a mark's changed since)."""
        return self._write_rev

    @property
    def checkpoint_revisions(self) -> RowStamps | None:
        """Per-row write revisions (read-only; ``None`` before the first stamp), a new object
        whenever they restart. Where processes share the rows but not these stamps (a
        ``shared_init`` storage: its rows were not known when it was handed out), every row
        counts as written at the group's last write, so a checkpoint misses none."""
        revisions = self._row_rev
        if revisions is not None and self._counts.shared \
                and not self._revisions_shared:
            return RowStamps.everywhere(revisions.rows, self._counts.write_rev)
        return revisions

    def _empty(self) -> None:
        self._len_value = 0
        self._bump_mutation_revision()

    def contains(self, item: Any) -> Any:
        if isinstance(item, int) and not isinstance(item, bool):
            if not self.initialized:
                return False
            n = self._len_along_dim0
            if item < 0:
                item += n
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            if not self.initialized:
                return torch.zeros(item.shape[:1] if item.ndim > 1 else item.shape, dtype=torch.bool)
            shape = self.shape
            if item.ndim >= 2 and item.shape[-1] == self.ndim:
                bounds = torch.tensor(list(shape), device=item.device)
                return ((item >= -bounds) & (item < bounds)).all(-1)
            n = shape[0]
            return (item >= -n) & (item < n)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    @torch.compiler.disable()
    def _rand_given_ndim(self, batch_size: int) -> Any:
        """Random cell indices of the written part, outside compiled code (as TorchRL's): the
        length it reads changes at every write, and a compiled frame guarding it would
        recompile at every step."""
        return self._rand_given_ndim_impl(batch_size)

    def _rand_given_ndim_impl(self, batch_size: int) -> Any:
        """:meth:`_rand_given_ndim` without the compiler boundary (TorchRL's name: its
        tests count the recompiles this alone causes)."""
        if self.ndim == 1:
            return super()._rand_given_ndim(batch_size)
        shape = self.shape
        return tuple(torch.randint(0, dim, (batch_size,), generator=self._rng, device=self.device)
                     for dim in shape)

    def flatten(self) -> "TensorStorage":
        """A 1-D storage over the written rows, lanes flattened into the first dim."""
        if self.ndim == 1:
            return self
        if not self.initialized:
            raise RuntimeError("Cannot flatten a non-initialized storage.")
        data = self.get(slice(None))
        if is_tensor_collection(data):
            flat = data.flatten(0, self.ndim - 1)
        else:
            flat = map_leaves(data, lambda x: x.flatten(0, self.ndim - 1))
        return TensorStorage(flat, device=self.device)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        container = self._container_for_state()
        if container is None:
            storage_state: Any = {}
        elif isinstance(container, torch.Tensor):
            storage_state = container
        elif is_tensor_collection(container):
            storage_state = container.state_dict()
        else:
            raise TypeError(f"Objects of type {type(container)} are not supported by "
                            f"{type(self).__name__}.state_dict")
        return {"_storage": storage_state, "initialized": self.initialized, "_len": self._len_value}

    def _container_for_state(self) -> Any:
        return self._storage

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["_storage"]
        if isinstance(saved, torch.Tensor):
            if isinstance(self._storage, torch.Tensor):
                self._storage.copy_(saved)
            elif self._storage is None:
                self._storage = saved.clone()
            else:
                raise RuntimeError(f"Cannot copy a storage of type {type(saved)} onto another of "
                                   f"type {type(self._storage)}")
        elif isinstance(saved, (dict,)) or is_tensor_collection(saved):
            if is_tensor_collection(self._storage):
                self._storage.load_state_dict(saved, strict=False)
            elif self._storage is None:
                self._storage = TensorDict().load_state_dict(saved, strict=False) if saved else None
                if self._storage is not None:
                    self._storage = self._storage.clone()
            else:
                raise RuntimeError(f"Cannot copy a storage of type {type(saved)} onto another of "
                                   f"type {type(self._storage)}")
        else:
            raise TypeError(f"Objects of type {type(saved)} are not supported by "
                            f"{type(self).__name__}.load_state_dict")
        self.initialized = bool(state_dict["initialized"]) and self._storage is not None
        if self.initialized:
            self._mark_rows(slice(None))
        self._len_value = int(state_dict["_len"])
        self._bump_mutation_revision()

    # -- conditional patches (ReplayBuffer.update_if_present) -----------------------------
    def _conditional_patch_head(self, key: Any) -> torch.Tensor:
        """Key ``key`` of no row: its dtype, device and ``[0, *lanes, *features]`` shape."""
        if not self.initialized:
            raise RuntimeError("Conditional updates require an initialized storage. "
                               "Write data to the buffer first.")
        head = self.get(slice(0, 0))
        if not is_tensor_collection(head) or key not in head.keys(True, True):
            raise KeyError(f"key {key!r} is not in the storage")
        return head.get(key)

    def _conditional_patch_leaf(self, key: Any) -> torch.Tensor:
        """Key ``key`` of every row of the container, written or not, as TorchRL's hook."""
        self._conditional_patch_head(key)
        return self._storage.get(key)

    def _validate_conditional_patch(self, index: Any, patch: Any) -> dict[Any, torch.Tensor]:
        """``patch`` (a mapping or TensorDict) as ``{leaf key: [records, *features] tensor}``,
        checked against the storage's keys, dtypes and feature shapes; no row is read."""
        index = torch.as_tensor(index)
        n_coords = index.shape[-1] if index.ndim > 1 else 1
        n_rows = index.shape[0] if index.ndim > 1 else index.numel()
        if is_tensor_collection(patch):
            patch = dict(patch.items(include_nested=True, leaves_only=True))
        normalized = {}
        for key, value in patch.items():
            head = self._conditional_patch_head(key)
            value = torch.as_tensor(value)
            if value.dtype != head.dtype:
                raise ValueError(f"dtype mismatch for patch key {key!r}: expected {head.dtype}, "
                                 f"got {value.dtype}")
            features = head.shape[n_coords:]
            try:
                normalized[key] = value.reshape((n_rows, *features)).to(head.device)
            except RuntimeError:
                raise ValueError(f"shape mismatch for patch key {key!r}: expected {n_rows} "
                                 f"records of feature shape {tuple(features)}, got "
                                 f"{tuple(value.shape)}") from None
        return normalized

    def _apply_conditional_patch(self, index: Any, patch: Any) -> None:
        """Overwrite ``patch``'s keys of the records at ``index`` (rows, or ``[records, ndim]``
        cell coordinates); the last of duplicate records wins."""
        index = torch.as_tensor(index)
        cursor = tuple(index.t().contiguous()) if index.ndim > 1 else index
        current = self.get(cursor)
        current.update(patch)
        self._write(cursor, current)
        self._mark_rows(cursor)
        self._bump_mutation_revision()

    # -- display ---------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Fill, cursor and, per key, feature shape, dtype, bytes allocated (``stored``) and filled (``raw``)."""
        base = super().summary()
        return dataclasses.replace(base, **self._summary_details(base)) if self.initialized else base

    def _summary_details(self, base: Summary) -> dict[str, Any]:
        """The :class:`Summary` fields an initialised storage adds to the base ones."""
        filled = self._len_along_dim0
        rows = []
        for key, shape, dtype, nbytes in _leaves_per_key(self._storage):
            row_bytes = nbytes // shape[0] if shape[0] else 0
            rows.append(KeyRow(key, shape[self.ndim:], dtype_name(dtype),
                               stored_bytes=nbytes, raw_bytes=filled * row_bytes))
        return {"rows": tuple(rows), "facts": self._summary_facts(),
                "stored_bytes": sum(r.stored_bytes for r in rows),
                "raw_bytes": sum(r.raw_bytes for r in rows),
                "episodes": base.episodes if base.episodes is not None else self._episodes_ended()}

    def _summary_facts(self) -> tuple[tuple[str, str], ...]:
        facts = (("shape", str(list(self._total_shape))), ("device", str(self.device)))
        return facts + ((("ndim", str(self.ndim)),) if self.ndim > 1 else ())

    def _episodes_ended(self) -> int | None:
        """How many ``("next", "done")`` flags are set in the filled cells (in-RAM TED data only)."""
        done = self._storage.get(("next", "done"), None) if is_tensor_collection(self._storage) else None
        if not isinstance(done, torch.Tensor) or (self.ndim > 1 and not self._is_full):
            return None  # not TED data; or the last row is partly filled (its other cells hold no data)
        return int(done[: self._len_along_dim0].sum())


def _has_non_tensors(data: Any) -> bool:
    """Whether a tensor collection holds non-tensor leaves (``NonTensorData``: strings...)."""
    return next(non_tensor_leaves(data), None) is not None


def non_text_keys(data: Any) -> list[Any]:
    """Keys of a tensor collection's non-tensor leaves that hold a value other than strings
    (a buffer stores strings as text cells, and nothing else that is no tensor)."""
    return [key for key, value in non_tensor_leaves(data)
            if holds_value(value) and not is_text(value)]


def _leaves_per_key(container: Any) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """``(key path, shape, dtype, bytes)`` of a container's leaves. In a lazy stack (items of
    different shapes) a key is one tensor per stacked TensorDict: its shape has ``-1``
    where they differ (a ragged dim)."""
    if not isinstance(container, LazyStackedTensorDict):
        return [(key, tuple(v.shape), v.dtype, v.numel() * v.element_size())
                for key, v in tensor_leaves(container)]
    per_td = [{key: rest for key, *rest in _leaves_per_key(td)} for td in container.tensordicts]
    out = []
    for key in per_td[0]:
        parts = [part[key] for part in per_td if key in part]
        if len(parts) != len(per_td) or len({len(shape) for shape, _, _ in parts}) != 1:
            continue  # an exclusive key, or a different number of dims
        shape = [dims[0] if len(set(dims)) == 1 else -1 for dims in zip(*(p[0] for p in parts))]
        shape.insert(container.stack_dim, len(parts))
        out.append((key, tuple(shape), parts[0][1], sum(p[2] for p in parts)))
    return out


def _stacked_stand_in(data: LazyStackedTensorDict, key: Any) -> Any:
    """A ``meta`` tensor of the shape and dtype of key ``key`` of lazy stack ``data``, as
    its item-wise write sees them, without stacking the items (of several dtypes: one
    other than the first, which a write by position refuses); a refusal naming ``key``
    where its items differ in shape. Values that are no tensors come back as they are."""
    parts = [item.get(key) for item in data.tensordicts]
    if not parts or not all(isinstance(part, torch.Tensor) for part in parts):
        return parts[0] if parts else None
    shapes = sorted({tuple(part.shape) for part in parts})
    if len(shapes) > 1:
        raise RuntimeError(f"shape mismatch for key {key!r}: the items of the lazily stacked "
                           f"batch hold it in shapes {[list(s) for s in shapes[:4]]}, which no "
                           "rows of one shape take; nothing was written")
    shape = list(shapes[0])
    shape.insert(data.stack_dim, len(parts))
    dtypes = [part.dtype for part in parts]
    dtype = next((d for d in dtypes if d != dtypes[0]), dtypes[0])
    return torch.empty(shape, dtype=dtype, device="meta")


def _refuse_regrouping(held: set, new: list) -> None:
    """Raise before anything is written if a key the rows lack turns a nested TensorDict of
    the rows into a tensor or the reverse (setting it would replace that node in every row)."""
    def path(key: Any) -> tuple:
        return key if isinstance(key, tuple) else (key,)

    leaves = {path(key) for key in held}
    below = {leaf[:depth]: leaf for leaf in leaves for depth in range(1, len(leaf))}
    for key in map(path, new):
        if key in below:  # the rows hold a nested TensorDict there
            old, was, now = below[key], "a nested TensorDict", "a tensor"
        elif parents := [key[:depth] for depth in range(1, len(key)) if key[:depth] in leaves]:
            old, was, now = parents[0], "a tensor", "a nested TensorDict"
        else:
            continue
        held_below = f" (they hold {'/'.join(old)!r})" if len(old) > len(key) else ""
        raise SchemaError(
            f"key {'/'.join(min(key, old, key=len))!r} is {was} in the rows{held_below} and "
            f"cannot become {now}: nothing was written. Keep each key's kind, or give the new "
            "data another key")


def _refuse_misfits(cursor: Any, pairs: list) -> None:
    """Raise before anything is written if a value cannot fill the rows ``cursor`` selects.

    A TensorDict or a pytree is written leaf by leaf: without this check, a batch whose
    third key has the wrong shape would already have overwritten the first two.
    ``pairs``: ``(container leaf, value, key)``. Positions (tensors, lists) must be in
    range and their values of the leaf's dtype, as torch's indexed writes require; the
    ``meta`` tensors the shapes are found with check neither.
    """
    index = None if is_int(cursor) else _meta_index(cursor)
    positions = [(dim, torch.as_tensor(part)) for dim, part in
                 enumerate(index if isinstance(index, tuple) else (index,))
                 if isinstance(part, (torch.Tensor, list)) and len(part)]
    # (dim, lowest, highest, positions) of the integer ones, each reduced once for every leaf
    ranges = [(dim, int(part.min()), int(part.max()), part) for dim, part in positions
              if not part.dtype.is_floating_point]
    for leaf, value, key in pairs:
        if not isinstance(value, torch.Tensor) or not isinstance(leaf, torch.Tensor):
            continue
        for dim, low, high, part in ranges:
            size = leaf.shape[dim] if dim < leaf.ndim else 0
            if not -size <= low <= high < size:
                raise IndexError(f"rows {part.tolist()[:8]} are out of range for a storage of "
                                 f"{size} rows along dim {dim}; nothing was written")
        if positions and value.dtype != leaf.dtype:
            raise RuntimeError(
                f"dtype mismatch for key {key!r}: the rows hold {leaf.dtype}, the value is "
                f"{value.dtype} (torch writes rows by position only in their own dtype); "
                "nothing was written. Cast the value first")
        target = leaf.shape[1:] if index is None else \
            torch.empty(leaf.shape, device="meta")[index].shape
        shape = list(value.shape)
        while len(shape) > len(target) and shape[0] == 1:  # torch drops leading unit dims
            shape.pop(0)
        try:
            fits = torch.broadcast_shapes(shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise RuntimeError(
                f"shape mismatch for key {key!r}: value of shape {list(value.shape)} cannot be "
                f"written to rows of shape {list(target)}; nothing was written")


def _meta_index(cursor: Any) -> Any:
    """``cursor`` as an index of a ``meta`` tensor: tensors on the CPU, NumPy arrays as
    tensors, and boolean masks as the positions they select (``torch.nonzero`` has no
    ``meta`` kernel; TorchRL's buffer hands ``rb[mask] = td`` over as a NumPy mask, or as
    the list of flags it was given)."""
    if isinstance(cursor, tuple):
        return tuple(part for c in cursor for part in _mask_parts(_meta_index(c)))
    if isinstance(cursor, np.ndarray):
        cursor = torch.from_numpy(np.ascontiguousarray(cursor))  # a reversed view too
    elif isinstance(cursor, list) and cursor and all(isinstance(c, bool) for c in cursor):
        cursor = torch.tensor(cursor)  # a mask as a list of flags (rb[[True, False, ...]] = td)
    if isinstance(cursor, torch.Tensor):
        cursor = cursor.cpu()
        if cursor.dtype == torch.bool:
            return cursor.nonzero(as_tuple=True)
    return cursor


def _mask_parts(index: Any) -> tuple:
    """The parts one element of an index tuple stands for (a mask: one per dim it covers)."""
    return index if isinstance(index, tuple) else (index,)


def _without_leading_ones(value: Any, count: int) -> Any:
    """``value`` without its first ``count`` dims where they are dims of 1 (a tensor or a
    tensor collection's batch dims); as it is otherwise (broadcast as torch's)."""
    shape = getattr(value, "batch_size", None) if is_tensor_collection(value) else \
        getattr(value, "shape", None)
    if shape is None or len(shape) < count or any(size != 1 for size in shape[:count]):
        return value
    return value[(0,) * count]


def map_leaves(container: Any, fn) -> Any:
    """``fn`` applied to a tensor or tensor collection, or to each leaf of a pytree."""
    if isinstance(container, torch.Tensor) or is_tensor_collection(container):
        return fn(container)
    return pytree.tree_map(fn, container)


class LazyTensorStorage(TensorStorage):
    """A TensorStorage allocated in RAM (or on ``device``) at the first write.

    Args:
        max_size: capacity in cells.
        device: where the container lives; ``"auto"`` uses the first item's device.
        ndim: cell dims (``max_size`` is rounded up to whole rows when ``ndim > 1``).
        consolidated: consolidate the TensorDict container into one buffer.

    >>> s = LazyTensorStorage(10)
    >>> s.set(torch.arange(3), TensorDict(obs=torch.ones(3, 2), batch_size=[3]))
    >>> len(s), s.get(0)["obs"].tolist()
    (3, [1.0, 1.0])
    """

    def __init__(self, max_size: int, *, device: Any = "cpu", ndim: int = 1,
                 compilable: bool = False, consolidated: bool = False,
                 shared_init: bool = False, cleanup_memmap: bool = True):
        if shared_init and compilable:
            raise RuntimeError("Cannot share a compilable storage between processes.")
        if shared_init and device not in (None, "auto") and torch.device(device).type != "cpu":
            warnings.warn(f"{type(self).__name__}(shared_init=True) keeps its rows in CPU memory "
                          f"that every process maps; the requested device ({device}) cannot be "
                          "honored and is reset to 'cpu'.", UserWarning, stacklevel=2)
            device = "cpu"
        super().__init__(None, max_size, device=device, ndim=ndim, compilable=compilable)
        self.consolidated = consolidated
        self.shared_init = shared_init
        self.cleanup_memmap = cleanup_memmap
        if shared_init:
            self._rendezvous = InitRendezvous()
            self._use_shared_counters(self._counts.to_shared())

    def _init(self, example: Any, text_bytes: int = 0) -> None:
        rendezvous = self._rendezvous
        if rendezvous is None:
            self._allocate(example, text_bytes)
        elif rendezvous.coordinate():
            try:
                self._create_shared_rows(example, text_bytes)
            except BaseException:
                rendezvous.failed()
                raise
            rendezvous.created()
        else:
            self._open_shared_rows(example)

    def _join_shared_init(self) -> None:
        if self._rendezvous is not None and self._rendezvous.ready:
            self._open_shared_rows(None)

    def _create_shared_rows(self, example: Any, text_bytes: int) -> None:
        """``shared_init``: allocate the rows as memory-mapped files every process can map,
        described by a JSON file (:mod:`.shared_rows`)."""
        if isinstance(example, LazyStackedTensorDict) or _has_non_tensors(example):
            raise SchemaError(
                f"{type(self).__name__}(shared_init=True) keeps one dense tensor per key in "
                "files every process maps: a lazy stack or a non-tensor value cannot be "
                "shared that way. Write the first rows before starting the processes "
                "(shared_init=False) instead")
        rows = self._rows_for(example)
        self._storage = create_shared_rows(self._shared_directory(), example, self.ndim, rows,
                                           self.max_size, self.device)
        self.initialized = True

    def _open_shared_rows(self, example: Any) -> None:
        self._storage, self.max_size = open_shared_rows(
            self._shared_directory(), self.device,
            type(example) if is_tensorclass(example) else None)
        self.initialized = True

    def _shared_directory(self) -> str:
        """The directory of a ``shared_init`` storage's rows, made once, before any process
        is handed the storage (then the others find it in what they were handed)."""
        directory = self.__dict__.get("_init_directory")
        if directory is None:
            directory = self._init_directory = tempfile.mkdtemp(prefix="zstore_shared_init_")
            weakref.finalize(self, shutil.rmtree, directory, True)
        return directory

    def _share_with_processes(self) -> None:
        if self._rendezvous is not None:
            self._shared_directory()  # named in the pickle, so every process maps the same rows
        super()._share_with_processes()

    def _allocate(self, example: Any, text_bytes: int = 0) -> None:
        """Allocate the in-RAM container for rows like ``example``."""
        if self.device == "auto":
            self.device = _first_leaf(example).device if not is_tensor_collection(example) \
                else example.device
        device = self.device
        rows = self._rows_for(example)
        if isinstance(example, LazyStackedTensorDict) or _has_non_tensors(example):
            # items of different shapes (TorchRL's ragged lazy stacks): a lazy stack of
            # containers, one per stacked TensorDict; non-tensor fields (a tensorclass's
            # string): one per row. Both as TorchRL's ``empty_like(expand)``
            container = torch.empty_like(
                (example.to(device) if device is not None else example)
                .expand(rows, *example.batch_size))
            if self.consolidated:
                container = container.consolidate()
        elif is_tensor_collection(example):
            td = example._tensordict if is_tensorclass(example) else example
            container = td.apply(
                lambda x: torch.empty((rows, *x.shape), dtype=x.dtype, device=device or x.device),
                batch_size=[rows, *td.batch_size], device=device)
            for key in td.keys(include_nested=True):  # apply gives nested nodes no batch dims
                node = td.get(key)
                if is_tensor_collection(node) and node.batch_size:  # parents come first
                    container.get(key).batch_size = torch.Size([rows, *node.batch_size])
            if is_tensorclass(example):
                container = type(example).from_tensordict(container)
            if self.consolidated:
                container = container.consolidate()
        else:
            if self.consolidated:
                raise ValueError("Cannot consolidate non-tensordict storages.")
            container = map_leaves(example, lambda x: torch.empty(
                (rows, *x.shape), dtype=x.dtype, device=device or x.device))
        self._storage = container
        self.initialized = True
