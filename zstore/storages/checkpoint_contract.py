"""The checkpoint contract: everything `checkpoint/` uses of a storage, in one place.

The ``checkpoint_*`` names below carry no leading underscore so that the
``checkpoint`` package may call them, but they are **package-internal**: not
exported from ``zstore``, documented here, and free to change together with
``checkpoint/``. A checkpointer uses nothing else of a storage but its public API
(``len``, ``max_size``, ``ndim``, ``initialized``, ``spec``, ``flush``, ``table``)
and TorchRL's public-by-convention ``_storage``, ``_storages`` and ``_empty``
(``tests/test_checkpoint_contract.py`` checks it).

* :class:`Checkpointable` — every storage;
* :class:`TensorCheckpointable` — ``TensorStorage``, ``LazyTensorStorage`` and
  ``LazyMemmapStorage`` (whose inner tables also give ``checkpoint_meta``);
* :class:`CompressedCheckpointable` — ``CompressedListStorage``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ..layout import Schema
from ..store import StoreSpec


@dataclasses.dataclass(frozen=True)
class TensorExport:
    """A tensor storage as a dump reads it: nothing is copied until ``read`` runs."""

    schema: Schema
    rows: int  # rows of the container (its capacity along dim 0)
    last_cursor: int  # the last cell index written, -1 when unknown
    written: int  # rows [0, written) may hold data, by the storage's own bookkeeping
    read: Callable[[int, int], dict[str, torch.Tensor]]  # rows [lo, hi) as {key path: tensor}
    #: {key path: the whole column} when the rows live in RAM (the container's own
    #: tensors, writable in place), None when they live in a store
    columns: Mapping[str, torch.Tensor] | None = None
    #: whether rows may change in place where no write revision records it: the in-RAM
    #: container's tensors, or the views of a memory-mapped store's chunk files
    in_place: bool = False


class Checkpointable(Protocol):
    """What every checkpointer may use of any storage."""

    def checkpoint_loaded(self) -> None:
        """A checkpointer filled the storage outside ``loads`` (an ensemble member):
        readers learn that its rows changed."""


class TensorCheckpointable(Checkpointable, Protocol):
    """What a tensor checkpointer uses of a tensor storage."""

    #: {destination URL: what the checkpointer remembers of its last dump to / load from
    #: there}; the storage only empties it (when its row revisions restart)
    checkpoint_marks: dict[str, Any]

    def checkpoint_ready(self) -> bool:
        """Whether it holds rows a dump can read (rows another process created included)."""

    def checkpoint_export(self) -> TensorExport:
        """Its rows and counters as a dump reads them (an initialised storage)."""

    def checkpoint_allocate(self, example: Any, text_bytes: int = 0) -> None:
        """Allocate the container for rows like ``example`` (before a load), with text
        cells of at least ``text_bytes`` where it stores strings as such."""

    def checkpoint_shape(self) -> tuple[int, ...]:
        """The allocated container's ``(rows, *lanes)``."""

    def checkpoint_write(self, lo: int, rows: Any) -> None:
        """Write a batch at rows ``lo, lo + 1, ...``; no counter or revision moves."""

    def checkpoint_restored(self, length: int, last_cursor: int, loaded: int) -> None:
        """Set the counters after a load: rows ``[0, loaded)`` are the checkpoint's, later
        rows as never written; committed where the storage commits."""

    @property
    def checkpoint_revision(self) -> int:
        """The write revision of its last write."""

    @property
    def checkpoint_revisions(self) -> Any:
        """Per-row write revisions (``None`` before the first): ``changed_since(revision)``
        gives the rows stamped after ``revision``; a new object whenever they restart."""


class CompressedCheckpointable(Checkpointable, Protocol):
    """What the compressed checkpointer uses of a ``CompressedListStorage``."""

    #: as :attr:`TensorCheckpointable.checkpoint_marks`
    checkpoint_marks: dict[str, Any]

    def checkpoint_tables(self) -> dict[str, Any]:
        """Its inner ``LazyMemmapStorage`` tables by their path below its URL."""

    def checkpoint_replace(self, fill: Callable[[], None]) -> None:
        """As its location's one writer: drop its arrays, let ``fill()`` write new objects
        there, adopt them and commit."""

    @staticmethod
    def checkpoint_block(spec: StoreSpec) -> dict[str, Any] | None:
        """The committed ``CompressedListStorage`` block at ``spec`` (a checkpoint
        generation), ``None`` when there is none."""
