"""zstore's storages as drop-in storages for TorchRL's replay buffers.

TorchRL's ``ReplayBuffer`` accepts only instances of its own ``Storage``, picks
its default collate function by class, and its ``SliceSampler`` takes a fast
path for ``isinstance(storage, TensorStorage)``. Each class here therefore
subclasses **both** the zstore storage and the TorchRL storage of the same
name, with zstore first in the method resolution order::

    LazyMemmapStorage -> zstore.LazyMemmapStorage ... zstore.Storage
                      -> (gap fillers) -> torchrl LazyMemmapStorage ... torchrl Storage

so every method zstore defines is zstore's (Zarr stores at any URL, 64-bit
counters, specific errors), and TorchRL's classes only make the ``isinstance``
checks pass. One addition: a slice of a tensor storage, which TorchRL's in-place buffer
updates (``rb.set_at_``, ``rb.set_``, ``rb.update_``) write into, stores them
(:class:`_WriteThrough`). The checkpointers and ``ImmutableDatasetWriter`` have twins too
(zstore's classes, subclassing TorchRL's of the same name): all 17 names of TorchRL's
"Storage Backends" page. Switching is one import line::

    from zstore.torchrl import LazyMemmapStorage   # was: from torchrl.data import ...
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(1_000_000, scratch_dir="s3://b/rb"))

This module imports TorchRL; ``import zstore`` never imports this module.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from multiprocessing.context import get_spawning_popen
from typing import Any

import torch
from tensordict import TensorDict, is_tensor_collection, is_tensorclass
from tensordict.utils import _unravel_key_to_tuple

try:
    from torchrl.data.replay_buffers import checkpointers as _trl_ckpt
    from torchrl.data.replay_buffers import storages as _trl
    from torchrl.data.replay_buffers import writers as _trl_writers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"zstore.torchrl needs TorchRL (pip install torchrl): {exc}") from exc

import checkpoint as _ckpt

from . import storages as _z
from . import writers as _zw
from .api import open as _open
from .cache import DEFAULT_CACHE_BYTES
from .columns import MIRROR_CELL_BYTES, ColumnMirror, cell_bytes, zeros_paged_in
from .lease import DEFAULT_TTL
from .sharing import ProcessLock
from .storages.base import SCAN_ROWS
from .torchrl_checkpoints import dumps, loads
from .writers import resume_at, resume_point, resume_point_if_moved, rolled_back_on_error

#: The checkpointers of TorchRL's "Storage Backends" page (twins built below).
CHECKPOINTERS = (
    "StorageCheckpointerBase", "ListStorageCheckpointer", "CompressedListStorageCheckpointer",
    "TensorStorageCheckpointer", "FlatStorageCheckpointer", "NestedStorageCheckpointer",
    "H5StorageCheckpointer", "StorageEnsembleCheckpointer",
)

__all__ = [
    "CompressedListStorage",
    "ImmutableDatasetWriter",
    "LazyMemmapStorage",
    "LazyStackStorage",
    "LazyTensorStorage",
    "ListStorage",
    "RoundRobinWriter",
    "Storage",
    "StorageEnsemble",
    "TensorDictRoundRobinWriter",
    "TensorStorage",
    "dumps",
    "loads",
    "open",
    "torchrl_class",
    *CHECKPOINTERS,
]


class _GapFiller:
    """Placed after the zstore classes and before TorchRL's in every MRO below.

    It only supplies what zstore does not define and TorchRL's version would get
    wrong on a zstore object. TorchRL's ``Storage.__setstate__`` rebuilds its
    ``multiprocessing.Value`` counters, which zstore does not use (and which a
    second pickling would refuse); a plain state restore is what zstore needs.
    """

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _outside_compiled_code(cls: type) -> type:
    """``cls.set`` and ``cls.get`` run outside ``torch.compile``'s graphs: each is one graph break.

    A storage whose rows live in a Zarr store (or in compressed blobs) reads and writes
    through fsspec, zarr and NumPy, which Dynamo cannot trace; a list storage's Python list
    grows at every write, and a compiled frame guarding its length recompiles at every
    step. Run eagerly, the call is the same at every step: a compiled ``extend`` /
    ``sample`` breaks its graph there and does not recompile (TorchRL runs its
    ``_rand_given_ndim`` the same way).
    """
    def eager(name: str):
        impl = cls.__dict__.get(name)  # the class's own method, or its parent's
        if impl is None:
            def impl(self, *args: Any, **kwargs: Any) -> Any:
                return getattr(super(cls, self), name)(*args, **kwargs)
        outside = torch.compiler.disable()(impl)

        def method(self, *args: Any, **kwargs: Any) -> Any:
            # the boundary only under the compiler: it costs ~0.7 µs a call in eager code
            if torch.compiler.is_compiling():
                return outside(self, *args, **kwargs)
            return impl(self, *args, **kwargs)

        method.__name__, method.__qualname__ = name, f"{cls.__qualname__}.{name}"
        method.__doc__ = getattr(cls, name).__doc__
        return method

    for name in ("set", "get"):
        setattr(cls, name, eager(name))
    return cls


class Storage(_z.Storage, _GapFiller, _trl.Storage):
    """:class:`zstore.Storage` that TorchRL's replay buffers accept (the base of the others)."""


@_outside_compiled_code
class ListStorage(_z.ListStorage, Storage, _trl.ListStorage):
    """:class:`zstore.ListStorage` that TorchRL's replay buffers accept."""


class LazyStackStorage(_z.LazyStackStorage, ListStorage, _trl.LazyStackStorage):
    """:class:`zstore.LazyStackStorage` that TorchRL's replay buffers accept."""


@_outside_compiled_code
class CompressedListStorage(_z.CompressedListStorage, ListStorage, _trl.CompressedListStorage):
    """:class:`zstore.CompressedListStorage` that TorchRL's replay buffers accept.

    TorchRL collates its samples with ``lazy_stack``; pass
    ``collate_fn=zstore.stack_items`` to get the pre-stacked batch instead.
    """


class _WriteThrough(TensorDict):
    """The rows ``start, start + step, ...`` of a storage, as ``storage[a:b]`` returns them:
    their in-place updates are stored.

    TorchRL's ``rb.set_at_`` / ``rb.set_`` / ``rb.update_`` write into ``storage[:]``, and
    ``rb[key] = value`` assigns a key of it. ``set_at_``, ``set_``, ``update_``,
    ``update_at_`` and item assignment here write the rows they change back with
    ``storage.set(rows, ..., set_cursor=False)``: it takes the lease, marks the rows for
    commits and incremental checkpoints, and refuses a read-only store. A key assigned is
    updated in place (a buffer's keys are fixed).

    A view of it (a ``transpose``, which TorchRL's buffers apply to the rows of an
    ``ndim=2`` storage, or an index of ints and slices) shares its tensors and stores its
    updates the same way: it finds, for each of its cells, the row of the slice it came from
    (``_cell_rows``), and stores those rows of the slice (``_rows``). Other derived TensorDicts
    (a tensor index, a clone, a nested TensorDict) store nothing themselves.
    """

    _source: tuple[Any, int, int] | None = None  # (storage, start, step)
    _rows: "_WriteThrough | None" = None  # the slice a view was derived from; None: itself
    # a view's derivation: (what it was derived from, how), applied to that one's _cell_rows
    _derived: tuple["_WriteThrough", Any] | None = None

    @classmethod
    def of(cls, td: TensorDict, storage: Any, start: int, step: int) -> "_WriteThrough":
        """``td`` (the same tensors) as the rows ``start::step`` of ``storage``."""
        out = cls._wrap(td)
        out._source = (storage, start, step)
        return out

    @staticmethod
    def _wrap(td: TensorDict) -> "_WriteThrough":
        """``td``'s tensors (not copied) in a new instance that stores nothing yet."""
        return _WriteThrough._new_unsafe(dict(td.items()), batch_size=td.batch_size,
                                         device=td.device,
                                         names=td.names if td._has_names() else None)

    def _cell_rows(self) -> torch.Tensor:
        """For each cell of the batch, its row in the slice this was derived from (computed
        when a view stores an update, not when it is made)."""
        if self._derived is not None:
            parent, derive = self._derived
            return derive(parent._cell_rows())
        n = self.batch_size[0]
        return torch.arange(n).view(n, *(1,) * (self.batch_dims - 1)).expand(self.batch_size)

    def _view(self, td: TensorDict, derive: Any) -> "_WriteThrough":
        """``td``, a view of these tensors, storing its updates into the rows its cells came
        from: ``derive`` maps this one's cell rows to ``td``'s."""
        out = self._wrap(td)
        out._source, out._rows, out._derived = self._source, self._whole(), (self, derive)
        return out

    def _whole(self) -> "_WriteThrough":
        """The slice this is a view of (itself, unless it is a view)."""
        return self if self._rows is None else self._rows

    def transpose(self, dim0: int, dim1: int) -> Any:
        out = super().transpose(dim0, dim1)
        if self._source is None or out is self or not isinstance(out, TensorDict):
            return out
        return self._view(out, lambda rows: rows.transpose(dim0, dim1))

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        if self._source is None or out is self or not isinstance(out, TensorDict) \
                or not _is_basic(index):
            return out
        return self._view(out, lambda rows: rows[index])

    def set_at_(self, key: Any, value: Any, index: Any, **kwargs: Any) -> "_WriteThrough":
        with self._stored(index):
            return super().set_at_(key, value, index, **kwargs)

    def set_(self, *args: Any, **kwargs: Any) -> "_WriteThrough":
        with self._stored(slice(None)):
            return super().set_(*args, **kwargs)

    def update_(self, *args: Any, **kwargs: Any) -> "_WriteThrough":
        with self._stored(slice(None)):
            return super().update_(*args, **kwargs)

    def update_at_(self, input_dict_or_td: Any, index: Any, *args: Any,
                   **kwargs: Any) -> "_WriteThrough":
        with self._stored(index):
            return super().update_at_(input_dict_or_td, index, *args, **kwargs)

    def __setitem__(self, index: Any, value: Any) -> None:
        key = _key_of(index)
        if not key:
            with self._stored(index):
                super().__setitem__(index, value)
        elif key in self.keys(include_nested=True):
            self.set_(key, value)
        else:
            raise KeyError(f"{index!r} is not a key of this buffer (its keys are fixed at its "
                           f"first write; keys: {sorted(self.keys(True, True), key=str)})")

    @contextlib.contextmanager
    def _stored(self, index: Any):
        """Run an in-place update at ``index``, then store the rows it wrote (once: the
        updates it calls inside store nothing)."""
        source, self._source = self._source, None
        try:
            yield
        finally:
            self._source = source
        if source is not None:
            storage, start, step = source
            cells = self._cell_rows()  # 0-dim for one row (``rb[:][i]``): nothing to index
            rows = (cells if cells.dim() == 0 else cells[index]).reshape(-1).unique()
            if len(rows):
                storage.set(start + step * rows, TensorDict.__getitem__(self._whole(), rows),
                            set_cursor=False)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_source", None)  # a pickled copy is plain data, not the storage's rows
        return state


class _WriteThroughTensor(torch.Tensor):
    """The rows ``start, start + step, ...`` of a storage of plain tensors, as
    ``storage[a:b]`` returns them where they are a copy (``memory://``, S3, a compressed
    codec): an item assignment into them, or into a view of them (a transpose, an index of
    ints and slices), stores the rows it wrote, as :class:`_WriteThrough` does for
    TensorDicts. TorchRL's ``rb[i, j] = x`` (over an ``ndim=2`` storage too) is
    ``rb[:][i, j] = x``. Other in-place ops, and code ``torch.compile`` traces, store nothing.
    """

    _source: tuple[Any, int, int] | None = None  # (storage, start, step)
    _root: torch.Tensor | None = None  # the slice's rows (a plain tensor), which views share

    @classmethod
    def of(cls, rows: torch.Tensor, storage: Any, start: int, step: int) -> "_WriteThroughTensor":
        """``rows`` (the same memory) as the rows ``start::step`` of ``storage``."""
        return cls._sharing(rows, rows, (storage, start, step))

    @classmethod
    def _sharing(cls, tensor: torch.Tensor, root: torch.Tensor,
                 source: tuple[Any, int, int]) -> "_WriteThroughTensor":
        out = tensor.as_subclass(cls)
        out._root, out._source = root, source
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # (traced code stores nothing: Dynamo would recurse)
            return super().__torch_function__(func, types, args, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        first = args[0] if args else None
        if not isinstance(first, _WriteThroughTensor) or first._source is None:
            return out
        if func is torch.Tensor.__setitem__:
            first._store(args[1])
        elif isinstance(out, torch.Tensor) and out.dtype == first.dtype and out.numel() \
                and out.untyped_storage().data_ptr() == first._root.untyped_storage().data_ptr():
            return cls._sharing(out, first._root, first._source)  # a view: stores its writes
        return out

    def _store(self, index: Any) -> None:
        """Store the rows an assignment at ``index`` wrote into (all this view spans, for an
        index of tensors, whose result is no view to measure)."""
        storage, start, step = self._source
        with torch._C.DisableTorchFunctionSubclass():
            written = self[index] if _is_basic(index) else self
        rows = _rows_spanned(written, self._root)
        if len(rows):
            storage.set(start + step * torch.arange(rows.start, rows.stop),
                        self._root[rows.start:rows.stop].clone(), set_cursor=False)  # (no alias)

    def __reduce_ex__(self, protocol: int) -> Any:  # a copy is plain data, not the rows
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()

    def __repr__(self, **kwargs: Any) -> str:  # shown as the rows it is
        return torch.Tensor.__repr__(self.as_subclass(torch.Tensor), **kwargs)


def _rows_spanned(view: torch.Tensor, root: torch.Tensor) -> range:
    """The rows of ``root`` that ``view``, a view of its memory, has elements in (all of
    ``root``'s when its rows are not laid out one after another along its dim 0)."""
    if not view.numel():
        return range(0)
    row = root.stride(0) if root.dim() else 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(root.shape[1:], root.stride()[1:]))
    if root.dim() == 0 or row < extent:
        return range(root.shape[0] if root.dim() else 0)
    low = high = view.storage_offset() - root.storage_offset()
    for size, stride in zip(view.shape, view.stride()):
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    return range(max(low // row, 0), min(high // row + 1, root.shape[0]))


class _ReadOnDemand(_WriteThrough):
    """``storage[a:b]`` of a :class:`LazyMemmapStorage` whose reads are copies (``memory://``,
    S3, a compressed codec, a store this process has not written yet): its rows are read
    when first needed, and a narrow key is served from the storage's column mirror.

    TorchRL's ``SliceSampler`` reads ``storage[:][end_key]`` (or its ``traj_key``) at every
    sample: here that reads nothing from the store (:meth:`LazyMemmapStorage._column`).
    Any other use (another key, an index, an in-place update, printing) reads the rows once,
    as ``storage.get(slice)`` does, and from then on this is a :class:`_WriteThrough`.
    """

    @classmethod
    def rows(cls, storage: "LazyMemmapStorage", index: slice,
             template: TensorDict) -> "_ReadOnDemand":
        """The rows ``index`` (a slice with a positive step, within the filled rows)."""
        start, stop, step = index.start, index.stop, index.step
        out = cls._new_unsafe({}, batch_size=torch.Size([len(range(start, stop, step)),
                                                          *template.batch_size[1:]]),
                              device=template.device)
        out._source = (storage, start, step)
        out.__dict__["_pending"] = (storage, index)
        return out

    def _leaves(self) -> Any:
        """The leaves, read from the store at the first use that needs them."""
        pending = self._still_pending()
        if pending is not None:
            storage, index = pending
            self.__dict__["_items"] = storage._read_rows(index)._tensordict
            del self.__dict__["_pending"]
        return self.__dict__["_items"]

    def _still_pending(self) -> tuple["LazyMemmapStorage", slice] | None:
        """The storage and rows not read yet (``None``: read); ``IndexError`` where the
        storage no longer holds them (emptied or loaded shorter since): read now, they
        would not fill this TensorDict's batch size."""
        pending = self.__dict__.get("_pending")
        if pending is not None:
            storage, index = pending
            filled = storage._len_along_dim0 if storage.initialized else 0
            if index.stop > filled:
                raise IndexError(
                    f"rows {index.start}:{index.stop} of {storage.spec.redacted()} were taken "
                    f"as a slice that reads its rows when first used, and the buffer holds "
                    f"{filled} rows now (emptied or loaded since): read the slice (or clone "
                    "it) before emptying the buffer")
        return pending

    _tensordict = property(_leaves)

    @_tensordict.setter
    def _tensordict(self, value: Any) -> None:
        self.__dict__["_items"] = value

    def _from_memory(self, key: tuple[str, ...]) -> torch.Tensor | None:
        """Key ``key`` of these rows from the storage's column mirror, while nothing is read."""
        pending = self._still_pending()
        if pending is None or not key:
            return None
        storage, index = pending
        column = storage._column(key)
        return None if column is None else column[index].to(storage.device, copy=True)

    # only the public reads: TensorDict's own in-place writes fetch leaves through _get_str
    def get(self, key: Any, *args: Any, **kwargs: Any) -> Any:
        column = self._from_memory(_key_of(key))
        return super().get(key, *args, **kwargs) if column is None else column

    def __getitem__(self, index: Any) -> Any:
        column = self._from_memory(_key_of(index))
        return super().__getitem__(index) if column is None else column

    @contextlib.contextmanager
    def _stored(self, index: Any):
        self._leaves()  # an in-place update writes into the rows, so they are read first
        with super()._stored(index):
            yield

    def __getstate__(self) -> dict[str, Any]:
        self._leaves()  # a pickled copy holds its rows, not the storage
        return super().__getstate__()


def _key_of(index: Any) -> tuple[str, ...]:
    """``index`` as a nested key (``()`` when it indexes rows instead)."""
    return _unravel_key_to_tuple(index) if isinstance(index, (str, tuple)) else ()


def _slice_then_basic(index: Any) -> bool:
    """Whether ``index`` is ``(rows, *rest)``: ``rows`` a slice of positive step, ``rest``
    basic (:func:`_is_basic`)."""
    return (isinstance(index, tuple) and len(index) > 1 and isinstance(index[0], slice)
            and (index[0].step is None or index[0].step > 0) and _is_basic(index[1:]))


def _is_basic(index: Any) -> bool:
    """Whether ``index`` indexes by ints, slices, ``...`` and ``None`` only (its result is a
    view of what it indexes)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(part, (int, slice, type(Ellipsis), type(None)))
               and not isinstance(part, bool) for part in parts)


@_outside_compiled_code
class TensorStorage(_z.TensorStorage, Storage, _trl.TensorStorage):
    """:class:`zstore.TensorStorage` that TorchRL's replay buffers accept.

    A slice of TensorDicts or tensorclasses (``storage[:]``, which TorchRL's in-place buffer
    updates write into) stores its in-place updates: see :class:`_WriteThrough`; a slice of
    plain tensors its item assignments (:class:`_WriteThroughTensor`).
    """

    def get(self, index: Any) -> Any:
        if _slice_then_basic(index) and self.initialized and (self._rows_are_collections()
                                                               or self._rows_are_tensors()):
            # storage[a:b, lanes] (TorchRL's rb[:] of an ndim=2 storage reads [:, :]): a view
            # of the slice's rows, which stores its in-place updates as the slice does
            return self.get(index[0])[(slice(None), *index[1:])]
        if (isinstance(index, int) and not isinstance(index, bool) and self.initialized
                and -self._len_along_dim0 <= index < self._len_along_dim0
                and self._rows_are_collections()):
            # storage[i] (TorchRL's rb[i]) is a view of that row in TorchRL's storages, and
            # rb[i].set_(...) lands: here the one-row slice's view, which stores it
            row = index % self._len_along_dim0
            return self.get(slice(row, row + 1))[0]
        out = super().get(index)
        if not isinstance(index, slice):
            return out
        start, _, step = index.indices(self._len_along_dim0)
        if type(out) is TensorDict:
            return _WriteThrough.of(out, self, start, step)
        if is_tensorclass(out) and type(out._tensordict) is TensorDict:
            return type(out).from_tensordict(_WriteThrough.of(out._tensordict, self, start, step))
        if type(out) is torch.Tensor and out.dim() and self._rows_are_tensors() \
                and self._slices_are_copies():
            return _WriteThroughTensor.of(out, self, start, step)
        return out

    def _rows_are_collections(self) -> bool:
        """Whether the rows are TensorDicts or tensorclasses (an initialised storage)."""
        return is_tensor_collection(self._storage)

    def _rows_are_tensors(self) -> bool:
        """Whether the rows are plain tensors (an initialised storage)."""
        return isinstance(self._storage, torch.Tensor)

    def _slices_are_copies(self) -> bool:
        """Whether ``storage[a:b]`` is a copy of the rows that can store its assignments
        (else it is views of them, as in RAM, where they land without help)."""
        return False


class LazyTensorStorage(_z.LazyTensorStorage, TensorStorage, _trl.LazyTensorStorage):
    """:class:`zstore.LazyTensorStorage` that TorchRL's replay buffers accept."""


@_outside_compiled_code
class LazyMemmapStorage(_z.LazyMemmapStorage, LazyTensorStorage, _trl.LazyMemmapStorage):
    """:class:`zstore.LazyMemmapStorage` (Zarr at any URL) that TorchRL's replay buffers accept.

    Where its reads are copies (``memory://``, S3, a compressed codec), a slice of TensorDict
    rows reads them only when needed (:class:`_ReadOnDemand`), and a narrow key of every row
    (TorchRL's ``SliceSampler`` reads ``storage[:][end_key]`` at every sample) is kept in
    memory as it is written (:class:`zstore.columns.ColumnMirror`): a sample reads only the
    rows it draws.
    """

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        before = self._mutation_revision
        try:
            super().set(cursor, data, set_cursor=set_cursor)
        except BaseException:
            self._mirror.clear()  # a refused or partial write: read the columns again
            raise
        self._mirror.written(cursor, data, before, self._mutation_revision)

    def get(self, index: Any) -> Any:
        if isinstance(index, slice) and self.initialized and not self._maps_writable:
            start, stop, step = index.indices(self._len_along_dim0)
            template = self._template()
            if step > 0 and template is not None:
                return _ReadOnDemand.rows(self, slice(start, max(start, stop), step), template)
        return super().get(index)

    def _rows_are_collections(self) -> bool:
        return self._schema.kind in ("tensordict", "tensorclass")

    def _rows_are_tensors(self) -> bool:
        return self._schema.kind == "tensor"

    def _slices_are_copies(self) -> bool:  # (a read-only store's copy is the reader's to edit)
        return not self._maps_writable and not self.spec.read_only

    def _read_rows(self, index: Any) -> Any:
        """``get(index)``, reading the rows now."""
        return super().get(index)

    def _template(self) -> TensorDict | None:
        """No row of the buffer, as a plain TensorDict (its keys, dtypes and cell shapes);
        ``None`` unless its rows are TensorDicts. Kept while the schema is the same (it is
        fixed at the first write)."""
        cached = self.__dict__.get("_empty_rows")
        if cached is None or cached[0] is not self._schema:
            empty = self._read_rows(slice(0, 0))
            # not to_tensordict(): it asks an empty stack of strings for names it cannot have
            plain = (TensorDict._new_unsafe(dict(empty.items()), batch_size=empty.batch_size,
                                            device=empty.device)
                     if type(empty) is _WriteThrough else None)
            cached = self.__dict__["_empty_rows"] = (self._schema, plain)
        return cached[1]

    @property
    def _mirror(self) -> ColumnMirror:
        mirror = self.__dict__.get("_column_mirror")
        if mirror is None:  # not pickled: a copy builds its own
            mirror = self.__dict__["_column_mirror"] = ColumnMirror()
        return mirror

    def _column(self, key: tuple[str, ...]) -> torch.Tensor | None:
        """Key ``key`` of every row of the container, from memory (read from the store at the
        first request after a change the mirror did not follow); ``None`` unless ``key`` is a
        leaf of at most ``MIRROR_CELL_BYTES`` a cell."""
        leaf = self._template().get(key, None)  # called for TensorDict rows only
        if not isinstance(leaf, torch.Tensor) or cell_bytes(leaf, self.ndim) > MIRROR_CELL_BYTES:
            return None

        def read() -> torch.Tensor:
            n = self._len_along_dim0
            column = zeros_paged_in((*self._total_shape, *leaf.shape[self.ndim:]), leaf.dtype)
            for lo in range(0, n, SCAN_ROWS):
                column[lo:min(lo + SCAN_ROWS, n)] = self._read_rows(
                    slice(lo, min(lo + SCAN_ROWS, n))).get(key)
            return column

        try:
            return self._mirror.column(key, self._mutation_revision, read)
        except MemoryError:  # a capacity past this machine's address space: no mirror, the
            return None      # reads go to the store

    def __del__(self) -> None:
        """Nothing: zstore's finalizer deletes an ``auto_cleanup`` store, at a safe point for
        ``memory://`` (TorchRL's ``__del__`` would delete it in the middle of a collection)."""


class StorageEnsemble(_z.StorageEnsemble, Storage, _trl.StorageEnsemble):
    """:class:`zstore.StorageEnsemble` that TorchRL's replay buffers (and
    ``ReplayBufferEnsemble``) accept; TorchRL stacks its samples (``_stack_anything``)."""

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        return _as_twin(out) if type(out) is _z.StorageEnsemble else out  # a sub-ensemble


_TWINS: dict[type, type] = {
    _z.Storage: Storage, _z.ListStorage: ListStorage, _z.LazyStackStorage: LazyStackStorage,
    _z.CompressedListStorage: CompressedListStorage, _z.TensorStorage: TensorStorage,
    _z.LazyTensorStorage: LazyTensorStorage, _z.LazyMemmapStorage: LazyMemmapStorage,
    _z.StorageEnsemble: StorageEnsemble,
}


def _checkpointer_twin(name: str) -> type:
    """zstore's checkpointer ``name`` (its formats, any URL) as a subclass of TorchRL's too."""
    zcls = getattr(_ckpt, name)
    return type(name, (zcls, getattr(_trl_ckpt, name)), {
        "__module__": __name__,
        "__doc__": f":class:`checkpoint.{name}` that is also TorchRL's ``{name}``.",
    })


StorageCheckpointerBase = _checkpointer_twin("StorageCheckpointerBase")
ListStorageCheckpointer = _checkpointer_twin("ListStorageCheckpointer")
CompressedListStorageCheckpointer = _checkpointer_twin("CompressedListStorageCheckpointer")
TensorStorageCheckpointer = _checkpointer_twin("TensorStorageCheckpointer")
FlatStorageCheckpointer = _checkpointer_twin("FlatStorageCheckpointer")
NestedStorageCheckpointer = _checkpointer_twin("NestedStorageCheckpointer")
H5StorageCheckpointer = _checkpointer_twin("H5StorageCheckpointer")
StorageEnsembleCheckpointer = _checkpointer_twin("StorageEnsembleCheckpointer")


class ImmutableDatasetWriter(_zw.ImmutableDatasetWriter, _trl_writers.ImmutableDatasetWriter):
    """:class:`zstore.ImmutableDatasetWriter` that TorchRL's replay buffers accept."""


def torchrl_class(cls: type) -> type:
    """The TorchRL-compatible class of a zstore storage class (built once for subclasses).

    >>> torchrl_class(zstore.LazyMemmapStorage) is LazyMemmapStorage
    True
    """
    if cls in _TWINS.values():
        return cls
    if cls not in _TWINS:
        base = next((c for c in cls.__mro__ if c in _TWINS), None)
        if base is None:
            raise TypeError(f"{cls.__name__} is not a zstore storage class")
        _TWINS[cls] = type(cls.__name__, (cls, _TWINS[base]),
                           {"__module__": __name__, "__doc__": cls.__doc__})
    return _TWINS[cls]


def open(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
         mode: str = "r+", cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host",
         device: Any = None, lease_ttl: float | None = DEFAULT_TTL,
         autocommit_seconds: float = 5.0):
    """:func:`zstore.open` (the same arguments), returning the storage as its
    TorchRL-compatible class.

    >>> storage = zstore.torchrl.open("s3://bucket/rb", mode="r")  # doctest: +SKIP
    >>> rb = TensorDictReplayBuffer(storage=storage, writer=ImmutableDatasetWriter())  # doctest: +SKIP
    """
    return _as_twin(_open(url, storage_options, mode=mode, cache_bytes=cache_bytes, cache=cache,
                          device=device, lease_ttl=lease_ttl,
                          autocommit_seconds=autocommit_seconds))


def _as_twin(storage: Any) -> Any:
    """``storage`` (and an ensemble's members) as its TorchRL-compatible class: adds no
    state, only ``isinstance`` changes."""
    storage.__class__ = torchrl_class(type(storage))
    if isinstance(storage, _z.StorageEnsemble):
        for member in storage._storages:
            _as_twin(member)
    return storage


class _Resuming:
    """On ``register_storage``, a fresh writer continues after a reopened storage's last
    cursor; and again after the state it reloads on taking the write lease at its first
    write (another writer may have committed rows since it was opened).

    TorchRL's writers always start at cursor 0, so a buffer built over a storage
    reopened with :func:`open` would overwrite its oldest rows from row 0 on.
    """

    def register_storage(self, storage: Any) -> None:
        """Write into ``storage``; a fresh writer continues after its stored cursor."""
        super().register_storage(storage)
        if self._cursor == 0 and self._write_count == 0:
            resume_at(self, resume_point(storage))

    def add(self, data: Any) -> Any:
        """Write one item at the cursor (after rows another writer committed meanwhile);
        returns its index."""
        resume_at(self, resume_point_if_moved(self._storage))
        return super().add(data)

    def extend(self, data: Any) -> Any:
        """Write a batch from the cursor on (after rows another writer committed
        meanwhile); returns their indices."""
        resume_at(self, resume_point_if_moved(self._storage))
        return super().extend(data)


class _AllOrNothing:
    """A write the storage refuses leaves the writer's cursor and count as they were; and
    where processes share the writer, each write is theirs alone.

    TorchRL's writers move their cursor before the storage sees the data, so a
    refused batch (a wrong shape, a missing key) would leave a gap of never-written
    rows that the next write skips over and samplers draw from. Handed to spawned
    processes, TorchRL's writers read and move their shared cursor without a lock, so two
    processes can take the same rows; these hold one lock for the whole write
    (:class:`zstore.sharing.ProcessLock`, made when the writer is first handed out).
    """

    #: the lock of the processes this writer was handed to (None: one process)
    _processes_lock: ProcessLock | None = None

    def add(self, data: Any) -> Any:
        with self._one_writer(), rolled_back_on_error(self):
            return super().add(data)

    def extend(self, data: Any) -> Any:
        with self._one_writer(), rolled_back_on_error(self):
            return super().extend(data)

    def _one_writer(self) -> Any:
        """The lock that makes a write the only one (nothing to take in one process)."""
        return self._processes_lock or contextlib.nullcontext()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if get_spawning_popen() is not None:
            if self._processes_lock is None:
                self._processes_lock = ProcessLock()
            state["_processes_lock"] = self._processes_lock
        return state


class RoundRobinWriter(_Resuming, _AllOrNothing, _trl_writers.RoundRobinWriter):
    """TorchRL's RoundRobinWriter that resumes a reopened storage (see :func:`open`) and
    moves nothing on a refused write."""


class TensorDictRoundRobinWriter(_Resuming, _AllOrNothing, _trl_writers.TensorDictRoundRobinWriter):
    """TorchRL's TensorDictRoundRobinWriter that resumes a reopened storage (see :func:`open`)
    and moves nothing on a refused write."""
