"""Checksums by default: compressed chunks, and every chunk on a remote store, carry a crc32c.

Bit rot in a plain zstd or raw chunk decodes into wrong rows without an error; the
checksum turns it into a :class:`~zstore.CorruptChunkError` naming the key and chunk.
``"+nocrc"`` opts out; stores written without checksums keep reading as they are.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import CodecSpec, CorruptChunkError, StoreSpec
from zstore.codecs import parse_codecs

N = 1200


def rows(n: int = N) -> TensorDict:
    """Incompressible pixels (zstd stores them verbatim: flipped bytes decode silently)."""
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (n, 1024), generator=g, dtype=torch.uint8)
    return TensorDict(pixels=pixels, step=torch.arange(n), batch_size=[n])


def write(location, codec, storage_class=zstore.LazyMemmapStorage):
    url = location.new()
    storage = storage_class(N, scratch_dir=url, storage_options=location.options, codec=codec)
    storage.set(torch.arange(N), rows())
    storage.close()
    return url


def flip_16_bytes(location, url: str, key: str = "pixels") -> str:
    """Flip 16 bytes inside the first stored chunk (or shard) object of ``key``; its path."""
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    path = sorted(p for p in fs.find(root) if f"/{key}/c/" in p)[0]
    data = bytearray(fs.cat_file(path))
    at = len(data) // 3  # inside the first chunk's payload: clear of block headers and shard index
    data[at: at + 16] = bytes(b ^ 0xFF for b in data[at: at + 16])
    fs.pipe_file(path, bytes(data))
    return path


def block(location, url: str) -> dict:
    """The ``zstore`` block of the buffer at ``url``."""
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    return json.loads(fs.cat_file(f"{root}/zarr.json"))["attributes"]["zstore"]


def chunk_codecs(location, url: str, key: str = "pixels") -> list[str]:
    """The codecs of ``key``'s chunks (inside the shards, when sharded)."""
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    codecs = json.loads(fs.cat_file(f"{root}/{key}/zarr.json"))["codecs"]
    if codecs[0]["name"] == "sharding_indexed":
        codecs = codecs[0]["configuration"]["codecs"]
    return [c["name"] for c in codecs]


def test_a_flipped_zstd_chunk_names_the_key_by_default(location):
    url = write(location, "zstd")
    assert block(location, url)["codec"] == {"name": "zstd", "level": 1, "checksum": True}
    flip_16_bytes(location, url)
    reader = zstore.open(url, location.options, mode="r")
    assert torch.equal(reader[N - 1]["step"], torch.tensor(N - 1))  # other keys still read
    with pytest.raises(CorruptChunkError, match=r"key 'pixels', chunk 0: .*crc32c checksum mismatch"):
        reader.get(torch.arange(N))


def test_the_opt_out_stores_no_checksum(location):
    """``"zstd+nocrc"``: what the default guards against — the same damage reads silently."""
    url = write(location, "zstd+nocrc")
    assert block(location, url)["codec"] == {"name": "zstd", "level": 1, "checksum": False}
    assert chunk_codecs(location, url) == ["bytes", "zstd"]
    flip_16_bytes(location, url)
    pixels = zstore.open(url, location.options, mode="r").get(torch.arange(N))["pixels"]
    assert not torch.equal(pixels, rows()["pixels"])  # wrong rows, no error


@pytest.mark.parametrize("codec", ["zstd:3", "lz4", "blosc-zstd",
                                   pytest.param({"default": "lz4", "step": "zstd:2"}, id="per-key")])
def test_every_compressed_preset_is_checksummed(codec):
    from conftest import Location

    location = Location("memory", "memory://zstore-tests/checksums", {})
    url = write(location, codec)
    assert chunk_codecs(location, url)[-1] == chunk_codecs(location, url, "step")[-1] == "crc32c"
    assert block(location, url)["codec"]["checksum"] is True
    flip_16_bytes(location, url)
    with pytest.raises(CorruptChunkError, match=r"'pixels'"):
        zstore.open(url, mode="r").get(torch.arange(N))


@pytest.mark.parametrize("location", ["s3"], indirect=True)
@pytest.mark.parametrize("storage_class", [zstore.LazyMemmapStorage, zstore.CompressedListStorage])
def test_raw_chunks_on_a_remote_store_are_checksummed_by_default(location, storage_class):
    url = write(location, None, storage_class)
    table = url if storage_class is zstore.LazyMemmapStorage else f"{url}/items-1"
    assert chunk_codecs(location, table) == ["bytes", "crc32c"]
    assert block(location, table)["codec"] == {"name": None, "level": None, "checksum": True}
    flip_16_bytes(location, table)
    with pytest.raises(CorruptChunkError, match=r"'pixels'"):
        zstore.open(url, location.options, mode="r").get(torch.arange(N))


@pytest.mark.parametrize("location", ["s3"], indirect=True)
def test_raw_nocrc_keeps_remote_chunks_raw(location):
    url = write(location, {"default": "raw+nocrc", "step": None})
    assert chunk_codecs(location, url) == ["bytes"]  # opted out
    assert chunk_codecs(location, url, "step") == ["bytes", "crc32c"]  # this key did not
    assert str(zstore.open(url, location.options, mode="r").codec) == "raw+nocrc"


@pytest.mark.parametrize("location", ["memory", "local"], indirect=True)
def test_raw_chunks_stay_raw_on_local_and_memory_stores(location):
    url = write(location, None)
    assert chunk_codecs(location, url) == ["bytes"]
    assert block(location, url)["codec"] == {"name": None, "level": None, "checksum": False}
    reader = zstore.open(url, location.options, mode="r")
    assert torch.equal(reader.get(torch.arange(N))["pixels"], rows()["pixels"])
    if location.kind == "local":
        assert reader.cache_stats is None  # memory-mapped: no chunk cache


def test_an_old_store_without_checksums_opens_reads_and_stays_so(location):
    """A zstd store written before checksums were the default (its JSON says ``false``)."""
    url = write(location, "zstd+nocrc")
    old = {"name": "zstd", "level": 1, "checksum": False}
    assert block(location, url)["codec"] == old
    storage = zstore.open(url, location.options, mode="r+")
    assert str(storage.codec) == "zstd:1+nocrc"
    assert torch.equal(storage.get(torch.arange(N))["pixels"], rows()["pixels"])
    storage.set(torch.arange(10), rows(10))  # a write does not add a checksum either
    storage.close()
    assert block(location, url)["codec"] == old
    assert chunk_codecs(location, url) == ["bytes", "zstd"]


@pytest.mark.parametrize("location", ["s3"], indirect=True)
def test_an_old_compressed_list_storage_reopens_without_a_checksum(location):
    url = write(location, "zstd:3+nocrc", zstore.CompressedListStorage)
    reopened = zstore.open(url, location.options, mode="r")
    assert str(reopened.default_codec) == "zstd:3+nocrc"
    assert torch.equal(torch.stack(reopened.get(torch.arange(N)))["pixels"], rows()["pixels"])


@pytest.mark.parametrize("text", [None, "raw+nocrc", "raw+crc32c", "zstd", "zstd:3+nocrc",
                                  "lz4+crc32c", "blosc-zstd:5+nocrc"])
def test_a_spec_round_trips_through_its_text_and_json(text):
    spec = CodecSpec.parse(text)
    assert CodecSpec.parse(str(spec)) == spec == CodecSpec.parse(json.loads(json.dumps(spec.to_json())))
    for remote in (False, True):  # a decided checksum is never re-decided
        default, _ = parse_codecs(str(spec), remote=remote)
        assert spec.checksum is None or default == spec


def test_json_without_a_checksum_field_means_none():
    assert CodecSpec.parse({"name": "zstd", "level": 1}).checksum is False
    default, per_key = parse_codecs({"default": {"name": "zstd", "level": 1, "checksum": False},
                                     "a": {"name": None, "level": None, "checksum": False}},
                                    remote=True)
    assert (str(default), str(per_key["a"])) == ("zstd:1+nocrc", "raw+nocrc")


def test_a_bad_preset_names_the_opt_out():
    with pytest.raises(ValueError, match=r"unknown codec preset 'zstd\+crc'.*'\+nocrc'"):
        CodecSpec.parse("zstd+crc")


@pytest.mark.parametrize(("preset", "bounds"), [("zstd:25", "from -131072 to 22"),
                                                ("lz4:10", "from 0 to 9"),
                                                ("blosc-zstd:-1+crc32c", "from 0 to 9")])
def test_a_level_the_compressor_refuses_is_refused_when_named(tmp_path, capsys, preset, bounds):
    """``zstore convert --codec zstd:25`` passed argument parsing, then failed at run time
    (exit 1, "Value must be less than or equal to 22") leaving an empty DST folder."""
    from zstore.cli import main

    with pytest.raises(ValueError, match=f"codec level in '{re.escape(preset)}' must be {bounds}"):
        CodecSpec.parse(preset)
    src = str(tmp_path / "src")
    storage = zstore.LazyMemmapStorage(4, scratch_dir=src)
    storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 3), batch_size=[2]))
    storage.close()
    assert main(["convert", src, str(tmp_path / "dst"), "--codec", preset]) == 2
    assert f"must be {bounds}" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()
    assert main(["convert", src, str(tmp_path / "dst"), "--codec", "foo"]) == 2  # not a level
    assert "unknown codec 'foo': choose none, zstd, lz4" in capsys.readouterr().err
