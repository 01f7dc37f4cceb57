"""Row indices of a tensor storage: what an index a TorchRL user passes selects.

An index (int, slice, list, range, array, tensor, boolean mask, or a tuple whose first
element is one of those) is resolved against a number of rows into an int64 tensor of row
positions, the leading shape of the result and whether its first dim is dropped.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch


def is_int(cursor: Any) -> bool:
    """Whether ``cursor`` is one integer (a Python or NumPy int, or a 0-d tensor or array),
    not a bool."""
    if isinstance(cursor, bool):
        return False
    if isinstance(cursor, (int, np.integer)):
        return True
    return isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0


def span_tensor(span: range) -> torch.Tensor:
    """``span`` as an int64 tensor (empty when the range is)."""
    if not len(span):
        return torch.empty(0, dtype=torch.int64)
    return torch.arange(span.start, span.stop, span.step)


def is_negative(cursor: Any) -> bool:
    """Whether an int cursor (or the last element of a tensor cursor, or a bound of a slice)
    is negative: a position counted from the end."""
    if isinstance(cursor, slice):
        return any(bound is not None and int(bound) < 0 for bound in (cursor.start, cursor.stop))
    if is_int(cursor):
        return int(cursor) < 0
    if isinstance(cursor, torch.Tensor) and cursor.numel():
        return int(cursor.reshape(-1)[-1]) < 0
    return False


def as_index_tensor(index: Any) -> Any:
    """Lists, ranges and arrays inside a tuple index become tensors (so they pair up)."""
    if isinstance(index, (list, range, np.ndarray)):
        return torch.as_tensor(list(index) if isinstance(index, range) else index,
                               dtype=torch.int64 if len(index) == 0 else None)
    return index


def without_new_axes(index: Any, dims: Callable[[], int | None]) -> tuple[int, Any]:
    """``(news, index)``: an index with its leading ``None`` s (new dims of 1, as torch adds
    them) counted and taken off, uint8 tensors taken as the masks torch takes them for, and
    a leading ``...`` spelled as the slices it stands for over the ``dims()`` dims every
    stored value has (``None``: not the same for all, or left to torch: ``...`` is kept;
    asked only for such an index).
    ``news`` is how many dims of 1 the result of the rest gains in front."""
    if isinstance(index, torch.Tensor) and index.dtype == torch.uint8:
        return 0, index.bool()
    if index is None or index is Ellipsis:  # (x[...] is x[:])
        return int(index is None), slice(None)
    if not isinstance(index, tuple):
        return 0, index
    index = tuple(i.bool() if isinstance(i, torch.Tensor) and i.dtype == torch.uint8 else i
                  for i in index)
    news = next((at for at, i in enumerate(index) if i is not None), len(index))
    rest = index[news:]
    if rest and rest[0] is Ellipsis and (spans := dims()) is not None:
        taken = sum(i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                    for i in rest[1:] if i is not None and i is not Ellipsis)
        rest = (*(slice(None),) * max(0, spans - taken), *rest[1:])
    return news, (rest if rest else slice(None))


def is_key(index: Any) -> bool:
    """Whether ``index`` names a (nested) key rather than rows."""
    return isinstance(index, str) or (isinstance(index, tuple) and bool(index)
                                      and all(isinstance(k, str) for k in index))


def rows_of(index: Any, n: int) -> tuple[torch.Tensor, tuple[int, ...] | None, bool]:
    """Row indices (checked against ``n`` rows), the result's leading shape (``None``: one
    dim of ``len(rows)``), and whether the leading dim is dropped (an int index)."""
    if is_int(index):
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
        return torch.tensor([i % n]), (), True
    if isinstance(index, slice):
        return span_tensor(range(*index.indices(n))), None, False
    if index is Ellipsis:
        return torch.arange(n), None, False
    if index is None or isinstance(index, bool):  # as torch: a new leading dim of 1 (False: 0)
        return (torch.arange(n), (1, n), False) if index is not False else \
            (torch.empty(0, dtype=torch.int64), (0, n), False)
    if isinstance(index, (list, range)) and len(index) == 0 or \
            isinstance(index, np.ndarray) and index.shape == (0,):  # (float, as torch takes it)
        return torch.empty(0, dtype=torch.int64), (0,), False
    rows = torch.as_tensor(index if not isinstance(index, range) else list(index))
    if rows.dtype in (torch.bool, torch.uint8):  # torch takes a uint8 index as a mask too
        if rows.ndim != 1 or rows.shape[0] != n:
            raise IndexError(f"boolean index of shape {list(rows.shape)} does not match {n} rows")
        rows = torch.nonzero(rows).squeeze(-1)
    if rows.is_floating_point():
        raise IndexError(f"row indices must be integers, got {rows.dtype}")
    rows = rows.to("cpu", torch.int64)
    shape = tuple(rows.shape)
    rows = rows.reshape(-1)
    if rows.numel():
        low, high = torch.aminmax(rows)
        if int(high) >= n or int(low) < -n:
            bad = rows[(rows >= n) | (rows < -n)][0]
            raise IndexError(f"index {int(bad)} is out of bounds for dimension 0 with size {n}")
        if int(low) < 0:
            rows = torch.remainder(rows, n)
    return rows, shape, False


def broadcast_tensor_index(first: Any, rest: tuple) -> tuple[Any, tuple]:
    """A tuple index of integer tensors indexes as torch does: its tensors are broadcast
    together and pair up (``IndexError`` when they cannot be, as torch's). Any other index
    is returned as it is (slices and ints combine with tensors as outer indexing)."""
    parts = (first, *rest)
    if not rest or not all(isinstance(p, torch.Tensor) and p.ndim and p.dtype != torch.bool
                           and not p.is_floating_point() for p in parts):
        return first, rest
    try:
        shape = torch.broadcast_shapes(*(p.shape for p in parts))
    except RuntimeError:
        raise IndexError("shape mismatch: indexing tensors could not be broadcast together "
                         f"with shapes {', '.join(str(list(p.shape)) for p in parts)}") from None
    first, *rest = (p.expand(shape) for p in parts)
    return first, tuple(rest)
