"""Per-row write stamps (``zstore.storages.row_stamps``), by which incremental checkpoints
find changed chunks: against a dense reference array, and in memory proportional to the
rows written, not to the capacity."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.storages.row_stamps import BLOCK_ROWS, RowStamps


def _random_index(rng: np.random.Generator, rows: int):
    kind = rng.integers(6)
    if kind == 0:
        return int(rng.integers(-rows, rows))
    if kind == 1:
        lo = int(rng.integers(0, rows))
        return slice(lo, lo + int(rng.integers(0, 3 * BLOCK_ROWS)))
    if kind == 2:
        return slice(int(rng.integers(0, rows)), None, int(rng.integers(1, 5000)))
    if kind == 3:
        return range(int(rng.integers(0, rows)), rows, int(rng.integers(1, 70_000)))
    if kind == 4:
        return torch.as_tensor(rng.integers(-rows, rows, size=int(rng.integers(0, 300))))
    return torch.as_tensor(rng.random(rows) < 0.001)


@pytest.mark.parametrize("rows", [1, 5, BLOCK_ROWS, 3 * BLOCK_ROWS + 17])
def test_stamps_match_a_dense_reference(rows):
    rng = np.random.default_rng(rows)
    stamps, ref = RowStamps(rows), np.zeros(rows, np.int64)
    for revision in range(1, 120):
        index = _random_index(rng, rows)
        stamps.stamp(index, revision)
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        ref[index] = revision
        if revision % 17 == 0:
            row = int(rng.integers(0, rows))
            stamps.clear_from(row)
            ref[row:] = 0
        since = int(rng.integers(0, revision + 1))
        assert np.array_equal(stamps.changed_since(since), np.flatnonzero(ref > since))
        written = np.flatnonzero(ref)
        assert stamps.last_written() == (int(written[-1]) if written.size else -1)
    for copy in (pickle.loads(pickle.dumps(stamps)), stamps.shared(),
                 pickle.loads(pickle.dumps(stamps.shared()))):
        assert np.array_equal(copy.changed_since(0), np.flatnonzero(ref))
        assert np.array_equal(copy.changed_since(60), np.flatnonzero(ref > 60))


def test_a_shared_copy_stamps_the_shared_tensor():
    stamps = RowStamps(3 * BLOCK_ROWS).shared()
    stamps.stamp(slice(BLOCK_ROWS - 2, BLOCK_ROWS + 2), 7)
    stamps.stamp_row(-1, 9)
    assert stamps.dense.is_shared()
    assert torch.equal(stamps.dense.nonzero().flatten(),
                       torch.tensor([BLOCK_ROWS - 2, BLOCK_ROWS - 1, BLOCK_ROWS, BLOCK_ROWS + 1,
                                     3 * BLOCK_ROWS - 1]))


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_large_bucket_buffer_pays_for_the_rows_it_wrote_not_its_capacity():
    """One stamp per row of capacity: the first write into a 2 * 10^8-row buffer allocated
    and zeroed 1.6 GB (a 10^9-row one failed allocating 8 GB). Its rows live in chunks made
    as they are written, so nothing else of it grows with the capacity."""
    rows = TensorDict(obs=torch.ones(1000, 4), batch_size=[1000])
    small = zstore.LazyMemmapStorage(1000, scratch_dir="memory://zstore-tests/stamps-small")
    zstore.ReplayBuffer(small).extend(rows)  # what any first write loads, loaded
    small.close()
    storage = zstore.LazyMemmapStorage(200_000_000, scratch_dir="memory://zstore-tests/stamps")
    before = _rss_bytes()
    zstore.ReplayBuffer(storage).extend(rows)
    grown = _rss_bytes() - before
    storage.close()
    assert grown < 200 << 20, f"{grown >> 20} MiB"
