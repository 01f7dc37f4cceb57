"""A zstore buffer is a plain Zarr v3 group: other readers see the same committed rows, and
every torch dtype round-trips bit for bit through every codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from tensordict import TensorDict

import zstore
from zstore import LazyMemmapStorage

DTYPES = [
    torch.bool, torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.complex64, torch.complex128,
] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                       "float8_e5m2fnuz") if hasattr(torch, name)]
CODECS = [None, "zstd", "lz4", "blosc-zstd"]


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs and all; bools are 0/1)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, width), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, comparable with ``torch.equal`` even for NaNs."""
    return x.reshape(-1).contiguous().view(torch.uint8)


def every_dtype(n: int, g: torch.Generator) -> TensorDict:
    return TensorDict({str(dt).removeprefix("torch."): random_bits(dt, (n, 2), g) for dt in DTYPES},
                      batch_size=[n])


@pytest.mark.parametrize("codec", CODECS)
def test_every_dtype_round_trips_bit_exactly(location, codec):
    g = torch.Generator().manual_seed(len(str(codec)))
    url = location.new()
    data = every_dtype(5, g)
    storage = LazyMemmapStorage(8, scratch_dir=url, storage_options=location.options, codec=codec,
                                chunks=3, shards=3)
    storage.set(torch.arange(5), data)
    live = storage[:]
    storage.flush()
    reopened = zstore.open(url, location.options, mode="r")[:]
    for key, expected in data.items():
        for got in (live[key], reopened[key]):
            assert got.dtype == expected.dtype, key
            assert torch.equal(bits(got), bits(expected)), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_buffer_of_each_dtype(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    data = random_bits(dtype, (4, 3), g)
    for codec in (None, "zstd"):
        url = str(tmp_path / f"rb-{codec}")
        storage = LazyMemmapStorage(6, scratch_dir=url, codec=codec)
        storage.set(torch.arange(4), data)
        storage.flush()
        got = zstore.open(url).get(torch.tensor([3, 0]))
        assert got.dtype == dtype
        assert torch.equal(bits(got), bits(data[[3, 0]]))


def _written_buffer(url: str, options: dict, codec) -> TensorDict:
    g = torch.Generator().manual_seed(7)
    data = TensorDict(
        obs=torch.randn(6, 3, generator=g),
        action=torch.randint(0, 5, (6,), generator=g),
        next=TensorDict(reward=torch.randn(6, 1, generator=g), done=torch.zeros(6, 1, dtype=torch.bool),
                        batch_size=[6]),
        half=torch.randn(6, 2, generator=g).to(torch.bfloat16),
        batch_size=[6],
    )
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=options, codec=codec,
                                chunks=4, shards=4)
    storage.set(torch.arange(6), data)
    storage.flush()
    return data


def _as_torch(array, like: torch.Tensor) -> torch.Tensor:
    value = torch.from_numpy(np.asarray(array))
    return value.view(like.dtype) if value.dtype != like.dtype else value


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_zarr_python_reads_the_buffer(location, codec):
    url = location.new()
    data = _written_buffer(url, location.options, codec)
    group = zarr.open_group(url, mode="r", storage_options=location.options or None)
    assert group.attrs["zstore"]["length"] == 6
    assert group.attrs["__tensordict__"]["batch_size"][0] == 10
    for key in data.keys(include_nested=True, leaves_only=True):
        path = key if isinstance(key, str) else "/".join(key)
        array = group[path]
        assert array.shape[0] == 10
        expected = data.get(key)
        assert torch.equal(bits(_as_torch(array[:6], expected)), bits(expected)), path


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_tensordict_from_zarr_reads_the_buffer(tmp_path, codec):
    url = str(tmp_path / "rb")
    data = _written_buffer(url, {}, codec)
    loaded = TensorDict.from_zarr(url)
    assert loaded.batch_size == torch.Size([10])
    assert loaded["next"].batch_size == torch.Size([10])
    for key in data.keys(include_nested=True, leaves_only=True):
        expected = data.get(key)
        got = loaded.get(key)[:6]
        got = got.view(expected.dtype) if got.dtype != expected.dtype else got
        assert torch.equal(bits(got), bits(expected)), key


def test_bfloat16_records_its_torch_dtype(tmp_path):
    url = str(tmp_path / "rb")
    _written_buffer(url, {}, None)
    array = zarr.open_group(url, mode="r")["half"]
    assert array.dtype == np.uint16
    assert array.attrs["zstore"]["torch_dtype"] == "bfloat16"


def test_ndim2_layout_is_time_major(tmp_path):
    url = str(tmp_path / "rb")
    storage = LazyMemmapStorage(8, scratch_dir=url, ndim=2)
    data = TensorDict(obs=torch.arange(2 * 4 * 3.0).view(2, 4, 3), batch_size=[2, 4])
    storage.set(torch.arange(2), data)
    storage.flush()
    group = zarr.open_group(url, mode="r")
    assert group["obs"].shape == (2, 4, 3)
    assert group.attrs["__tensordict__"]["batch_size"] == [2, 4]
    assert np.array_equal(group["obs"][:], data["obs"].numpy())
    assert torch.equal(TensorDict.from_zarr(url)["obs"], data["obs"])
