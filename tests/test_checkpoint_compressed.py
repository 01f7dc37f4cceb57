"""Incremental dumps of CompressedListStorage on memory://, local and S3.

References: a plain list of the items written (every load must give them back
bit for bit), and the objects of the previous generation (the objects whose
bytes differ from it are exactly what a second dump may write).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from test_checkpoint import _record, assert_same, spec

import checkpoint
import zstore
from checkpoint._compressed import listing
from zstore import CompressedListStorage, LazyTensorStorage, StoreSpec

ROOT = Path(__file__).resolve().parents[1]


def make_items(n: int, seed: int, ragged: bool = True) -> list[TensorDict]:
    """Items with a fixed key (``obs``), a nested one and ``tokens`` (of varying length
    when ``ragged``); random, so every chunk compresses differently."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 6, (1,), generator=g)) if ragged else 3
        out.append(TensorDict(obs=torch.randn(32, generator=g),
                              tokens=torch.randint(0, 1000, (length,), generator=g),
                              next=TensorDict(reward=torch.randn(1, generator=g), batch_size=[]),
                              batch_size=[]))
    return out


def write(storage, model: list, positions, items) -> None:
    """``storage.set`` each item at its position, and the same on the list model."""
    for position, item in zip(positions, items, strict=True):
        storage.set(position, item)
        if position == len(model):
            model.append(item)
        else:
            model[position] = item


def loads_as(dest, model: list, capacity: int) -> None:
    """A fresh storage loaded from ``dest`` holds the model's items."""
    loaded = CompressedListStorage(capacity)
    loaded.loads(dest)
    assert len(loaded) == len(model)
    for i, item in enumerate(model):
        assert_same(loaded.get(i), item)


def generation(dest, record) -> StoreSpec:
    return StoreSpec.parse(f"{dest.url}/{record['generation']}", dest.storage_options)


def objects(spec: StoreSpec) -> dict[str, str]:
    """``{relative path: sha256}`` of every object below ``spec``."""
    fs, root = spec.filesystem()
    return {name: hashlib.sha256(fs.cat_file(f"{root.rstrip('/')}/{name}")).hexdigest()
            for name in listing(spec)}


def sizes(spec: StoreSpec, names) -> int:
    found = listing(spec)
    return sum(int(found[name]["size"]) for name in names)


def test_second_dump_writes_only_the_changed_objects(location, monkeypatch):
    # on S3 a storage shards each key into ~32 MiB objects (one would hold every row here):
    # that storage stays in memory; the checkpoint still goes to S3
    storage = CompressedListStorage(256, chunks=8) if location.kind == "s3" else \
        location.compressed(256, chunks=8)
    model: list = []
    items = make_items(200, seed=0)
    write(storage, model, range(192), items[:192])
    dest = spec(location, "ck")
    storage.dumps(dest)
    first = _record(dest)
    gen1 = generation(dest, first)
    before = objects(gen1)
    assert not first["incremental"] and first["bytes_written"] == sizes(gen1, before)

    staged = {}

    def at(point: str) -> None:
        if point == "commit":                   # the new generation is staged, not committed
            staged["gen1"] = objects(gen1)

    monkeypatch.setattr(checkpoint._dest, "_FAULT", at)
    write(storage, model, range(192, 195), items[192:195])  # rows 192-194: chunk 24 of 8 rows
    storage.dumps(dest)
    monkeypatch.setattr(checkpoint._dest, "_FAULT", None)
    second = _record(dest)
    gen2 = generation(dest, second)
    after = objects(gen2)
    changed = {name for name, digest in after.items() if before.get(name) != digest}
    assert second["incremental"]
    assert second["bytes_written"] == sizes(gen2, changed)   # exactly the changed objects
    assert second["bytes_written"] * 5 < first["bytes_written"]
    assert len(after) - len(changed) > 10                     # the rest was carried over
    assert all("/c/24/" in name for name in changed if name.startswith("items-") and "/c/" in name)
    assert staged["gen1"] == before                        # staging never touched gen 1
    loads_as(dest, model, 256)

    # the storage rewriting its chunks in place never reaches the checkpoint's objects
    dumped = list(model)
    write(storage, model, range(16), items[100:116])
    storage.flush()
    assert objects(gen2) == after
    loads_as(dest, dumped, 256)
    storage.dumps(dest)
    third = _record(dest)
    assert third["incremental"] and third["bytes_written"] < first["bytes_written"] // 2
    loads_as(dest, model, 256)


def test_dumps_loads_and_overwrites_match_a_list(location):
    """A sequence of dumps between appends, ring overwrites, a key turning ragged, loads into
    fresh storages and another storage's dump to the same destination."""
    capacity = 40
    items = iter(make_items(200, seed=1, ragged=False) + make_items(200, seed=2))
    a, model = location.compressed(capacity, chunks=8), []
    dest = spec(location, "seq")

    def dump(storage, expected_model, incremental: bool) -> None:
        storage.dumps(dest)
        assert _record(dest)["incremental"] is incremental
        loads_as(dest, expected_model, capacity)

    def take(n):
        return [next(items) for _ in range(n)]

    write(a, model, range(30), take(30))
    dump(a, model, False)
    write(a, model, range(30, 40), take(10))                # full
    dump(a, model, True)
    for _ in range(150):                                  # tokens turn ragged on the way
        next(items)
    assert "tokens" not in a._ragged
    write(a, model, range(12), take(12))                    # the ring wraps
    assert "tokens" in a._ragged                            # its tables were recreated
    dump(a, model, True)

    b, b_model = CompressedListStorage(capacity), list(model)
    b.loads(dest)
    write(b, b_model, range(12, 20), take(8))
    dump(b, b_model, True)                                  # load -> write -> dump: incremental

    c, c_model = location.compressed(capacity, chunks=8), []
    write(c, c_model, range(25), take(25))
    dump(c, c_model, False)                                 # another storage: a full dump
    b.loads(dest)                                           # b again (it holds its lease)
    b_model = list(c_model)
    write(b, b_model, range(25, 27), take(2))
    dump(b, b_model, True)

    write(a, model, range(20, 24), take(4))
    dump(a, model, False)                                   # c's generation is current: full
    write(a, model, range(24, 28), take(4))
    dump(a, model, True)
    checkpoint._dest.settle()
    assert len(checkpoint._dest.Destination(dest).children()) == 2  # zarr.json + one generation


CHILD = """
import os, signal, sys
sys.path.insert(0, "tests")
from checkpoint import _dest
from zstore import CompressedListStorage
from test_checkpoint_compressed import make_items


def dump_twice(scratch, dest, point, k):
    items = make_items(60, seed=3)
    storage = CompressedListStorage(64, chunks=8, scratch_dir=scratch)
    for i in range(50):
        storage.set(i, items[i])
    storage.dumps(dest)
    for i in range(50, 60):
        storage.set(i, items[i])
    seen = []

    def fault(name):
        seen.extend([name] if name == point else [])
        if len(seen) == k:
            os.kill(os.getpid(), signal.SIGKILL)

    _dest._FAULT = fault
    storage.dumps(dest)


# each case in a forked child, killed at the k-th fault point `point` of its second dump
for case in sys.argv[1:]:
    scratch, dest, point, k = case.split(",")
    pid = os.fork()
    if pid == 0:
        try:
            dump_twice(scratch, dest, point, int(k))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, flush=True)
"""
KILLS = {"copy": ("copy", 2),       # carried-over objects half linked
         "commit": ("commit", 1)}   # all staged, the commit record not yet written


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, Path]:
    """Both kill points in one child interpreter: ``{case: destination}``."""
    root = tmp_path_factory.mktemp("killed")
    cases = [f"{root / (name + '-s')},{root / name},{point},{k}" for name, (point, k) in KILLS.items()]
    done = subprocess.run([sys.executable, "-c", CHILD, *cases], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.split() == ["True"] * len(KILLS), done.stderr[-3000:]
    return {name: root / name for name in KILLS}


@pytest.mark.parametrize("case", list(KILLS))
def test_killed_incremental_dump_leaves_the_previous_checkpoint(killed, case):
    dest = killed[case]
    items = make_items(60, seed=3)
    assert len(list(dest.glob("gen-*"))) == 2              # the staged generation is there
    loads_as(dest, items[:50], 64)                          # ... and ignored
    storage = CompressedListStorage(64)
    storage.loads(dest)
    for i in range(50, 60):
        storage.set(i, items[i])
    storage.dumps(dest)                                     # over the debris, incrementally
    assert _record(StoreSpec.parse(str(dest)))["incremental"]
    checkpoint._dest.settle()
    names = sorted(p.name for p in dest.iterdir())
    assert len(names) == 2 and names[0].startswith("gen-") and names[1] == "zarr.json", names
    loads_as(dest, items, 64)


def test_a_table_left_in_the_location_is_not_copied_into_a_checkpoint(location):
    """A table the commit no longer names (left for a later commit to delete, or an older
    zstore's ungenerationed ``ragged/<key>/index``) was copied into the generation: an older
    zstore loading it paired that stale index with the new values, and read wrong items."""
    storage, model = location.compressed(8), []
    write(storage, model, range(6), make_items(6, seed=1))
    storage.flush()
    fs, root = storage.spec.filesystem()
    live = sorted(storage.checkpoint_tables())
    index = next(path for path in live if "/index-" in path)
    stale = index.rsplit("-", 1)[0]  # ragged/tokens/index: the layout before generations
    for name in listing(storage.spec):
        if name.startswith(f"{index}/"):
            if location.kind == "local":
                fs.makedirs(f"{root}/{stale}/{name[len(index) + 1:]}".rsplit("/", 1)[0],
                            exist_ok=True)
            fs.pipe_file(f"{root}/{stale}/{name[len(index) + 1:]}",
                         fs.cat_file(f"{root}/{name}"))
    dest = spec(location, "ck")
    storage.dumps(dest)
    copied = listing(generation(dest, _record(dest)))
    assert not [name for name in copied if name.startswith(f"{stale}/")]
    assert {name.split("/")[0] for name in copied} >= {path.split("/")[0] for path in live}
    loads_as(dest, model, 8)


def test_revisions_find_overwrites_a_listing_cannot_see(tmp_path, monkeypatch):
    """Some fsspec stores list sizes only, and a chunk of random floats overwritten in place
    keeps its size: the write revisions alone must find it."""
    monkeypatch.setattr(checkpoint._compressed, "_SIGNATURE_FIELDS", ())
    storage = CompressedListStorage(64, chunks=8, scratch_dir=str(tmp_path / "s"))
    model: list = []
    items = make_items(80, seed=4, ragged=False)
    write(storage, model, range(64), items[:64])
    dest = StoreSpec.parse(str(tmp_path / "ck"))
    storage.dumps(dest)
    write(storage, model, range(8, 16), items[64:72])      # chunk 1 of every key, same sizes
    storage.dumps(dest)
    assert _record(dest)["incremental"]
    loads_as(dest, model, 64)
    storage._empty()                 # what ReplayBuffer.empty() calls: tables made anew, under
    model = []                       # the same names, their revisions restarting from 0
    write(storage, model, range(64), items[16:80])
    storage.dumps(dest)
    loads_as(dest, model, 64)


def test_ensemble_member_dumps_incrementally(tmp_path):
    items = make_items(200, seed=5)
    member, model = CompressedListStorage(256, chunks=8), []
    ensemble = zstore.StorageEnsemble(member, LazyTensorStorage(4))
    write(member, model, range(192), items[:192])
    ensemble._storages[1].set(torch.arange(4), TensorDict(x=torch.arange(4.0), batch_size=[4]))
    dest = StoreSpec.parse(str(tmp_path / "ens"))
    ensemble.dumps(dest)
    first = _record(dest)["records"]["0"]
    write(member, model, range(192, 196), items[192:196])
    ensemble.dumps(dest)
    second = _record(dest)["records"]["0"]
    assert not first["incremental"] and second["incremental"]
    assert second["bytes_written"] * 5 < first["bytes_written"]
    again = zstore.StorageEnsemble(CompressedListStorage(256), LazyTensorStorage(4))
    again.loads(dest)
    assert len(again._storages[0]) == len(model)
    for i, item in enumerate(model):
        assert_same(again._storages[0].get(i), item)


def test_dumps_returns_a_result(tmp_path):
    storage = CompressedListStorage(64, chunks=4)
    for i, item in enumerate(make_items(12, seed=7)):
        storage.set(i, item)
    first = storage.dumps(tmp_path / "ck")
    storage.set(12, make_items(1, seed=8)[0])
    second = storage.dumps(tmp_path / "ck")
    assert not first.incremental and second.incremental and second.length == 13
    assert 0 < second.bytes_written < first.bytes_written
    assert first.checkpointer == "CompressedListStorageCheckpointer"


@pytest.mark.torchrl
def test_a_load_from_what_is_no_compressed_checkpoint_names_what_is_there(tmp_path):
    """It said "no committed checkpoint" for all of these, though each holds something:
    the error now names it, and the way on."""
    T = pytest.importorskip("torchrl.data")
    td = TensorDict(obs=torch.arange(5.).unsqueeze(-1), batch_size=[5])
    buffer = zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "buffer"))
    buffer.set(torch.arange(5), td)
    buffer.flush()
    tensor = T.LazyTensorStorage(10)
    tensor.set(torch.arange(5), td)
    tensor.dumps(str(tmp_path / "torchrl_tensor"))
    theirs = T.CompressedListStorage(10)
    for i in range(5):
        theirs.set(i, td[i])
    theirs.dumps(str(tmp_path / "torchrl_compressed"))
    ours = CompressedListStorage(10)
    for i in range(5):
        ours.set(i, td[i])
    ours.dumps(str(tmp_path / "interrupted"))
    (tmp_path / "interrupted" / "zarr.json").unlink()  # a first dump killed before its commit
    for name, said in (("buffer", "holds a zstore buffer, not a CompressedListStorage "
                                  "checkpoint: open it with zstore.open"),
                       ("torchrl_tensor", "holds a checkpoint of TorchRL's tensor storage"),
                       ("torchrl_compressed", "holds a checkpoint of TorchRL's own "
                                              "CompressedListStorage.*load_state_dict"),
                       ("interrupted", "holds an incomplete checkpoint: a dump was interrupted"),
                       ("nothing", "no checkpoint at")):
        with pytest.raises(checkpoint.CheckpointError, match=said):
            CompressedListStorage(10).loads(str(tmp_path / name))
