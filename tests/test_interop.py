"""A zstore buffer is a plain Zarr v3 group: other readers see the same committed rows, and
every torch dtype round-trips bit for bit through every codec."""

from __future__ import annotations

import json

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
    # closed: a live writer's commits may keep the rows of partly written shards in log
    # segments (remote stores, zstore.tail), which zarr alone does not read
    storage.close()
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


def _xarray(url: str, options: dict, **kw):
    """The group at ``url`` as an xarray Dataset (``group=`` opens a sub-group)."""
    xr = pytest.importorskip("xarray")
    return xr.open_zarr(url, storage_options=options or None, **kw)


def _xarray_tree(url: str, options: dict, **kw):
    xr = pytest.importorskip("xarray")
    return xr.open_datatree(url, engine="zarr", storage_options=options or None, **kw)


def _assert_xarray_rows(ds, data: TensorDict, prefix: tuple[str, ...] = ()) -> None:
    """Every leaf of ``data`` under ``prefix`` is a variable of ``ds`` holding its rows."""
    node = data.get(prefix) if prefix else data
    names = {key for key, value in node.items() if isinstance(value, torch.Tensor)}
    assert names and names <= set(ds.data_vars)
    for name in names:
        expected = node[name]
        got = _as_torch(ds[name].values[: len(expected)], expected)
        assert torch.equal(bits(got), bits(expected)), (prefix, name)


def test_xarray_reads_the_buffer_and_its_sub_groups(location):
    url = location.new()
    data = _written_buffer(url, location.options, "zstd")
    root = _xarray(url, location.options, consolidated=False)
    assert root.sizes["row"] == 10 and root["obs"].dims == ("row", "obs_0")
    _assert_xarray_rows(root, data)
    nested = _xarray(url, location.options, consolidated=False, group="next")
    assert nested["reward"].dims == ("row", "next.reward_0")
    _assert_xarray_rows(nested, data, ("next",))
    tree = _xarray_tree(url, location.options, consolidated=False)
    _assert_xarray_rows(tree["next"].to_dataset(), data, ("next",))


def test_xarray_reads_an_ndim2_buffer(location):
    url = location.new()
    storage = LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options, ndim=2)
    data = TensorDict(obs=torch.arange(3 * 4 * 2.0).view(3, 4, 2),
                      reward=torch.randn(3, 4), batch_size=[3, 4])
    storage.set(torch.arange(3), data)
    storage.close()  # no log segments left (see _written_buffer)
    ds = _xarray(url, location.options, consolidated=False)
    assert ds["obs"].dims == ("row", "env", "obs_0") and ds["reward"].dims == ("row", "env")
    assert dict(ds.sizes) == {"row": 4, "env": 4, "obs_0": 2}
    _assert_xarray_rows(ds, data)


def test_xarray_opens_a_tree_with_a_dotted_key_beside_the_nested_one(tmp_path):
    """A key ``"a.b"`` and a nested ``("a", "b")`` of other widths: their feature dims were
    both ``a.b_0`` and xarray refused the tree (a dim of two sizes)."""
    url = str(tmp_path / "buffer")
    storage = LazyMemmapStorage(8, scratch_dir=url)
    data = TensorDict({"a.b": torch.randn(8, 3), ("a", "b"): torch.randn(8, 5),
                       "c%2Ed": torch.randn(8, 2), "c.d": torch.randn(8, 4)}, batch_size=[8])
    storage.set(torch.arange(8), data)
    storage.close()
    tree = _xarray_tree(url, {}, consolidated=False)
    root = tree.to_dataset()
    assert root["a.b"].dims == ("row", "a%2Eb_0") and root["c.d"].dims == ("row", "c%2Ed_0")
    assert root["c%2Ed"].dims == ("row", "c%252Ed_0")
    assert tree["a"].to_dataset()["b"].dims == ("row", "a.b_0")
    assert torch.equal(torch.from_numpy(root["a.b"].values), data["a.b"])
    assert torch.equal(torch.from_numpy(tree["a"].to_dataset()["b"].values), data["a", "b"])


def test_xarray_opens_a_buffer_with_a_key_named_as_its_lane_dims(tmp_path):
    """A key ``"env"`` with feature dims, in a buffer of two lane dims (``env_0``,
    ``env_1``): its first feature dim was named ``env_0`` too, and xarray refused the buffer
    (a dim of two sizes)."""
    url = str(tmp_path / "buffer")
    storage = LazyMemmapStorage(60, scratch_dir=url, ndim=3)
    data = TensorDict({"env": torch.randn(4, 2, 3, 5), "obs": torch.randn(4, 2, 3)}, [4, 2, 3])
    storage.set(torch.arange(4), data)
    storage.close()
    ds = _xarray(url, {}, consolidated=False)
    assert ds["env"].dims == ("row", "env_0", "env_1", "env%5F0")
    assert dict(ds.sizes) == {"row": 10, "env_0": 2, "env_1": 3, "env%5F0": 5}
    assert torch.equal(torch.from_numpy(ds["env"].values[:4]), data["env"])


def _ted(n: int) -> TensorDict:
    """``n`` TED steps with an episode end every 5 steps."""
    done = (torch.arange(n) % 5 == 4).unsqueeze(-1)
    return TensorDict({
        "obs": torch.randn(n, 3), "action": torch.randint(0, 4, (n, 1)),
        ("next", "obs"): torch.randn(n, 3), ("next", "reward"): torch.randn(n, 1),
        ("next", "done"): done, ("next", "terminated"): done,
        ("next", "truncated"): torch.zeros(n, 1, dtype=torch.bool),
    }, batch_size=[n])


def test_xarray_reads_a_sealed_dataset(location):
    from zstore.dataset import open_dataset

    url = location.new("ds")
    data = _ted(20)
    storage = LazyMemmapStorage(20, scratch_dir=url, storage_options=location.options)
    storage.set(torch.arange(20), data)
    assert storage.seal() == 4
    storage.close()
    _assert_xarray_rows(_xarray(url, location.options), data)  # consolidated metadata
    _assert_xarray_rows(_xarray(url, location.options, group="next"), data, ("next",))
    tree = _xarray_tree(url, location.options)
    index = tree["__episodes__"].to_dataset()
    assert index["start"].dims == ("episode_row",)
    episodes = open_dataset(url, location.options).episodes
    _assert_xarray_rows(index, episodes.select(*index.data_vars))


def _checkpoint(location, data: TensorDict, *hooks) -> tuple[str, dict]:
    """Dump a buffer holding ``data`` with a TensorStorageCheckpointer (save ``hooks``
    registered); the URL of the generation written and the commit record."""
    import checkpoint

    source = LazyMemmapStorage(16, scratch_dir=location.new("lms"), storage_options=location.options)
    source.checkpointer = checkpoint.TensorStorageCheckpointer(chunks=8)
    for hook in hooks:
        source.checkpointer.register_save_hook(hook)
    source.set(torch.arange(len(data)), data)
    dest = zstore.StoreSpec.parse(location.new("ck"), location.options)
    source.dumps(dest)
    record = checkpoint._dest.Destination(dest).read_commit()
    return f"{dest.url}/{record['generation']}", record


def test_xarray_reads_a_tensor_checkpoint(location):
    data = _ted(12)
    url, record = _checkpoint(location, data)
    assert record["form"] == "buffer"
    _assert_xarray_rows(_xarray(url, location.options, consolidated=False), data)
    _assert_xarray_rows(_xarray(url, location.options, consolidated=False, group="next"), data,
                        ("next",))


def test_xarray_reads_a_flat_ted_checkpoint(location):
    import checkpoint

    data = _ted(12)
    url, record = _checkpoint(location, data, checkpoint.TED2Flat())
    assert record["form"] == "tree"
    steps = _xarray_tree(url, location.options, consolidated=False)["next"].to_dataset()
    assert steps["reward"].dims == ("next.reward_0", "next.reward_1")
    _assert_xarray_rows(steps, data.select(("next", "reward"), ("next", "done")), ("next",))


def _drop_dimension_names(root) -> int:
    """Remove ``dimension_names`` from every ``zarr.json`` under ``root`` (consolidated
    copies too), as stores written before zstore wrote them; return how many it removed."""
    def strip(node) -> int:
        if isinstance(node, dict):
            return int(node.pop("dimension_names", None) is not None) \
                + sum(strip(value) for value in node.values())
        return sum(strip(value) for value in node) if isinstance(node, list) else 0

    removed = 0
    for path in root.rglob("zarr.json"):
        meta = json.loads(path.read_text())
        removed += strip(meta)
        path.write_text(json.dumps(meta))
    return removed


def test_stores_without_dimension_names_still_open(tmp_path):
    from zstore.dataset import open_dataset

    buffer, sealed = tmp_path / "rb", tmp_path / "ds"
    data, steps = _written_buffer(str(buffer), {}, "zstd"), _ted(20)
    storage = LazyMemmapStorage(20, scratch_dir=str(sealed))
    storage.set(torch.arange(20), steps)
    storage.seal()
    storage.close()
    assert _drop_dimension_names(buffer) == 5 and _drop_dimension_names(sealed)
    reopened = zstore.open(str(buffer))
    reopened.set(torch.tensor([6]), data[:1])  # still writable
    got = reopened[:7]
    for key, expected in data.items(include_nested=True, leaves_only=True):
        assert torch.equal(bits(got[key][:6]), bits(expected)), key
    ds = open_dataset(str(sealed))
    assert ds.num_episodes == 4 and torch.equal(ds[:]["next", "reward"], steps["next", "reward"])
