"""A reader fetches most of a shard whole, in one request.

A reader that wants at least ``WHOLE_SHARD_SHARE`` of a shard's chunks, and has not read
its index yet, GETs the whole object and reads the index from its end: one round trip
where the index and then the chunk ranges took two (zstore/chunkio.py). Fewer chunks are
read as before, through the index and coalesced ranges. Values are checked against the
rows written; a damaged or truncated shard is refused naming the key.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import StoreSpec
from zstore.chunkio import WHOLE_SHARD_SHARE
from zstore.errors import CorruptChunkError


def _rows(n: int) -> TensorDict:
    return TensorDict({"obs": torch.arange(n * 6.0).reshape(n, 6),
                       "action": torch.arange(n) * 7}, [n])


def _written(location, codec=None):
    """64 rows in shards of 32 rows (8 chunks of 4 rows per shard), closed."""
    data = _rows(64)
    storage = location.memmap(64, chunks=4, shards=32, codec=codec)
    storage.set(torch.arange(64), data)
    storage.close()
    return storage.scratch_dir, data


def _read(url, location, rows):
    reader = zstore.open(url, location.options, mode="r")
    got = reader.get(torch.as_tensor(rows))
    return got, reader.cache_stats


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_most_of_a_shard_comes_in_one_request_per_key(location, codec):
    url, data = _written(location, codec)
    if location.kind == "local" and codec is None:
        pytest.skip("a local raw buffer is memory-mapped: no chunk requests")
    wanted = list(range(0, 28))  # 7 of the first shard's 8 chunks
    assert 7 / 8 >= WHOLE_SHARD_SHARE
    got, stats = _read(url, location, wanted)
    assert torch.equal(got["obs"], data["obs"][wanted])
    assert torch.equal(got["action"], data["action"][wanted])
    assert stats.requests == 2  # obs and action: the shard whole, no index request

    wanted = [1, 13, 40, 63]  # 2 chunks of each shard: its index, then its ranges
    got, stats = _read(url, location, wanted)
    assert torch.equal(got["obs"], data["obs"][wanted])
    assert torch.equal(got["action"], data["action"][wanted])
    assert stats.requests == 2 * 2 * 2  # 2 keys x 2 shards x (index + one coalesced range)


def test_every_row_in_one_request_per_shard(location):
    url, data = _written(location, "zstd")
    got, stats = _read(url, location, list(range(64)))
    assert torch.equal(got["obs"], data["obs"]) and torch.equal(got["action"], data["action"])
    assert stats.requests == 2 * 2  # 2 keys x 2 shards


@pytest.mark.parametrize("damage", ["index", "truncated"])
def test_a_damaged_shard_fetched_whole_is_refused_naming_it(s3_bucket, s3_options, damage):
    from conftest import Location

    location = Location("s3", f"s3://{s3_bucket}/damaged-shard", s3_options)
    url, _ = _written(location)
    fs, root = StoreSpec.parse(url, s3_options).filesystem()
    path = f"{root}/obs/c/0/0"
    shard = fs.cat_file(path)
    fs.pipe_file(path, shard[:-3] + bytes(b ^ 0xFF for b in shard[-3:]) if damage == "index"
                 else shard[:20])
    reader = zstore.open(url, s3_options, mode="r")
    expected = "'obs', shard 0 index" if damage == "index" else "'obs', shard 0 .*truncated"
    with pytest.raises(CorruptChunkError, match=expected):
        reader.get(torch.arange(0, 32))
