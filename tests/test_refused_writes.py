"""A write the storage refuses changes nothing: no cursor move, no length change, no row stored.

The reference is a plain list of the rows that were accepted. Every storage runs on
memory://, local disk and S3 (the ``location`` fixture), reopened where it persists.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import zstore

CAPACITY = 1000


def rows(start: int, n: int, width: int = 4) -> TensorDict:
    """``n`` rows whose ``obs`` holds their (1-based, never zero) serial number."""
    serial = torch.arange(start + 1, start + n + 1, dtype=torch.float32)
    return TensorDict(obs=serial[:, None].expand(n, width).clone(),
                      act=serial.long(), batch_size=[n])


def make(kind: str, location) -> zstore.Storage:
    if kind == "LazyTensorStorage":
        return zstore.LazyTensorStorage(CAPACITY)
    cls = getattr(zstore, kind)
    return cls(CAPACITY, scratch_dir=location.new(), storage_options=location.options)


def refused_batches():
    """Batches of 200 rows a 4-wide ``obs`` / ``act`` buffer refuses, and why."""
    return {"wrong shape": rows(400, 200, width=5),
            "missing key": TensorDict(obs=torch.ones(200, 4), batch_size=[200]),
            "wrong batch": rows(400, 200).reshape(20, 10)}


def batch(items):
    """A list storage's items as one batch; a tensor storage's batch as it is."""
    return zstore.stack_items(items) if isinstance(items, list) else items


def assert_holds_exactly(storage, serials: list[int]) -> None:
    """The storage holds exactly these rows, in order, and nothing a sampler could draw else."""
    assert len(storage) == len(serials)
    got = batch(storage.get(torch.arange(len(storage))))
    assert got["obs"][:, 0].tolist() == [float(s) for s in serials]
    assert got["act"].tolist() == serials
    drawn = batch(storage.get(torch.randint(len(storage), (256,))))
    assert (drawn["obs"] != 0).all(), "a sampler drew a row that was never written"


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "LazyMemmapStorage",
                                  "CompressedListStorage"])
def test_a_refused_extend_moves_neither_the_writer_nor_the_storage(kind, location):
    storage = make(kind, location)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(rows(0, 400))
    refused = refused_batches()
    if kind == "LazyTensorStorage":
        del refused["missing key"]  # TorchRL's in-RAM storage writes the keys a batch has
    if kind == "CompressedListStorage":
        del refused["wrong shape"]  # a list storage holds items of any shape
    for why, batch in refused.items():
        with pytest.raises((zstore.errors.ZStoreError, RuntimeError)):
            writer.extend(batch)
        assert (writer._cursor, writer._write_count, len(storage)) == (400, 400, 400), why
    writer.extend(rows(400, 200))
    tensor = isinstance(storage, zstore.TensorStorage)  # list storages keep no last cursor
    assert writer._cursor == 600 and (not tensor or storage._last_cursor_index == 599)
    assert_holds_exactly(storage, list(range(1, 601)))
    if kind != "LazyTensorStorage":
        storage.flush()
        again = zstore.open(storage.scratch_dir, location.options, mode="r")
        assert not tensor or again._last_cursor_index == 599
        assert_holds_exactly(again, list(range(1, 601)))


def test_a_refused_first_batch_creates_no_store(location):
    """Regression: a first batch stacked lazily along its rows, whose rows differ in shape,
    made the store from its first row (``x`` of shape [1]) before it was refused ("nothing
    was written"), so the next, valid batch of ``x`` [3] was refused too."""
    from tensordict import lazy_stack

    storage = make("LazyMemmapStorage", location)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    ragged = lazy_stack([TensorDict(x=torch.full((i % 3 + 1,), float(i))) for i in range(7)])
    with pytest.raises(zstore.SchemaError, match=r"\['x'\].*nothing was written"):
        writer.extend(ragged)
    assert not storage.initialized and len(storage) == 0
    assert not zstore.StoreSpec.parse(storage.scratch_dir, location.options).exists() or \
        zstore.StoreSpec.parse(storage.scratch_dir, location.options).is_empty(ignore=("zstore-lease",))
    writer.extend(TensorDict(x=torch.ones(5, 3), batch_size=[5]))
    storage.flush()
    assert zstore.open(storage.scratch_dir, location.options, mode="r").get(torch.arange(5))["x"].shape == (5, 3)


def test_a_refused_add_moves_nothing(location):
    storage = make("LazyMemmapStorage", location)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(rows(0, 3))
    with pytest.raises(zstore.errors.SchemaError, match="obs"):
        writer.add(rows(3, 1, width=7)[0])
    assert (writer._cursor, len(storage)) == (3, 3)
    assert writer.add(rows(3, 1)[0]) == 3
    assert_holds_exactly(storage, [1, 2, 3, 4])


def test_the_replay_buffer_never_samples_a_row_that_was_not_written(location):
    rb = zstore.ReplayBuffer(make("LazyMemmapStorage", location), batch_size=256)
    rb.extend(rows(0, 400))
    with pytest.raises(zstore.errors.SchemaError):
        rb.extend(rows(400, 200, width=5))
    rb.extend(rows(400, 200))
    assert len(rb) == 600
    for _ in range(4):
        assert (rb.sample()["obs"] != 0).all()


def test_a_refused_batch_leaves_the_rows_it_would_overwrite_intact():
    """A TensorDict is written key by key: the check runs before the first key is stored."""
    storage = zstore.LazyTensorStorage(10)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(rows(0, 10))  # full: the next batch would overwrite rows 0..3
    bad = TensorDict(act=torch.zeros(4, dtype=torch.long), obs=torch.zeros(4, 9), batch_size=[4])
    with pytest.raises(RuntimeError, match="'obs'.*nothing was written"):
        writer.extend(bad)
    assert_holds_exactly(storage, list(range(1, 11)))


def test_a_refused_pytree_batch_leaves_every_leaf_intact():
    storage = zstore.LazyTensorStorage(6)
    storage.set(torch.arange(6), (torch.ones(6, 2), torch.ones(6, 3)))
    with pytest.raises(RuntimeError, match="nothing was written"):
        storage.set(torch.arange(2), (torch.zeros(2, 2), torch.zeros(2, 4)))
    first, second = storage.get(torch.arange(6))
    assert (first == 1).all() and (second == 1).all()


@pytest.mark.parametrize("why", ["wrong dtype", "rows out of range", "a new key, a wrong shape"])
def test_an_in_ram_storage_refuses_before_writing_any_key(why):
    """Regression: the in-RAM storages checked shapes only, on ``meta`` tensors, which check
    neither dtypes nor ranges, and made a batch's new keys before the check. A batch whose
    ``act`` had the wrong dtype, or whose positions ran past the rows, raised after its
    ``obs`` was written (rows torn across keys); a refused batch still added its new key."""
    storage = zstore.LazyTensorStorage(10)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(rows(0, 10))
    bad = rows(100, 4)
    where = torch.arange(4)
    if why == "wrong dtype":
        bad["act"] = bad["act"].int()
    elif why == "rows out of range":
        where = torch.tensor([1, 2, 3, 10])
    else:
        bad["extra"] = torch.ones(4)
        bad["obs"] = torch.ones(4, 5)
    error = IndexError if why == "rows out of range" else RuntimeError
    with pytest.raises(error, match="nothing was written"):
        storage.set(where, bad)
    if why == "wrong dtype":
        with pytest.raises(RuntimeError, match="'act'.*nothing was written"):
            writer.extend(bad)  # wraps onto rows 0..3
    assert_holds_exactly(storage, list(range(1, 11)))
    assert set(storage.get(0).keys()) == {"obs", "act"}


@pytest.mark.parametrize("why", ["items of two shapes", "a wrong shape", "a wrong dtype"])
def test_an_in_ram_storage_refuses_a_lazy_stack_before_writing_any_key(why):
    """Regression: a lazily stacked batch skipped the check (it is written item by item),
    so one whose ``act`` was ragged, misshapen or of another dtype raised (naming no key)
    after its ``obs`` was written: rows torn across keys."""
    from tensordict import lazy_stack

    storage = zstore.LazyTensorStorage(10)
    storage.set(torch.arange(10), rows(0, 10))
    items = list(rows(100, 3).unbind(0))
    if why == "items of two shapes":
        items[1]["act"] = torch.tensor([7, 7])
    elif why == "a wrong shape":
        items = [item.set("act", torch.tensor([7, 7])) for item in items]
    else:
        items = [item.set("act", item["act"].int()) for item in items]
    with pytest.raises(RuntimeError, match="'act'.*nothing was written"):
        storage.set(torch.arange(3), lazy_stack(items))
    assert_holds_exactly(storage, list(range(1, 11)))
    storage.set(torch.arange(3), lazy_stack(list(rows(100, 3).unbind(0))))  # a good one writes
    assert storage.get(torch.arange(3))["act"].tolist() == [101, 102, 103]


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "LazyTensorStorage"])
def test_a_capacity_of_no_row_is_refused_at_construction(kind, location):
    """``LazyMemmapStorage(-5)`` was accepted; its first write then failed with torch's
    "Expected all values to be non-negative", naming neither the capacity nor the fix."""
    options = {} if kind == "LazyTensorStorage" else \
        {"scratch_dir": location.new(), "storage_options": location.options}
    for capacity in (0, -5):
        with pytest.raises(ValueError, match=f"max_size={capacity} holds no row"):
            getattr(zstore, kind)(capacity, **options)


def test_a_capacity_no_reader_would_open_is_refused_before_anything_is_written(location):
    """``LazyMemmapStorage(int(1e10))`` of Atari frames wrote and committed its rows, and
    then ``zstore.open`` refused the store (a key over 2**48 elements) and a new storage
    at the URL too ("already holds a buffer"): rows stranded. Now its first write is
    refused, naming the capacity and the key, and the URL stays free."""
    url = location.new()
    frames = TensorDict(pixels=torch.zeros(3, 4, 84, 84, dtype=torch.uint8), batch_size=[3])
    storage = zstore.LazyMemmapStorage(int(1e10), scratch_dir=url, storage_options=location.options)
    with pytest.raises(ValueError, match=r"capacity 10000000000.*'pixels'.*nothing was written"):
        storage.set(torch.arange(3), frames)
    assert len(storage) == 0 and not storage.initialized
    again = zstore.LazyMemmapStorage(1000, scratch_dir=url, storage_options=location.options)
    again.set(torch.arange(3), frames)
    again.flush()
    assert len(zstore.open(url, location.options, mode="r")) == 3
    again.close()


def test_an_in_ram_pytree_storage_names_the_leaf_it_refuses():
    storage = zstore.LazyTensorStorage(6)
    storage.set(torch.arange(6), {"a": torch.ones(6), "b": torch.ones(6, dtype=torch.long)})
    with pytest.raises(RuntimeError, match=r"\['b'\].*nothing was written"):
        storage.set(torch.arange(2), {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int32)})
    got = storage.get(torch.arange(6))
    assert (got["a"] == 1).all() and (got["b"] == 1).all()


# -- under TorchRL's buffers -------------------------------------------------------------------

T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")


@pytest.mark.torchrl
@pytest.mark.parametrize("writer_cls", ["RoundRobinWriter", "TensorDictRoundRobinWriter"])
def test_zstore_torchrl_writers_roll_back_a_refused_extend(writer_cls, location):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options)
    rb = T.TensorDictReplayBuffer(storage=storage, writer=getattr(zt, writer_cls)(),
                                  batch_size=256)
    rb.extend(rows(0, 400))
    with pytest.raises(zstore.errors.SchemaError, match="obs"):
        rb.extend(rows(400, 200, width=5))
    assert (rb._writer._cursor, rb._writer._write_count, len(rb)) == (400, 400, 400)
    rb.extend(rows(400, 200))
    assert len(rb) == 600
    for _ in range(4):
        assert (rb.sample()["obs"] != 0).all()


@pytest.mark.torchrl
def test_under_torchrl_own_writer_the_rows_after_a_refused_batch_stay_reachable(location):
    """TorchRL's writer moves its cursor before the storage sees the data, by design: as on
    TorchRL's own storage, the rows written after the refused batch are inside ``len``."""
    ours = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                storage_options=location.options)
    theirs = T.LazyTensorStorage(CAPACITY)
    buffers = [T.TensorDictReplayBuffer(storage=s, writer=T.RoundRobinWriter())
               for s in (ours, theirs)]
    for rb in buffers:
        rb.extend(rows(0, 400))
        with pytest.raises(Exception):
            rb.extend(rows(400, 200, width=5))
        rb.extend(rows(600, 200))
    assert len(buffers[0]) == len(buffers[1]) == 800
    good = buffers[0][600:800]
    assert good["act"].tolist() == list(range(601, 801))
    ours.flush()
    again = zstore.open(ours.scratch_dir, location.options, mode="r")
    assert len(again) == 800 and again.get(799)["act"].item() == 800
