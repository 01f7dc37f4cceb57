"""Damaged stores: each kind of damage gives its own error naming the key, chunk or file.

Complements ``test_errors.py`` (undecodable zstd chunk, newer format version)
and ``test_compressed.py`` (CompressedListStorage chunks): here the damage is
done to the stored objects themselves, on memory://, local and S3 stores —
flipped bytes, truncated chunks and shards, missing or malformed metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import CorruptChunkError, NotAZStoreError, StoreSpec

LAYOUTS = {
    "crc32c": {"codec": "zstd+crc32c", "chunks": 4, "shards": 4},  # shards = chunks: unsharded
    "raw-crc32c": {"codec": "raw+crc32c", "chunks": 4, "shards": 4},
    "zstd": {"codec": "zstd+nocrc", "chunks": 4, "shards": 4},  # opted out of the checksum
    "raw": {"codec": None, "chunks": 4, "shards": 4},  # checksummed on S3 only
    "sharded": {"codec": "zstd", "chunks": 4, "shards": 8},
}


def rows(n: int) -> TensorDict:
    x = torch.arange(n)
    return TensorDict(obs=x.float().unsqueeze(-1).expand(n, 3).clone(), a=x, batch_size=[n])


def build(location, layout: str, n: int = 12):
    url = location.new()
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options,
                                       **LAYOUTS[layout])
    storage.set(torch.arange(n), rows(n))
    storage.close()
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    return url, fs, root


def damage(fs, path: str, change) -> None:
    fs.pipe_file(path, change(fs.cat_file(path)))


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


@pytest.mark.parametrize("layout", ["crc32c", "raw-crc32c"])
def test_a_flipped_byte_under_crc32c_names_key_and_chunk(location, layout):
    url, fs, root = build(location, layout)
    for at in (0, 7, -5):  # payload start, middle, checksum itself
        damage(fs, f"{root}/obs/c/1/0", lambda data, at=at: flip(data, at))
        reader = zstore.open(url, location.options, mode="r")
        assert reader[0]["a"].item() == 0  # other chunks still read
        with pytest.raises(CorruptChunkError, match=r"'obs', chunk 1"):
            reader[5]
        damage(fs, f"{root}/obs/c/1/0", lambda data, at=at: flip(data, at))  # undo
        # regression: the failed load used to leave the block's cache slot claimed (zeros)
        assert reader[5]["obs"].tolist() == [5.0] * 3


def test_without_a_checksum_a_flipped_raw_byte_is_not_detectable(tmp_path):
    """Documented limit: local raw chunks (memory-mapped) carry no checksum; use a
    ``+crc32c`` preset to detect bit rot."""
    from conftest import Location

    url, fs, root = build(Location("local", str(tmp_path), {}), "raw")
    damage(fs, f"{root}/a/c/1", lambda data: flip(data, 8))
    assert zstore.open(url, mode="r")[5]["a"].item() != 5  # silently different: hence crc32c


@pytest.mark.parametrize("cut", [lambda data: data[: len(data) // 2], lambda data: data[:-1]],
                         ids=["half", "one byte"])
@pytest.mark.parametrize("layout", ["crc32c", "zstd", "raw"])
def test_a_truncated_chunk_names_key_and_chunk(location, layout, cut):
    """One byte off a raw chunk named every chunk read ([0, 1, 2]) and NumPy's "buffer size
    must be a multiple of element size"; it names the chunk and its size now."""
    url, fs, root = build(location, layout)
    damage(fs, f"{root}/a/c/2", cut)
    reader = zstore.open(url, location.options, mode="r")
    with pytest.raises(CorruptChunkError, match=r"'a', chunk 2"):
        reader[9]
    assert reader[3]["a"].item() == 3


def test_a_truncated_shard_names_key_and_shard(location):
    url, fs, root = build(location, "sharded")
    damage(fs, f"{root}/a/c/1", lambda data: data[: len(data) - 7])  # cuts into the index
    reader = zstore.open(url, location.options, mode="r")
    with pytest.raises(CorruptChunkError, match=r"'a', shard 1"):
        reader[9]
    damage(fs, f"{root}/a/c/0", lambda data: data[5:])  # index intact, chunks shifted
    with pytest.raises(CorruptChunkError, match=r"'a'"):
        reader[1]


@pytest.mark.parametrize("kind", ["mmap-reader", "mmap-writer"])
@pytest.mark.parametrize("kept", [40, 0])
def test_a_truncated_memory_mapped_chunk_file_is_refused_not_resized(tmp_path, kind, kept):
    """Regression: a writer used to extend a short chunk file with zeros (silent data loss),
    and until 2026-12-06 one cut to 0 bytes, which read as zeros and was resized by a writer
    too (a 0-byte file is only sized where no row was ever committed)."""
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url)
    storage.set(torch.arange(12), rows(12))
    storage.close()
    chunk = tmp_path / "rb" / "a" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[:kept])
    with pytest.raises(CorruptChunkError, match=rf"'a'.* {kept} bytes"):
        zstore.open(url, mode="r" if kind == "mmap-reader" else "r+")
    assert chunk.stat().st_size == kept


@pytest.mark.parametrize("mode", ["r", "r+"])
def test_a_missing_memory_mapped_chunk_file_is_refused_not_recreated(tmp_path, mode):
    """Regression: a chunk file deleted (or left out of a copy) under committed rows read as
    zeros, and a writer created it afresh, making the loss permanent at its next commit."""
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url)
    storage.set(torch.arange(12), rows(12))
    storage.close()
    chunk = tmp_path / "rb" / "a" / "c" / "0"
    chunk.unlink()
    with pytest.raises(CorruptChunkError, match=r"'a' is missing.* 12 written rows.*again whole"):
        zstore.open(url, mode=mode)
    assert not chunk.exists()


def test_a_key_whose_rows_hold_no_element_reopens(tmp_path):
    """Its chunk file holds 0 bytes by right: not taken for one cut to 0 bytes."""
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url)
    storage.set(torch.arange(3), TensorDict(obs=torch.ones(3, 2), empty=torch.ones(3, 0),
                                            batch_size=[3]))
    storage.close()
    for mode in ("r", "r+"):
        again = zstore.open(url, mode=mode)
        got = again.get(torch.arange(3))
        assert got["empty"].shape == (3, 0) and (got["obs"] == 1).all()
        again.close()


def test_a_0_byte_chunk_file_of_a_store_without_rows_is_sized(tmp_path):
    """A kill between creating a chunk file and sizing it leaves 0 bytes in a store that has
    no committed row: a writer sizes it and writes on."""
    import shutil

    storage = zstore.LazyMemmapStorage(16, scratch_dir=str(tmp_path / "rb"),
                                       autocommit_seconds=float("inf"))
    storage.set(torch.arange(2), rows(2))  # arrays created, no row committed
    url = str(tmp_path / "killed")
    shutil.copytree(tmp_path / "rb", url, ignore=shutil.ignore_patterns("*lease*"))
    storage.close()
    chunk = tmp_path / "killed" / "a" / "c" / "0"
    chunk.write_bytes(b"")  # created, not yet sized, when the writer was killed
    assert len(zstore.open(url, mode="r")) == 0
    again = zstore.open(url, mode="r+")
    again.set(torch.arange(3), rows(3))
    again.close()
    assert (zstore.open(url, mode="r").get(torch.arange(3)) == rows(3)).all()


def _read_from_the_roots_copy(url, location) -> None:
    """A closed remote buffer's reader builds its arrays from the copy of their metadata in
    the root ``zarr.json`` (format.md §6) and reads no array's own: its rows are intact."""
    got = zstore.open(url, location.options, mode="r").get(torch.arange(12))
    assert (got == rows(12)).all()


def test_a_missing_array_names_the_key(location):
    url, fs, root = build(location, "zstd")
    fs.rm(f"{root}/obs/zarr.json")
    modes = ["r+"] if location.kind == "s3" else ["r", "r+"]
    if location.kind == "s3":
        _read_from_the_roots_copy(url, location)
    for mode in modes:  # a writer (and any local reader) reads every array's own zarr.json
        with pytest.raises(NotAZStoreError, match=r"'obs'"):
            zstore.open(url, location.options, mode=mode)


@pytest.mark.parametrize("target", ["root", "array"])
def test_malformed_zarr_json_is_not_a_zstore_buffer(location, target):
    url, fs, root = build(location, "zstd")
    path = f"{root}/zarr.json" if target == "root" else f"{root}/a/zarr.json"
    damage(fs, path, lambda data: data[: len(data) // 2])  # not JSON any more
    mode = "r"
    if target == "array" and location.kind == "s3":
        _read_from_the_roots_copy(url, location)
        mode = "r+"  # a writer reads every array's own zarr.json
    with pytest.raises(NotAZStoreError) as info:
        zstore.open(url, location.options, mode=mode)
    assert url in str(info.value)
    assert target == "root" or "'a'" in str(info.value)  # regression: was a bare JSONDecodeError


BAD_BLOCKS = {
    "length-negative": (lambda b: b.update(length=-1), "length"),
    "length-past-capacity": (lambda b: b.update(length=10**6), "length"),
    "missing-rows": (lambda b: b.pop("rows"), "rows"),
    "capacity-2**62": (lambda b: b.update(max_size=2**62, rows=2**62), "max_size"),
    "unknown-dtype": (lambda b: b["schema"]["leaves"][0].update(dtype="object"), "dtype"),
    "escaping-key": (lambda b: b["schema"]["leaves"][0].update(path="../../etc"), ".."),
    "cursor-past-rows": (lambda b: b.update(last_cursor=99), "last_cursor"),
    "schema-not-an-object": (lambda b: b.update(schema=[1, 2]), "schema"),
    "item-batch-not-sizes": (lambda b: b["schema"].update(item_batch="3"), "item_batch"),
    "item-batch-past-a-shape": (lambda b: b["schema"].update(item_batch=[10**6]), "item_batch"),
    "texts-not-paths": (lambda b: b["schema"].update(texts="obs"), "texts"),
    "stack-past-the-item-dims": (lambda b: b["schema"].update(stack={"dim": 0, "count": 2}),
                                 "stack"),
    "texts-of-a-float-leaf": (lambda b: b["schema"].update(
        texts=[b["schema"]["leaves"][0]["path"]]), "texts"),
    "empty-not-paths": (lambda b: b["schema"].update(empty="info"), "empty"),
    "empty-naming-a-leaf": (lambda b: b["schema"].update(
        empty=[b["schema"]["leaves"][0]["path"]]), "empty"),
    "empty-escaping": (lambda b: b["schema"].update(empty=["../x"]), ".."),
    # until 2026-12-07: read as length 1, as 12, and as a sealed dataset
    "length-true": (lambda b: b.update(length=True), "length"),
    "length-a-string": (lambda b: b.update(length="12"), "length"),
    "read-only-a-string": (lambda b: b.update(read_only="yes"), "read_only"),
    "extra-a-list": (lambda b: b.update(extra=[]), "extra"),
    # until 2026-12-07: every row misread, or a bare KeyError / TypeError / AttributeError
    "lane-shape-not-ndim": (lambda b: b["schema"].update(lane_shape=[2]), "lane_shape"),
    "tensor-kind-of-named-leaves": (lambda b: b["schema"].update(kind="tensor"), "one leaf"),
    "pytree-without-treespec": (lambda b: b["schema"].update(kind="pytree"), "treespec"),
    "group-batch-of-no-group": (lambda b: b["schema"].update(group_batch={"zz": [3]}),
                                "group_batch"),
    "a-leaf-twice": (lambda b: b["schema"]["leaves"].append(b["schema"]["leaves"][0]), "twice"),
    "dtype-against-the-array": (lambda b: b["schema"]["leaves"][0].update(dtype="int32"),
                                "torch_dtype 'float32'"),
    "another-storage-class": (lambda b: b.update(storage_class="CompressedListStorage"),
                              "malformed CompressedListStorage block"),
}


@pytest.mark.parametrize("bad", sorted(BAD_BLOCKS))
def test_malformed_zstore_block_is_refused_naming_the_field(tmp_path, bad):
    from conftest import Location

    url, fs, root = build(Location("local", str(tmp_path), {}), "zstd")
    change, field = BAD_BLOCKS[bad]
    doc = json.loads(fs.cat_file(f"{root}/zarr.json"))
    change(doc["attributes"]["zstore"])
    fs.pipe_file(f"{root}/zarr.json", json.dumps(doc).encode())
    for mode in ("r", "r+"):
        with pytest.raises(zstore.ZStoreError) as info:
            zstore.open(url, mode=mode)
        assert field in str(info.value) and url in str(info.value)


def _compressed_store(tmp_path):
    """A closed local CompressedListStorage of 5 items, ``traj`` ragged; its URL."""
    url = str(tmp_path / "cls")
    storage = zstore.CompressedListStorage(8, scratch_dir=url)
    for i in range(5):
        storage.set(i, TensorDict(pix=torch.full((4, 4), i, dtype=torch.uint8),
                                  traj=torch.full((2 + i % 3, 2), float(i))))
    storage.close()
    return url


def _ragged_move(block):
    block["ragged"]["../../victim"] = block["ragged"].pop("traj")
    block["dtypes"]["../../victim"] = block["dtypes"].pop("traj")


BAD_COMPRESSED_BLOCKS = {
    "length-past-capacity": (lambda b: b.update(length=9), "length 9"),
    "length-negative": (lambda b: b.update(length=-1), "length -1"),
    "capacity-below-length": (lambda b: b.update(max_size=3), "length 5"),
    "newest-past-capacity": (lambda b: b.update(newest=99), "newest 99"),
    "a-ragged-key-escaping-the-store": (_ragged_move, "'..'"),
    "items-null-with-dense-keys": (lambda b: b.update(items=None), "items is null"),
    "a-node-above-no-key": (lambda b: b.update(nodes={"zz": 2}), "nodes names 'zz'"),
    "a-key-in-no-table": (lambda b: b["fixed"].pop("pix"), "are not those of"),
    "unit-not-sizes": (lambda b: b["ragged"]["traj"].update(unit=["2"]), "unit"),
    "used-past-the-values": (lambda b: b["ragged"]["traj"].update(used=999), "used 999"),
}


def test_every_kind_of_compressed_item_passes_the_block_check(tmp_path):
    """The block check refused what a storage writes itself: an item with a batch size
    (its root node, ``.root``, lies above no key path) could not be reopened."""
    url = str(tmp_path / "batched")
    items = [TensorDict(a=torch.full((3, 2), float(i)), traj=torch.zeros(3, 2 + i),
                        nested=TensorDict(b=torch.ones(3, 4), batch_size=[3, 4]),
                        batch_size=[3]) for i in range(3)]
    storage = zstore.CompressedListStorage(8, scratch_dir=url)
    for i, item in enumerate(items):
        storage.set(i, item)
    storage.close()
    reader = zstore.open(url, mode="r")
    for i, item in enumerate(items):
        assert (reader[i] == item).all() and reader[i]["nested"].batch_size == (3, 4)


@pytest.mark.parametrize("bad", sorted(BAD_COMPRESSED_BLOCKS))
def test_a_malformed_compressed_block_is_refused_naming_the_field(tmp_path, bad):
    """The root block of a CompressedListStorage was used as it was: a ragged key
    ``../../victim`` read tables outside the store, a length past the capacity was the
    storage's length, other edits raised bare KeyError / RuntimeError without the URL."""
    url = _compressed_store(tmp_path)
    change, field = BAD_COMPRESSED_BLOCKS[bad]
    doc = json.loads((Path(url) / "zarr.json").read_text())
    change(doc["attributes"]["zstore"])
    (Path(url) / "zarr.json").write_text(json.dumps(doc))
    for mode in ("r", "r+"):
        with pytest.raises(zstore.NotAZStoreError) as info:
            zstore.open(url, mode=mode)
        assert field in str(info.value) and url in str(info.value), str(info.value)


@pytest.mark.parametrize("column,row,value", [("start", 1, 1000), ("start", 1, -3),
                                              ("shape", 1, [2, 5]), ("shape", 1, [-1, 2]),
                                              ("shape", 1, [99, 2])], ids=str)
def test_a_ragged_index_row_no_write_makes_is_refused_not_misread(tmp_path, column, row, value):
    """A row of a ragged key's index pointing outside its values, or with a shape of
    another unit, came back as a wrong item (a negative start read the last units, a shape
    [2, 5] reshaped another item's values) or as a bare IndexError / RuntimeError."""
    import zarr

    url = _compressed_store(tmp_path)
    block = json.loads((Path(url) / "zarr.json").read_text())["attributes"]["zstore"]
    index = zarr.open_array(f"{url}/ragged/traj/index-{block['ragged']['traj']['index']}/{column}",
                            mode="r+")
    index[row] = np.asarray(value)
    reader = zstore.open(url, mode="r")
    assert reader[0]["traj"].tolist() == [[0.0, 0.0]] * 2  # the other items still read
    with pytest.raises(zstore.CorruptChunkError, match=rf"{url}: key 'traj': item {row} is "
                                                       r"recorded .*restore a copy"):
        reader[row]


@pytest.mark.parametrize("codec", [{"name": "numcodecs.pickle"},
                                   {"name": "transpose", "configuration": {"order": [1, 0]}}])
def test_an_array_naming_a_foreign_codec_is_refused_before_decoding(tmp_path, codec):
    """Nothing in a store is unpickled: only the codecs zstore writes are accepted."""
    from conftest import Location

    url, fs, root = build(Location("local", str(tmp_path), {}), "zstd")
    doc = json.loads(fs.cat_file(f"{root}/obs/zarr.json"))
    doc["codecs"] = [codec, *doc["codecs"]]
    fs.pipe_file(f"{root}/obs/zarr.json", json.dumps(doc).encode())
    with pytest.raises(NotAZStoreError, match=r"'obs'"):
        zstore.open(url, mode="r")


def _big_endian(doc: dict) -> None:
    for codec in doc["codecs"]:
        for inner in [codec, *(codec.get("configuration") or {}).get("codecs", [])]:
            if inner["name"] == "bytes":
                inner["configuration"] = {"endian": "big"}


@pytest.mark.parametrize("edit, refusal", [
    (_big_endian, "big-endian values"),
    (lambda doc: doc.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}),
     "chunk key encoding"),
    (lambda doc: doc.update(fill_value=7), "fill value 7"),
], ids=["big-endian", "v2 chunk keys", "fill value"])
@pytest.mark.parametrize("layout", ["crc32c", "raw", "sharded"])
def test_array_metadata_that_would_misread_every_row_is_refused(location, layout, edit, refusal):
    """Before: a "big" byte order read every value byte-swapped (the crc32c covers the encoded
    bytes, so it passed), and another chunk key encoding read every row as zeros. A bucket's
    buffer is opened from the copy of its arrays' metadata in the root commit (one request):
    the edited file is not read, and the rows come back right. A fill value other than 0
    read zeros where plain zarr reads that value (rows never stored, or a chunk equal to it,
    which zarr does not store)."""
    url, fs, root = build(location, layout)
    doc = json.loads(fs.cat_file(f"{root}/a/zarr.json"))
    edit(doc)
    fs.pipe_file(f"{root}/a/zarr.json", json.dumps(doc).encode())
    if location.kind == "s3":
        assert zstore.open(url, location.options, mode="r")[:]["a"].tolist() == list(range(12))
        return
    with pytest.raises(NotAZStoreError, match=f"array of key 'a' disagrees .*{refusal}"):
        zstore.open(url, location.options, mode="r")[:]


def test_a_checkpoint_generation_disagreeing_with_its_commit_record_is_refused(location):
    """Before: a generation whose length was edited (or damaged) loaded with that length:
    2 rows of zeros more, or 4 rows fewer, than the commit record says."""
    import checkpoint

    source = zstore.LazyTensorStorage(16)
    source.set(torch.arange(12), rows(12))
    dest = StoreSpec.parse(location.new("ck"), location.options)
    result = source.dumps(dest)
    fs, root = dest.filesystem()
    path = f"{root}/{result.generation}/zarr.json"
    for length in (14, 8):
        doc = json.loads(fs.cat_file(path))
        doc["attributes"]["zstore"]["length"] = length
        fs.pipe_file(path, json.dumps(doc).encode())
        with pytest.raises(checkpoint.CheckpointError,
                           match=f"generation's length {length} \\(the commit record says 12\\)"):
            zstore.LazyTensorStorage(16).loads(dest)


@pytest.mark.parametrize("how", ["moved", "deleted"])
@pytest.mark.parametrize("kind", ["zstd", "sharded", "compressed-list"])
def test_a_store_moved_or_deleted_under_its_reader_raises_not_zeros(location, kind, how):
    """Rows a reader had not cached read as zeros once its store was moved or deleted (an
    absent chunk is Zarr's fill value); now they raise StoreNotFoundError naming the store:
    locally since 2026-12-05, on memory:// and buckets since 2026-12-06 (one request per
    read that meets a missing object). A single deleted chunk, the array still there, reads
    as zeros as Zarr defines (reliability.md)."""
    if how == "moved" and location.kind != "local":
        pytest.skip("a bucket or memory:// store is not moved under a reader: it is copied")
    url = location.new()
    n = 64
    if kind == "compressed-list":
        writer = location.compressed(n, scratch_dir=url, chunks=4)
        writer.set(list(range(n)), [rows(n)[i] for i in range(n)])
    else:
        writer = location.memmap(n, scratch_dir=url, **LAYOUTS[kind])
        writer.set(torch.arange(n), rows(n))
    writer.close()
    reader = zstore.open(url, location.options, mode="r")
    first = reader.get([0] if kind == "compressed-list" else torch.tensor([0]))
    assert (first[0] if kind == "compressed-list" else first)["a"].reshape(-1).tolist() == [0]
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    if how == "moved":
        fs.mv(root, root + "-elsewhere", recursive=True)
    else:
        fs.rm(root, recursive=True)
    with pytest.raises(zstore.StoreNotFoundError, match="moved or deleted while it was open") as err:
        reader.get([n - 1] if kind == "compressed-list" else torch.tensor([n - 1]))
    assert url in str(err.value)


@pytest.mark.parametrize("kind", ["zstd", "sharded"])
def test_a_dataset_copied_without_a_key_folder_says_so(location, kind):
    """A dataset (consolidated metadata: it opens without reading any array's own zarr.json)
    copied without one key's folder: its reads used to say the store was moved or deleted
    while it was open, and to reopen it where it is now. They now say it was copied in part,
    name the key and the fix."""
    url = location.new()
    writer = location.memmap(64, scratch_dir=url, **LAYOUTS[kind])
    writer.set(torch.arange(40), rows(40))
    writer.seal()
    writer.close()
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    fs.rm(f"{root}/obs", recursive=True)
    dataset = zstore.open_dataset(url, location.options)
    with pytest.raises(zstore.StoreNotFoundError, match="copied in part") as err:
        dataset.get(torch.arange(40))
    assert url in str(err.value) and "'obs'" in str(err.value) and "zstore convert" in str(err.value)


@pytest.mark.parametrize("kind", ["zstd", "sharded", "raw"])
def test_a_dataset_copied_without_a_chunk_refuses_its_rows(location, kind):
    """Regression: a sealed dataset that lost one chunk or shard object (a copy or sync that
    failed part-way, a deleted file) served those rows as zeros. Sealing now stores the
    all-zero objects Zarr skips too, so every object of the rows is there and a missing one
    raises, naming the object and the fix; the other rows still read."""
    url = location.new()
    writer = location.memmap(64, scratch_dir=url, **LAYOUTS[kind])
    data = rows(40)
    data[8:16] = 0  # whole chunks of zeros: Zarr stores none of them, sealing does
    writer.set(torch.arange(40), data)
    writer.seal()
    writer.close()
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    assert fs.exists(f"{root}/a/c/2")  # an all-zero chunk (or the shard holding it) is stored
    assert (zstore.open_dataset(url, location.options).get(torch.arange(40)) == data).all()
    lost = "a/c/1" if kind != "sharded" else "a/c/0"  # rows 4-7, or the shard of rows 0-7
    fs.rm(f"{root}/{lost}")
    dataset = zstore.open_dataset(url, location.options)
    assert (dataset.get(torch.arange(16, 40)) == data[16:]).all()
    with pytest.raises(CorruptChunkError, match="copied in part") as err:
        dataset.get(torch.arange(40))
    assert url in str(err.value) and repr(lost) in str(err.value) and "zstore convert" in str(err.value)


@pytest.mark.parametrize("kind", ["zstd", "sharded"])
def test_all_zero_rows_never_stored_read_as_zeros_on_every_store(location, kind):
    """The look for a store gone is no false alarm: chunks of all-zero rows, which Zarr
    does not store, read as zeros."""
    url = location.new()
    writer = location.memmap(64, scratch_dir=url, **LAYOUTS[kind])
    data = rows(40)
    data[8:16] = 0  # two whole chunks of every key: never stored
    writer.set(torch.arange(40), data)
    writer.close()
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    if kind == "zstd":
        assert not fs.exists(f"{root}/a/c/2") and fs.exists(f"{root}/a/c/1")
    reader = zstore.open(url, location.options, mode="r")
    assert (reader.get(torch.arange(40)) == data).all()


def test_a_deleted_chunk_of_a_local_store_still_reads_as_zeros(tmp_path):
    path = tmp_path / "buffer"
    writer = zstore.LazyMemmapStorage(16, scratch_dir=str(path), **LAYOUTS["zstd"])
    writer.set(torch.arange(1, 13), rows(13)[1:])
    writer.close()
    reader = zstore.open(str(path), mode="r")
    (path / "a" / "c" / "2").unlink()  # rows 8..11 of key "a"
    got = reader.get(torch.arange(12))
    assert got["a"].tolist() == [0, *range(1, 8), 0, 0, 0, 0]
    assert got["obs"][:, 0].tolist() == list(range(12))
