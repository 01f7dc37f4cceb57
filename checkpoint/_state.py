"""What a checkpoint needs to know about a tensor storage, and how to fill one back.

:class:`TensorState` reads a :class:`~zstore.TensorStorage` (in RAM or on Zarr)
as columns ``{key path: tensor [rows, ...]}`` plus its counters; :func:`restore`
initialises (if needed) a storage with the checkpoint's capacity and writes rows
into it, then restores the length and write cursor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from zstore.layout import SINGLE_TENSOR_KEY, Schema
from zstore.storages.checkpoint_contract import TensorCheckpointable
from zstore.storages.tensor import lead_shape, map_leaves
from zstore.text import widest

from ._dest import CheckpointError


@dataclasses.dataclass
class TensorState:
    """A tensor storage seen as columns: schema, capacity, counters and a row reader."""

    schema: Schema
    rows: int
    max_size: int
    ndim: int
    length: int
    last_cursor: int
    high: int  # rows [0, high) hold data (written at least once or below the length)
    read: Callable[[int, int], dict[str, torch.Tensor]]
    in_place: bool = False  # rows may change where no write revision records it

    @property
    def lanes(self) -> tuple[int, ...]:
        """The lane dims after the row dim (``ndim > 1``)."""
        return tuple(self.schema.lane_shape)

    @property
    def is_full(self) -> bool:
        """Whether every cell was written (the ring has wrapped or is exactly full)."""
        return self.length >= self.max_size

    @property
    def filled_rows(self) -> int:
        """Rows holding the storage's ``length`` cells."""
        return self.rows if self.is_full else -(-self.length // max(1, math.prod(self.lanes)))

    @classmethod
    def of(cls, storage: TensorCheckpointable) -> TensorState:
        """Read the state of an initialised tensor storage."""
        if not storage.checkpoint_ready():
            raise RuntimeError("Cannot save a non-initialized storage.")
        export = storage.checkpoint_export()
        rows, cursor = export.rows, export.last_cursor
        state = cls(export.schema, rows, storage.max_size, storage.ndim, len(storage),
                    cursor if 0 <= cursor < rows else -1, 0, export.read, export.in_place)
        state.high = min(rows, max(export.written, state.filled_rows))
        return state

    def data(self, lo: int, hi: int) -> Any:
        """Rows ``[lo, hi)`` as the storage's own kind of data."""
        return self.schema.build(self.read(lo, hi), (hi - lo, *self.lanes))


def changed_rows(revisions: Any, since: int) -> np.ndarray | None:
    """The rows a storage stamped after write revision ``since`` (its
    ``checkpoint_revisions``); None when it stamped none."""
    return None if revisions is None else revisions.changed_since(since)


def shift_of(state: TensorState) -> int:
    """The ring position after the newest row (TorchRL's ``shift``)."""
    if state.last_cursor >= 0:
        return (state.last_cursor + 1) % state.rows if state.is_full else state.last_cursor + 1
    return 0 if state.is_full else state.filled_rows


def require_fit(storage: TensorCheckpointable, rows: int, max_size: int, ndim: int | None,
                where: str, lanes: int | None = None) -> None:
    """Refuse (``CheckpointError``) a checkpoint of ``rows`` rows (``max_size`` cells, of
    ``ndim`` dims: ``None`` when not known) that ``storage`` cannot take: its rows, allocated
    or those its ``max_size`` gives at ``lanes`` cells a row (by default the checkpoint's)."""
    if ndim is not None and storage.ndim != ndim:
        raise CheckpointError(f"{where} holds an ndim={ndim} storage; this storage has "
                              f"ndim={storage.ndim}")
    lanes = max(1, max_size // rows) if lanes is None else lanes
    held = storage.checkpoint_shape()[0] if storage.initialized else \
        -(-storage.max_size // lanes)
    if held != rows:
        raise CheckpointError(
            f"{where} holds a storage of {rows} rows (max_size={max_size}); this storage "
            f"has max_size={storage.max_size}: the capacities must match")


def prepare(storage: TensorCheckpointable, example: Any, schema: Schema | None, rows: int,
            max_size: int, where: str, text_bytes: int = 0) -> None:
    """Initialise ``storage`` for a checkpoint of ``rows`` rows, or check that it fits;
    without a schema, ``text_bytes`` is the width its strings need."""
    if not storage.initialized:
        require_fit(storage, rows, max_size, None if schema is None else len(schema.lane_shape) + 1,
                    where, math.prod(schema.lane_shape) if schema is not None else None)
        storage.max_size = max_size
        storage.checkpoint_allocate(example, max(
            (schema.by_path[path].shape[-1] for path in schema.texts), default=0)
            if schema is not None else text_bytes)
    shape = storage.checkpoint_shape()
    lanes = tuple(schema.lane_shape) if schema is not None else shape[1:]
    if shape != (rows, *lanes):
        raise CheckpointError(
            f"{where} holds a storage of shape {[rows, *lanes]} (max_size={max_size}); this "
            f"storage has shape {list(shape)} (max_size={storage.max_size}): the capacities "
            "must match")
    if schema is not None:
        export = storage.checkpoint_export()
        mine = _columns_of(export.schema)
        theirs = _columns_of(schema)
        missing = sorted(set(theirs) - set(mine))
        extra = sorted(set(mine) - set(theirs))
        changed = sorted(p for p in set(mine) & set(theirs) if mine[p] != theirs[p])
        # keys only the checkpoint has join a storage in RAM, as TorchRL's take them (its
        # TensorDictReplayBuffer adds "index" to a TensorStorage built with the data's keys)
        joins = missing and not extra and not changed and export.columns is not None
        if mine != theirs and not joins:
            differences = ([f"only in the checkpoint: {_named(p)}" for p in missing]
                           + [f"only in this storage: {_named(p)}" for p in extra]
                           + [f"{_named(p)} is {_column(theirs[p])} in the checkpoint, "
                              f"{_column(mine[p])} in this storage" for p in changed])
            raise CheckpointError(
                f"{where}: the checkpoint's keys do not match this storage's ("
                + "; ".join(differences) + "): load it into a new storage of the same "
                "max_size, which takes the checkpoint's keys")


def _named(path: str) -> str:
    """A column as a user names it: its key, or what a storage of plain tensors holds."""
    return "the tensors (a storage of plain tensors)" if path == SINGLE_TENSOR_KEY else repr(path)


def _column(column: tuple) -> str:
    """A column of :func:`_columns_of` in words: ``float32 of shape (3,)``."""
    dtype, shape, text = column
    return "text" if text else f"{str(dtype).removeprefix('torch.')} of shape {tuple(shape)}"


def _columns_of(schema: Schema) -> dict[str, tuple]:
    """``{path: (dtype, shape)}`` of a schema's leaves; a text leaf's width is left out (the
    strings are written into the storage's own text cells, and a longer one is refused)."""
    return {leaf.path: (leaf.dtype, leaf.shape[:-1] if leaf.path in schema.texts else leaf.shape,
                        leaf.path in schema.texts) for leaf in schema.leaves}


def restore(storage: TensorCheckpointable, data: Any, record: Any, schema: Schema | None,
            where: str) -> None:
    """Fill ``storage`` with rows ``data`` (from row 0) and the counters of ``record``
    (``rows``, ``max_size``, ``length``, ``last_cursor``), initialising it if needed."""
    prepare(storage, map_leaves(data, lambda x: x[0]), schema, int(record["rows"]),
            int(record["max_size"]), where, widest(data) if schema is None else 0)
    storage.checkpoint_write(0, data)
    finish(storage, int(record["length"]), int(record["last_cursor"]),
           lead_shape(data, 1)[0])


def finish(storage: TensorCheckpointable, length: int, last_cursor: int, loaded: int,
           mark: tuple[str, str] | None = None) -> None:
    """Restore counters after loading rows ``[0, loaded)``; remember that they equal
    checkpoint ``mark`` = (destination URL, generation), for incremental dumps."""
    storage.checkpoint_restored(length, last_cursor, loaded)
    storage.checkpoint_marks = {} if mark is None else \
        {mark[0]: (mark[1], storage.checkpoint_revision)}
