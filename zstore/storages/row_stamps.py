"""The write revision of each row of a tensor storage, by which incremental checkpoints
find the chunks that changed without hashing them.

Rows are stamped in blocks of :data:`BLOCK_ROWS`, each allocated at its first stamp: a
buffer of large capacity pays 8 bytes for each row it has written, not for each row it
could hold (one stamp per row of capacity took 8 GB at the first write of a
10^9-row bucket buffer). Storages whose rows several processes write keep their stamps in
one tensor in shared memory instead (:meth:`RowStamps.shared`), as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: Rows per block of stamps (512 KiB of int64).
BLOCK_ROWS = 1 << 16
_SHIFT = BLOCK_ROWS.bit_length() - 1


class RowStamps:
    """Per-row write revisions of ``rows`` rows; ``0`` marks a row never written."""

    def __init__(self, rows: int, dense: torch.Tensor | None = None) -> None:
        self.rows = int(rows)
        #: the shared-memory tensor holding every row's stamp, or ``None`` (blocks on demand)
        self.dense = dense
        self._blocks: dict[int, np.ndarray] = {}
        if dense is not None:
            values = dense.numpy()
            self._blocks = {b: values[b << _SHIFT:(b + 1) << _SHIFT]
                            for b in range(-(-self.rows // BLOCK_ROWS))}

    def __reduce__(self) -> tuple:
        """Shared stamps travel as their tensor (torch hands a process its shared memory);
        others as their blocks."""
        if self.dense is not None:
            return RowStamps, (self.rows, self.dense)
        return _from_blocks, (self.rows, self._blocks)

    def shared(self) -> "RowStamps":
        """These stamps in one tensor in shared memory (itself when they are already)."""
        if self.dense is not None:
            return self
        dense = torch.zeros(self.rows, dtype=torch.int64)
        values = dense.numpy()
        for b, block in self._blocks.items():
            values[b << _SHIFT:(b << _SHIFT) + len(block)] = block
        return RowStamps(self.rows, dense.share_memory_())

    def _block(self, b: int) -> np.ndarray:
        block = self._blocks.get(b)
        if block is None:
            block = self._blocks[b] = np.zeros(min(BLOCK_ROWS, self.rows - (b << _SHIFT)), np.int64)
        return block

    def stamp_row(self, row: int, revision: int) -> None:
        """Stamp one row (``-rows <= row < rows``): ``add()``'s hot path."""
        if row < 0:
            row += self.rows
        self._block(row >> _SHIFT)[row & (BLOCK_ROWS - 1)] = revision

    def stamp(self, index: Any, revision: int) -> None:
        """Stamp the rows ``index`` selects: an ``int``, a ``slice``, a ``range``, or a 1-D
        tensor / array of rows (negative ones count from the end) or a boolean mask."""
        if isinstance(index, (int, np.integer)):
            self.stamp_row(int(index), revision)
            return
        if isinstance(index, range):
            index = slice(index.start, index.stop, index.step)
        if isinstance(index, slice):
            start, stop, step = index.indices(self.rows)
            if step == 1:
                for b in range(start >> _SHIFT, -(-stop // BLOCK_ROWS)):
                    lo = b << _SHIFT
                    self._block(b)[max(start - lo, 0):stop - lo] = revision
                return
            rows = np.arange(start, stop, step, dtype=np.int64)
        else:
            rows = np.asarray(torch.as_tensor(index).to("cpu")).reshape(-1)
            rows = np.flatnonzero(rows) if rows.dtype == np.bool_ else rows.astype(np.int64) % self.rows
        if not rows.size:
            return
        rows = np.sort(rows)
        blocks = rows >> _SHIFT
        edges = np.flatnonzero(np.diff(blocks)) + 1
        for part in np.split(rows, edges):
            self._block(int(part[0]) >> _SHIFT)[part & (BLOCK_ROWS - 1)] = revision

    def changed_since(self, revision: int) -> np.ndarray:
        """The rows stamped after ``revision``, in order."""
        found = [np.flatnonzero(block > revision) + (b << _SHIFT)
                 for b, block in sorted(self._blocks.items())]
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def last_written(self) -> int:
        """The last row ever stamped (``-1`` when none)."""
        for b in sorted(self._blocks, reverse=True):
            block = self._blocks[b]
            if block[-1]:  # the usual case once a buffer is full
                return (b << _SHIFT) + len(block) - 1
            written = block[::-1] != 0
            if written.any():
                return (b << _SHIFT) + len(block) - 1 - int(written.argmax())
        return -1

    def clear_from(self, row: int) -> None:
        """Mark rows ``row`` and after as never written."""
        for b, block in self._blocks.items():
            block[max(row - (b << _SHIFT), 0):] = 0

    @classmethod
    def everywhere(cls, rows: int, revision: int) -> "RowStamps":
        """Stamps of ``rows`` rows all at ``revision``."""
        stamps = cls(rows)
        stamps.stamp(slice(None), revision)
        return stamps


def _from_blocks(rows: int, blocks: dict[int, np.ndarray]) -> RowStamps:
    """Unpickle :class:`RowStamps` kept in blocks."""
    stamps = RowStamps(rows)
    stamps._blocks = dict(blocks)
    return stamps
