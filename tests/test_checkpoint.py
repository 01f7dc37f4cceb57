"""Checkpointers: round trips on memory://, local and S3, TED compaction, incremental dumps.

The reference is the storage's own content before the dump (and TorchRL where
TorchRL is right): after ``loads`` a fresh storage must hold the same rows
bit for bit, with the same length, capacity and write cursor.
"""

from __future__ import annotations

import copy
import faulthandler
import math
import os
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import checkpoint
import zstore
from checkpoint import (
    CheckpointError,
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    NestedStorageCheckpointer,
    TensorStorageCheckpointer,
)
from zstore import LazyMemmapStorage, LazyTensorStorage, RoundRobinWriter, StoreSpec

CHECKPOINTERS = {
    "tensor": lambda: TensorStorageCheckpointer(chunks=8),
    "flat": FlatStorageCheckpointer,
    "nested": NestedStorageCheckpointer,
    "h5": H5StorageCheckpointer,
}


class TEDStream:
    """Transitions of ``lanes`` parallel envs in TED layout, continuous across batches.

    Episodes end at random (terminated or truncated); ``("next", "obs")`` at t
    equals ``obs`` at t + 1 inside an episode, as a collector writes them.
    """

    def __init__(self, lanes: tuple[int, ...] = (), seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.lanes = lanes
        self.obs = torch.randn((*lanes, 3), generator=self.g)

    def batch(self, n: int) -> TensorDict:
        lanes = self.lanes
        obs, nxt = [], []
        done = torch.rand((n, *lanes, 1), generator=self.g) < 0.2
        trunc = done & (torch.rand((n, *lanes, 1), generator=self.g) < 0.5)
        for t in range(n):
            obs.append(self.obs)
            step = self.obs + torch.randn(self.obs.shape, generator=self.g)
            nxt.append(step)
            reset = torch.randn(self.obs.shape, generator=self.g)
            self.obs = torch.where(done[t], reset, step)
        zeros = torch.zeros((n, *lanes, 1), dtype=torch.bool)
        return TensorDict(
            obs=torch.stack(obs), action=torch.randint(0, 9, (n, *lanes, 2), generator=self.g),
            done=zeros, terminated=zeros.clone(), truncated=zeros.clone(),
            next=TensorDict(obs=torch.stack(nxt), done=done, terminated=done & ~trunc,
                            truncated=trunc, reward=torch.randn((n, *lanes, 1), generator=self.g),
                            batch_size=[n, *lanes]),
            batch_size=[n, *lanes])


def assert_same(a, b) -> None:
    """Same keys, and every leaf bit-for-bit equal."""
    ka = set(a.keys(include_nested=True, leaves_only=True))
    kb = set(b.keys(include_nested=True, leaves_only=True))
    assert ka == kb, (ka ^ kb)
    for key in ka:
        x, y = a.get(key), b.get(key)
        assert x.shape == y.shape and x.dtype == y.dtype, key
        assert torch.equal(_bytes(x), _bytes(y)), key


def _bytes(x: torch.Tensor) -> torch.Tensor:
    flat = x.contiguous().reshape(-1)
    return flat if flat.dtype == torch.bool else flat.view(torch.uint8)


def fill(storage, case: str, stream: TEDStream) -> None:
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    sizes = {"partial": [5, 4], "full": [7, 6, 9], "exact": [12]}[case]
    for n in sizes:
        writer.extend(stream.batch(n))


def spec(location, name: str) -> StoreSpec:
    return StoreSpec.parse(location.new(name), location.options)


# every checkpointer x storage x case on local disk; a cross-section on memory:// and S3
MATRIX = (
    [("local", c, k, case) for c in CHECKPOINTERS for k in ("lazy", "memmap")
     for case in ("partial", "full", "exact", "ndim2")]
    + [("memory", c, "memmap", case) for c in CHECKPOINTERS for case in ("partial", "ndim2")]
    + [("s3", c, k, case) for c in CHECKPOINTERS for k, case in (("memmap", "full"), ("lazy", "ndim2"))]
)


@pytest.mark.parametrize(("location", "ckpt", "kind", "case"), MATRIX, indirect=["location"])
def test_round_trip(location, ckpt, kind, case):
    ndim, lanes = (2, (3,)) if case == "ndim2" else (1, ())
    capacity = 12 * math.prod(lanes)

    def fresh():
        return LazyTensorStorage(capacity, ndim=ndim) if kind == "lazy" else \
            location.memmap(capacity, ndim=ndim, codec="zstd", chunks=8)

    source = fresh()
    source.checkpointer = CHECKPOINTERS[ckpt]()
    fill(source, "full" if case == "ndim2" else case, TEDStream(lanes, seed=len(case)))
    dest = spec(location, f"ck-{ckpt}")
    source.dumps(dest)
    target = fresh()  # not initialised
    target.checkpointer = CHECKPOINTERS[ckpt]()
    target.loads(dest)
    assert (len(target), target.max_size, target.shape) == (len(source), source.max_size, source.shape)
    assert target._last_cursor_index == source._last_cursor_index
    assert_same(target.get(slice(None)), source.get(slice(None)))
    # keep writing after the reload, then dump and load again (TorchRL crashes on a full one)
    writer = RoundRobinWriter()
    writer.register_storage(target)
    writer._cursor = (target._last_cursor_index + 1) % target._max_size_along_dim0()
    writer.extend(TEDStream(lanes, seed=99).batch(3))
    target.dumps(dest)
    again = fresh()
    again.checkpointer = CHECKPOINTERS[ckpt]()
    again.loads(dest)
    assert len(again) == len(target) and again._last_cursor_index == target._last_cursor_index
    assert_same(again.get(slice(None)), target.get(slice(None)))


@pytest.mark.parametrize("record, refusal", [
    ({"format_version": 0}, "no valid format_version \\(got 0\\)"),
    ({"format_version": -3}, "no valid format_version"),
    ({"format_version": True}, "no valid format_version \\(got True\\)"),
    ({"format_version": "1"}, "no valid format_version"),
    ({"format_version": 2}, "format 2 is not readable.*pip install -U zstore"),
    ("not a record", "malformed: zstore_checkpoint is not an object"),
], ids=["zero", "negative", "bool", "string", "newer", "not an object"])
def test_a_commit_record_without_a_valid_version_is_refused_naming_the_fault(location, record,
                                                                             refusal):
    """Before: versions 0, -3 and true loaded as 1; a record that is not an object was called
    "an incomplete checkpoint: a dump was interrupted"; a newer format named no fix."""
    import json

    source = LazyTensorStorage(10)
    source.set(torch.arange(5), TensorDict(x=torch.arange(5), batch_size=[5]))
    url = location.new("ck")
    source.dumps(StoreSpec.parse(url, location.options))
    fs, root = StoreSpec.parse(url, location.options).filesystem()
    doc = json.loads(fs.cat_file(f"{root}/zarr.json"))
    held = doc["attributes"]["zstore_checkpoint"]
    doc["attributes"]["zstore_checkpoint"] = {**held, **record} if isinstance(record, dict) else record
    fs.pipe_file(f"{root}/zarr.json", json.dumps(doc).encode())
    target = LazyTensorStorage(10)
    with pytest.raises(CheckpointError, match=refusal) as info:
        target.loads(StoreSpec.parse(url, location.options))
    assert url.split("://")[-1] in str(info.value) and len(target) == 0


def test_tensor_and_pytree_storages(location):
    for data in (torch.arange(24.0).reshape(12, 2),
                 {"a": torch.arange(12), "b": (torch.ones(12, 2), torch.zeros(12, dtype=torch.bool))}):
        source = LazyTensorStorage(20)
        source.set(torch.arange(12), data)
        dest = spec(location, "pytree")
        source.dumps(dest)
        target = LazyTensorStorage(20)
        target.loads(dest)
        assert len(target) == 12
        got, want = target.get(slice(None)), source.get(slice(None))
        for x, y in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert torch.equal(x, y)
    full = zstore.TensorStorage(torch.arange(10))
    full.dumps(dest)
    back = LazyTensorStorage(10)
    back.loads(dest)
    assert torch.equal(back.get(slice(None)), torch.arange(10)) and len(back) == 10


def test_checkpoint_is_a_zstore_buffer(tmp_path):
    source = LazyTensorStorage(100)
    source.checkpointer = TensorStorageCheckpointer(chunks=8)
    fill(source, "partial", TEDStream())
    source.dumps(tmp_path / "ck")
    record = checkpoint._dest.Destination(StoreSpec.parse(tmp_path / "ck")).read_commit()
    opened = zstore.open(tmp_path / "ck" / record["generation"], mode="r")
    assert len(opened) == 9 and opened.max_size == 100 and opened._last_cursor_index == 8
    assert_same(opened.get(slice(None)), source.get(slice(None)))
    # only the filled rows were written: chunks 0 and 1 (rows 0-15), none of the other 11;
    # their keys use "." (every chunk of an array in the array's own directory)
    array = tmp_path / "ck" / record["generation"] / "obs"
    assert sorted(p.name for p in array.iterdir()) == ["c.0.0", "c.1.0", "zarr.json"]


# -- TED compaction: where TorchRL loses data, zstore does not -------------------------------

def awkward_ted(n: int = 10) -> TensorDict:
    data = TEDStream(seed=3).batch(n)
    data["done"][4] = True                       # a root-level done flag
    data["next", "obs"][6] += 1.0                # ("next", obs) != next obs (multi-step transform)
    data["next", "info"] = torch.arange(n, dtype=torch.float32)[:, None]   # next-only key
    data["next", "obs"][2, 0] = float("nan")     # NaNs compare bitwise
    return data


@pytest.mark.parametrize("ckpt", ["flat", "nested", "h5"])
def test_ted_compaction_is_lossless(tmp_path, ckpt):
    source = LazyTensorStorage(16)
    source.checkpointer = CHECKPOINTERS[ckpt]()
    source.set(torch.arange(10), awkward_ted())
    source.dumps(tmp_path / "ck")
    target = LazyTensorStorage(16)
    target.checkpointer = CHECKPOINTERS[ckpt]()
    target.loads(tmp_path / "ck")
    assert_same(target.get(slice(None)), source.get(slice(None)))


def test_hooks_match_torchrl_where_torchrl_is_right():
    """On plain TED data (its assumptions hold), the TED hooks restore what TorchRL's do."""
    pytest.importorskip("torchrl")
    import warnings

    from torchrl.data.replay_buffers.utils import Flat2TED as TFlat2TED
    from torchrl.data.replay_buffers.utils import TED2Flat as TTED2Flat

    chrono = TEDStream(seed=5).batch(12)
    data = torch.cat([chrono[7:], chrono[:7]], 0)  # a wrapped ring: row 5 is the oldest
    save = checkpoint.TED2Flat()
    save.shift, save.is_full = 5, True
    ours = checkpoint.Flat2TED()(save(data))
    theirs_save = TTED2Flat()
    theirs_save.shift, theirs_save.is_full = 5, True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = TFlat2TED()(theirs_save(data.clone()), out=None)
    assert_same(ours, data)
    assert_same(ours.exclude("done", "terminated", "truncated"),
                theirs.exclude("done", "terminated", "truncated").to_tensordict())


def test_h5_compression_and_file_destination(tmp_path):
    source = LazyTensorStorage(64)
    source.checkpointer = H5StorageCheckpointer(h5_kwargs={"compression": "gzip"})
    fill(source, "partial", TEDStream())
    source.dumps(tmp_path / "buffer.h5")
    assert (tmp_path / "buffer.h5").is_file()
    target = LazyTensorStorage(64)
    target.checkpointer = H5StorageCheckpointer()
    target.loads(tmp_path / "buffer.h5")
    assert_same(target.get(slice(None)), source.get(slice(None)))


@pytest.mark.parametrize("shift,is_full", [(5, True), (9, False)], ids=["wrapped", "partial"])
@pytest.mark.parametrize("lanes", [(), (2,)], ids=["ndim1", "ndim2"])
def test_h5_split_and_combine_hooks_round_trip_ted_rows(shift, is_full, lanes):
    """The public hooks chained as H5StorageCheckpointer chains TorchRL's: TED2Nested then
    H5Split to save, H5Combine then Nested2TED to load, give back the TED rows."""
    chrono = TEDStream(lanes=lanes, seed=6).batch(12)
    data = torch.cat([chrono[12 - shift:], chrono[:12 - shift]], 0) if is_full else chrono
    save_nested, split = checkpoint.TED2Nested(), checkpoint.H5Split()
    save_nested.shift, save_nested.is_full = shift, is_full
    segmented = split(save_nested(data))
    assert any(key.startswith("traj_") for key in segmented.keys())
    restored = checkpoint.Nested2TED()(checkpoint.H5Combine()(segmented))
    rows = len(data) if is_full else shift  # a partial buffer's later rows were never written
    assert_same(restored[:rows], data[:rows])


# -- incremental dumps -------------------------------------------------------------------------

def _record(dest):
    return checkpoint._dest.Destination(dest).read_commit()


def test_incremental_dump_writes_only_changed_chunks(location):
    source = location.memmap(400)
    source.checkpointer = TensorStorageCheckpointer(chunks=16)
    writer = RoundRobinWriter()
    writer.register_storage(source)
    stream = TEDStream(seed=1)
    keys = ["obs", ("next", "obs"), ("next", "done")]
    writer.extend(stream.batch(320).select(*keys))
    dest = spec(location, "inc")
    source.dumps(dest)
    full = _record(dest)
    assert not full["incremental"]
    writer.extend(stream.batch(4).select(*keys))  # 4 new rows: one chunk per key changes
    source.dumps(dest)
    inc = _record(dest)
    assert inc["incremental"] and inc["generation"] != full["generation"]
    assert inc["bytes_written"] * 20 <= full["bytes_written"]  # one 16-row chunk of 320 rows
    target = LazyTensorStorage(400)
    target.loads(dest)
    assert_same(target.get(slice(None)), source.get(slice(None)))
    checkpoint._dest.settle()                     # old generations are deleted in the background
    assert len(checkpoint._dest.Destination(dest).children()) == 2  # zarr.json + one generation
    # the loaded storage dumps incrementally too
    target[3] = stream.batch(1)[0].select(*keys)  # an in-place overwrite (length unchanged)
    target.dumps(dest)
    assert _record(dest)["incremental"]
    again = LazyTensorStorage(400)
    again.loads(dest)
    assert_same(again.get(slice(None)), target.get(slice(None)))


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_storage_dumps_the_single_rows_it_wrote_since(tmp_path, copy_of):
    """add()'s hot path stamps a row's revision through a NumPy view of the revisions; a
    copy of the storage must stamp its own, or its incremental dump skips the row."""
    source = LazyTensorStorage(64)
    source.checkpointer = TensorStorageCheckpointer(chunks=16)
    stream = TEDStream(seed=2)
    source.set(torch.arange(32), stream.batch(32).select("obs"))
    source.dumps(tmp_path / "ckpt")
    copied = copy_of(source)
    copied[3] = stream.batch(1)[0].select("obs")  # one row in place, by an int cursor
    copied.dumps(tmp_path / "ckpt")
    assert _record(StoreSpec.parse(str(tmp_path / "ckpt")))["incremental"]
    target = LazyTensorStorage(64)
    target.loads(tmp_path / "ckpt")
    assert_same(target.get(slice(None)), copied.get(slice(None)))


def test_interrupted_incremental_dump_leaves_the_previous_checkpoint_intact(location, monkeypatch):
    """The new generation's metadata is carried over from the previous one; staging and
    committing it (up to the commit record) must not touch the previous generation."""
    stream = TEDStream(seed=3)
    storage = LazyTensorStorage(64)
    storage.checkpointer = TensorStorageCheckpointer(chunks=8)
    storage.set(torch.arange(40), stream.batch(40))
    dest = spec(location, "intact")
    storage.dumps(dest)
    before = storage.get(slice(None)).clone()
    storage.set(torch.arange(40, 44), stream.batch(4))

    def interrupt(point: str) -> None:
        if point == "commit":
            raise KeyboardInterrupt("stopped before the commit record")

    monkeypatch.setattr(checkpoint._dest, "_FAULT", interrupt)
    with pytest.raises(KeyboardInterrupt):
        storage.dumps(dest)
    monkeypatch.setattr(checkpoint._dest, "_FAULT", None)
    back = LazyTensorStorage(64)
    back.loads(dest)
    assert len(back) == 40 and back._last_cursor_index == 39
    assert_same(back.get(slice(None)), before)
    storage.dumps(dest)                       # the next dump commits everything
    again = LazyTensorStorage(64)
    again.loads(dest)
    assert len(again) == 44
    assert_same(again.get(slice(None)), storage.get(slice(None)))


def test_incremental_dump_falls_back_when_the_previous_generation_is_damaged(tmp_path):
    stream = TEDStream(seed=4)
    storage = LazyTensorStorage(64)
    storage.set(torch.arange(64), stream.batch(64))
    dest = StoreSpec.parse(tmp_path / "ck")
    storage.dumps(dest)
    (tmp_path / "ck" / _record(dest)["generation"] / "obs" / "zarr.json").unlink()
    storage.set(0, stream.batch(1)[0])
    storage.dumps(dest)
    assert not _record(dest)["incremental"]
    back = LazyTensorStorage(64)
    back.loads(dest)
    assert_same(back.get(slice(None)), storage.get(slice(None)))


def test_incremental_dump_reads_a_previous_generation_it_does_not_remember(tmp_path):
    """Another process (or an evicted memo): the previous generation is read from the store."""
    stream = TEDStream(seed=5)
    storage = LazyTensorStorage(64)
    storage.checkpointer = TensorStorageCheckpointer(chunks=8)
    storage.set(torch.arange(64), stream.batch(64))
    dest = StoreSpec.parse(tmp_path / "ck")
    storage.dumps(dest)
    checkpoint._buffer._KNOWN.clear()
    storage.set(9, stream.batch(1)[0])
    result = storage.dumps(dest)
    assert result.incremental and result.bytes_written == 8 * storage_row_bytes(storage)
    back = LazyTensorStorage(64)
    back.loads(dest)
    assert_same(back.get(slice(None)), storage.get(slice(None)))


def storage_row_bytes(storage) -> int:
    return sum(v[0].numel() * v.element_size() for v in storage.get(slice(None)).values(True, True))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_dumps_and_loads_work_in_a_forked_child(tmp_path):
    """The checkpoint I/O thread pool of the parent does not exist in a forked child (a
    DataLoader worker, a collector): the child must start its own, not wait forever."""
    values = torch.randn(5000, 300)  # 10 chunks of 512 rows: written on the I/O threads
    storage = LazyTensorStorage(5000)
    storage.set(torch.arange(5000), values)
    storage.dumps(tmp_path / "parent")  # starts the pool in this process
    pid = os.fork()
    if pid == 0:  # the child: exit 0 on success; killed by faulthandler if it hangs
        code = 1
        try:
            faulthandler.dump_traceback_later(120, exit=True)
            storage.dumps(tmp_path / "child")
            back = LazyTensorStorage(5000)
            back.loads(tmp_path / "child")
            code = 0 if np.array_equal(back.get(slice(None)).numpy(), values.numpy()) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_incremental_never_trusts_another_writers_generation(tmp_path):
    stream = TEDStream(seed=2)
    a, b = LazyTensorStorage(64), LazyTensorStorage(64)
    a.set(torch.arange(64), stream.batch(64))
    b.set(torch.arange(64), stream.batch(64))
    a.dumps(tmp_path / "ck")
    b.dumps(tmp_path / "ck")          # another storage's generation is now current
    a.set(0, stream.batch(1)[0])
    a.dumps(tmp_path / "ck")          # must be a full dump, not a patch of b's rows
    assert not _record(StoreSpec.parse(tmp_path / "ck"))["incremental"]
    back = LazyTensorStorage(64)
    back.loads(tmp_path / "ck")
    assert_same(back.get(slice(None)), a.get(slice(None)))


def test_memmap_storage_on_its_own_store(tmp_path):
    url = str(tmp_path / "rb")
    storage = LazyMemmapStorage(50, scratch_dir=url, autocommit_seconds=1e9)
    storage.set(torch.arange(10), TEDStream().batch(10))
    assert len(zstore.open(url, mode="r")) == 0    # not committed yet
    storage.dumps(url)                             # a dump onto its own store is a commit
    assert len(zstore.open(url, mode="r")) == 10
    adopted = LazyMemmapStorage(50, scratch_dir=url)
    adopted.loads(url)                             # adopts the store in place
    assert len(adopted) == 10 and adopted._last_cursor_index == 9
    assert_same(adopted.get(slice(None)), storage.get(slice(None)))


# -- errors --------------------------------------------------------------------------------

def test_a_load_with_the_wrong_checkpointer_or_bucket_names_what_is_there(tmp_path, s3_options):
    """Before: "... was written without save hooks; this checkpointer has load hooks", "no
    H5 checkpoint at ...", and "no checkpoint at s3://..." for a bucket that does not exist,
    none of them naming what the location holds or lacks."""
    source = LazyTensorStorage(10)
    source.set(torch.arange(3), TEDStream().batch(3))
    source.dumps(tmp_path / "ck")  # a TensorStorageCheckpointer checkpoint
    for other in (checkpoint.FlatStorageCheckpointer(), checkpoint.NestedStorageCheckpointer()):
        target = LazyTensorStorage(10)
        target.checkpointer = other
        with pytest.raises(CheckpointError, match=f"holds a TensorStorageCheckpointer checkpoint "
                                                  f".* this {type(other).__name__} .* load it "
                                                  "with a TensorStorageCheckpointer"):
            target.loads(tmp_path / "ck")
    target = LazyTensorStorage(10)
    target.checkpointer = H5StorageCheckpointer()
    with pytest.raises(CheckpointError, match="no H5 checkpoint at .*; .* holds a "
                                              "TensorStorageCheckpointer checkpoint: load it"):
        target.loads(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="no checkpoint at s3://zstore-no-such-bucket/ck.*: "
                                              "its bucket does not exist"):
        LazyTensorStorage(10).loads(StoreSpec.parse("s3://zstore-no-such-bucket/ck", s3_options))


def test_errors_name_the_location(tmp_path):
    with pytest.raises(RuntimeError, match="non-initialized"):
        LazyTensorStorage(10).dumps(tmp_path / "a")
    with pytest.raises(CheckpointError, match="no checkpoint at .*nothing"):
        LazyTensorStorage(10).loads(tmp_path / "nothing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    source = LazyTensorStorage(10)
    source.set(torch.arange(3), TEDStream().batch(3))
    with pytest.raises(CheckpointError, match="other files"):
        source.dumps(tmp_path / "other")
    source.dumps(tmp_path / "ck")
    small = LazyTensorStorage(8)
    with pytest.raises(CheckpointError, match="max_size=10"):
        small.loads(tmp_path / "ck")
    with pytest.raises(NotImplementedError, match="ListStorage"):
        zstore.ListStorage(4).dumps(tmp_path / "list")
    for wrong in (LazyMemmapStorage(10, scratch_dir=str(tmp_path / "wrong")), LazyTensorStorage(10)):
        wrong.set(0, TensorDict(other=torch.zeros(1), batch_size=[]))
        with pytest.raises(CheckpointError, match="only in this storage: 'other'.*: load it into "
                                                  "a new storage of the same max_size"):
            wrong.loads(tmp_path / "ck")
        assert len(wrong) == 1 and wrong.get(0)["other"].item() == 0  # unchanged


def test_a_load_into_other_columns_names_each_difference(tmp_path):
    """A checkpoint whose column has another dtype or shape than the storage's named the
    key but neither side's dtype and shape, nor the way on; a storage of plain tensors was
    named by its internal array name."""
    source = LazyTensorStorage(10)
    source.set(torch.arange(6), TensorDict(obs=torch.randn(6, 3), batch_size=[6]))
    where = tmp_path / "ck"
    source.dumps(where)
    for data, difference in (
            (TensorDict(obs=torch.zeros(2, 3, dtype=torch.float64), batch_size=[2]),
             r"'obs' is float32 of shape \(3,\) in the checkpoint, float64 of shape \(3,\) in "
             "this storage"),
            (TensorDict(obs=torch.zeros(2, 4), batch_size=[2]),
             r"'obs' is float32 of shape \(3,\) in the checkpoint, float32 of shape \(4,\)"),
            (torch.zeros(2, 3), r"only in the checkpoint: 'obs'; only in this storage: the "
                                r"tensors \(a storage of plain tensors\)")):
        wrong = LazyTensorStorage(10)
        wrong.set(torch.arange(2), data)
        with pytest.raises(CheckpointError, match=difference + ".*new storage of the same max_size"):
            wrong.loads(where)
        assert len(wrong) == 2  # unchanged
    fresh = LazyTensorStorage(10)  # the way on the error names
    fresh.loads(where)
    assert torch.equal(fresh.get(torch.arange(6))["obs"], source.get(torch.arange(6))["obs"])


def test_compressed_checkpoint(location):
    """A codec sends chunks through zarr's codec pipeline (full and incremental dumps)."""
    source = LazyTensorStorage(100)
    source.checkpointer = TensorStorageCheckpointer(codec="zstd:3+crc32c", chunks=16)
    stream = TEDStream(seed=6)
    source.set(torch.arange(70), stream.batch(70))
    dest = spec(location, "zstd")
    source.dumps(dest)
    source[20] = stream.batch(1)[0]
    source.dumps(dest)
    record = _record(dest)
    assert record["incremental"]
    target = location.memmap(100)
    target.loads(dest)
    assert_same(target.get(slice(None)), source.get(slice(None)))
    opened = zstore.open(dest.url + "/" + record["generation"], location.options, mode="r")
    assert str(opened.codec) == "zstd:3+crc32c" and len(opened) == 70


def test_docs_example(capsys):
    """The example in docs/checkpoints.md runs and prints what it says."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]
    exec(compile(code, "docs/checkpoints.md", "exec"), {})  # noqa: S102 - our own docs
    assert capsys.readouterr().out.split() == ["10", "1000", "9"]


def test_dumps_returns_what_it_wrote(location):
    stream = TEDStream(seed=5)
    storage = LazyTensorStorage(64)
    storage.checkpointer = TensorStorageCheckpointer(chunks=8)
    storage.set(torch.arange(32), stream.batch(32))
    dest = spec(location, "result")
    full = storage.dumps(dest)
    assert isinstance(full, checkpoint.DumpResult) and not full.incremental
    assert full.generation == _record(dest)["generation"] and full.length == 32
    assert full.bytes_written == _record(dest)["bytes_written"] > 0
    assert full.url == dest.redacted() and "full dump of 32 items" in str(full)
    storage.set(torch.arange(32, 36), stream.batch(4))
    again = storage.dumps(dest)
    assert again.incremental and again.length == 36
    assert 0 < again.bytes_written < full.bytes_written // 2
    flat = LazyTensorStorage(64)
    flat.checkpointer = FlatStorageCheckpointer()
    flat.set(torch.arange(32), stream.batch(32))
    tree = flat.dumps(spec(location, "flat"))
    assert tree.checkpointer == "FlatStorageCheckpointer" and tree.bytes_written > 0


def test_lazy_memmap_dumps_returns_what_the_checkpointer_did(location, tmp_path):
    """It returned None, dropping the DumpResult that LazyTensorStorage returns."""
    storage = location.memmap(50)
    storage.set(torch.arange(20), TensorDict(obs=torch.arange(20.0), batch_size=[20]))
    result = storage.dumps(tmp_path / "ckpt")
    assert isinstance(result, checkpoint.DumpResult)
    assert result.length == 20 and result.bytes_written > 0 and not result.incremental
    again = storage.dumps(tmp_path / "ckpt")
    assert isinstance(again, checkpoint.DumpResult) and again.incremental
    assert storage.dumps(storage.scratch_dir) is None  # its own store: a commit


@pytest.mark.parametrize("name", CHECKPOINTERS)
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_keys_at_the_root_and_under_next_round_trip(tmp_path, name, dtype):
    """zstore stores these dtypes; the Flat, Nested and H5 dumps failed on a root/next pair
    of them (torch's "index_put not implemented for 'UInt16'", naming no key): such pairs
    are now stored as two keys, not compacted into one."""
    n = 8
    count = torch.arange(n).to(dtype)
    data = TensorDict(obs=torch.arange(n * 1.).unsqueeze(-1), count=count,
                      next=TensorDict(obs=torch.arange(n * 1.).unsqueeze(-1) + 1,
                                      count=(torch.arange(n) + 1).to(dtype),
                                      done=(torch.arange(n) % 4 == 3).unsqueeze(-1),
                                      batch_size=[n]), batch_size=[n])
    storage = LazyMemmapStorage(12, scratch_dir=str(tmp_path / "rb"))
    storage.set(torch.arange(n), data)
    storage.checkpointer = CHECKPOINTERS[name]()
    storage.dumps(str(tmp_path / "ck"))
    again = LazyMemmapStorage(12, scratch_dir=str(tmp_path / "again"))
    again.checkpointer = CHECKPOINTERS[name]()
    again.loads(str(tmp_path / "ck"))
    assert len(again) == n
    for key in ("count", ("next", "count")):
        assert again[:n][key].dtype == dtype and torch.equal(again[:n][key], data[key]), key


@pytest.mark.s3
def test_a_checkpoint_chunk_the_bucket_refuses_is_an_access_error(s3_options):
    """A refused read of a generation's chunk is the credentials' fault, not the server's."""
    from conftest import denying_bucket

    bucket = denying_bucket(s3_options, "s3:GetObject", "ck/gen-*/x/c*")
    source = LazyTensorStorage(16)
    source.set(torch.arange(12), TensorDict(x=torch.arange(12.0), batch_size=[12]))
    dest = StoreSpec.parse(f"s3://{bucket}/ck", s3_options)
    source.dumps(dest)
    target = LazyTensorStorage(16)
    with pytest.raises(PermissionError, match=f"s3://{bucket}/ck") as info:
        target.loads(dest)
    assert not isinstance(info.value, ConnectionError) and len(target) == 0
