"""A buffer in a bucket, closed or still being written, opens with one request.

Every commit of a writer of a remote store carries a copy of every other node's
``zarr.json`` in the root's (Zarr's consolidated metadata, docs/format.md §6), fetched once
at its first commit. A read-only ``zstore.open`` then reads that one object; so do
zarr-python and xarray, without listing the store. A store without the copy (written
before it) opens from the arrays' own documents, as before.

Requests are counted at a proxy in front of the server (``faultproxy.logged``), so
what is checked holds for both transports, s3fs and obstore.
"""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
import zarr
from faultproxy import Requests, logged
from tensordict import TensorDict

import zstore
from zstore import StoreSpec

REMOTE = pytest.mark.parametrize("location", ["s3", "s3-rclone"], indirect=True)


def _rows(n: int, offset: int = 0) -> TensorDict:
    return TensorDict({"obs": torch.arange(n * 3.0).reshape(n, 3) + offset,
                       "action": torch.arange(n) + offset,
                       ("next", "reward"): -torch.arange(n * 1.0).reshape(n, 1) - offset}, [n])


@pytest.fixture
def through_proxy():
    """Makes :class:`Requests` for an S3 location (its proxies stop after the test)."""
    with contextlib.ExitStack() as stack:
        def make(location) -> Requests:
            return stack.enter_context(logged(location.options, location.base.split("/")[2]))
        yield make


def _root(url: str, options: dict) -> dict:
    fs, path = StoreSpec.parse(url, options).filesystem()
    return json.loads(fs.cat_file(f"{path}/zarr.json"))


def _read_only(url, requests):
    requests.clear()
    reader = zstore.open(url, requests.options, mode="r")
    return reader, requests.seen()


def _same_rows(reader, data) -> None:
    got = reader.get(torch.arange(len(data)))
    for key, value in data.items(include_nested=True, leaves_only=True):
        assert torch.equal(got[key], value), key


def _one_request(url, requests, data) -> None:
    reader, seen = _read_only(url, requests)
    assert seen == [("GET", f"{url.split('/', 3)[3]}/zarr.json")], seen
    _same_rows(reader, data)


@REMOTE
def test_a_buffer_opens_with_one_request_while_written_and_closed(location, through_proxy):
    requests = through_proxy(location)
    data = _rows(20)
    storage = location.memmap(32, chunks=4, shards=8)
    storage.set(torch.arange(20), data)
    storage.flush()  # being written: its rows sit in a shard and log segments
    assert set(_root(storage.scratch_dir, location.options)["consolidated_metadata"]["metadata"]) \
        == {"obs", "action", "next", "next/reward"}
    _one_request(storage.scratch_dir, requests, data)

    more = _rows(4, offset=100)
    storage.set(torch.arange(20, 24), more)
    storage.flush()
    _one_request(storage.scratch_dir, requests, torch.cat([data, more]))
    storage.close()
    _one_request(storage.scratch_dir, requests, torch.cat([data, more]))


@REMOTE
def test_a_writer_fetches_the_copy_once_and_commits_it_every_time(location, through_proxy):
    requests = through_proxy(location)
    data = _rows(20)
    storage = location.memmap(32, chunks=4, shards=8)
    storage.set(torch.arange(20), data)
    storage.close()
    url = storage.scratch_dir

    writer = zstore.open(url, requests.options)
    more = _rows(4, offset=100)
    writer.set(torch.arange(20, 21), more[:1])
    requests.clear()
    writer.flush()
    gets = requests.gets()
    assert sum(key.endswith("obs/zarr.json") for key in gets) == 1, gets  # fetched once
    for step in (1, 2):
        requests.clear()
        writer.set(torch.arange(20 + step, 21 + step), more[step:step + 1])
        writer.flush()
        gets = requests.gets()
        assert not any(key.endswith("obs/zarr.json") for key in gets), gets
        assert "consolidated_metadata" in _root(url, location.options)
        _one_request(url, requests, torch.cat([data, more[:step + 1]]))
    writer.close()
    _one_request(url, requests, torch.cat([data, more[:3]]))


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


def test_close_publishes_the_copy_its_commits_lacked(s3_bucket, s3_options, monkeypatch,
                                                    through_proxy):
    from conftest import Location

    import zstore.storages.memmap as memmap

    location = Location("s3", f"s3://{s3_bucket}/late-copy", s3_options)
    requests = through_proxy(location)
    data = _rows(8)
    storage = location.memmap(16, chunks=4)
    storage.set(torch.arange(8), data)
    with monkeypatch.context() as patched:
        patched.setattr(memmap, "nodes_metadata", lambda group, meta: None)
        storage.flush()
    reader, seen = _read_only(storage.scratch_dir, requests)
    assert any(key.endswith("obs/zarr.json") for _, key in seen), seen  # no copy: two round trips
    storage.close()
    _one_request(storage.scratch_dir, requests, data)
