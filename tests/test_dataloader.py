"""PyTorch DataLoader workers (fork and spawn, two of them) read zstore storages exactly.

Workers receive the dataset pickled (spawn) or inherit it (fork): storages
travel as specs and reopen in each worker; a forked worker never reuses its
parent's fsspec filesystem or file maps.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import BatchSampler, DataLoader, Dataset

import zstore

N = 60
BATCH = 7


def expected_rows(n: int) -> TensorDict:
    index = torch.arange(n)
    return TensorDict(x=torch.stack([index, index * index], 1),
                      obs=index.float().unsqueeze(1).expand(n, 3) / 4, batch_size=[n])


class Rows(Dataset):
    """A map-style dataset over a storage; each item is one batch of rows."""

    def __init__(self, storage):
        self.storage = storage

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, indices: list[int]) -> TensorDict:
        got = self.storage.get(torch.as_tensor(indices))
        return zstore.stack_items(got) if isinstance(got, list) else got


def keep(batch):
    return batch


def filled(storage):
    """``storage`` holding :func:`expected_rows` ``(N)``, committed."""
    rows = expected_rows(N)
    if isinstance(storage, zstore.CompressedListStorage):
        storage.set(list(range(N)), list(rows.unbind(0)))
    else:
        storage.set(torch.arange(N), rows)
    storage.flush()
    return storage


@pytest.mark.parametrize(("start", "location", "kind"), [
    ("fork", "local", "memmap"), ("fork", "s3", "memmap"), ("fork", "local", "compressed"),
    ("fork", "s3", "compressed"), ("spawn", "local", "memmap"),
    pytest.param("spawn", "s3", "memmap", marks=pytest.mark.campaign)], indirect=["location"])
def test_two_workers_return_exactly_the_expected_rows(start, location, kind):
    storage = filled(location.memmap(N, codec="zstd", chunks=8) if kind == "memmap" else
                     location.compressed(N, chunks=8))
    storage.get(torch.arange(N))  # the parent's caches and filesystem are warm before forking
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(Rows(storage), batch_size=None, collate_fn=keep, num_workers=2,
                        multiprocessing_context=start,
                        sampler=BatchSampler(order, batch_size=BATCH, drop_last=False))
    batches = list(loader)
    assert [len(b) for b in batches] == [BATCH] * (N // BATCH) + [N % BATCH]
    got = torch.cat([b["x"] for b in batches])
    reference = expected_rows(N)[torch.tensor(order)]
    assert torch.equal(got, reference["x"])
    assert torch.equal(torch.cat([b["obs"] for b in batches]), reference["obs"])
    storage.close() if kind == "memmap" else storage.cleanup()
