"""Recycled output buffers: a sampled batch's memory is reused only once nothing refers
to it, so batches (and views of them) the caller keeps never change.

The reference is the tensor written to the storage: every batch still held is
compared with the rows it was sampled from after every later sample.
"""

from __future__ import annotations

import random
import threading

import torch
from tensordict import TensorDict

import zstore
from zstore.outbuf import MIN_POOLED_BYTES, OutputPool, gather

ROWS, WIDTH = 600, 2048  # 8 KiB rows: a batch of 256 is 2 MiB per key, so it is pooled


def reference() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


def storage(location) -> tuple[zstore.LazyMemmapStorage, torch.Tensor]:
    values = reference()
    store = zstore.LazyMemmapStorage(ROWS, scratch_dir=location.new(),
                                     storage_options=location.options)
    store.set(torch.arange(ROWS), TensorDict(obs=values, batch_size=[ROWS]))
    return store, values


def test_kept_batches_and_views_never_change(location):
    """Random samples, some kept whole, some as a view of one row, the rest dropped."""
    store, values = storage(location)
    rng = random.Random(1)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (sampled tensor or view, expected)
    pointers: list[int] = []
    for _ in range(40):
        index = torch.tensor([rng.randrange(ROWS) for _ in range(256)])
        obs = store.get(index)["obs"]
        assert torch.equal(obs, values[index])
        pointers.append(obs.data_ptr())
        choice = rng.random()
        if choice < 0.2:
            kept.append((obs, values[index]))
        elif choice < 0.3:
            kept.append((obs[7:8], values[index][7:8]))  # a view keeps the whole buffer
        del obs
        for got, expected in kept:
            assert torch.equal(got, expected)
        if len(kept) > 6:
            kept.pop(rng.randrange(len(kept)))
    assert len(set(pointers)) < len(pointers), "no buffer was ever reused"


def test_concurrent_samplers_get_their_own_buffers(tmp_path):
    store = zstore.LazyMemmapStorage(ROWS, scratch_dir=str(tmp_path / "rb"))
    values = reference()
    store.set(torch.arange(ROWS), TensorDict(obs=values, batch_size=[ROWS]))
    failures: list[str] = []

    def sample(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        held = []
        for _ in range(30):
            index = torch.randint(0, ROWS, (256,), generator=g)
            held.append((store.get(index)["obs"], index))
            if len(held) > 2:
                held.pop(0)
            for got, idx in held:
                if not torch.equal(got, values[idx]):
                    failures.append(f"thread {seed}: a held batch changed")
                    return

    threads = [threading.Thread(target=sample, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_pool_reuses_only_free_buffers_and_stays_bounded():
    pool = OutputPool(max_buffers=3)
    source = torch.arange(ROWS * WIDTH, dtype=torch.float32).reshape(ROWS, WIDTH)
    index = torch.arange(255, -1, -1)
    first = gather(source, index, pool)
    address = first.data_ptr()
    del first
    again = gather(source, index, pool)
    assert again.data_ptr() == address and pool.reused == 1
    assert torch.equal(again, source[index])
    held = [again] + [gather(source, index, pool) for _ in range(5)]  # all in use at once
    assert len({t.data_ptr() for t in held}) == 6  # none shared
    assert len(pool._buffers) == 3
    assert all(torch.equal(t, source[index]) for t in held)
    small = gather(source[:, :8], index, pool)  # 8 KiB: plain torch.empty, never pooled
    assert small.nbytes < MIN_POOLED_BYTES and len(pool._buffers) == 3
