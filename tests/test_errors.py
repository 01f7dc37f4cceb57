"""Bad input raises a specific zstore error that names the culprit, and changes nothing.

"Changes nothing" is checked on both sides: the live storage (length, last
cursor, mutation revision, rows) and the committed store as a fresh read-only
handle sees it.
"""

from __future__ import annotations

import builtins
import os

import numpy as np
import pytest
import torch
import zarr
from conftest import denying_bucket, run_bound_by_file_modes
from tensordict import TensorDict

import zstore
from zstore import (
    BackendNotInstalledError,
    CorruptChunkError,
    FormatVersionError,
    InvalidKeyError,
    LazyMemmapStorage,
    MissingKeyError,
    NotAZStoreError,
    ReadOnlyError,
    SchemaError,
    StoreExistsError,
    StoreNotFoundError,
)
from zstore.lease import LEASE_NAME


def batch(n: int, start: int = 0) -> TensorDict:
    values = torch.arange(start, start + n)
    return TensorDict(
        obs=values.float().unsqueeze(-1).expand(n, 3).clone(),
        action=values,
        next=TensorDict(reward=values.double().unsqueeze(-1), batch_size=[n]),
        batch_size=[n],
    )


def snapshot(url: str, options: dict):
    """What a fresh reader sees: (length, last cursor, every committed row)."""
    reader = zstore.open(url, options, mode="r")
    rows = reader[:].clone() if len(reader) else None
    return len(reader), reader._last_cursor_index, rows


def assert_same_snapshot(a, b) -> None:
    assert a[:2] == b[:2]
    assert (a[2] is None) == (b[2] is None)
    if a[2] is not None:
        assert (a[2] == b[2]).all()


@pytest.fixture
def filled(location):
    """A committed buffer of 6 rows (capacity 10, chunks of 4) and its snapshot."""
    url = location.new()
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options,
                                chunks=4, shards=4, codec="zstd")
    storage.set(torch.arange(6), batch(6))
    storage.flush()
    return storage, url, location.options, snapshot(url, location.options)


def live_state(storage):
    return len(storage), storage._last_cursor_index, storage._mutation_revision, storage[:].clone()


def assert_nothing_changed(storage, url, options, before_snapshot, before_live) -> None:
    after = live_state(storage)
    assert after[:3] == before_live[:3]
    assert (after[3] == before_live[3]).all()
    storage.flush()
    assert_same_snapshot(snapshot(url, options), before_snapshot)


def _replace(td: TensorDict, key, value) -> TensorDict:
    td = td.clone()
    td.set(key, value)
    return td


def _without(td: TensorDict, key) -> TensorDict:
    td = td.clone()
    del td[key]
    return td


BAD_DATA = {
    # name: (make bad 2-row batch, exception, fragments the message must contain)
    "obs-shape": (lambda b: _replace(b, "obs", torch.zeros(2, 4)), SchemaError, ["obs", "4"]),
    "obs-dtype": (lambda b: _replace(b, "obs", torch.zeros(2, 3, dtype=torch.float64)),
                  SchemaError, ["obs", "float64", "float32"]),
    "nested-dtype": (lambda b: _replace(b, ("next", "reward"), torch.zeros(2, 1)),
                     SchemaError, ["reward", "float32", "float64"]),
    "nested-shape": (lambda b: _replace(b, ("next", "reward"), torch.zeros(2, 2, dtype=torch.float64)),
                     SchemaError, ["reward"]),
    "new-key": (lambda b: _replace(b, "extra", torch.zeros(2)), MissingKeyError, ["extra"]),
    "new-nested-key": (lambda b: _replace(b, ("next", "obs"), torch.zeros(2, 3)),
                       MissingKeyError, ["obs"]),
    "missing-key": (lambda b: _without(b, "action"), MissingKeyError, ["action"]),
    "not-a-tensordict": (lambda b: torch.zeros(2, 3), SchemaError, ["TensorDict"]),
}


@pytest.mark.parametrize("write", ["set", "setitem"])
def test_bad_data_raises_and_changes_nothing(filled, write):
    storage, url, options, before = filled
    live = live_state(storage)
    for case, (make_bad, error, fragments) in BAD_DATA.items():
        bad = make_bad(batch(2, start=100))
        try:
            if write == "set":
                storage.set(torch.tensor([1, 7]), bad)
            else:
                storage[torch.tensor([1, 7])] = bad
        except error as exc:  # naming the store, whose keys an earlier run may have fixed
            missing = [f for f in [*fragments, url.split("://")[-1]] if f not in str(exc)]
            assert not missing, f"{case}: {missing} not named in {exc}"
        else:
            pytest.fail(f"{case}: no {error.__name__} raised")
        assert_nothing_changed(storage, url, options, before, live)


def test_single_item_with_batch_dim_is_written_into_its_row(filled):
    """An int cursor given a batch of one row writes that row, as TorchRL's storages and
    torch's setitem do (it was refused until 2026-12-06: ``rb[i] = batch_of_one``,
    test_tensor_fidelity_rows.py); a batch of two is still refused, nothing changed."""
    storage, url, options, before = filled
    live = live_state(storage)
    with pytest.raises(SchemaError, match="obs"):
        storage.set(3, batch(2, start=50))
    assert_nothing_changed(storage, url, options, before, live)
    storage.set(3, batch(1, start=50))
    assert (storage.get(3) == batch(1, start=50)[0]).all()


@pytest.mark.parametrize("index", [6, -7, 10, [0, 6], torch.tensor([2, 9]), slice(0, 2, 0)])
def test_read_out_of_range(filled, index):
    storage, *_ = filled
    with pytest.raises((IndexError, ValueError)):
        storage.get(index)


@pytest.mark.parametrize("cursor", [10, 11, -11, torch.tensor([1, 10]), [3, 12]])
def test_write_out_of_range(filled, cursor):
    storage, url, options, before = filled
    live = live_state(storage)
    n = 1 if isinstance(cursor, int) else len(cursor)
    data = batch(n, start=50)
    with pytest.raises(IndexError, match="1[0-2]"):
        storage.set(cursor, data[0] if isinstance(cursor, int) else data)
    assert_nothing_changed(storage, url, options, before, live)


@pytest.mark.parametrize("key", ["..", ".", "a/b", "", " padded", "padded ", "zarr.json",
                                 ("next", ".."), ("ok", "x/y")])
def test_keys_that_escape_the_group(location, key):
    url = location.new()
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options)
    data = TensorDict({"fine": torch.zeros(2)}, batch_size=[2])
    data.set(key, torch.ones(2))
    with pytest.raises(InvalidKeyError) as info:
        storage.set(torch.arange(2), data)
    assert repr(key[-1] if isinstance(key, tuple) else key) in str(info.value)
    assert not storage.initialized and len(storage) == 0
    with pytest.raises((StoreNotFoundError, NotAZStoreError)):
        zstore.open(url, location.options)
    # the storage is still usable with valid keys
    storage.set(torch.arange(2), TensorDict({"fine": torch.zeros(2)}, batch_size=[2]))
    assert len(storage) == 2


@pytest.mark.parametrize("tree", [{"..": torch.zeros(2)}, {"a/b": torch.zeros(2)},
                                  {(1, 2): torch.zeros(2)}])  # int keys are stored (test_key_names)
def test_pytree_keys_that_escape_the_group(location, tree):
    storage = LazyMemmapStorage(10, scratch_dir=location.new(), storage_options=location.options)
    with pytest.raises(InvalidKeyError):
        storage.set(torch.arange(2), tree)
    assert not storage.initialized


def test_open_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAZStoreError, match="empty"):
        zstore.open(tmp_path / "empty")


def test_open_missing_location(location):
    url = location.new("missing")
    with pytest.raises(StoreNotFoundError) as info:
        zstore.open(url, location.options)
    assert url in str(info.value)


def test_a_location_holding_only_a_lease_says_a_buffer_is_being_created(location):
    """A writer killed after taking its lease and before writing its group (or one still
    creating it) left a location that ``zstore.open`` called "not a zstore buffer: no Zarr
    group there"; it now says what is there and the way on, and creating it again works."""
    url = location.new("lease-only")
    creating = location.memmap(8, scratch_dir=url)
    creating.take_write_lease()  # the first step of a creation: the lease, nothing else yet
    with pytest.raises(NotAZStoreError, match="holds only a write lease, no buffer yet") as info:
        zstore.open(url, location.options, mode="r")
    assert url in str(info.value) and "create the buffer there again" in str(info.value)
    creating.set(torch.arange(2), TensorDict(x=torch.ones(2), batch_size=[2]))
    creating.close()
    assert len(zstore.open(url, location.options, mode="r")) == 2


def test_plain_zarr_group_is_not_a_buffer(location):
    url = location.new("plain")
    group = zarr.open_group(url, mode="w", storage_options=location.options or None)
    group.create_array("x", shape=(3,), dtype="f4")
    group.attrs["owner"] = "someone else"
    with pytest.raises(NotAZStoreError) as info:
        zstore.open(url, location.options)
    assert url in str(info.value)
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options,
                                existsok=True)
    with pytest.raises(NotAZStoreError):
        storage.set(torch.arange(2), batch(2))
    again = zarr.open_group(url, mode="r", storage_options=location.options or None)
    assert dict(again.attrs) == {"owner": "someone else"}
    assert list(again.array_keys()) == ["x"]
    # the refused creation left no lease object among the group's files (it stayed as long
    # as the storage lived: a notebook's traceback keeps it)
    assert not zstore.StoreSpec.parse(url, location.options).objects().keys() & {LEASE_NAME}


def test_a_buffer_of_another_storage_class_is_named_by_its_class(tmp_path):
    """A LazyMemmapStorage over a CompressedListStorage buffer names that class (it said "a
    Zarr group that is not a zstore buffer") and leaves it as it was."""
    url = str(tmp_path / "frames")
    frames = zstore.CompressedListStorage(10, scratch_dir=url)
    frames.set(0, TensorDict(obs=torch.zeros(2)))
    frames.close()
    storage = LazyMemmapStorage(10, scratch_dir=url)
    with pytest.raises(NotAZStoreError) as info:
        storage.set(torch.arange(2), batch(2))
    assert str(info.value) == f"{url} already holds a CompressedListStorage buffer; choose an empty location"
    assert len(zstore.open(url)) == 1


def _set_format_version(url: str, options: dict, version: int) -> None:
    group = zarr.open_group(url, mode="r+", storage_options=options or None)
    block = dict(group.attrs["zstore"])
    block["format_version"] = version
    group.attrs["zstore"] = block


def test_newer_format_version(filled):
    storage, url, options, _ = filled
    storage.close()
    _set_format_version(url, options, 3)  # 2 is read: log segments
    with pytest.raises(FormatVersionError, match="v3.*reads up to v2"):
        zstore.open(url, options)
    with pytest.raises(FormatVersionError):
        zstore.open(url, options, mode="r")
    adopt = LazyMemmapStorage(10, scratch_dir=url, storage_options=options, existsok=True)
    with pytest.raises(FormatVersionError):
        adopt.set(torch.arange(2), batch(2))
    group = zarr.open_group(url, mode="r", storage_options=options or None)
    assert group.attrs["zstore"]["format_version"] == 3
    assert group.attrs["zstore"]["length"] == 6
    _set_format_version(url, options, 1)
    assert len(zstore.open(url, options)) == 6


def _add_fields(url: str, options: dict, block: dict, schema: dict | None = None) -> None:
    """Add fields to the ``zstore`` block of the buffer at ``url`` (and to its schema), as a
    newer zstore would."""
    group = zarr.open_group(url, mode="r+", storage_options=options or None)
    stored = dict(group.attrs["zstore"])
    stored.update(block)
    if schema:
        stored["schema"] = {**stored["schema"], **schema}
    group.attrs["zstore"] = stored


def test_fields_of_a_newer_zstore_are_read_past_and_never_dropped_by_a_write(filled):
    """A newer zstore grows the format by optional fields (format.md §5). This one reads such
    a store, but refuses to write it, naming the fields: a commit rewrites the block from the
    fields it knows, so a write erased them for good (a newer reader then misread the rows)."""
    storage, url, options, before = filled
    storage.close()
    _add_fields(url, options, {"future": {"x": 1}}, schema={"future_leaves": [1]})
    assert_same_snapshot(snapshot(url, options), before)  # read as before
    with pytest.raises(FormatVersionError, match=r"\(future, schema\.future_leaves\).*mode='r'"):
        zstore.open(url, options)
    with pytest.raises(FormatVersionError, match="future"):
        LazyMemmapStorage(10, scratch_dir=url, storage_options=options, existsok=True)
    stored = zarr.open_group(url, mode="r", storage_options=options or None).attrs["zstore"]
    assert stored["future"] == {"x": 1} and stored["schema"]["future_leaves"] == [1]
    assert stored["length"] == 6

    frames_url = url + "-frames"
    frames = zstore.CompressedListStorage(10, scratch_dir=frames_url, storage_options=options)
    frames.set(0, TensorDict(obs=torch.ones(3)))
    frames.close()
    _add_fields(frames_url, options, {"future": 1})
    assert (zstore.open(frames_url, options, mode="r")[0]["obs"] == 1).all()
    with pytest.raises(FormatVersionError, match="future"):
        zstore.open(frames_url, options)
    assert zarr.open_group(frames_url, mode="r",
                           storage_options=options or None).attrs["zstore"]["future"] == 1

    # a checkpoint of one: refused before the loading storage changes (it was emptied first)
    import checkpoint

    source = zstore.CompressedListStorage(10)
    source.set(0, TensorDict(obs=torch.zeros(3)))
    ck = zstore.StoreSpec.parse(url + "-ck", options)
    generation = source.dumps(ck).generation
    _add_fields(f"{ck.url}/{generation}", options, {"future": 1})
    target = zstore.CompressedListStorage(10)
    target.set(0, TensorDict(obs=torch.ones(3)))
    with pytest.raises(checkpoint.CheckpointError, match=r"\(future\).*Upgrade zstore"):
        target.loads(ck)
    assert len(target) == 1 and (target[0]["obs"] == 1).all()
    rows = zstore.LazyTensorStorage(10)  # a buffer's checkpoint likewise
    rows.set(torch.arange(2), batch(2))
    ck = zstore.StoreSpec.parse(url + "-ck2", options)
    generation = rows.dumps(ck).generation
    _add_fields(f"{ck.url}/{generation}", options, {"future": 1}, schema={"future_leaves": [1]})
    target = zstore.LazyTensorStorage(10)
    with pytest.raises(checkpoint.CheckpointError, match=r"\(future, schema\.future_leaves\)"):
        target.loads(ck)
    assert len(target) == 0


def test_the_fields_zstore_writes_are_known_fields(filled):
    """A writable open never refuses a store this version wrote: the fields a buffer's block
    and schema hold, and those of a CompressedListStorage's root block, are known ones."""
    from zstore.layout import BLOCK_FIELDS, Schema
    from zstore.storages.compressed import BLOCK_FIELDS as CLS_BLOCK_FIELDS

    storage, url, options, _ = filled
    block = zarr.open_group(url, mode="r", storage_options=options or None).attrs["zstore"]
    assert set(block) <= BLOCK_FIELDS and set(block["schema"]) <= Schema.FIELDS
    frames = zstore.CompressedListStorage(10, scratch_dir=url + "-frames", storage_options=options)
    frames.set(0, TensorDict(obs=torch.ones(3)))
    assert set(frames._block()) == CLS_BLOCK_FIELDS
    frames.close()


@pytest.mark.parametrize("action", ["set", "setitem", "empty", "load_state_dict"])
def test_read_only_refuses_writes(filled, action):
    storage, url, options, before = filled
    reader = zstore.open(url, options, mode="r")
    live = live_state(reader)
    with pytest.raises(ReadOnlyError) as info:
        if action == "set":
            reader.set(torch.arange(2), batch(2, 40))
        elif action == "setitem":
            reader[0] = batch(1, 40)[0]
        elif action == "empty":
            reader._empty()
        else:
            reader.load_state_dict(storage.state_dict())
    assert "read-only" in str(info.value)
    after = live_state(reader)
    assert after[:3] == live[:3] and (after[3] == live[3]).all()
    assert_same_snapshot(snapshot(url, options), before)


def test_read_only_cleanup_keeps_handle_usable(filled):
    _, url, options, before = filled
    reader = zstore.open(url, options, mode="r")
    with pytest.raises(ReadOnlyError):
        reader.cleanup()
    assert_same_snapshot(snapshot(url, options), before)
    assert (reader[:] == before[2]).all()


def test_read_only_new_storage_creates_nothing(location):
    url = location.new()
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options,
                                read_only=True)
    with pytest.raises(ReadOnlyError):
        storage.set(torch.arange(2), batch(2))
    with pytest.raises(StoreNotFoundError):
        zstore.open(url, location.options)


def test_existsok_false_on_existing_buffer(filled):
    storage, url, options, before = filled
    other = LazyMemmapStorage(10, scratch_dir=url, storage_options=options)
    with pytest.raises(StoreExistsError) as info:
        other.set(torch.arange(2), batch(2, 70))
    assert "existsok" in str(info.value) and url in str(info.value)
    assert not other.initialized
    assert_same_snapshot(snapshot(url, options), before)


def test_existsok_with_other_schema(filled):
    _, url, options, before = filled
    other = LazyMemmapStorage(10, scratch_dir=url, storage_options=options, existsok=True)
    with pytest.raises(SchemaError, match="obs"):
        other.set(torch.arange(2), _replace(batch(2), "obs", torch.zeros(2, 5)))
    assert_same_snapshot(snapshot(url, options), before)


def test_unknown_protocol():
    with pytest.raises(BackendNotInstalledError, match="nosuchproto"):
        zstore.open("nosuchproto://bucket/rb")
    storage = LazyMemmapStorage(10, scratch_dir="nosuchproto://bucket/rb")
    with pytest.raises(BackendNotInstalledError, match="nosuchproto"):
        storage.set(torch.arange(2), batch(2))
    assert not storage.initialized


def test_missing_s3_bucket(s3_options):
    url = "s3://zstore-no-such-bucket-4f1c/rb"
    with pytest.raises(StoreNotFoundError, match="zstore-no-such-bucket-4f1c"):
        zstore.open(url, s3_options)
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=s3_options)
    with pytest.raises(StoreNotFoundError, match="zstore-no-such-bucket-4f1c"):
        storage.set(torch.arange(2), batch(2))
    assert not storage.initialized


def test_error_messages_hide_s3_secrets(s3_options):
    options = dict(s3_options, secret="very-secret-value")
    with pytest.raises(StoreNotFoundError) as info:
        zstore.open("s3://zstore-no-such-bucket-4f1c/rb", options)
    assert "very-secret-value" not in str(info.value)


def test_a_refused_read_names_the_store_and_the_fix(s3_options):
    """A reader the server refuses (403, as S3 answers wrong credentials; moto takes any key,
    so a bucket policy refuses) is told which store refused it and what to check, through
    either transport (``make test-obstore`` runs this through obstore)."""
    url = f"s3://{denying_bucket(s3_options)}/rb"
    for attempt in (lambda: zstore.open(url, s3_options, mode="r"), lambda: zstore.open(url, s3_options)):
        with pytest.raises(PermissionError) as info:
            attempt()
        message = str(info.value)
        assert message.startswith(f"cannot read {url} ") and "Forbidden" in message, message
        assert message.endswith("check storage_options key= and secret= (or AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY) and the bucket's policy"), message


@pytest.mark.parametrize("transport", ["fsspec", "obstore"])
def test_an_unreachable_endpoint_is_named_with_the_fix(transport):
    """A reader and a new buffer's first write, their S3 server out of reach, are told which
    store and what to check, through either transport (the writer raised botocore's bare
    ``EndpointConnectionError``, naming neither the buffer nor the fix)."""
    url = "s3://zstore-tests/unreachable"
    options = {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s",
               "transport": transport, "config_kwargs": {"retries": {"max_attempts": 1}}}
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=options)
    for attempt in (lambda: zstore.open(url, options, mode="r"),
                    lambda: storage.set(torch.arange(2), batch(2)),
                    # what storage.nbytes lists (it raised botocore's error, naming neither)
                    lambda: zstore.StoreSpec.parse(url, options).stored_bytes()):
        with pytest.raises(ConnectionError) as info:
            attempt()
        message = str(info.value)
        assert url in message and "its server cannot be reached (" in message, message
        assert message.endswith("check the server's address (for S3, storage_options "
                                "endpoint_url or AWS_ENDPOINT_URL; else the host and port in "
                                "the URL), that the server is running, and that this machine "
                                "can reach it"), message
    assert not storage.initialized


def test_corrupt_chunk_names_key_and_chunk(tmp_path):
    url = str(tmp_path / "rb")
    storage = LazyMemmapStorage(10, scratch_dir=url, codec="zstd", chunks=3)
    storage.set(torch.arange(6), batch(6))
    storage.close()
    chunk = os.path.join(url, "obs", "c", "1", "0")
    assert os.path.exists(chunk)
    with builtins.open(chunk, "wb") as handle:
        handle.write(b"not zstd")
    reader = zstore.open(url, mode="r")
    assert reader.get(0)["action"].item() == 0  # other chunks still read
    with pytest.raises(CorruptChunkError) as info:
        reader.get(4)
    assert "obs" in str(info.value) and "1" in str(info.value)


def test_error_types_keep_builtin_bases():
    assert issubclass(MissingKeyError, KeyError)
    assert issubclass(SchemaError, ValueError)
    assert issubclass(InvalidKeyError, ValueError)
    assert issubclass(ReadOnlyError, PermissionError)
    assert issubclass(StoreNotFoundError, FileNotFoundError)
    assert issubclass(BackendNotInstalledError, ImportError)
    assert str(MissingKeyError("key 'x' missing")) == "key 'x' missing"


_READ_ONLY_FOLDER = r'''
import subprocess, sys, torch, zstore
from tensordict import TensorDict
kind, path = sys.argv[1], sys.argv[2]
def rows(a, n):
    return TensorDict(obs=torch.arange(a, a + n).double()[:, None].expand(n, 4).clone(),
                      act=torch.arange(a, a + n), batch_size=[n])
def put(storage, a, n):
    index = list(range(a, a + n)) if kind == "cls" else torch.arange(a, a + n)
    storage.set(index, rows(a, n))
def refused(call):
    try:
        call()
    except PermissionError as exc:
        assert f"cannot write to the store {path}: permission denied on {path}/" in str(exc), exc
        assert f"chmod -R u+w {path}" in str(exc) and "mode='r'" in str(exc), exc
        return
    raise AssertionError("no PermissionError")
if kind == "cls":
    storage = zstore.CompressedListStorage(1000, scratch_dir=path)
else:
    storage = zstore.LazyMemmapStorage(1000, scratch_dir=path, codec=None if kind == "raw" else kind)
put(storage, 0, 10)
storage.flush()
subprocess.run(["chmod", "-R", "a-w", path], check=True)
put(storage, 10, 10)
refused(storage.flush)
reader = zstore.open(path, mode="r")
assert len(reader) == 10
refused(lambda: put(zstore.open(path, mode="r+"), 10, 1))
subprocess.run(["chmod", "-R", "u+w", path], check=True)
storage.flush()
reader = zstore.open(path, mode="r")
got = reader.get(list(range(20)) if kind == "cls" else torch.arange(20))
got = zstore.stack_items(got) if kind == "cls" else got
assert len(reader) == 20 and torch.equal(got["act"], torch.arange(20))
print("ok")
'''


@pytest.mark.parametrize("kind", ["raw", "zstd", "cls"])
def test_a_read_only_folder_is_refused_naming_it_and_the_fix_and_rows_wait(tmp_path, kind):
    """A local store whose folder turned read-only under its writer: the flush, and a writer
    opened on it, raise a PermissionError naming the folder, the file and the fix (it was a
    bare PermissionError on a temporary file, or torch's RuntimeError); readers read the
    commit, and the writer's rows land once the folder is writable again. Root ignores file
    modes, so as root the child runs without the capabilities that let it."""
    done = run_bound_by_file_modes("-c", _READ_ONLY_FOLDER, kind, str(tmp_path / "buffer"))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_BAD_ROWS = [{"chunks": 0}, {"chunks": -3}, {"chunks": {"obs": 0}}, {"chunks": 2.5}]


@pytest.mark.parametrize("cls, bad", [
    *((LazyMemmapStorage, bad) for bad in [*_BAD_ROWS, {"shards": 0}]),
    *((zstore.CompressedListStorage, bad) for bad in _BAD_ROWS)])
def test_rows_per_chunk_or_shard_below_one_are_refused_naming_the_argument(tmp_path, cls, bad):
    """chunks=0 or -3 were taken as 1-row chunks (one object per row), silently."""
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"{name}.*must be a whole number of at least 1"):
        cls(10, scratch_dir=str(tmp_path / "rb"), **bad)
    assert not (tmp_path / "rb").exists()



@pytest.mark.parametrize("bad", [{"cache_bytes": -1}, {"cache_bytes": "1X"},
                                 {"autocommit_seconds": -1}, {"autocommit_seconds": "soon"},
                                 {"autocommit_seconds": float("nan")}], ids=str)
@pytest.mark.parametrize("cls", [LazyMemmapStorage, zstore.CompressedListStorage],
                         ids=lambda cls: cls.__name__)
def test_a_negative_cache_budget_or_commit_interval_is_refused_naming_it(tmp_path, cls, bad):
    """``cache_bytes=-1`` was taken as no cache, ``autocommit_seconds=-1`` as commit at
    every write and ``nan`` as never, silently; by the constructor, by ``zstore.open``
    (where a ``CompressedListStorage`` called its own block "malformed") and by the setter.
    ``"1X"`` and ``"soon"`` raised Python's "invalid literal for int()" and "'>=' not
    supported"."""
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"^{name}\b.* >= 0"):
        cls(10, scratch_dir=str(tmp_path / "new"), **bad)
    assert not (tmp_path / "new").exists()
    storage = cls(10, scratch_dir=str(tmp_path / "rb"))
    storage.set(0, TensorDict(a=torch.ones(3)) if cls is zstore.CompressedListStorage
                else TensorDict(a=torch.ones(1, 3), batch_size=[1])[0])
    storage.close()
    with pytest.raises(ValueError, match=rf"^{name}\b.* >= 0"):
        zstore.open(str(tmp_path / "rb"), **bad)
    reopened = zstore.open(str(tmp_path / "rb"))  # (the refused open held no lease)
    if name == "autocommit_seconds":
        with pytest.raises(ValueError, match=rf"^{name} must be"):
            reopened.autocommit_seconds = bad[name]
        assert reopened.autocommit_seconds == 5.0
    assert len(reopened) == 1
    reopened.close()


@pytest.mark.parametrize("name", ["LazyMemmapStorage", "LazyTensorStorage"])
def test_a_capacity_is_taken_as_torchrl_takes_it_and_a_wrong_argument_is_named(tmp_path, name):
    """``max_size="10"`` (a capacity read from a config file) works with TorchRL's storages
    and raised "'<' not supported between 'str' and 'int'" with zstore's; ``ndim="2"``
    raised Python's error at the first write (TorchRL's too), ``ndim=0`` a capacity error,
    ``scratch_dir=5`` "expected str, bytes or os.PathLike object"."""
    torchrl_data = pytest.importorskip("torchrl.data")
    import zstore.torchrl

    rows = TensorDict(obs=torch.arange(6.0).reshape(3, 2), batch_size=[3])
    made = {}
    for lib in (torchrl_data, zstore.torchrl):
        storage = getattr(lib, name)("10")
        storage.set(torch.arange(3), rows)
        made[lib] = storage
    assert made[zstore.torchrl].max_size == made[torchrl_data].max_size == 10
    ours, theirs = (made[lib].get(torch.arange(3)) for lib in (zstore.torchrl, torchrl_data))
    assert (ours == theirs).all()
    with pytest.raises(ValueError, match=rf"^{name}: max_size='ten' is not a number of cells; "
                                         rf"give the capacity as a whole number"):
        getattr(zstore.torchrl, name)("ten")
    with pytest.raises(ValueError, match=rf"^{name}: max_size=inf is not a number of cells"):
        getattr(zstore.torchrl, name)(float("inf"))
    assert getattr(zstore.torchrl, name)(10, ndim=np.int64(2)).ndim == 2
    for ndim in ("2", 0, 1.5, True):
        with pytest.raises(ValueError, match=rf"^{name}: ndim={ndim!r}: give the number of "
                                             rf"leading dimensions .* >= 1"):
            getattr(zstore.torchrl, name)(10, ndim=ndim)
    if name == "LazyMemmapStorage":
        with pytest.raises(zstore.InvalidURLError, match="must be a non-empty string or path, "
                                                         "got 5$"):
            LazyMemmapStorage(10, scratch_dir=5)


@pytest.mark.parametrize("size,budget", [("512MB", 512 * 10**6), ("4 GiB", 4 << 30),
                                         ("2.5kib", 2560), ("1000", 1000), (1e6, 10**6)])
def test_a_cache_budget_may_be_written_as_a_size(tmp_path, size, budget):
    """``cache_bytes="4GiB"`` raised "invalid literal for int()"; sizes with decimal (``MB``)
    or binary (``MiB``) units are read as such, by every constructor and ``zstore.open``."""
    storage = LazyMemmapStorage(10, scratch_dir=str(tmp_path / "rb"), cache_bytes=size)
    assert storage.cache_bytes == budget
    storage.set(0, TensorDict(obs=torch.ones(1, 2), batch_size=[1])[0])
    storage.close()
    assert zstore.open(str(tmp_path / "rb"), cache_bytes=size).cache_bytes == budget
    assert zstore.CompressedListStorage(10, cache_bytes=size).cache_bytes == budget

_UNREADABLE_STORE = r'''
import os, sys, torch, zstore
from tensordict import TensorDict
path = sys.argv[1]
storage = zstore.LazyMemmapStorage(10, scratch_dir=path, codec="zstd")
storage.set(torch.arange(3), TensorDict(obs=torch.zeros(3, 2), batch_size=[3]))
storage.close()
os.chmod(f"{path}/zarr.json", 0)
try:
    zstore.open(path, mode="r")
except PermissionError as exc:
    text = str(exc)
    assert text == (f"cannot read {path}: permission denied on {path}/zarr.json; check the "
                    f"permissions of {path} and of the files in it"), text
    print("ok")
'''


def test_an_unreadable_local_store_is_named_with_a_fix_for_files_not_credentials(tmp_path):
    """A local file the OS refused was worded as an S3 refusal ("check storage_options key=
    and secret= ... and the bucket's policy")."""
    done = run_bound_by_file_modes("-c", _UNREADABLE_STORE, str(tmp_path / "buffer"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_file_given_as_a_new_buffer_s_location_is_named(tmp_path):
    """A write to LazyMemmapStorage(scratch_dir=FILE) raised a bare "[Errno 17] File exists"
    (taking the lease made the folder); the file is left as it was."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    storage = LazyMemmapStorage(10, scratch_dir=str(file))
    with pytest.raises(NotAZStoreError, match=f"^{file} is a file; a zstore buffer or dataset is a directory$"):
        storage.set(torch.arange(2), batch(2))
    with pytest.raises(NotAZStoreError, match="is a file"):
        zstore.CompressedListStorage(10, scratch_dir=str(file))
    assert file.read_text() == "mine"


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "CompressedListStorage"])
def test_a_location_under_a_file_is_named_with_the_file(tmp_path, kind):
    """A new buffer at ``FILE/rb`` (or deeper) raised the OS's bare "[Errno 20] Not a
    directory", naming the location but not the file in its way."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for url in (file / "rb", file / "runs" / "rb"):
        storage = getattr(zstore, kind)(10, scratch_dir=str(url))
        with pytest.raises(NotAZStoreError, match=f"^cannot create a buffer at {url}: {file} is a "
                                                  "file, not a folder; choose a location inside"):
            storage.set(0, TensorDict(obs=torch.zeros(3)))
            storage.flush()
    assert file.read_text() == "mine"


@pytest.mark.s3
def test_an_https_endpoint_on_a_plain_http_server_is_named_with_the_fix(s3_options):
    """Through s3fs it raised a bare ``OSError`` ("wrong version number") naming no fix.
    (obstore's error says only "error sending request": it reads as an unreachable server,
    whose message names the endpoint to check.)"""
    url = "s3://zstore-tests/tls"
    options = dict(s3_options, transport="fsspec",
                   endpoint_url=s3_options["endpoint_url"].replace("http://", "https://"),
                   config_kwargs={"retries": {"max_attempts": 1}})
    with pytest.raises(ConnectionError) as info:
        zstore.open(url, options, mode="r")
    message = str(info.value)
    assert url in message and "speaks plain HTTP fails so (write http://)" in message, message


def test_a_dtype_or_shape_refusal_names_the_key_s_path_and_the_fix(location):
    """Before: "key ('nest', 'c'): dtype torch.int64 does not match the buffer's
    torch.float32", naming no fix (LazyTensorStorage's says to cast first)."""
    storage = LazyMemmapStorage(8, scratch_dir=location.new(), storage_options=location.options)
    first = TensorDict(nest=TensorDict(c=torch.zeros(2, 3), batch_size=[2]), batch_size=[2])
    storage.set(torch.arange(2), first)
    with pytest.raises(SchemaError, match=r"key 'nest/c': dtype torch.int64 .* cast the data "
                                          r"first, e.g. data.to\(torch.float32\); nothing"):
        storage.set(torch.arange(2, 4), first.to(torch.int64))
    with pytest.raises(SchemaError, match=r"key 'nest/c': shape \(2, 4\) .*\('N', 3\).* "
                                          r"reshape the data"):
        storage.set(torch.arange(2, 4), TensorDict(
            nest=TensorDict(c=torch.zeros(2, 4), batch_size=[2]), batch_size=[2]))
    assert len(storage) == 2
    storage.close()


def test_a_url_one_slash_short_is_refused_naming_the_url_it_means(tmp_path, monkeypatch):
    """``s3:/bucket/rb`` (and ``memory:/x``) were local paths: a folder ``s3:`` was written in
    the working directory and the S3 storage options were ignored, without a word."""
    monkeypatch.chdir(tmp_path)
    for url, meant in (("s3:/my-bucket/run-1/rb", "s3://my-bucket/run-1/rb"),
                       ("memory:/x", "memory://x")):
        with pytest.raises(zstore.InvalidURLError, match=f"one slash short.*'{meant}'"):
            LazyMemmapStorage(10, scratch_dir=url).set(torch.arange(2), batch(2))
        with pytest.raises(zstore.InvalidURLError, match=f"'{meant}'"):
            zstore.open(url)
    assert list(tmp_path.iterdir()) == []
    storage = LazyMemmapStorage(10, scratch_dir=f"file:{tmp_path}/rb")  # RFC 8089's form
    storage.set(torch.arange(2), batch(2))
    assert storage.scratch_dir == str(tmp_path / "rb") and (tmp_path / "rb").is_dir()
    assert zstore.StoreSpec.parse("file://rel/rb").url == str(tmp_path / "rel" / "rb")
    assert zstore.StoreSpec.parse(f"local:{tmp_path}/rb").url == str(tmp_path / "rb")
    for url in ("file://", "local://"):  # (were the working directory, or a remote store)
        with pytest.raises(zstore.InvalidURLError, match=rf"'{url}' names no location: write it "
                                                         rf"as {url}/PATH"):
            zstore.StoreSpec.parse(url)


def test_storage_options_given_a_mode_name_the_keyword(tmp_path):
    """``zstore.open(url, "r")`` (as ``builtins.open``) raised "dictionary update sequence
    element #0 has length 1; 2 is required", naming nothing."""
    with pytest.raises(TypeError, match=rf"storage_options of '{tmp_path}' must be a mapping.*"
                                        r"write mode='r'"):
        zstore.open(str(tmp_path), "r")


@pytest.mark.parametrize("held", ["array", "damaged"])
def test_a_new_buffer_where_zarr_metadata_cannot_be_a_group_is_refused_naming_it(tmp_path, held):
    """A scratch_dir holding one Zarr array (a key's column of another buffer) or a damaged
    zarr.json raised zarr's ContainsArrayError, or json's JSONDecodeError naming no path, at
    the first write; the location is left as it was."""
    url = tmp_path / "rb"
    if held == "array":
        zarr.create_array(str(url), shape=(4,), dtype="float32")
    else:
        url.mkdir()
        (url / "zarr.json").write_text("{not json")
    before = {p: p.read_bytes() for p in url.rglob("*") if p.is_file()}
    why = "it holds one Zarr array" if held == "array" else "its zarr.json is not valid JSON"
    for existsok in (False, True):
        with pytest.raises(NotAZStoreError, match=f"^{url} is not a zstore buffer: {why}"):
            LazyMemmapStorage(10, scratch_dir=str(url), existsok=existsok).set(
                torch.arange(2), batch(2))
    assert {p: p.read_bytes() for p in url.rglob("*") if p.is_file()} == before


def test_an_hdf5_file_opened_as_a_dataset_names_the_importer(tmp_path):
    """``open_dataset("hopper-medium-v2.hdf5")`` said "a zstore buffer is a directory" and
    nothing of the import a D4RL file needs."""
    path = tmp_path / "hopper-medium-v2.hdf5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n")
    for opener in (zstore.open_dataset, zstore.open):
        with pytest.raises(NotAZStoreError, match=r"is a file.*D4RL.*import_d4rl\(.*"
                                                  r"zstore import d4rl"):
            opener(str(path))
    with pytest.raises(NotAZStoreError, match=r"is a file; a zstore buffer or dataset is a "
                                              r"directory$"):  # a write: no importer to name
        LazyMemmapStorage(10, scratch_dir=str(path)).set(torch.arange(2), batch(2))


def test_a_compression_level_out_of_range_names_the_argument():
    """``CompressedListStorage(compression_level=99)`` named an internal codec string
    (``'zstd:99+crc32c'``), not the argument."""
    for level, why in ((99, "must be from -131072 to 22"), ("high", "must be an integer")):
        with pytest.raises(ValueError, match=rf"^compression_level={level!r}: codec level {why}$"):
            zstore.CompressedListStorage(10, compression_level=level)
    assert zstore.CompressedListStorage(10, codec="lz4", compression_level=99).max_size == 10


def test_a_failed_request_of_a_reader_that_fetches_nothing_again_names_it():
    """A body damaged in transfer, met by a checkpoint's or a TorchRL save's read (which
    fetch nothing again), was raised as botocore's bare error, naming no object; a chunk
    read fetches it again (None here: not the request's failure)."""
    from zstore.credentials import request_error

    damaged = type("FlexibleChecksumError", (Exception,), {"__module__": "botocore.exceptions"})
    for exc in (damaged("checksum mismatch"), OSError("no errno"), RuntimeError("client")):
        error = request_error(exc, "s3://b/ck", "cannot read x of s3://b/ck", "load it again")
        assert isinstance(error, ConnectionError) and error.__cause__ is exc
        assert str(error).startswith("cannot read x of s3://b/ck: the request failed")
    assert request_error(damaged("mismatch"), "s3://b/rb", "chunk 3", "", refetched=True) is None
    assert request_error(OSError(5, "503"), "s3://b/rb", "chunk 3", "", refetched=True) is not None
    for local in (PermissionError(13, "Permission denied", "/ck/x"), OSError(5, "I/O error")):
        assert request_error(local, "/ck", "cannot read x of /ck", "", remote=False) is None


def test_a_read_timeout_rebuilt_for_the_message_names_the_store():
    """botocore's ``ReadTimeoutError`` (a server that takes connections and never answers) is
    an ``OSError`` whose constructor formats keyword arguments: rebuilding it with a message
    raised a bare ``KeyError: 'endpoint_url'`` in place of the error naming the store."""
    from botocore.exceptions import ReadTimeoutError

    from zstore.group import store_io_error

    error = store_io_error("cannot read", ReadTimeoutError(endpoint_url="http://127.0.0.1:9/b"),
                           "s3://b/rb")
    assert isinstance(error, OSError) and str(error).startswith(
        "cannot read s3://b/rb: ReadTimeoutError: Read timeout on endpoint URL")
