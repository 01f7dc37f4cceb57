"""The :class:`Storage` base class: TorchRL's storage contract, with 64-bit counters.

What every storage provides (SPEC §1.2): item access by index, length,
state dicts, checkpointing through a checkpointer (which uses only the names of
:mod:`zstore.storages.checkpoint_contract`), and the bookkeeping a replay buffer
relies on (mutation revision, last cursor, attached readers). Unlike TorchRL, the
abstract methods raise ``NotImplementedError`` instead of silently returning ``None``.
"""

from __future__ import annotations

import math
from multiprocessing.context import get_spawning_popen
from typing import Any, Iterator

import torch

from .._registry import make_checkpointer
from ..display import Summary, render_html, render_text
from ..sharing import Counters, counter
from ..store import StoreSpec

#: Rows read at a time when a whole key is scanned (samplers' end flags or trajectory ids,
#: ``storage._storage.get(key)``).
SCAN_ROWS = 1 << 16


class Storage:
    """Base class of every storage.

    Args:
        max_size: capacity in cells.
        checkpointer: the object whose ``dumps``/``loads`` save this storage;
            ``None`` selects the class default (resolved lazily from the
            ``checkpoint`` package, so importing zstore never imports it).
        compilable: accepted for TorchRL compatibility; counters are plain
            Python ints (64-bit, never wrapping) either way.
    """

    ndim = 1
    supports_conditional_update = False
    _default_checkpointer = "StorageCheckpointerBase"
    _rng: torch.Generator | None = None

    #: the counters, in ``_counts`` (:mod:`.sharing`: shared with the processes a storage is
    #: handed to)
    _revision = counter("revision")
    _last_cursor_value = counter("last_cursor")

    def __init__(self, max_size: int, checkpointer: Any = None, compilable: bool = False):
        self.max_size = capacity(type(self).__name__, max_size)
        self._compilable = compilable
        self._attached_entities_list: list = []
        self._counts = Counters()
        self._checkpointer = None
        self.checkpointer = checkpointer

    # -- abstract contract -------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write ``data`` at ``cursor``."""
        raise NotImplementedError(f"{type(self).__name__}.set is not implemented")

    def get(self, index: Any) -> Any:
        """Read the item(s) at ``index``."""
        raise NotImplementedError(f"{type(self).__name__}.get is not implemented")

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.__len__ is not implemented")

    def state_dict(self) -> dict[str, Any]:
        """In-memory snapshot of the storage."""
        raise NotImplementedError(f"{type(self).__name__}.state_dict is not implemented")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        raise NotImplementedError(f"{type(self).__name__}.load_state_dict is not implemented")

    def _empty(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}._empty is not implemented")

    def contains(self, item: Any) -> Any:
        """Whether ``item`` is a valid, written index."""
        raise NotImplementedError(f"{type(self).__name__}.contains is not implemented")

    # -- item protocol -------------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        return self.get(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        """In-place overwrite: does not move the length or the last cursor."""
        self.set(index, value, set_cursor=False)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def __contains__(self, item: Any) -> Any:
        return self.contains(item)

    # -- checkpointing -------------------------------------------------------------------
    @property
    def checkpointer(self):
        """The checkpointer used by :meth:`dumps` / :meth:`loads` (the class default if unset)."""
        if self._checkpointer is None:
            self._checkpointer = make_checkpointer(self._default_checkpointer)
        return self._checkpointer

    @checkpointer.setter
    def checkpointer(self, value) -> None:
        if type(value).__module__.split(".")[0] == "torchrl":
            name = type(value).__name__
            raise TypeError(
                f"TorchRL's {name} cannot save a zstore {type(self).__name__}: it reads "
                f"TorchRL's private containers. Use zstore's own checkpointer of the same "
                f"name, `from checkpoint import {name}` (the same formats), or leave the "
                "checkpointer unset for this storage's default")
        self._checkpointer = value

    def dumps(self, path) -> Any:
        """Save the storage to ``path`` (a local path or any fsspec URL); returns the
        checkpointer's :class:`checkpoint.DumpResult` (bytes written, incremental or not)."""
        return self.checkpointer.dumps(self, path)

    save = dump = dumps

    def loads(self, path) -> None:
        """Load the storage from ``path``."""
        self.checkpointer.loads(self, path)
        self._bump_mutation_revision()

    load = loads

    def checkpoint_loaded(self) -> None:
        """Package-internal (:mod:`zstore.storages.checkpoint_contract`): a checkpointer
        filled this storage outside :meth:`loads`; readers learn that its rows changed."""
        self._bump_mutation_revision()

    def register_save_hook(self, hook) -> None:
        """Forward a save hook to the current checkpointer."""
        self.checkpointer.register_save_hook(hook)

    def register_load_hook(self, hook) -> None:
        """Forward a load hook to the current checkpointer."""
        self.checkpointer.register_load_hook(hook)

    # -- replay-buffer bookkeeping -------------------------------------------------------
    def attach(self, buffer: Any) -> None:
        """Register a reader (a replay buffer) to be told about writes, once."""
        if buffer not in self._attached_entities_list:
            self._attached_entities_list.append(buffer)

    def _attached_entities_iter(self):
        return self._attached_entities_list

    @property
    def _mutation_revision(self) -> int:
        return self._revision

    def _bump_mutation_revision(self) -> None:
        self._counts.revision += 1

    @property
    def _last_cursor_index(self) -> int | None:
        value = self._last_cursor_value
        return None if value < 0 else value

    def _newest_row(self) -> int | None:
        """The row written last, by which zstore's samplers order a full ring (oldest first):
        ``_last_cursor_index``, TorchRL's name for it, unless the storage keeps it otherwise."""
        return self._last_cursor_index

    def _set_last_cursor(self, cursor: Any) -> None:
        """Record ``cursor`` and the last time index it writes (SPEC §1.6)."""
        self._last_cursor = cursor
        self._last_cursor_value = _last_time_index(cursor, self.max_size)

    @property
    def _is_full(self) -> bool:
        return len(self) == self.max_size

    @property
    def shape(self) -> torch.Size:
        """``torch.Size([max_size])`` for 1-D storages."""
        if self.ndim == 1:
            return torch.Size([self.max_size])
        raise RuntimeError(f"shape is not supported for storages of type {type(self)} when ndim > 1")

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        if self.ndim == 1:
            return self.max_size
        raise RuntimeError(f"_max_size_along_dim0 is not supported for storages of type "
                           f"{type(self)} when ndim > 1")

    def flatten(self) -> "Storage":
        """This storage seen as 1-D (itself when ``ndim == 1``)."""
        if self.ndim == 1:
            return self
        raise RuntimeError(f"flatten is not supported for storages of type {type(self)} when ndim > 1")

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        if self.ndim != 1:
            raise RuntimeError("Random number generation is not implemented for storages of type "
                               f"{type(self)} with ndim {self.ndim}.")
        return torch.randint(0, len(self), (batch_size,), generator=self._rng,
                             device=getattr(self, "device", None))

    # -- display -------------------------------------------------------------------------
    def summary(self) -> Summary:
        """What this storage shows about itself (fill, cursor, keys, bytes); see :mod:`zstore.display`.

        Subclasses extend it with their keys, sizes and store; ``episodes`` comes
        from a ``num_episodes`` attribute where a storage has one (never computed here).
        """
        unbounded = self.max_size >= torch.iinfo(torch.int64).max
        return Summary(type(self).__name__, len(self), None if unbounded else self.max_size,
                       cursor=self._last_cursor_index,
                       episodes=getattr(self, "num_episodes", None))

    def __repr__(self) -> str:
        return render_text(self.summary())

    def _repr_html_(self) -> str:
        return render_html(self.summary())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_rng", None)
        return state


def capacity(owner: str, max_size: Any) -> int:
    """``max_size`` as TorchRL's storages take it (``int(max_size)``: ``"10"`` and ``10.0``
    too), or a ``ValueError`` naming the argument."""
    try:
        return int(max_size)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{owner}: max_size={max_size!r} is not a number of cells; give the "
                         f"capacity as a whole number, e.g. max_size=100_000") from None


def refuse_spawn_sharing(storage: Storage, why: str, fix: str) -> None:
    """Raise (as TorchRL's storages do) when ``storage`` is being pickled for a process that
    multiprocessing spawns, which would get a copy that shares nothing with this one."""
    if get_spawning_popen() is not None:
        raise RuntimeError(f"{why.format(cls=type(storage))} {fix}")


class ClosedByWith:
    """Mixin for storages with ``close()``: ``with storage:`` closes it when the block ends
    (its last commit, its write lease released)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CompressionRatio:
    """Mixin for storages with ``nbytes`` (stored) and ``raw_nbytes`` (uncompressed)."""

    @property
    def compression_ratio(self) -> float:
        """Raw bytes over stored bytes (0.0 when nothing is stored)."""
        stored = self.nbytes
        return self.raw_nbytes / stored if stored else 0.0


def _last_time_index(cursor: Any, max_size: int) -> int:
    """The last time index a cursor writes, ``-1`` when unknown (SPEC §1.6)."""
    if cursor is None:
        return -1
    if cursor is Ellipsis:  # every row
        cursor = slice(None)
    if isinstance(cursor, torch.Tensor):
        return int(cursor.reshape(-1)[-1]) if cursor.numel() else -1
    if isinstance(cursor, range):
        return cursor[-1] if len(cursor) else -1
    if isinstance(cursor, slice):
        span = range(*cursor.indices(max_size))
        return span[-1] if len(span) else -1
    if isinstance(cursor, (tuple, list)):
        if not cursor:
            return -1
        first = cursor[0]
        if isinstance(cursor, list) and not isinstance(first, (torch.Tensor, list, tuple, slice, range)):
            return int(cursor[-1])
        return _last_time_index(first, max_size)
    try:
        import numpy as np

        if isinstance(cursor, np.ndarray):
            flat = cursor.reshape(-1)
            return int(flat[-1]) if flat.size else -1
    except ImportError:  # pragma: no cover
        pass
    return int(cursor)


def sizes_listed(spec: StoreSpec) -> bool:
    """Whether a summary lists stored bytes: only local and ``memory://`` stores (listing an
    object store can take long; ``nbytes`` does it on request)."""
    return spec.cheap_listing


def unlisted_sizes_fact(spec: StoreSpec) -> tuple[tuple[str, str], ...]:
    """The summary fact saying why stored bytes are missing (empty when they are listed)."""
    if sizes_listed(spec):
        return ()
    return (("stored", f"not listed on {spec.protocol}:// (storage.nbytes lists it)"),)


def stored_bytes_under(spec: StoreSpec, path: str) -> int:
    """Bytes stored under ``path`` inside ``spec``'s location (one key's objects)."""
    return StoreSpec.parse(f"{spec.url}/{path}", spec.storage_options).stored_bytes()


def cells(shape: tuple[int, ...]) -> int:
    """Number of cells in a shape (product of its dims)."""
    return math.prod(shape)
