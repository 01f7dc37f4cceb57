"""H5 checkpoints both ways: TorchRL 0.14.1's own ``H5StorageCheckpointer`` loads zstore's
files, and gets what it gets from the file it dumps itself from the same data;
zstore loads its own files exactly (lossless extras included) and format-1 files.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import warnings
from pathlib import Path

import h5py
import pytest
import torch
from tensordict import TensorDict
from test_checkpoint import TEDStream, assert_same

import checkpoint
from checkpoint import CheckpointError, H5StorageCheckpointer
from zstore import LazyMemmapStorage, LazyTensorStorage, RoundRobinWriter

GOLDEN = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("make_golden_h5_v1", GOLDEN / "make_golden_h5_v1.py")
make_golden_h5_v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden_h5_v1)

#: name -> (lanes, capacity, extend sizes, nested keys)
CASES = {
    "partial": ((), 12, [5, 4], False),
    "exact": ((), 12, [12], False),
    "wrapped": ((), 12, [7, 6, 9], False),
    "episodes": ((), 40, [13, 11, 9], False),   # many terminated / truncated episodes, partial
    "nested": ((), 12, [7, 8], True),
    "ndim2-partial": ((3,), 24, [3, 2], False),
    "ndim2-wrapped": ((3,), 24, [3, 4, 3], True),
}


@pytest.fixture(scope="module")
def trl():
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    return pytest.importorskip("torchrl.data")


def batches(lanes, sizes, nested, seed=7):
    stream = TEDStream(lanes, seed=seed)
    for n in sizes:
        batch = stream.batch(n)
        if nested:  # nested keys, compacted and not: ("agent", "pos") follows obs
            batch["agent", "pos"] = batch["obs"][..., :2] * 2
            batch["next", "agent", "pos"] = batch["next", "obs"][..., :2] * 2
            batch["agent", "id"] = torch.arange(n).expand(*lanes, n).movedim(-1, 0).clone()
        yield batch


def zstore_storage(case, kind=LazyTensorStorage, **kw):
    lanes, capacity, sizes, nested = CASES[case]
    storage = kind(capacity, ndim=1 + len(lanes), **kw)
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    for batch in batches(lanes, sizes, nested):
        writer.extend(batch)
    return storage


def torchrl_storage(trl, case, seed=7):
    lanes, capacity, sizes, nested = CASES[case]
    rb = trl.ReplayBuffer(storage=trl.LazyTensorStorage(capacity, ndim=1 + len(lanes)))
    for batch in batches(lanes, sizes, nested, seed):
        rb.extend(batch.transpose(0, 1) if lanes else batch)  # TorchRL's ndim=2 takes [B, T]
    storage = rb.storage
    # rows past the cursor are torch.empty garbage in TorchRL: a garbage done flag in a lane's
    # last row shifts every later lane of its own H5 file (ndim=2). zstore pads with zeros.
    storage._storage[written(storage).stop:].zero_()
    return storage


def torchrl_loads(trl, path, capacity, ndim, kind="LazyTensorStorage", storage=None):
    storage = getattr(trl, kind)(capacity, ndim=ndim) if storage is None else storage
    storage.checkpointer = trl.H5StorageCheckpointer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage.loads(path)
    return storage


def written(source) -> slice:
    """The rows holding data (TorchRL's rows past the cursor of a partial buffer are garbage)."""
    lanes = math.prod(source.shape[1:])
    rows = source.shape[0] if len(source) >= source.max_size else -(-len(source) // lanes)
    return slice(0, rows)


def rows_of(storage, rows: slice) -> TensorDict:
    data = storage._storage if hasattr(storage, "_storage") else storage.get(slice(None))
    return data[rows].to_tensordict()


@pytest.mark.parametrize("case", list(CASES))
def test_torchrl_loads_zstore_h5_as_its_own(tmp_path, trl, case):
    lanes, capacity, _, _ = CASES[case]
    ndim = 1 + len(lanes)
    ours = zstore_storage(case)
    theirs = torchrl_storage(trl, case)
    rows = written(ours)
    assert len(ours) == len(theirs)
    assert_same(ours.get(rows), rows_of(theirs, rows))        # the same data on both sides
    ours.checkpointer = H5StorageCheckpointer()
    ours.dumps(tmp_path / "zstore.h5")
    theirs.checkpointer = trl.H5StorageCheckpointer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.dumps(tmp_path / "torchrl.h5")
    from_ours = torchrl_loads(trl, tmp_path / "zstore.h5", capacity, ndim)
    from_theirs = torchrl_loads(trl, tmp_path / "torchrl.h5", capacity, ndim)
    assert len(from_ours) == len(from_theirs) == len(ours)
    assert from_ours._storage.shape == from_theirs._storage.shape
    assert_same(rows_of(from_ours, rows), rows_of(from_theirs, rows))
    assert_same(rows_of(from_ours, rows), ours.get(rows))     # plain TED data: TorchRL is right
    # into an initialised storage holding other data: the same outcome as from its own file
    # (TorchRL's in-place roll fails on a full ring whose cursor is the last row: "exact")
    outcomes = []
    for path in ("zstore.h5", "torchrl.h5"):
        try:
            into = torchrl_loads(trl, tmp_path / path, capacity, ndim,
                                 storage=torchrl_storage(trl, case, seed=11))
            outcomes.append(rows_of(into, rows))
        except RuntimeError as exc:
            outcomes.append(type(exc))
    if isinstance(outcomes[0], TensorDict):
        assert_same(outcomes[0], outcomes[1])
        assert_same(outcomes[0], ours.get(rows))
    else:
        assert outcomes == [RuntimeError, RuntimeError] and case == "exact"
    back = LazyTensorStorage(capacity, ndim=ndim)              # and zstore reads its file exactly
    back.loads(tmp_path / "zstore.h5")
    assert (len(back), back._last_cursor_index) == (len(ours), ours._last_cursor_index)
    assert_same(back.get(slice(None)), ours.get(slice(None)))


def test_torchrl_loads_compressed_memmap_checkpoint(tmp_path, trl):
    ours = zstore_storage("ndim2-wrapped", LazyMemmapStorage, scratch_dir=str(tmp_path / "lms"))
    ours.checkpointer = H5StorageCheckpointer(h5_kwargs={"compression": "gzip"})
    ours.dumps(tmp_path / "ck")                                # a directory: checkpoint.h5 in it
    with h5py.File(tmp_path / "ck" / "checkpoint.h5") as f:
        assert f["traj_0/obs"].compression == "gzip"
    got = torchrl_loads(trl, tmp_path / "ck", 24, 2, "LazyMemmapStorage")
    assert len(got) == len(ours)
    assert_same(rows_of(got, slice(None)), ours.get(slice(None)))


def awkward(n=12, info=False) -> TensorDict:
    """TED steps that TorchRL's compaction loses: see the assignments."""
    data = TEDStream(seed=3).batch(n)
    data["done"][4] = True                          # a root-level done flag
    data["next", "obs"][5] += 1.0                   # ("next", obs) != next obs, no done
    data["next", "obs"][2, 0] = float("nan")        # NaNs compare bitwise
    data["next", "done"][9] = data["next", "truncated"][9] = True
    data["next", "obs"][9] = -0.0                   # the reset value is stored, -0.0 kept
    if info:
        data["next", "info"] = torch.arange(n, dtype=torch.float32)[:, None]  # next-only key
    return data


def torchrl_view(data: TensorDict, done_rows: list[int]) -> TensorDict:
    """What TorchRL's H5 round trip makes of ``data`` (written from row 0, not wrapped):
    root done flags zeroed, ``("next", obs)`` replaced by the next step's ``obs`` inside
    a segment (segments end at ``done_rows``)."""
    view = data.clone()
    for key in ("done", "terminated", "truncated"):
        view[key].zero_()
    for t in range(len(data) - 1):
        if t not in done_rows:
            view["next", "obs"][t] = data["obs"][t + 1]
    return view


def test_lossless_extras_are_invisible_to_torchrl(tmp_path, trl):
    data = awkward()
    ours = LazyTensorStorage(16)
    ours.set(torch.arange(12), data)
    ours.checkpointer = H5StorageCheckpointer()
    ours.dumps(tmp_path / "zstore.h5")
    theirs = trl.LazyTensorStorage(16)
    theirs.set(torch.arange(12), data.clone())
    theirs._storage[12:].zero_()                      # torch.empty garbage past the cursor
    theirs.checkpointer = trl.H5StorageCheckpointer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.dumps(tmp_path / "torchrl.h5")
    from_ours = rows_of(torchrl_loads(trl, tmp_path / "zstore.h5", 16, 1), slice(0, 12))
    from_theirs = rows_of(torchrl_loads(trl, tmp_path / "torchrl.h5", 16, 1), slice(0, 12))
    ends = torch.nonzero(data["next", "done"].reshape(-1)).reshape(-1).tolist() + [11]
    assert_same(from_ours, from_theirs)
    assert_same(from_ours, torchrl_view(data, ends))
    back = LazyTensorStorage(16)
    back.loads(tmp_path / "zstore.h5")
    assert_same(back.get(slice(None)), ours.get(slice(None)))
    with h5py.File(tmp_path / "zstore.h5") as f:     # the extras: root flags, two patched steps
        assert f["zstore/root/done"][()].reshape(-1).tolist() == data["done"].reshape(-1).tolist()
        assert sorted(f["zstore/next/obs/index"][()].tolist()) == [2, 5]
        assert "terminated" not in f["zstore/root"]  # all false: restored as zeros


def test_next_only_keys_and_rows_past_the_cursor(tmp_path, trl):
    """TorchRL cannot dump a next-only key; it loads zstore's. Rows written past the
    cursor (a rewound writer) round-trip in zstore."""
    data = awkward(info=True)
    ours = LazyTensorStorage(16)
    ours.set(torch.arange(12), data)
    ours.set(torch.arange(3), data[5:8])              # cursor at 2, rows 3..11 written before
    ours.checkpointer = H5StorageCheckpointer()
    ours.dumps(tmp_path / "zstore.h5")
    back = LazyTensorStorage(16)
    back.loads(tmp_path / "zstore.h5")
    assert (len(back), back._last_cursor_index) == (len(ours), 2)
    assert_same(back.get(slice(None)), ours.get(slice(None)))
    got = rows_of(torchrl_loads(trl, tmp_path / "zstore.h5", 16, 1), slice(0, 12))
    assert torch.equal(got["next", "info"], data["next", "info"][[5, 6, 7, *range(3, 12)]])
    assert_same(got[:3].exclude(("next", "obs"), "done", "terminated", "truncated"),
                data[5:8].exclude(("next", "obs"), "done", "terminated", "truncated"))


def test_persistent_tensordict_reads_the_file(tmp_path):
    from tensordict import PersistentTensorDict

    ours = zstore_storage("wrapped")
    ours.checkpointer = H5StorageCheckpointer()
    ours.dumps(tmp_path / "zstore.h5")
    td = PersistentTensorDict.from_h5(str(tmp_path / "zstore.h5"))
    assert td["_len"] == 12 and td["shift"] == 10 and bool(td["is_full"]) is True
    assert list(td["_storage_shape"]) == [12]
    assert set(td["traj_0"].keys()) == {"obs", "action", "done", "terminated", "truncated", "reward"}
    td.close()


def test_partial_buffer_pads_without_storing_zeros(tmp_path):
    ours = LazyTensorStorage(100_000)
    writer = RoundRobinWriter()
    writer.register_storage(ours)
    writer.extend(TEDStream().batch(6))
    ours.checkpointer = H5StorageCheckpointer()
    ours.dumps(tmp_path / "zstore.h5")
    assert (tmp_path / "zstore.h5").stat().st_size < 64_000     # not 100k rows of obs
    with h5py.File(tmp_path / "zstore.h5") as f:
        table = f["zstore/segments"][()]
        assert table[-1].tolist() == [100_000 - 6, 0, 0] and table[:, 0].sum() == 100_000
        assert sum(f[n]["action"].shape[0] for n in f if n.startswith("traj_")) == 100_000


def test_format_1_files_still_load():
    source = make_golden_h5_v1.golden_storage()
    back = LazyTensorStorage(make_golden_h5_v1.CAPACITY)
    back.loads(make_golden_h5_v1.FILE)
    assert (len(back), back._last_cursor_index) == (len(source), source._last_cursor_index) == (6, 1)
    assert_same(back.get(slice(None)), source.get(slice(None)))


def test_newer_format_is_refused(tmp_path):
    import json
    import shutil

    path = tmp_path / "future.h5"
    shutil.copy(make_golden_h5_v1.FILE, path)
    with h5py.File(path, "a") as f:
        record = json.loads(f.attrs[checkpoint._h5.ATTR])
        f.attrs[checkpoint._h5.ATTR] = json.dumps({**record, "format_version": 99})
    target = LazyTensorStorage(6)
    with pytest.raises(CheckpointError, match=r"future\.h5.*format 99"):
        target.loads(path)
    assert not target.initialized


def test_torchrl_loads_a_partial_lane_buffer_whose_last_row_is_written(tmp_path, trl):
    """ndim=2, not full, rows 5-7 of 8 written (cursor at the last row): TorchRL's loader
    expects an extra row after that forced end, which its own writer leaves out (its own
    file of this storage fails to load); zstore writes it, TorchRL loads the data."""
    data = TEDStream((3,), seed=2).batch(3)
    ours = LazyTensorStorage(24, ndim=2)
    ours.set(torch.arange(5, 8), data)
    ours._len = 9  # TorchRL's count of these writes (zstore's len also covers row 7: full)
    ours.checkpointer = H5StorageCheckpointer()
    ours.dumps(tmp_path / "zstore.h5")
    got = rows_of(torchrl_loads(trl, tmp_path / "zstore.h5", 24, 2), slice(5, 8))
    want = rows_of(ours, slice(5, 8))
    # TorchRL never loads ("next", obs) of a partial buffer's last row: compare the others
    assert torch.equal(got["next", "obs"][:2], want["next", "obs"][:2])
    assert_same(got.exclude(("next", "obs")), want.exclude(("next", "obs")))
    back = LazyTensorStorage(24, ndim=2)
    back.loads(tmp_path / "zstore.h5")
    assert (len(back), back._last_cursor_index) == (len(ours), 7)
    assert_same(back.get(slice(None)), ours.get(slice(None)))


def test_h5_dumps_returns_the_file_it_wrote(tmp_path):
    storage = LazyTensorStorage(32)
    storage.checkpointer = H5StorageCheckpointer()
    storage.set(torch.arange(8), TensorDict(
        obs=torch.randn(8, 3), next=TensorDict(obs=torch.randn(8, 3), done=torch.zeros(8, 1, dtype=torch.bool),
                                               batch_size=[8]), batch_size=[8]))
    result = storage.dumps(tmp_path / "ck")
    path = tmp_path / "ck" / "checkpoint.h5"
    assert result.url == str(path) and result.generation is None and not result.incremental
    assert result.bytes_written == path.stat().st_size and result.length == 8


@pytest.mark.parametrize("victim", ["traj_0/extra", "traj_1/extra"])
def test_a_dataset_missing_from_one_traj_group_says_the_file_is_damaged(tmp_path, victim):
    """It raised h5py's KeyError naming no file (traj_1), or a key mismatch stated the
    wrong way round (traj_0: "only in the checkpoint: ['extra']")."""
    n = 8
    storage = LazyTensorStorage(20)
    storage.checkpointer = H5StorageCheckpointer()
    storage.set(torch.arange(n), TensorDict(
        obs=torch.arange(n * 1.).unsqueeze(-1), extra=torch.arange(n).unsqueeze(-1) * 2,
        next=TensorDict(obs=torch.arange(n * 1.).unsqueeze(-1) + 1,
                        done=(torch.arange(n) % 4 == 3).unsqueeze(-1), batch_size=[n]),
        batch_size=[n]))
    storage.dumps(str(tmp_path / "ck"))
    with h5py.File(tmp_path / "ck" / "checkpoint.h5", "a") as f:
        del f[victim]
    again = LazyTensorStorage(20)
    again.checkpointer = H5StorageCheckpointer()
    group = victim.split("/")[0]
    with pytest.raises(CheckpointError, match=rf"checkpoint.h5: {group} lacks \['extra'\], which "
                                              "other traj groups hold: the checkpoint is damaged"):
        again.loads(str(tmp_path / "ck"))


_DUMP_AND_LOAD = """
import torch
from tensordict import TensorDict
from checkpoint import H5StorageCheckpointer
from zstore import LazyTensorStorage
from zstore.store import StoreSpec
from zstore.testing.s3 import MotoS3

with MotoS3() as server:  # in this process, as a notebook or a script runs one
    bucket = server.new_bucket()
    for i in range(3):
        url = StoreSpec.parse(f"s3://{bucket}/h5-{i}", server.storage_options)
        source = LazyTensorStorage(12)
        source.checkpointer = H5StorageCheckpointer()
        source.set(torch.arange(5), TensorDict(obs=torch.arange(15.0).view(5, 3), batch_size=[5]))
        source.dumps(url)
        target = LazyTensorStorage(12)
        target.checkpointer = H5StorageCheckpointer()
        target.loads(url)
        assert torch.equal(target.get(torch.arange(5))["obs"], torch.arange(15.0).view(5, 3))
print("loaded")
"""


@pytest.mark.s3
@pytest.mark.timeout(600)
def test_a_remote_load_right_after_a_dump_does_not_deadlock():
    """A script that dumps and then loads on S3: the load used to hand HDF5 an fsspec file,
    and a garbage collection on fsspec's event-loop thread that freed an h5py object waited
    for h5py's lock, which the thread reading the file held. That deadlocked every such
    script here, and the suite's loads now and then. The file is now downloaded first, then
    opened by HDF5's own driver."""
    import subprocess
    import sys

    try:
        child = subprocess.run([sys.executable, "-c", _DUMP_AND_LOAD], capture_output=True,
                               text=True, timeout=480)  # a hang guard only
    except subprocess.TimeoutExpired:
        pytest.fail("dumps then loads of an H5 checkpoint on S3 hung (the h5py lock deadlock)")
    assert child.returncode == 0 and child.stdout.strip() == "loaded", child.stderr[-3000:]


def test_a_remote_load_leaves_no_temporary_file(s3_options, s3_bucket, tmp_path, monkeypatch):
    """The download a remote load reads from is deleted after the load, and after a load of a
    file that is not HDF5."""
    import s3fs

    from zstore.store import StoreSpec

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    url = StoreSpec.parse(f"s3://{s3_bucket}/h5-tmp", s3_options)
    source = zstore_storage("partial")
    source.checkpointer = H5StorageCheckpointer()
    source.dumps(url)
    target = LazyTensorStorage(12)
    target.checkpointer = H5StorageCheckpointer()
    target.loads(url)
    assert_same(target.get(slice(None)), source.get(slice(None)))
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.pipe(f"{s3_bucket}/h5-bad/checkpoint.h5", b"not an HDF5 file")
    with pytest.raises(CheckpointError, match="not a readable HDF5 file"):
        target.loads(StoreSpec.parse(f"s3://{s3_bucket}/h5-bad", s3_options))
    with pytest.raises(CheckpointError, match="no H5 checkpoint"):
        target.loads(StoreSpec.parse(f"s3://{s3_bucket}/h5-none", s3_options))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.s3
@pytest.mark.parametrize("name", ["ck", "ck/run.h5"])
def test_an_h5_dump_to_a_missing_bucket_names_it(s3_options, name):
    """A dump to a missing bucket raised s3fs's "The specified bucket does not exist" from its
    upload, naming no URL, after the file was encoded; the other checkpointers name it."""
    from zstore.errors import StoreNotFoundError
    from zstore.store import StoreSpec

    storage = LazyTensorStorage(10)
    storage.checkpointer = H5StorageCheckpointer()
    storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 3), batch_size=[2]))
    url = StoreSpec.parse(f"s3://zstore-no-such-bucket-4b1e/{name}", s3_options)
    with pytest.raises(StoreNotFoundError, match=r"bucket 'zstore-no-such-bucket-4b1e' of "
                                                 r"s3://zstore-no-such-bucket-4b1e.* does not "
                                                 "exist; create it first"):
        storage.dumps(url)
