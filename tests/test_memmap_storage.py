"""LazyMemmapStorage on every location, checked op by op against a plain reference model.

Each test draws a seeded random sequence of add / extend / set / get /
``__setitem__`` / reopen operations and replays it on a zstore buffer and on
:class:`Model`, a few full-capacity tensors written row by row in Python (so
"last write wins" for duplicate indices is the model's own rule, not torch's).
Rows that were never written hold unspecified values in TorchRL, so reads are
compared on written rows only.
"""

from __future__ import annotations

import math
import random
import uuid

import pytest
import torch
from tensordict import TensorDict, is_tensor_collection, is_tensorclass, tensorclass
from torch.utils import _pytree as pytree

import zstore
from zstore import LazyMemmapStorage, LazyTensorStorage, ReadOnlyError, RoundRobinWriter


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


# -- data of every kind --------------------------------------------------------------------

def make_data(kind: str, lead: tuple[int, ...], g: torch.Generator):
    """An item (``lead`` = lane dims) or a batch (``lead`` = (n, *lanes)) of ``kind``."""
    def randn(*shape, dtype=torch.float32):
        return torch.randn((*lead, *shape), generator=g, dtype=dtype)

    def randint(*shape, dtype=torch.int64):
        return torch.randint(-50, 50, (*lead, *shape), generator=g, dtype=dtype)

    if kind == "td":
        return TensorDict(
            obs=randn(3),
            action=randint(),
            done=randint(1) > 0,
            next=TensorDict(reward=randn(1), obs=randn(3), batch_size=lead),
            batch_size=lead,
        )
    if kind == "tensor":
        return randn(2)
    if kind == "pytree":
        return {"a": randn(2), "b": (randint(dtype=torch.int32), randn(1, 2, dtype=torch.float64))}
    if kind == "tensorclass":
        return Transition(obs=randn(2), reward=randn(), batch_size=lead)
    raise AssertionError(kind)


def leaves(data) -> list[torch.Tensor]:
    """The tensors of ``data`` in a fixed order (sorted keys for tensor collections)."""
    if isinstance(data, torch.Tensor):
        return [data]
    if is_tensor_collection(data):
        td = data.to_tensordict() if is_tensorclass(data) else data
        keys = sorted(td.keys(include_nested=True, leaves_only=True),
                      key=lambda k: (k,) if isinstance(k, str) else tuple(k))
        return [td.get(k) for k in keys]
    return pytree.tree_leaves(data)


def check_kind(got, kind: str, reopened: bool) -> None:
    if kind == "td":
        assert isinstance(got, TensorDict)
    elif kind == "tensor":
        assert isinstance(got, torch.Tensor)
    elif kind == "pytree":
        assert isinstance(got, dict) and set(got) == {"a", "b"} and isinstance(got["b"], tuple)
    elif not reopened:  # a reopened tensorclass buffer may come back as a TensorDict
        assert isinstance(got, Transition)


# -- the reference model ---------------------------------------------------------------------

class Model:
    """What a TorchRL tensor storage + RoundRobinWriter hold, written row by row."""

    def __init__(self, max_size: int, lanes: tuple[int, ...], example):
        self.lanes = lanes
        self.cells_per_row = math.prod(lanes)
        self.rows = -(-max_size // self.cells_per_row)
        self.max_size = self.rows * self.cells_per_row
        self.ref = [torch.zeros(self.rows, *x.shape, dtype=x.dtype) for x in leaves(example)]
        self.written = torch.zeros(self.rows, dtype=torch.bool)
        self.count = 0  # TorchRL's count of the cells written (a reopened store counts from len)
        self.len = 0
        self.last: int | None = None
        self.cursor = 0

    @property
    def len_rows(self) -> int:
        return -(-self.len // self.cells_per_row)

    def write(self, rows: list[int], batch, *, single: bool, set_cursor: bool) -> None:
        values = leaves(batch)
        for j, r in enumerate(rows):
            for ref, value in zip(self.ref, values):
                ref[r] = value if single else value[j]
            self.written[r] = True
        if set_cursor:
            self.last = rows[-1]
            # writes are counted, and every row up to the last one written is reachable
            self.count = min(self.count + len(rows) * self.cells_per_row, self.max_size)
            self.len = min(max(self.len, self.count, (self.last + 1) * self.cells_per_row),
                           self.max_size)

    def add(self, item) -> int:
        index = self.cursor
        self.cursor = (index + 1) % self.rows
        self.write([index], item, single=True, set_cursor=True)
        return index

    def extend(self, batch, n: int) -> list[int]:
        rows = [(self.cursor + i) % self.rows for i in range(n)]
        self.cursor = (self.cursor + n) % self.rows
        self.write(rows, batch, single=False, set_cursor=True)
        return rows

    def resolve(self, index) -> tuple[torch.Tensor, bool]:
        """Row numbers an index reads (within the current length) and whether it is an int."""
        n = self.len_rows
        if isinstance(index, int):
            return torch.tensor([index % n]), True
        if isinstance(index, slice):
            return torch.tensor(range(*index.indices(n)), dtype=torch.int64), False
        return torch.as_tensor(index) % n, False

    def assert_read(self, got, index, lanes_index=None) -> None:
        rows, single = self.resolve(index)
        mask = self.written[rows]
        for value, ref in zip(leaves(got), self.ref):
            expected = ref[rows] if lanes_index is None else ref[rows, lanes_index]
            if single:
                assert value.shape == expected.shape[1:]
                value = value.unsqueeze(0)
            else:
                assert value.shape == expected.shape
            assert value.dtype == expected.dtype
            assert torch.equal(value[mask], expected[mask])

    def assert_matches(self, storage, kind: str, reopened: bool = False) -> None:
        assert len(storage) == self.len
        assert storage.max_size == self.max_size
        assert storage._last_cursor_index == self.last
        if self.len == 0:
            return
        assert tuple(storage.shape) == (self.len_rows if self.len < self.max_size else self.rows,
                                        *self.lanes)
        everything = storage[:]
        check_kind(everything, kind, reopened)
        self.assert_read(everything, slice(None))


# -- the random op sequence -------------------------------------------------------------------

CONFIGS = {
    # name: (kind, ndim, lanes, max_size, codec, chunks, shards, cache_bytes)
    # shards == chunks disables sharding (S3 would otherwise shard by default)
    "td-raw": ("td", 1, (), 23, None, None, None, 1 << 20),
    "td-zstd-chunks7-tinycache": ("td", 1, (), 23, "zstd", 7, 7, 1),
    "td-zstd-sharded": ("td", 1, (), 23, "zstd", 4, 8, 1 << 20),
    "td-sharded-tinycache": ("td", 1, (), 23, None, 3, 9, 1),
    "tensor-chunks7": ("tensor", 1, (), 23, None, 7, 7, 1 << 20),
    "pytree-zstd-chunks7": ("pytree", 1, (), 23, "zstd", 7, 7, 1),
    "tensorclass-chunks7-tinycache": ("tensorclass", 1, (), 23, None, 7, 7, 1),
    "td-ndim2-zstd-tinycache": ("td", 2, (3,), 25, "zstd", 4, 4, 1),
    "tensor-ndim2-raw": ("tensor", 2, (2,), 17, None, None, None, 1 << 20),
}


def random_index(rng: random.Random, n: int):
    """An index into ``n`` rows: int (maybe negative), slice, list or tensor (maybe with repeats)."""
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randrange(-n, n)
    if choice == 1:
        start = rng.randrange(n)
        stop = rng.choice([None, rng.randrange(start + 1, n + 1)])  # non-empty (see test_empty_slice)
        return slice(start - n if rng.random() < 0.5 else start, stop, rng.choice([None, 1, 2, 3]))
    rows = [rng.randrange(-n, n) for _ in range(rng.randrange(1, 2 * n + 1))]
    return rows if choice == 2 else torch.tensor(rows)


@pytest.mark.all_s3_servers  # moto's tiny-cache runs (a request a read) are campaign's, rclone's stay
@pytest.mark.parametrize(("location", "config"), [pytest.param(
    where, config, marks=[pytest.mark.campaign] if where == "s3" and config in (
        "td-sharded-tinycache", "td-zstd-chunks7-tinycache", "td-ndim2-zstd-tinycache") else [])
    for where in ["memory", "local", "s3", "s3-rclone"] for config in CONFIGS], indirect=["location"])
def test_random_ops_match_model(location, config):
    kind, ndim, lanes, max_size, codec, chunks, shards, cache_bytes = CONFIGS[config]
    seed = sum(map(ord, config + location.kind))
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n_ops = 24 if location.kind == "s3" else 60
    storage = location.memmap(max_size, ndim=ndim, codec=codec, chunks=chunks, shards=shards,
                              cache_bytes=cache_bytes)
    url = storage.scratch_dir
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    first = make_data(kind, (2, *lanes), g)
    model = Model(max_size, lanes, make_data(kind, lanes, g))
    index = writer.extend(first)
    expected = model.extend(first, 2)
    if ndim == 1:  # ndim > 1 returns coordinates, checked in test_writers
        assert index.tolist() == expected
    model.assert_matches(storage, kind)
    reopened = False
    for step in range(n_ops):
        op = rng.choice(["add", "extend", "extend", "set", "setitem", "get", "get", "reopen",
                         "reopen_ro", "contains"])
        if op == "add":
            item = make_data(kind, lanes, g)
            index = writer.add(item)
            expected = model.add(item)
            if ndim == 1:
                assert index == expected
        elif op == "extend":
            n = rng.randrange(1, model.rows + 4)  # may exceed the capacity: duplicate rows
            batch = make_data(kind, (n, *lanes), g)
            index = writer.extend(batch)
            expected = model.extend(batch, n)
            if ndim == 1:
                assert index.tolist() == expected
        elif op in ("set", "setitem"):
            if rng.random() < 0.3:
                row = rng.randrange(model.rows)
                item = make_data(kind, lanes, g)
                rows, single, cursor = [row], True, row
            else:
                rows = [rng.randrange(model.rows) for _ in range(rng.randrange(1, 6))]
                item = make_data(kind, (len(rows), *lanes), g)
                single, cursor = False, torch.tensor(rows)
            if op == "set":
                storage.set(cursor, item)
            else:
                storage[cursor] = item
            model.write(rows, item, single=single, set_cursor=op == "set")
        elif op == "get" and model.len:
            index = random_index(rng, model.len_rows)
            if ndim > 1 and rng.random() < 0.5:
                rows = torch.randint(0, model.len_rows, (4,), generator=g)
                lane = torch.randint(0, lanes[0], (4,), generator=g)
                model.assert_read(storage.get((rows, lane)), rows, lane)
            else:
                model.assert_read(storage.get(index), index)
        elif op == "contains":
            i = rng.randrange(-model.rows - 1, model.rows + 1)
            n = model.len_rows
            assert storage.contains(i) == (-n <= i < n)
        elif op == "reopen":
            storage.flush()
            if rng.random() < 0.5:
                storage.close()
            storage = zstore.open(url, location.options, cache_bytes=cache_bytes)
            reopened = True
            writer = RoundRobinWriter()
            writer.register_storage(storage)
            model.cursor = (model.last + 1) % model.rows if model.last is not None else 0
            model.count = model.len
            assert writer._cursor == model.cursor
        elif op == "reopen_ro":
            storage.flush()
            ro = zstore.open(url, location.options, mode="r", cache_bytes=cache_bytes)
            model.assert_matches(ro, kind, reopened=True)
            with pytest.raises(ReadOnlyError):
                ro.set(0, make_data(kind, lanes, g))
            ro.close()
        model.assert_matches(storage, kind, reopened)
    storage.flush()
    model.assert_matches(zstore.open(url, location.options, mode="r"), kind, reopened=True)


# -- targeted cases -----------------------------------------------------------------------------

def td_rows(start: int, n: int) -> TensorDict:
    """``n`` rows whose values encode their write number (start, start+1, ...)."""
    values = torch.arange(start, start + n)
    return TensorDict(x=values.float().unsqueeze(-1).expand(n, 2).clone(),
                      nested=TensorDict(i=values, batch_size=[n]), batch_size=[n])


@pytest.mark.all_s3_servers
@pytest.mark.parametrize("codec", [None, "zstd"])
def test_ring_wraparound_survives_reopen(location, codec):
    storage = location.memmap(10, codec=codec, chunks=3, shards=3)
    url = storage.scratch_dir
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    written = 0
    for n in (4, 5, 7):  # 16 rows into capacity 10: wraps once
        writer.extend(td_rows(written, n))
        written += n
    assert len(storage) == 10 and storage._is_full
    storage.flush()
    again = zstore.open(url, location.options)
    expected = [10, 11, 12, 13, 14, 15, 6, 7, 8, 9]
    assert again[:]["nested", "i"].tolist() == expected
    assert again[:]["x"][:, 0].tolist() == [float(v) for v in expected]
    assert again._last_cursor_index == 5
    w2 = RoundRobinWriter()
    w2.register_storage(again)
    assert w2._cursor == writer._cursor == 6
    w2.extend(td_rows(16, 5))
    assert again[:]["nested", "i"].tolist() == [20, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def test_extend_larger_than_capacity_keeps_last(location):
    storage = location.memmap(5, chunks=2, shards=2)
    url = storage.scratch_dir
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(td_rows(0, 12))
    assert len(storage) == 5
    # rows 0..4 received items 0,5,10 / 1,6,11 / 2,7 / 3,8 / 4,9: the last one wins
    assert storage[:]["nested", "i"].tolist() == [10, 11, 7, 8, 9]
    storage.flush()
    assert zstore.open(url, location.options)[:]["nested", "i"].tolist() == [10, 11, 7, 8, 9]


@pytest.mark.parametrize("codec", ["zstd", None])
def test_a_chunk_of_a_key_with_glob_characters_deleted_leaves_the_other_keys(location, codec):
    """zarr deletes a chunk rewritten all zeros (it stores none of those) through fsspec's
    ``rm``, which read the path of key ``*``'s chunk 1 as a pattern: chunk 1 of every key
    went with it, and key ``k``'s rows 4-7 read as zeros."""
    storage = location.memmap(8, chunks={"*": 2, "[k]": 4, "k": 4}, codec=codec)
    ones, values = torch.ones(8), torch.arange(1.0, 9.0)
    storage.set(torch.arange(8), TensorDict({"*": ones, "[k]": values, "k": values},
                                            batch_size=[8]))
    storage.flush()
    storage.set(torch.arange(2, 4), TensorDict({"*": torch.zeros(2), "[k]": values[2:4],
                                                "k": values[2:4]}, batch_size=[2]))
    storage.close()
    again = zstore.open(storage.scratch_dir, location.options, mode="r")[:]
    assert again["k"].tolist() == again["[k]"].tolist() == values.tolist()
    assert again["*"].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]


def test_ndim2_matches_lazy_tensor_storage(location):
    g = torch.Generator().manual_seed(3)
    storage = location.memmap(10, ndim=2, chunks=2, shards=2, codec="zstd")
    url = storage.scratch_dir
    ref = LazyTensorStorage(10, ndim=2)
    batch = make_data("td", (2, 4), g)
    for s in (storage, ref):
        s.set(torch.arange(2), batch)
    assert storage.max_size == ref.max_size == 12  # 10 cells, 4 lanes -> 3 rows
    assert len(storage) == len(ref) == 8
    assert storage.shape == ref.shape == torch.Size([2, 4])
    assert storage._max_size_along_dim0() == ref._max_size_along_dim0() == 3
    index = (torch.tensor([0, 1, 1]), torch.tensor([3, 0, 2]))
    assert (storage.get(index) == ref.get(index)).all()
    assert (storage.get(1) == ref.get(1)).all()
    row = make_data("td", (4,), g)
    storage[2] = row
    ref[2] = row
    assert len(storage) == len(ref) == 8
    storage.set(2, row)
    ref.set(2, row)
    assert len(storage) == len(ref) == 12 and storage.shape == ref.shape == torch.Size([3, 4])
    assert (storage[:] == ref[:]).all()
    storage.flush()
    again = zstore.open(url, location.options)
    assert again.ndim == 2 and again.shape == torch.Size([3, 4]) and again.max_size == 12
    assert (again[:] == ref[:]).all()


def test_small_cache_evicts_and_reads_back(location):
    g = torch.Generator().manual_seed(5)
    storage = location.memmap(40, chunks=7, shards=7, cache_bytes=1)
    url = storage.scratch_dir
    data = make_data("td", (40,), g)
    storage.set(torch.arange(40), data)
    perm = torch.randperm(40, generator=g)
    assert (storage.get(perm) == data[perm]).all()
    stats = storage.cache_stats
    assert stats is not None and stats.evictions > 0
    assert stats.capacity_bytes < 40 * sum(x[0].numel() * x.element_size() for x in leaves(data))
    storage.flush()
    again = zstore.open(url, location.options, cache_bytes=1)
    assert (again.get(perm) == data[perm]).all()
    assert again.cache_stats.evictions > 0


def buffer_with_rows(location, max_size: int, n: int, chunks: int):
    """A new buffer at a fresh URL holding rows 0..n-1 of :func:`td_rows` (not yet flushed)."""
    storage = location.memmap(max_size, chunks=chunks, shards=chunks)
    storage.set(torch.arange(n), td_rows(0, n))
    return storage, storage.scratch_dir


def test_reopen_shows_only_committed_state_after_flush(location):
    storage, url = buffer_with_rows(location, 20, 3, chunks=7)
    storage.flush()
    before = zstore.open(url, location.options, mode="r")
    storage.set(torch.arange(3, 5), td_rows(3, 2))
    storage.flush()
    assert len(before) == 3  # an open handle keeps its committed view of the length
    after = zstore.open(url, location.options, mode="r")
    assert len(after) == 5
    assert after[:]["nested", "i"].tolist() == [0, 1, 2, 3, 4]


def test_uninitialised_then_existsok_adopts(location):
    storage = location.memmap(8)
    url = storage.scratch_dir
    assert not storage.initialized and len(storage) == 0 and storage.shape is None
    assert storage.contains(0) is False
    with pytest.raises(RuntimeError, match="non-initialized"):
        storage.get(0)
    storage.set(torch.arange(3), td_rows(0, 3))
    storage.flush()
    other = location.memmap(8, scratch_dir=url, existsok=True)
    other.set(3, td_rows(3, 1)[0])
    assert len(other) == 4
    assert other[:]["nested", "i"].tolist() == [0, 1, 2, 3]


def test_existsok_keeps_the_stored_codec_and_refuses_another_capacity(location):
    """Adopting (``existsok``) takes the stored buffer's codec, not the one asked for (it
    reported ``lz4`` while writing ``zstd``), and refuses another capacity, naming both and
    the fix (it took the stored capacity silently at the first write)."""
    storage = location.memmap(8, codec="zstd")
    url = storage.scratch_dir
    storage.set(torch.arange(3), td_rows(0, 3))
    storage.close()
    bigger = location.memmap(20, scratch_dir=url, existsok=True, codec="lz4")
    with pytest.raises(zstore.SchemaError, match=r"8 cells, this storage has max_size=20.*"
                                                 r"Pass max_size=8"):
        bigger.set(3, td_rows(3, 1)[0])
    bigger.close()
    same = location.memmap(8, scratch_dir=url, existsok=True, codec="lz4")
    same.set(3, td_rows(3, 1)[0])
    assert same.codec.name == "zstd"
    same.close()
    again = zstore.open(url, location.options, mode="r")
    assert len(again) == 4 and again.max_size == 8
    assert again[:]["nested", "i"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "CompressedListStorage"])
def test_cleanup_at_a_bucket_s_root_deletes_its_objects_and_keeps_the_bucket(s3_options, kind):
    """A buffer at ``s3://bucket`` (no prefix) owns the bucket's objects; its ``cleanup()``
    deleted the bucket itself (s3fs's recursive ``rm`` of a bucket's root)."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    bucket = f"zstore-root-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    storage = getattr(zstore, kind)(8, scratch_dir=f"s3://{bucket}", storage_options=s3_options)
    storage.set(0, td_rows(0, 1)[0])
    storage.flush()
    assert fs.find(bucket)
    storage.cleanup()
    fs.invalidate_cache()
    assert fs.exists(bucket) and fs.find(bucket) == []
    again = getattr(zstore, kind)(8, scratch_dir=f"s3://{bucket}", storage_options=s3_options)
    again.set(0, td_rows(5, 1)[0])  # (the bucket is there to write into again)
    again.close()
    assert len(zstore.open(f"s3://{bucket}", s3_options, mode="r")) == 1


def test_close_flushes_and_cleanup_deletes(location):
    storage, url = buffer_with_rows(location, 8, 4, chunks=3)
    storage.close()
    again = zstore.open(url, location.options)
    assert again[:]["nested", "i"].tolist() == [0, 1, 2, 3]
    assert again.cleanup() is True
    assert again.cleanup() is False
    with pytest.raises(zstore.StoreNotFoundError):
        zstore.open(url, location.options)
    # the storage is ended (TorchRL's is "no longer usable"): it kept its length (a sampler drew from it), said
    # "non-initialized" to a read and, to a write, that a creation was under way there,
    # leaving a lease object in the deleted store
    assert len(again) == 0
    assert "state=deleted by cleanup()" in repr(again)  # (its repr said only <empty>)
    for act in (lambda: again.get(torch.arange(2)), lambda: again.set(0, td_rows(0, 1)[0])):
        with pytest.raises(RuntimeError, match="was deleted by cleanup\\(\\); build a new storage"):
            act()
    assert not zstore.StoreSpec.parse(url, location.options).exists()
    fresh = location.memmap(8, scratch_dir=url)  # the way on the error names
    fresh.set(0, td_rows(0, 1)[0])
    fresh.close()
    assert len(zstore.open(url, location.options, mode="r")) == 1


def test_empty_slice_reads_zero_rows(location):
    storage = location.memmap(10)
    storage.set(torch.arange(6), td_rows(0, 6))
    ref = LazyTensorStorage(10)
    ref.set(torch.arange(6), td_rows(0, 6))
    assert ref.get(slice(4, 2)).batch_size == torch.Size([0])
    assert storage.get(slice(4, 2)).batch_size == torch.Size([0])


# Regression tests: sharded stores used to recurse forever on flush when the other chunks of a
# shard were not cached (ChunkedTable._persist -> _load -> _persist), default cache size too.
@pytest.mark.parametrize("cache_bytes", [1, 1 << 30])
def test_sharded_write_then_flush(cache_bytes):
    storage = LazyMemmapStorage(10, scratch_dir=f"memory://zstore-tests/shard-{cache_bytes}",
                                chunks=3, shards=12, cache_bytes=cache_bytes)
    storage.set(torch.arange(4), td_rows(0, 4))
    storage.set(torch.arange(4, 9), td_rows(4, 5))
    storage.flush()
    assert storage[:]["nested", "i"].tolist() == list(range(9))


def test_s3_default_sharding_with_small_chunks(s3_bucket, s3_options):
    url = f"s3://{s3_bucket}/default-shards"
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=s3_options, chunks=3)
    storage.set(torch.arange(4), td_rows(0, 4))
    storage.set(torch.arange(4, 9), td_rows(4, 5))
    storage.flush()
    assert zstore.open(url, s3_options)[:]["nested", "i"].tolist() == list(range(9))


def test_a_slice_view_pickles_its_whole_column_and_a_copy_only_its_rows(tmp_path):
    """docs/scaling.md §5: a slice of a local buffer is a view of its memory-mapped file,
    and pickling a view (what a Ray actor returning it does) sends the whole column; a
    ``.clone()`` or a tensor index sends the rows. TorchRL's view pickles its file name,
    which does not open on another node."""
    import pickle

    rows, width = 10_000, 128
    column_bytes = rows * width * 4
    storage = LazyMemmapStorage(rows, scratch_dir=tmp_path / "buffer")
    storage.set(torch.arange(rows), TensorDict({"obs": torch.randn(rows, width)}, [rows]))
    view = storage[0:10]
    view["obs"][0] = 7.0  # a view: its in-place write lands in the buffer
    assert (storage[torch.tensor([0])]["obs"] == 7.0).all()
    assert len(pickle.dumps(view)) >= column_bytes
    assert len(pickle.dumps(view.clone())) < 10 * width * 4 + 4096
    assert len(pickle.dumps(storage[torch.arange(10)])) < 10 * width * 4 + 4096
    torchrl_data = pytest.importorskip("torchrl.data")
    theirs = torchrl_data.LazyMemmapStorage(rows, scratch_dir=tmp_path / "torchrl")
    theirs.set(torch.arange(rows), TensorDict({"obs": torch.randn(rows, width)}, [rows]))
    assert len(pickle.dumps(theirs[0:10])) < 4096


def test_a_closed_storage_refuses_writes_as_it_refuses_reads(location):
    """After close() a read raised "was closed; reopen it", but a write reopened the store,
    wrote, committed and took the write lease again, so the writer meant to take over was
    refused. Now the write raises the same error and changes nothing."""
    url = location.new()
    storage = location.memmap(20, scratch_dir=url)
    storage.set(torch.arange(5), td_rows(0, 5))
    storage.close()
    for write in (lambda: storage.set(torch.tensor([7]), td_rows(7, 1)),
                  lambda: storage._empty()):
        with pytest.raises(RuntimeError, match="was closed; reopen it with zstore.open"):
            write()
    with pytest.raises(RuntimeError, match="was closed"):
        storage.get(torch.tensor([0]))
    successor = zstore.open(url, location.options, mode="r+")
    assert len(successor) == 5
    successor.set(torch.tensor([5]), td_rows(5, 1))  # the lease is free for it
    successor.close()
    assert len(zstore.open(url, location.options, mode="r")) == 6


@pytest.mark.parametrize("writer", ["zstore", "torchrl-twin"])
def test_existsok_adopts_when_built_so_a_writer_continues_after_the_stored_rows(location, writer):
    """A rerun that passes ``existsok=True`` (as StoreExistsError advises) adopted the
    stored buffer only at its first write: the writer had started at row 0, so rows 0..9 of
    the earlier run were overwritten, and the length said 310 with rows 300..309 never
    written (zeros a sampler draws). Now the buffer is adopted when the storage is built."""
    from torchrl.data import ReplayBuffer

    import zstore.torchrl

    url = location.new()
    first = location.memmap(1000, scratch_dir=url)
    first.set(torch.arange(300), td_rows(0, 300))
    first.close()
    if writer == "zstore":
        storage = location.memmap(1000, scratch_dir=url, existsok=True)
        assert len(storage) == 300
        ring = zstore.RoundRobinWriter()
        ring.register_storage(storage)
        ring.extend(td_rows(300, 10))
    else:
        storage = zstore.torchrl.LazyMemmapStorage(1000, scratch_dir=url, existsok=True,
                                                   storage_options=location.options)
        assert len(storage) == 300
        rb = ReplayBuffer(storage=storage, writer=zstore.torchrl.RoundRobinWriter())
        rb.extend(td_rows(300, 10))
    storage.close()
    after = zstore.open(url, location.options, mode="r")
    assert len(after) == 310
    assert after[:]["nested", "i"].tolist() == list(range(310))


@pytest.mark.parametrize("layout", [{"chunks": 3}, {"chunks": 3, "shards": 6, "codec": "zstd"}])
def test_a_key_without_elements_takes_any_chunk_and_shard_layout(location, layout):
    """Regression: a key whose rows hold no element (shape (0,) or (2, 0)) was sharded with
    the rest, and zarr's shard check divided by its 0: the first write raised
    ``OSError: ... ZeroDivisionError`` naming no key. Such a key stores no object; it is
    never sharded now."""
    url = location.new()
    storage = zstore.LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options,
                                       **layout)
    data = TensorDict(obs=torch.arange(12.0).reshape(4, 3), empty=torch.zeros(4, 0),
                      wide=torch.zeros(4, 2, 0), batch_size=[4])
    storage.set(torch.arange(4), data)
    storage.close()
    again = zstore.open(url, location.options, mode="r")
    got = again.get(torch.arange(4))
    assert (got["obs"] == data["obs"]).all()
    assert got["empty"].shape == (4, 0) and got["wide"].shape == (4, 2, 0)
