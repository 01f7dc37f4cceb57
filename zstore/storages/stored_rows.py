"""``storage._storage`` of a :class:`~zstore.LazyMemmapStorage` whose reads are copies: the
whole buffer as TorchRL's container, read only where it is indexed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .base import SCAN_ROWS
from .row_index import as_index_tensor, is_key, rows_of

if TYPE_CHECKING:
    from .memmap import LazyMemmapStorage


class StoredRows:
    """``storage._storage`` of a :class:`LazyMemmapStorage` whose reads are copies (remote,
    compressed, read-only, or not yet this writer's): every row of the buffer, as TorchRL's
    container, read only where it is indexed.

    ``rows[index]`` reads those rows (negative indices count from the last row of the
    container, as TorchRL's); ``rows.get(key)`` reads one key of every row, ``SCAN_ROWS`` rows
    at a time; ``rows[index] = data`` is ``storage.set(index, data, set_cursor=False)`` (a
    read-only store refuses it). What a read returns is a copy: editing it stores nothing.
    """

    def __init__(self, storage: "LazyMemmapStorage"):
        self.storage = storage

    @property
    def shape(self) -> torch.Size:
        """``[rows, *lanes]`` of the whole container, then an item's own batch dims (those of
        a ``[N, 3]`` TensorDict in an ``ndim=1`` buffer), as TorchRL's ``_storage.shape``."""
        return torch.Size([*self.storage._total_shape, *self.storage._schema.item_batch])

    batch_size = shape

    @property
    def device(self) -> torch.device:
        """Where the rows read are returned (the storage's device)."""
        return self.storage.device

    def __len__(self) -> int:
        return self.shape[0]

    def keys(self, include_nested: bool = False, leaves_only: bool = False, **kwargs: Any):
        """The buffer's keys (TensorDict data only), read from its schema."""
        return self[:0].keys(include_nested, leaves_only, **kwargs)

    def get(self, key: Any, *default: Any) -> Any:
        """Key ``key`` of every row (``default`` when the buffer lacks it)."""
        if default and key not in self.keys(include_nested=True):
            return default[0]

        rows = len(self)
        return torch.cat([self[lo:min(lo + SCAN_ROWS, rows)].get(key)
                          for lo in range(0, rows, SCAN_ROWS)])

    def __getitem__(self, index: Any) -> Any:
        if is_key(index):
            return self.get(index)
        storage = self.storage
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        rows, lead, squeeze = rows_of(as_index_tensor(first), len(self))
        with storage._commit_lock:
            block = storage._build(storage.table.read(rows), (len(rows),), storage._schema.lane_shape)
        # the rows read, in order: the block indexed by their positions is the container
        # indexed by ``first``, and ``rest`` pairs with them as it would there
        if squeeze:
            local: Any = 0
        elif lead is None:
            local = slice(None)
        else:
            local = torch.arange(len(rows)).reshape(lead)
        return block[(local, *rest)]

    def __setitem__(self, index: Any, value: Any) -> None:
        if is_key(index):
            raise TypeError(
                f"storage._storage[{index!r}] = ... would rewrite a key of every row: write "
                "the rows instead, storage.set(index, data, set_cursor=False)")
        self.storage.set(index, value, set_cursor=False)

    def __repr__(self) -> str:
        return f"StoredRows(shape={list(self.shape)}, of={self.storage.spec.redacted()})"
