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


def make_storage(kind: str, url: str, options: dict):
    rows = expected_rows(N)
    if kind == "memmap":
        storage = zstore.LazyMemmapStorage(N, scratch_dir=url, storage_options=options,
                                           codec="zstd", chunks=8)
        storage.set(torch.arange(N), rows)
    else:
        storage = zstore.CompressedListStorage(N, scratch_dir=url, storage_options=options, chunks=8)
        storage.set(list(range(N)), list(rows.unbind(0)))
    storage.flush()
    return storage


@pytest.mark.parametrize(("start", "where", "kind"), [
    ("fork", "local", "memmap"), ("fork", "s3", "memmap"), ("fork", "local", "compressed"),
    ("fork", "s3", "compressed"), ("spawn", "local", "memmap"),
    pytest.param("spawn", "s3", "memmap", marks=pytest.mark.campaign)])
def test_two_workers_return_exactly_the_expected_rows(start, where, kind, tmp_path, request):
    if where == "s3":
        options = request.getfixturevalue("s3_options")
        url = f"s3://{request.getfixturevalue('s3_bucket')}/loader-{start}-{kind}"
    else:
        options, url = {}, str(tmp_path / "rb")
    storage = make_storage(kind, url, options)
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
