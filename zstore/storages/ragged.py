"""The ragged layout of a CompressedListStorage key whose shape varies from item to item.

A ragged key is two inner :class:`~zstore.LazyMemmapStorage` tables under the
storage's URL (plain Zarr v3, never pickled), of one generation ``<g>``::

    ragged/<key>/index-<g>/    start, shape [, item_shape]: one row per item
    ragged/<key>/values-<g>/   _-single-tensor-_ [capacity, *unit]: the items' values

``values`` holds *units* (the items' common trailing shape, or single elements), items
one after another; an item's row of ``index`` says where its units start and its shape.
Overwritten items leave dead units behind: :meth:`RaggedKey.regrow` compacts them into a
new generation of both tables when ``values`` fills, and hands the old one to the owner to
delete once no commit names it (:meth:`~zstore.CompressedListStorage.retire`): the
committed generation is never rewritten, only appended to. Stores written before
generations of ``index`` keep theirs at ``ragged/<key>/index`` until their first
compaction. The owning
:class:`~zstore.CompressedListStorage` makes and reopens the tables (``inner_table`` /
``reopened_inner_table``) and records :meth:`RaggedKey.to_json` in its root block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
from tensordict import TensorDict

from ..dtypes import torch_dtype_from_name, torch_dtype_name
from ..errors import CorruptChunkError
from ..layout import SINGLE_TENSOR_KEY

if TYPE_CHECKING:
    from .compressed import CompressedListStorage
    from .memmap import LazyMemmapStorage


class RaggedKey:
    """One key in the ragged layout: ``values`` (units) + per-item ``start`` / ``shape``."""

    def __init__(self, owner: "CompressedListStorage", path: str, dtype: torch.dtype,
                 unit: tuple[int, ...], ndim: int, item_ndim: int | None):
        self.owner, self.path, self.dtype, self.unit = owner, path, dtype, unit
        self.ndim, self.item_ndim = ndim, item_ndim  # item_ndim: custom codecs only
        self.gen = 0  # the generation of both tables (none before the first write)
        self.index_gen: int | None = None  # None: a store's ``index`` of before generations
        self.used = 0
        self.index: LazyMemmapStorage | None = None
        self.values: LazyMemmapStorage | None = None

    def to_json(self) -> dict[str, Any]:
        """What the root ``zstore`` block records to reopen this key."""
        return {"dtype": torch_dtype_name(self.dtype), "unit": list(self.unit), "ndim": self.ndim,
                "item_ndim": self.item_ndim, "index": self.index_gen, "values": self.gen,
                "used": self.used,
                "capacity": self.values.max_size if self.values is not None else None,
                "written": self.values is not None and self.values.initialized}

    @classmethod
    def reopen(cls, owner: "CompressedListStorage", path: str, data: Mapping[str, Any]) -> "RaggedKey":
        """The key as recorded by :meth:`to_json`, its arrays reopened."""
        self = cls.__new__(cls)
        self.owner, self.path = owner, path
        self.dtype = torch_dtype_from_name(data["dtype"])
        self.unit, self.ndim = tuple(int(u) for u in data["unit"]), int(data["ndim"])
        self.item_ndim = None if data["item_ndim"] is None else int(data["item_ndim"])
        self.gen, self.used = int(data["values"]), int(data["used"])
        index = data.get("index")  # absent from stores written before generations of index
        self.index_gen = None if index is None else int(index)
        self.index = owner.reopened_inner_table(
            f"ragged/{path}/index" if index is None else f"ragged/{path}/index-{self.index_gen}")
        # values never written: the next write makes a generation of its own
        self.values = owner.reopened_inner_table(f"ragged/{path}/values-{self.gen}") \
            if data["written"] else None
        if self.used > (self.values.max_size if self.values is not None else 0):
            raise ValueError(f"ragged {path!r}: used {self.used} is more units than its values "
                             "hold")
        return self

    @property
    def unit_numel(self) -> int:
        """Elements of one unit of ``values``."""
        return math.prod(self.unit)

    def new_generation(self, capacity: int) -> None:
        """Make a new, empty generation of both tables (``capacity`` units of values) this
        key's; the caller retires the tables it replaces once it has read them."""
        self.gen += 1
        self.index_gen = self.gen
        owner = self.owner
        self.index = owner.inner_table(f"ragged/{self.path}/index-{self.gen}", owner.max_size,
                                       owner.default_codec)
        self.values = owner.inner_table(f"ragged/{self.path}/values-{self.gen}", capacity,
                                        owner.codec_of(self.path))
        self.used = 0

    def write(self, rows: torch.Tensor, tensors: list[torch.Tensor],
              item_shapes: list[tuple[int, ...]] | None = None) -> None:
        """Append the items' values and point ``rows`` at them."""
        if self.unit and any(tuple(t.shape[1:]) != self.unit for t in tensors):
            self.regrow(0, unit=())
        units = [t.numel() // max(1, self.unit_numel) for t in tensors]
        total = sum(units)
        if self.values is None or self.used + total > self.values.max_size:
            self.regrow(total)
        flat = torch.cat([t.reshape(-1, *self.unit) for t in tensors]) if tensors else None
        starts = self.used + torch.tensor([0, *units[:-1]], dtype=torch.int64).cumsum(0)
        if total:
            self.values.set(torch.arange(self.used, self.used + total), flat)
        self.used += total
        self.index.set(rows, self._index_td(starts, [tuple(t.shape) for t in tensors], item_shapes))

    def _index_td(self, starts, shapes, item_shapes) -> TensorDict:
        def padded(shape_list, nd):
            out = torch.zeros(len(shape_list), max(1, nd), dtype=torch.int64)
            if nd:
                out[:] = torch.tensor(shape_list, dtype=torch.int64).reshape(len(shape_list), nd)
            return out
        data = {"start": starts, "shape": padded(shapes, self.ndim)}
        if self.item_ndim is not None:
            data["item_shape"] = padded(item_shapes, self.item_ndim)
        return TensorDict(data, batch_size=[len(starts)])

    def read(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple[int, ...]] | None]:
        """The stored tensors of ``rows`` (and the item shapes, for custom codecs)."""
        index = self._part_read(self.index, rows, "index")
        starts, shapes = index["start"], index["shape"][:, : self.ndim]
        lengths = shapes.prod(-1) // max(1, self.unit_numel)
        self._refuse_misfits(rows, starts, shapes, lengths)
        if len(rows) and int(lengths.sum()):
            take = torch.repeat_interleave(starts - lengths.cumsum(0) + lengths, lengths) \
                + torch.arange(int(lengths.sum()))
            flat = self._part_read(self.values, take, "values")[SINGLE_TENSOR_KEY]
        else:
            flat = torch.empty((0, *self.unit), dtype=self.dtype)
        parts = torch.split(flat, lengths.tolist())
        out = [p.reshape(s) for p, s in zip(parts, shapes.tolist())]
        item_shapes = None
        if self.item_ndim is not None:
            item_shapes = [tuple(s[: self.item_ndim]) for s in index["item_shape"].tolist()]
        return out, item_shapes

    def _refuse_misfits(self, rows: torch.Tensor, starts: torch.Tensor, shapes: torch.Tensor,
                        lengths: torch.Tensor) -> None:
        """:class:`CorruptChunkError` for an item whose row of ``index`` no write makes: a
        shape of other dims or trailing unit, or units outside the ``used`` ones of values
        (a store edited by hand, or damaged where no checksum covers it). NumPy: a few
        microseconds a read."""
        start, shape, length = starts.numpy(), shapes.numpy(), lengths.numpy()
        fits = ((start >= 0) & (start + length <= self.used) & (shape >= 0).all(-1)
                & (shape.prod(-1) == length * max(1, self.unit_numel)))
        if self.ndim and shape.shape[-1] != self.ndim:
            fits[:] = False
        elif self.unit:
            fits &= (shape[:, shape.shape[-1] - len(self.unit):] == self.unit).all(-1)
        if not fits.all():
            at = int(np.flatnonzero(~fits)[0])
            raise CorruptChunkError(
                f"{self.owner.spec.redacted()}: key {self.path!r}: item {int(rows[at])} is recorded "
                f"at unit {int(start[at])} with shape {shape[at].tolist()}, which no write "
                f"makes ({self.used} units of shape {list(self.unit)} used, items of "
                f"{self.ndim} dims): the store was edited or damaged; restore a copy")

    def _part_read(self, part: LazyMemmapStorage, rows: torch.Tensor, name: str) -> dict:
        try:
            return part.table.read(rows)
        except CorruptChunkError as exc:  # name the user's key, not the inner array's
            raise CorruptChunkError(f"key {self.path!r} ({name}): {exc}") from exc

    def regrow(self, extra: int, unit: tuple[int, ...] | None = None) -> None:
        """Copy the live items into a new generation (compacts; doubles the capacity); the
        old one is retired, not rewritten (a commit, and its readers, may still use it)."""
        n = len(self.owner)
        live, item_shapes = self.read(torch.arange(n)) if n and self.index is not None else ([], [])
        if unit is not None:
            self.unit = unit
        units = sum(t.numel() // max(1, self.unit_numel) for t in live)
        old = (self.index, self.values)
        self.new_generation(max(2 * (units + extra), (1 << 20) // max(
            1, self.unit_numel * self.dtype.itemsize), 64))
        if live:
            self.write(torch.arange(n), live, item_shapes)
        self.owner.retire(*old)

    def flush(self) -> None:
        """Store both parts' rows and commit them."""
        for part in (self.index, self.values):
            if part is not None:
                part.flush()
