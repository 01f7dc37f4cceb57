"""Narrow columns of a storage kept in memory as they are written.

TorchRL's ``SliceSampler`` reads one key of every row (``storage[:][end_key]``) at every
sample. A :class:`ColumnMirror` keeps such a key in RAM: it is read from the store once,
on first request, then every write the storage reports updates it, so later requests read
nothing. A mirror answers for one storage revision: a change it did not hear about (a
``loads``, ``load_state_dict``, ``empty``, a conditional patch) moves the storage's
mutation revision, and the column is read again at the next request.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

#: Widest cell (bytes) a column is mirrored for: flags, ids, counters, small vectors (not frames).
MIRROR_CELL_BYTES = 64


def cell_bytes(leaf: torch.Tensor, ndim: int) -> int:
    """Bytes of one cell of ``leaf``, shaped ``[rows, *lanes, *features]`` (its first ``ndim``
    dims index cells)."""
    return math.prod(leaf.shape[ndim:]) * leaf.element_size()


def zeros_paged_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the OS maps as they are first touched (NumPy's
    ``calloc``; ``torch.zeros`` writes every byte): a column the size of a buffer's
    capacity costs RAM for the rows written, not for the capacity."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not nbytes:  # (torch views no empty byte array as a wider dtype)
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).reshape(shape)


def _cpu_index(cursor: Any) -> Any:
    """``cursor`` as an index of a CPU tensor (index tensors moved to the CPU)."""
    if isinstance(cursor, tuple):
        return tuple(_cpu_index(c) for c in cursor)
    if isinstance(cursor, (int, slice, range)):
        return cursor
    return torch.as_tensor(cursor).cpu()


class ColumnMirror:
    """Copies of a few keys of every row of one storage, kept current by its writes.

    ``column(key, revision, read)`` returns the copy of ``key`` (``read()`` builds it when
    there is none for ``revision``); ``written(cursor, data, before, after)`` applies a
    write that moved the storage from revision ``before`` to ``after`` (a column that was
    not current at ``before`` is dropped instead); ``clear()`` drops every column.
    """

    def __init__(self) -> None:
        self._columns: dict[Any, tuple[int, torch.Tensor]] = {}

    def column(self, key: Any, revision: int, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The copy of ``key`` as of ``revision`` (the caller must not edit it)."""
        entry = self._columns.get(key)
        if entry is None or entry[0] != revision:
            entry = self._columns[key] = (revision, read())
        return entry[1]

    def written(self, cursor: Any, data: Any, before: int, after: int) -> None:
        """``data`` was written at ``cursor``, moving the storage from ``before`` to ``after``."""
        if not self._columns:
            return
        try:
            index = _cpu_index(cursor)
            for key, (revision, column) in list(self._columns.items()):
                if revision != before:
                    del self._columns[key]
                    continue
                column[index] = data.get(key).to(column.device)
                self._columns[key] = (after, column)
        except (AttributeError, IndexError, KeyError, RuntimeError, TypeError):
            # a write these columns cannot follow (a list of items...): read them again when asked
            self.clear()

    def clear(self) -> None:
        """Drop every column (each is read from the store again at its next request)."""
        self._columns.clear()
