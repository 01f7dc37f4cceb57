"""A buffer in a bucket, closed or still being written, opens with one request.

Every commit of a writer of a remote store carries a copy of every other node's
``zarr.json`` in the root's (Zarr's consolidated metadata, docs/format.md §6), fetched once
at its first commit. A read-only ``zstore.open`` then reads that one object; so do
zarr-python and xarray, without listing the store. A store without the copy (written
before it) opens from the arrays' own documents, as before.
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
#: Every test here counts s3fs's requests.
pytestmark = pytest.mark.usefixtures("s3fs_transport")


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


def _one_request(url, location, gets, data) -> None:
    reader, keys = _read_only(url, location, gets)
    assert keys == [keys[0]] and keys[0].rsplit("/", 1)[-1] == "zarr.json", keys
    _same_rows(reader, data)


@REMOTE
def test_a_buffer_opens_with_one_request_while_written_and_closed(location, gets):
    data = _rows(20)
    storage = location.memmap(32, chunks=4, shards=8)
    storage.set(torch.arange(20), data)
    storage.flush()  # being written: its rows sit in a shard and log segments
    assert set(_root(storage.scratch_dir, location.options)["consolidated_metadata"]["metadata"]) \
        == {"obs", "action", "next", "next/reward"}
    _one_request(storage.scratch_dir, location, gets, data)

    more = _rows(4, offset=100)
    storage.set(torch.arange(20, 24), more)
    storage.flush()
    _one_request(storage.scratch_dir, location, gets, torch.cat([data, more]))
    storage.close()
    _one_request(storage.scratch_dir, location, gets, torch.cat([data, more]))


@REMOTE
def test_a_writer_fetches_the_copy_once_and_commits_it_every_time(location, gets):
    data = _rows(20)
    storage = location.memmap(32, chunks=4, shards=8)
    storage.set(torch.arange(20), data)
    storage.close()
    url = storage.scratch_dir

    writer = zstore.open(url, location.options)
    more = _rows(4, offset=100)
    writer.set(torch.arange(20, 21), more[:1])
    gets.clear()
    writer.flush()
    assert sum(key.endswith("obs/zarr.json") for key in gets) == 1, gets  # fetched once
    for step in (1, 2):
        gets.clear()
        writer.set(torch.arange(20 + step, 21 + step), more[step:step + 1])
        writer.flush()
        assert not any(key.endswith("obs/zarr.json") for key in gets), gets
        assert "consolidated_metadata" in _root(url, location.options)
        _one_request(url, location, gets, torch.cat([data, more[:step + 1]]))
    writer.close()
    _one_request(url, location, gets, torch.cat([data, more[:3]]))


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
    """When a writer's commits went without the copy (its nodes' documents could not be
    read), close commits once more with it; when that write fails, close warns, still
    releases the lease and closes, and the buffer opens as before."""
    from conftest import Location

    import zstore.storages.memmap as memmap

    location = Location("s3", f"s3://{s3_bucket}/failed-copy", s3_options)
    data = _rows(8)
    storage = location.memmap(8, chunks=4)  # full: close has no rows to commit
    storage.set(torch.arange(8), data)
    monkeypatch.setattr(memmap, "nodes_metadata", lambda group, meta: None)
    storage.flush()
    assert "consolidated_metadata" not in _root(storage.scratch_dir, location.options)
    monkeypatch.undo()

    def refused(*args, **kwargs):
        raise OSError("connection reset by the test")

    monkeypatch.setattr(memmap, "commit", refused)
    with pytest.warns(RuntimeWarning, match="rows are committed.*two round trips"):
        storage.close()
    monkeypatch.undo()
    assert storage._table is None and "consolidated_metadata" not in _root(storage.scratch_dir,
                                                                            location.options)
    fs, root = StoreSpec.parse(storage.scratch_dir, location.options).filesystem()
    assert not fs.exists(f"{root}/zstore-lease.json")  # the lease was given back
    _same_rows(zstore.open(storage.scratch_dir, location.options, mode="r"), data)


def test_close_publishes_the_copy_its_commits_lacked(s3_bucket, s3_options, monkeypatch, gets):
    from conftest import Location

    import zstore.storages.memmap as memmap

    location = Location("s3", f"s3://{s3_bucket}/late-copy", s3_options)
    data = _rows(8)
    storage = location.memmap(16, chunks=4)
    storage.set(torch.arange(8), data)
    with monkeypatch.context() as patched:  # (the gets fixture's patch stays)
        patched.setattr(memmap, "nodes_metadata", lambda group, meta: None)
        storage.flush()
    reader, keys = _read_only(storage.scratch_dir, location, gets)
    assert any(key.endswith("obs/zarr.json") for key in keys), keys  # no copy: two round trips
    storage.close()
    _one_request(storage.scratch_dir, location, gets, data)
