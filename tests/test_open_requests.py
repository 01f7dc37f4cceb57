"""A closed buffer in a bucket opens with one request.

``close()`` of a buffer on a remote store commits once more with a copy of every other
node's ``zarr.json`` in the root's (Zarr's consolidated metadata, docs/format.md §6).
A read-only ``zstore.open`` then reads that one object; so do zarr-python and xarray,
without listing the store. A writer opens without the copy, so its commits drop it until
it closes. A store without the copy (written before, or still being written) opens from
the arrays' own documents, as before.
"""

from __future__ import annotations

import json
import warnings

import pytest
import s3fs
import torch
import zarr
from tensordict import TensorDict

import zstore
from zstore import StoreSpec

REMOTE = pytest.mark.parametrize("location", ["s3", "s3-rclone"], indirect=True)


def _rows(n: int, offset: int = 0) -> TensorDict:
    return TensorDict({"obs": torch.arange(n * 3.0).reshape(n, 3) + offset,
                       "action": torch.arange(n) + offset,
                       ("next", "reward"): -torch.arange(n * 1.0).reshape(n, 1) - offset}, [n])


@pytest.fixture
def gets(monkeypatch) -> list[str]:
    """The object key of every s3fs GET."""
    seen: list[str] = []
    call = s3fs.S3FileSystem._call_s3

    async def recorded(self, method, *args, **kwargs):
        if getattr(method, "__name__", method) == "get_object":
            seen.append(kwargs.get("Key", ""))
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", recorded)
    return seen


def _root(url: str, options: dict) -> dict:
    fs, path = StoreSpec.parse(url, options).filesystem()
    return json.loads(fs.cat_file(f"{path}/zarr.json"))


def _read_only(url, location, gets):
    gets.clear()
    reader = zstore.open(url, location.options, mode="r")
    return reader, [key.split("/", 2)[-1] for key in gets]


def _same_rows(reader, data) -> None:
    got = reader.get(torch.arange(len(data)))
    for key, value in data.items(include_nested=True, leaves_only=True):
        assert torch.equal(got[key], value), key


@REMOTE
def test_a_closed_buffer_opens_with_one_request(location, gets):
    data = _rows(20)
    storage = location.memmap(32, chunks=4, shards=8)
    storage.set(torch.arange(20), data)
    storage.flush()
    reader, keys = _read_only(storage.scratch_dir, location, gets)  # being written: no copy
    assert "consolidated_metadata" not in _root(storage.scratch_dir, location.options)
    assert any(key.endswith("obs/zarr.json") for key in keys), keys
    _same_rows(reader, data)

    storage.close()
    reader, keys = _read_only(storage.scratch_dir, location, gets)
    assert [key.rsplit("/", 1)[-1] for key in keys] == ["zarr.json"], keys
    assert len(keys) == 1
    _same_rows(reader, data)


@REMOTE
def test_a_writer_drops_the_copy_until_it_closes(location):
    data = _rows(20)
    storage = location.memmap(32, chunks=4, shards=8)
    storage.set(torch.arange(20), data)
    storage.close()
    url = storage.scratch_dir
    assert set(_root(url, location.options)["consolidated_metadata"]["metadata"]) == {
        "obs", "action", "next", "next/reward"}

    writer = zstore.open(url, location.options)
    more = _rows(4, offset=100)
    writer.set(torch.arange(20, 24), more)
    writer.flush()
    assert "consolidated_metadata" not in _root(url, location.options)
    writer.close()
    assert "consolidated_metadata" in _root(url, location.options)
    reader = zstore.open(url, location.options, mode="r")
    _same_rows(reader, torch.cat([data, more]))


@REMOTE
def test_zarr_opens_a_closed_buffer_without_listing_it(location):
    """zarr-python reads the copy (``use_consolidated`` defaults to using it): no member
    listing, so no warning about zstore's own objects, and the same values."""
    data = _rows(12)
    storage = location.memmap(16, chunks=4)
    storage.set(torch.arange(12), data)
    storage.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a listing would warn about zstore-lease.json & co
        group = zarr.open_group(storage.scratch_dir, mode="r",
                                storage_options=location.options, zarr_format=3)
        assert group.metadata.consolidated_metadata is not None
        assert sorted(name for name, _ in group.members(max_depth=None)) == [
            "action", "next", "next/reward", "obs"]
        assert (group["next/reward"][:12] == data["next", "reward"].numpy()).all()


def test_a_local_or_memory_buffer_closes_without_the_copy(location):
    """Off the network there is no round trip to save: close writes no copy there."""
    storage = location.memmap(16, chunks=4)
    storage.set(torch.arange(4), _rows(4))
    storage.close()
    root = _root(storage.scratch_dir, location.options)
    assert ("consolidated_metadata" in root) == (location.kind == "s3")


def test_a_failed_closing_copy_still_closes(s3_bucket, s3_options, monkeypatch):
    """The closing copy is an optimisation over committed rows: when its write fails, close
    warns, still releases the lease and closes, and the buffer opens as before."""
    from conftest import Location

    import zstore.group

    location = Location("s3", f"s3://{s3_bucket}/failed-copy", s3_options)
    data = _rows(8)
    storage = location.memmap(16, chunks=4)
    storage.set(torch.arange(8), data)
    storage.flush()

    def refused(*args, **kwargs):
        raise OSError("connection reset by the test")

    monkeypatch.setattr(zstore.group, "commit", refused)
    with pytest.warns(RuntimeWarning, match="rows are committed.*two round trips"):
        storage.close()
    monkeypatch.undo()
    assert storage._table is None and "consolidated_metadata" not in _root(storage.scratch_dir,
                                                                            location.options)
    fs, root = StoreSpec.parse(storage.scratch_dir, location.options).filesystem()
    assert not fs.exists(f"{root}/zstore-lease.json")  # the lease was given back
    _same_rows(zstore.open(storage.scratch_dir, location.options, mode="r"), data)
