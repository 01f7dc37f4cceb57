"""The golden format-v1 store (``tests/golden/v1``) stays readable, exactly.

The store was written once by ``tests/golden/make_golden_v1.py``; its values are
regenerated here by the same deterministic generator (never unpickled). If a
test here fails, the current code no longer reads what format v1 wrote: fix the
reader (or bump the format version and keep a v1 reader), never the golden store.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from tensordict import TensorDict

import zstore

GOLDEN = Path(__file__).resolve().parent / "golden"
STORE = GOLDEN / "v1"

_spec = importlib.util.spec_from_file_location("make_golden_v1", GOLDEN / "make_golden_v1.py")
make_golden_v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden_v1)
LEAVES = make_golden_v1.LEAVES
LENGTH, CAPACITY, CHUNK_ROWS = make_golden_v1.LENGTH, make_golden_v1.CAPACITY, make_golden_v1.CHUNK_ROWS


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def expected() -> TensorDict:
    return make_golden_v1.golden_data()


@pytest.fixture
def golden():
    """The golden store opened read-only; asserts afterwards that no file changed."""
    before = _digest(STORE)
    storage = zstore.open(STORE, mode="r")
    yield storage
    storage.close()
    assert _digest(STORE) == before, "opening the golden store read-only modified it"


def test_counters(golden):
    assert isinstance(golden, zstore.LazyMemmapStorage)
    assert len(golden) == LENGTH
    assert golden.max_size == CAPACITY
    assert golden.ndim == 1
    assert golden._last_cursor_index == LENGTH - 1
    assert golden.shape == torch.Size([LENGTH])


def test_keys_dtypes_values(golden, expected):
    got = golden.get(torch.arange(LENGTH))
    keys = {k if isinstance(k, tuple) else (k,) for k in got.keys(include_nested=True, leaves_only=True)}
    assert keys == set(LEAVES)
    assert got.batch_size == torch.Size([LENGTH])
    for key, (dtype, shape) in LEAVES.items():
        value = got.get(key)
        assert value.dtype == dtype, key
        assert value.shape == (LENGTH, *shape), key
        assert torch.equal(value, expected.get(key)), key


def test_single_rows_and_slices(golden, expected):
    for row in (0, 15, 16, LENGTH - 1, -1):
        got = golden.get(row)
        for key in LEAVES:
            assert torch.equal(got.get(key), expected.get(key)[row]), (key, row)
    got = golden.get(slice(10, 35))  # spans chunks 0, 1 and 2
    for key in LEAVES:
        assert torch.equal(got.get(key), expected.get(key)[10:35]), key
    with pytest.raises(IndexError):
        golden.get(LENGTH)  # committed length bounds reads


def test_read_only(golden, expected):
    with pytest.raises(zstore.ReadOnlyError):
        golden.set(0, expected[0])


def test_plain_zarr_reads_it(expected):
    group = zarr.open_group(STORE, mode="r")
    meta = group.attrs["zstore"]
    assert meta["format_version"] == 1
    assert meta["storage_class"] == "LazyMemmapStorage"
    assert (meta["max_size"], meta["rows"], meta["ndim"]) == (CAPACITY, CAPACITY, 1)
    assert (meta["length"], meta["last_cursor"], meta["high_water"]) == (LENGTH, LENGTH - 1, LENGTH)
    assert meta["codec"] == {"name": "zstd", "level": 1, "checksum": False}
    assert all(chunks == [CHUNK_ROWS, None] for chunks in meta["chunks"].values())
    assert group.attrs["__tensordict__"] == {"batch_size": [CAPACITY], "version": 1}
    assert "zstore_incomplete" not in group.attrs
    assert {leaf["path"] for leaf in meta["schema"]["leaves"]} == {"/".join(k) for k in LEAVES}
    for key, (dtype, shape) in LEAVES.items():
        array = group["/".join(key)]
        assert array.shape == (CAPACITY, *shape)
        assert array.chunks == (CHUNK_ROWS, *shape)
        assert array.attrs["zstore"] == {"torch_dtype": str(dtype).removeprefix("torch.")}
        assert [c.to_dict()["name"] for c in array.metadata.codecs] == ["bytes", "zstd"]
        data = array[:]
        if dtype == torch.bfloat16:
            assert data.dtype == np.uint16
            value = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        else:
            value = torch.from_numpy(data)
        assert value.dtype == dtype, key
        assert torch.equal(value[:LENGTH], expected.get(key)), key
        assert not value[LENGTH:].any(), key  # never written: the fill value 0
    # rows 48..63 were never written: chunk 3 does not exist
    assert not (STORE / "obs" / "c" / "3").exists()
    for sub in ("next", "next/info", "collector"):
        assert group[sub].attrs["__tensordict__"] == {"batch_size": [CAPACITY], "version": 1}


def test_tensordict_from_zarr_reads_it(expected):
    td = TensorDict.from_zarr(str(STORE))
    assert td.batch_size == torch.Size([CAPACITY])
    length = json.loads((STORE / "zarr.json").read_text())["attributes"]["zstore"]["length"]
    assert length == LENGTH
    obs = td.get(("next", "obs"))[:length]
    assert torch.equal(torch.as_tensor(obs), expected.get(("next", "obs")))
    done = td.get(("next", "done"))[:length]
    assert torch.equal(torch.as_tensor(done), expected.get(("next", "done")))
