"""String leaves of a tensor collection as text cells: fixed-width UTF-8 in a uint8 column.

A tensorclass's ``str`` field or a ``TensorDict.set_non_tensor`` string is a non-tensor
leaf (``NonTensorData`` for one value over the batch, ``NonTensorStack`` for one per row).
A buffer stores it as a plain Zarr ``uint8`` array whose last dim is the cell width: each
cell is the string's UTF-8 bytes, padded with NUL bytes (so a string holding NUL cannot be
stored; ``None`` is stored as the empty string), and reads give back one string per row,
as TorchRL's in-RAM storages do. Nothing is pickled. No I/O here.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, is_non_tensor
from tensordict import is_tensor_collection, is_tensorclass

from .errors import SchemaError

#: Default width in bytes of a text cell (``text_bytes=`` of a storage sets it): the
#: longest string of the first write widens it.
TEXT_BYTES = 256


def non_tensor_leaves(data: Any) -> Iterator[tuple[Any, Any]]:
    """``(key, value)`` of a tensor collection's non-tensor leaves (``NonTensorData``:
    strings...); none for a lazy stack or for data that is no tensor collection."""
    if not is_tensor_collection(data) or isinstance(data, LazyStackedTensorDict):
        return
    td = data._tensordict if is_tensorclass(data) else data
    for key, value in td.items(include_nested=True):
        if is_non_tensor(value):
            yield key, value


def values_of(value: Any) -> list[Any]:
    """The scalars of a non-tensor leaf, row after row (one, broadcast, for ``NonTensorData``)."""
    return _flatten(value.tolist()) if isinstance(value, NonTensorStack) else [value.data]


def holds_value(value: Any) -> bool:
    """Whether a non-tensor leaf holds a value: ``None`` everywhere is no value."""
    return any(v is not None for v in values_of(value))


def is_text(value: Any) -> bool:
    """Whether a non-tensor leaf holds strings only (``None`` counts as the empty string)."""
    return all(v is None or isinstance(v, str) for v in values_of(value))


def longest(value: Any) -> int:
    """UTF-8 bytes of the longest string of a leaf (0 without any)."""
    return max((len(v.encode()) for v in values_of(value) if isinstance(v, str)), default=0)


def width_for(value: Any, at_least: int) -> int:
    """The cell width for a leaf: ``at_least``, or a power of two holding its longest string."""
    return max(at_least, 1 << max(0, longest(value) - 1).bit_length())


def widest(data: Any) -> int:
    """The narrowest power-of-two cell width that holds every string of ``data`` (a batch,
    a whole container); 0 where it holds none."""
    return max((width_for(value, 0) for _, value in non_tensor_leaves(data)
                if is_text(value) and holds_value(value)), default=0)


def encode(value: Any, width: int, key: Any) -> torch.Tensor:
    """Text cells ``[*value.batch_size, width]`` of a string leaf (SchemaError naming
    ``key`` for a value that is no string, too long a string, or one holding NUL)."""
    shape = tuple(value.batch_size)
    strings = values_of(value)
    if isinstance(value, NonTensorData):
        strings = strings * int(np.prod(shape, dtype=np.int64))
    cells = np.zeros((len(strings), width), dtype=np.uint8)
    for i, text in enumerate(strings):
        if text is None:
            continue
        if not isinstance(text, str):
            raise SchemaError(f"key {key!r}: {type(text).__name__} values cannot be stored (only "
                              "tensors and strings; nothing is pickled): nothing was written")
        raw = text.encode()
        if len(raw) > width or b"\0" in raw:
            why = (f"is {len(raw)} UTF-8 bytes, longer than this buffer's {width}-byte text "
                   "cells (fixed when it is first written; pass text_bytes=N to a new storage)"
                   if len(raw) > width else "holds a NUL character, which text cells cannot keep")
            raise SchemaError(f"key {key!r}: the string {text[:40]!r}... {why}: nothing was written")
        cells[i, :len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(cells.reshape(*shape, width))


def decode(cells: torch.Tensor) -> Any:
    """The strings of text cells ``[*batch, width]``: ``NonTensorData`` for an empty batch,
    else a ``NonTensorStack`` of one string per row."""
    flat = cells.reshape(-1, cells.shape[-1]).cpu().numpy()
    strings = [row.tobytes().rstrip(b"\0").decode(errors="strict") for row in flat]
    batch = tuple(cells.shape[:-1])
    if not batch:
        return NonTensorData(strings[0], batch_size=())
    return NonTensorStack.from_list(_nest(strings, batch))


def _nest(strings: list[str], batch: tuple[int, ...]) -> list[Any]:
    """``strings`` (row-major) as nested lists of shape ``batch``."""
    if len(batch) == 1:
        return strings
    step = len(strings) // batch[0] if batch[0] else 0
    return [_nest(strings[i * step:(i + 1) * step], batch[1:]) for i in range(batch[0])]


def _flatten(values: Any) -> list[Any]:
    """The scalars of a nested list (``NonTensorStack.tolist()``)."""
    if isinstance(values, list):
        return [v for item in values for v in _flatten(item)]
    return [values]
