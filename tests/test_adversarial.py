"""Adversarial checks of the Zarr-backed LazyMemmapStorage.

Each known bug is an ``xfail(strict=True)`` test asserting the *correct* behaviour,
so it starts passing (and then fails as XPASS) once fixed. The other tests are
checks that found nothing, kept because they cover ground that
test_memmap_storage.py and test_cache.py do not: mixed exotic dtypes through
tiny caches, per-key chunk/shard lengths, pickling and background prefetch
interleaved with writes, ndim=2 cell reads through evicting caches.
"""

from __future__ import annotations

import pickle
import random
import uuid

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import LazyMemmapStorage, LazyTensorStorage, RoundRobinWriter
from zstore.errors import SchemaError


def mem_url() -> str:
    return f"memory://zstore-adversarial/{uuid.uuid4().hex[:10]}"


def ids(start: int, n: int) -> TensorDict:
    """``n`` rows whose values are their write numbers (stale rows are visible)."""
    v = torch.arange(start, start + n)
    return TensorDict(i=v, x=v.float().unsqueeze(-1).expand(n, 8).clone(), batch_size=[n])


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path) -> str:
    return mem_url() if request.param == "memory" else str(tmp_path / "rb")


# ==============================================================================================
# Bugs
# ==============================================================================================

# -- a read-only reader caches shard indexes forever -------------------------------------------

def test_reader_survives_writer_appending_into_the_same_shard(location):
    writer = location.memmap(64, chunks=4, shards=16, codec="zstd")
    url = writer.scratch_dir
    writer.set(torch.arange(6), ids(0, 6))  # block 1 half filled
    writer.flush()
    reader = zstore.open(url, location.options, mode="r")
    assert reader[0]["i"].item() == 0  # caches shard 0's index
    writer.set(torch.arange(6, 10), ids(6, 4))  # appends only: committed rows 0..5 unchanged
    writer.flush()  # shard 0 rewritten: block 1 has a new compressed size
    assert reader[torch.tensor([4, 5])]["i"].tolist() == [4, 5]


def test_reader_gets_right_rows_after_writer_rewrites_an_earlier_block_of_the_shard(url):
    writer = LazyMemmapStorage(16, scratch_dir=url, chunks=4, shards=16)
    writer.set(torch.arange(12), ids(0, 12))
    writer[torch.arange(4, 8)] = TensorDict(i=torch.zeros(4, dtype=torch.long),
                                            x=torch.zeros(4, 8), batch_size=[4])
    writer.flush()  # block 1 all zeros: omitted from the shard, block 2 moves up
    reader = zstore.open(url, mode="r")
    assert reader[0]["i"].item() == 0  # caches shard 0's index
    writer[torch.arange(4, 8)] = ids(100, 4)  # rows 8..11 untouched
    writer.flush()
    assert reader[torch.tensor([8, 9])]["i"].tolist() == [8, 9]


# -- a negative cursor is committed as an invalid last_cursor ----------------------------------

@pytest.mark.parametrize("cursor", [torch.tensor([-2]), [-2], -2])
def test_negative_cursor_keeps_the_store_openable(url, cursor):
    storage = LazyMemmapStorage(10, scratch_dir=url, chunks=2, codec="zstd")
    storage.set(torch.arange(3), ids(0, 3))
    one = ids(9, 1)
    storage.set(cursor, one[0] if isinstance(cursor, int) else one)
    storage.close()
    again = zstore.open(url)  # raised NotAZStoreError: inconsistent 'zstore' block
    assert again[:]["i"].tolist()[:3] == [0, 1, 2]


# -- boolean masks as write cursors -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["chunked", "mmap"])
def test_setitem_with_an_all_true_mask(tmp_path, kind):
    options = {"chunks": 2, "codec": "zstd"} if kind == "chunked" else {}
    storage = LazyMemmapStorage(6, scratch_dir=str(tmp_path / "rb"), **options)
    storage.set(torch.arange(6), ids(0, 6))
    storage[torch.ones(6, dtype=torch.bool)] = ids(100, 6)
    assert storage[:]["i"].tolist() == [100, 101, 102, 103, 104, 105]


def test_setitem_with_a_partial_mask_matches_lazy_tensor_storage():
    mask = torch.tensor([False, False, True, False, True, False])
    out = []
    for storage in (LazyTensorStorage(6), LazyMemmapStorage(6, scratch_dir=mem_url(), chunks=2)):
        storage.set(torch.arange(6), ids(0, 6))
        storage[mask] = ids(100, 2)
        out.append(storage[:]["i"].tolist())
    assert out[0] == [0, 1, 100, 3, 101, 5]
    assert out[1] == out[0]


# -- index forms LazyTensorStorage accepts ------------------------------------------------------

@pytest.mark.parametrize("index", [[], range(0)], ids=["list", "range"])
def test_empty_list_index_reads_zero_rows(index):
    for storage in (LazyTensorStorage(6), LazyMemmapStorage(6, scratch_dir=mem_url(), chunks=2)):
        storage.set(torch.arange(6), ids(0, 6))
        assert storage.get(index).batch_size == torch.Size([0])


def grid_storages():
    data = TensorDict(x=torch.arange(12.).reshape(3, 4), batch_size=[3, 4])
    ref = LazyTensorStorage(12, ndim=2)
    zs = LazyMemmapStorage(12, scratch_dir=mem_url(), ndim=2, chunks=2, codec="zstd")
    for s in (ref, zs):
        s.set(torch.arange(3), data)
    return ref, zs


def test_ndim2_tuple_of_lists_reads_cells():
    ref, zs = grid_storages()
    assert ref.get(([0, 2], [1, 3]))["x"].tolist() == [1.0, 11.0]
    assert zs.get(([0, 2], [1, 3]))["x"].tolist() == [1.0, 11.0]


def test_ndim2_cell_mask_reads_cells():
    ref, zs = grid_storages()
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, 1] = mask[2, 3] = True
    assert ref.get(mask)["x"].tolist() == [1.0, 11.0]
    assert zs.get(mask)["x"].tolist() == [1.0, 11.0]


# -- prefetch(background=True) contract ---------------------------------------------------------

def test_background_prefetch_returns_a_future_on_memory_mapped_buffers(tmp_path):
    storage = LazyMemmapStorage(6, scratch_dir=str(tmp_path / "rb"))
    storage.set(torch.arange(6), ids(0, 6))
    assert type(storage.table).__name__ == "MmapTable"
    future = storage.prefetch(torch.tensor([1, 2]), background=True)
    assert future is not None
    future.result()


# -- existsok adoption ignores ndim -------------------------------------------------------------

def test_existsok_refuses_or_adopts_a_different_ndim():
    url = mem_url()
    first = LazyMemmapStorage(4, scratch_dir=url, chunks=2)
    first.set(torch.arange(2), TensorDict(x=torch.ones(2, 3), batch_size=[2]))
    first.flush()
    second = LazyMemmapStorage(12, scratch_dir=url, ndim=2, existsok=True, chunks=2)
    try:
        second.set(torch.arange(2), TensorDict(x=torch.full((2, 3), 7.0), batch_size=[2, 3]))
    except (SchemaError, ValueError):
        return  # refusing is fine
    assert second.ndim == second._meta.ndim  # adopting the store's ndim is fine too


# ==============================================================================================
# Checks that found nothing (coverage beyond test_memmap_storage.py / test_cache.py)
# ==============================================================================================

def mixed(lead: tuple[int, ...], g: torch.Generator) -> TensorDict:
    """bfloat16, bool, complex and int16 leaves next to float32, one of them nested."""
    return TensorDict(
        obs=torch.randn(*lead, 5, generator=g),
        bf=torch.randn(*lead, 2, generator=g).to(torch.bfloat16),
        done=torch.rand(lead, generator=g) > 0.7,
        cplx=torch.randn(*lead, 2, generator=g, dtype=torch.complex64),
        nested=TensorDict(k=torch.randint(-999, 999, lead, generator=g).to(torch.int16),
                          batch_size=lead),
        batch_size=lead)


FUZZ_CONFIGS = {
    "per-key-chunks-and-shards-tinycache": dict(
        chunks={"obs": 3, "bf": 5, "done": 7, "cplx": 2, "nested/k": 4},
        shards={"obs": 9, "done": 14}, cache_bytes=1, codec="zstd"),
    "per-key-chunks-raw-smallcache": dict(chunks={"obs": 3, "done": 7}, cache_bytes=200),
    "per-key-codecs-sharded-tinycache": dict(
        chunks=4, shards=8, cache_bytes=1, codec={"default": "zstd", "done": None, "obs": "lz4"}),
    "checksummed": dict(chunks=5, shards=10, cache_bytes=500, codec="blosc-zstd+crc32c"),
    "default": dict(),  # memory-mapped on local disk
}


def same(a: TensorDict, b: TensorDict) -> bool:
    return all(torch.equal(a.get(k), b.get(k)) and a.get(k).dtype == b.get(k).dtype
               for k in b.keys(True, True))


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("config", list(FUZZ_CONFIGS))
def test_mixed_dtypes_random_ops_with_pickle_and_background_prefetch(url, config, ndim):
    """Seeded ops vs LazyTensorStorage: duplicate and negative indices, wrap-around, set vs
    __setitem__, flush / close / reopen / pickle, background prefetch left running."""
    cfg = FUZZ_CONFIGS[config]
    seed = sum(map(ord, config + url[:3])) + ndim
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    lanes = (3,) if ndim == 2 else ()
    cap = rng.randrange(8, 30)
    storage = LazyMemmapStorage(cap, scratch_dir=url, ndim=ndim, **cfg)
    ref = LazyTensorStorage(cap, ndim=ndim)
    ws, wr = RoundRobinWriter(), RoundRobinWriter()
    ws.register_storage(storage)
    wr.register_storage(ref)
    first = mixed((2, *lanes), g)
    ws.extend(first)
    wr.extend(first.clone())
    rows = ref._max_size_along_dim0()
    written = torch.zeros(rows, dtype=torch.bool)
    written[:2] = True
    for step in range(40):
        op = rng.choice(["add", "extend", "extend", "setitem", "set", "dup", "get", "get",
                         "flush", "reopen", "pickle", "prefetch"])
        if op == "add":
            item = mixed(lanes, g)
            ws.add(item)
            wr.add(item.clone())
        elif op == "extend":
            batch = mixed((rng.randrange(1, rows + 5), *lanes), g)
            ws.extend(batch)
            wr.extend(batch.clone())
        elif op in ("setitem", "set", "dup"):
            idx = torch.tensor([rng.randrange(-rows, rows) for _ in range(rng.randrange(1, 8))])
            if op == "set":
                idx = idx % rows  # negative set cursors: see test_negative_cursor_...
            if op == "dup":
                idx = torch.cat([idx, idx[:1]])
            batch = mixed((len(idx), *lanes), g)
            if op == "set":
                storage.set(idx, batch)
            else:
                storage[idx] = batch
            for j, r in enumerate(idx.tolist()):  # one row at a time: the last write wins
                ref[r] = batch[j].clone()
            if op == "set":
                ref._len_value, ref._last_cursor_value = storage._len_value, storage._last_cursor_value
            written[idx % rows] = True
        elif op == "get" and len(ref):
            n = ref._len_along_dim0
            idx = torch.tensor([rng.randrange(-n, n) for _ in range(rng.randrange(1, 3 * n))])
            mask = written[idx % n]
            assert same(storage.get(idx)[mask], ref.get(idx)[mask]), (step, op)
        elif op == "flush":
            storage.flush()
        elif op == "reopen":
            storage.flush()
            if rng.random() < 0.5:
                storage.close()
            storage = zstore.open(url, cache_bytes=cfg.get("cache_bytes", 1 << 30))
            ws = RoundRobinWriter()
            ws.register_storage(storage)
            wr._cursor = ws._cursor
        elif op == "pickle":
            storage = pickle.loads(pickle.dumps(storage))
            ws = RoundRobinWriter()
            ws.register_storage(storage)
            ws._cursor = wr._cursor
        elif op == "prefetch" and len(ref):
            n = ref._len_along_dim0
            future = storage.prefetch(torch.tensor([rng.randrange(n) for _ in range(5)]),
                                      background=True)
            if future is not None and rng.random() < 0.5:
                future.result()  # otherwise it races with the next write
        assert len(storage) == len(ref), (step, op)
        if len(ref):
            mask = written[: ref._len_along_dim0]
            assert same(storage[:][mask], ref[:][mask]), (step, op)
    storage.flush()
    reader = zstore.open(url, mode="r", cache_bytes=1)
    mask = written[: ref._len_along_dim0]
    assert same(reader[:][mask], ref[:][mask])


def bit_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.view(torch.uint8)


@pytest.mark.parametrize("cfg", [dict(chunks=3, shards=6, codec="zstd", cache_bytes=1),
                                 dict(chunks=4, codec="lz4+crc32c", cache_bytes=1),
                                 dict(codec=None),
                                 dict(chunks=5, codec=None, cache_bytes=1)],
                         ids=["zstd-sharded", "lz4-crc", "raw", "raw-chunked"])
def test_dtypes_without_index_kernels_round_trip_bit_exact(url, cfg):
    """uint16/32/64, float8 and bfloat16 (held in same-width compute dtypes) plus bool,
    complex128, float16, int8: bit-exact through evicting caches, batched writes and reopen."""
    g = torch.Generator().manual_seed(0)
    n = 20
    raw = torch.randint(0, 256, (n, 24), generator=g, dtype=torch.uint8)

    def bits(a, b, dtype):
        return raw[:, a:b].contiguous().view(dtype)

    data = TensorDict(
        u16=bits(0, 6, torch.uint16), u32=bits(0, 12, torch.uint32), u64=bits(0, 8, torch.uint64),
        f8=bits(0, 3, torch.float8_e4m3fn), f8b=bits(3, 6, torch.float8_e5m2),
        bf=bits(0, 4, torch.bfloat16), f16=bits(4, 8, torch.float16), i8=bits(8, 10, torch.int8),
        b=raw[:, 0] > 100, c128=torch.randn(n, 2, dtype=torch.complex128, generator=g),
        batch_size=[n])
    storage = LazyMemmapStorage(n, scratch_dir=url, **cfg)
    for start in range(0, n, 7):
        storage.set(torch.arange(start, min(n, start + 7)), data[start:start + 7])
    perm = torch.randperm(n, generator=g)
    for source in (storage, None):
        if source is None:
            storage.flush()
            source = zstore.open(url, mode="r", cache_bytes=1)
        got = source.get(perm)
        for key in data.keys():
            assert got[key].dtype == data[key].dtype, key
            assert torch.equal(bit_view(got[key]), bit_view(data[key][perm])), key


@pytest.mark.parametrize("cfg", [dict(chunks=2, cache_bytes=1, codec="zstd"),
                                 dict(chunks=3, shards=6, cache_bytes=1),
                                 dict(chunks={"x": 2, "y": 5}, cache_bytes=1)],
                         ids=["zstd", "sharded", "per-key-chunks"])
def test_ndim2_cell_reads_through_an_evicting_cache(cfg):
    """(rows, lanes) reads, 1-D and 2-D, negative, touching more blocks than the cache holds."""
    g = torch.Generator().manual_seed(0)
    url = mem_url()
    storage = LazyMemmapStorage(40, scratch_dir=url, ndim=2, **cfg)
    ref = LazyTensorStorage(40, ndim=2)
    data = TensorDict(x=torch.randn(10, 4, 2, generator=g),
                      y=torch.randint(0, 9, (10, 4), generator=g), batch_size=[10, 4])
    storage.set(torch.arange(10), data)
    ref.set(torch.arange(10), data)
    rows = torch.randint(-10, 10, (30,), generator=g)
    lanes = torch.randint(-4, 4, (30,), generator=g)
    assert (storage.get((rows, lanes)) == ref.get((rows, lanes))).all()
    grid = (rows.reshape(5, 6), lanes.reshape(5, 6))
    got = storage.get(grid)
    assert got.batch_size == torch.Size([5, 6]) and (got == ref.get(grid)).all()
    storage.flush()
    reader = zstore.open(url, mode="r", cache_bytes=1)
    assert (reader.get((rows, lanes)) == ref.get((rows, lanes))).all()


@pytest.mark.parametrize("kind", ["chunked", "mmap"])
def test_strided_inputs_are_written_by_value(tmp_path, kind):
    """Expanded (stride 0) and transposed inputs, through slice copies and index_copy_."""
    options = {"chunks": 3} if kind == "chunked" else {}
    storage = LazyMemmapStorage(8, scratch_dir=str(tmp_path / "rb"), **options)
    x = torch.arange(3.0).expand(8, 3)
    y = torch.arange(16.0).reshape(2, 8).t()
    storage.set(torch.arange(8), TensorDict(x=x, y=y, batch_size=[8]))
    storage[torch.tensor([5, 1])] = TensorDict(x=torch.tensor([9.0, 9, 9]).expand(2, 3),
                                               y=torch.arange(4.0).reshape(2, 2).t(),
                                               batch_size=[2])
    out = storage[:]
    assert out["x"][[1, 5, 0]].tolist() == [[9, 9, 9], [9, 9, 9], [0, 1, 2]]
    assert out["y"][[1, 5, 2]].tolist() == [[1, 3], [0, 2], [2, 10]]


def test_reader_of_an_unsharded_store_survives_writer_appends(url):
    """The non-sharded counterpart of the shard-index bug: whole chunk objects, no index."""
    writer = LazyMemmapStorage(64, scratch_dir=url, chunks=4, codec="zstd")
    writer.set(torch.arange(6), ids(0, 6))
    writer.flush()
    reader = zstore.open(url, mode="r", cache_bytes=1)
    assert reader[0]["i"].item() == 0
    writer.set(torch.arange(6, 10), ids(6, 4))
    writer.flush()
    assert reader[torch.tensor([4, 5, 0])]["i"].tolist() == [4, 5, 0]
    assert len(reader) == 6  # its committed view


def test_sign_of_zero_survives_fill_value_elision(url):
    """Zarr skips chunks equal to the fill value 0.0; -0.0 compares equal but must come back."""
    storage = LazyMemmapStorage(8, scratch_dir=url, chunks=4, codec="zstd")
    storage.set(torch.arange(8), TensorDict(x=torch.full((8,), -0.0), batch_size=[8]))
    storage.flush()
    assert torch.signbit(zstore.open(url, mode="r")[:]["x"]).all()
