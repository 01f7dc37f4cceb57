"""Per-row strings survive every checkpointer (Tensor, Flat, Nested, H5).

A string leaf (``set_non_tensor`` strings, a stack of TensorDicts with one string each,
a tensorclass ``str`` field) is stored by zstore's tensor storages as text cells. The TED
checkpointers (Flat, Nested, H5) used to drop it: Flat/Nested loaded without the key, H5
listed it without writing it. Each test compares what a storage loads, fresh or filled
with other rows, with the rows written (one string per row, nested keys included), on
``LazyTensorStorage`` and ``LazyMemmapStorage`` (local directory and memory://). H5 files
keep the strings as text cells in the ``zstore`` group, where TorchRL's own loader passes
over them: it still loads the tensor keys.
"""

from __future__ import annotations

import uuid

import h5py
import pytest
import torch
from tensordict import NonTensorStack, TensorDict, tensorclass

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

CAPACITY = 16
CHECKPOINTERS = ["TensorStorageCheckpointer", "FlatStorageCheckpointer",
                 "NestedStorageCheckpointer", "H5StorageCheckpointer"]
STORAGES = ["LazyTensorStorage", "LazyMemmapStorage-local", "LazyMemmapStorage-memory"]


def new_storage(kind, tmp_path, checkpointer, **kwargs):
    """An empty storage of ``kind`` using ``checkpointer``."""
    if kind == "LazyTensorStorage":
        storage = zt.LazyTensorStorage(CAPACITY, **kwargs)
    else:
        where = (str(tmp_path / f"rb-{uuid.uuid4().hex[:8]}") if kind.endswith("local")
                 else f"memory://fix-ckpt-strings/{uuid.uuid4().hex}")
        storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=where, **kwargs)
    storage.checkpointer = getattr(zt, checkpointer)()
    return storage


def text(i: int) -> str:
    """Row ``i``'s string: unicode, empty and long (300 UTF-8 bytes) ones among them."""
    return ["héllo wörld", "", "ünïcode ✓", "x" * 300][i % 4] + (f" {i}" if i % 4 != 1 else "")


def transitions(first: int, n: int, stale: bool = False) -> TensorDict:
    """``n`` TED rows with root, ``next`` and nested string keys (a done every 5 steps)."""
    i = torch.arange(first, first + n)
    sign = -1.0 if stale else 1.0
    td = TensorDict({"obs": sign * i.float().unsqueeze(-1),
                     ("next", "obs"): sign * (i + 1).float().unsqueeze(-1),
                     ("next", "done"): (i % 5 == 4).unsqueeze(-1),
                     ("next", "reward"): i.float().unsqueeze(-1)}, batch_size=[n])
    word = (lambda j: "STALE" + "y" * 300) if stale else text
    td.set("txt", NonTensorStack.from_list([word(j) for j in i.tolist()]))
    td.set(("next", "txt"), NonTensorStack.from_list([word(j + 1) for j in i.tolist()]))
    td.set(("meta", "note"), NonTensorStack.from_list([f"note {j}" for j in i.tolist()]))
    return td


def expected_rows(rows: int) -> TensorDict:
    """What a ring of CAPACITY rows holds after ``rows`` rows were written round robin."""
    data = transitions(0, rows)
    if rows <= CAPACITY:
        return data
    last = [max(r for r in range(rows) if r % CAPACITY == p) for p in range(CAPACITY)]
    return data[torch.tensor(last)]


STRING_KEYS = ["txt", ("next", "txt"), ("meta", "note")]


def assert_rows_equal(got, want):
    """Same tensor leaves (exactly) and same strings, row by row."""
    for key in want.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got.get(key), want.get(key)), key
    for key in STRING_KEYS:
        assert got.get(key).tolist() == want.get(key).tolist(), key


def fill(storage, data):
    """Write ``data`` round robin, as TorchRL's buffer does (cursor included); the buffer
    gives the storage its default checkpointer, so the storage's own is set back."""
    checkpointer = storage.checkpointer
    rb = T.ReplayBuffer(storage=storage, batch_size=4)
    for lo in range(0, len(data), 6):
        rb.extend(data[lo:lo + 6])
    storage.checkpointer = checkpointer


@pytest.mark.parametrize("checkpointer", CHECKPOINTERS)
@pytest.mark.parametrize("kind", STORAGES)
@pytest.mark.parametrize("rows", [10, 21], ids=["partial", "wrapped"])
@pytest.mark.parametrize("filled", [False, True], ids=["fresh", "filled"])
def test_every_checkpointer_keeps_one_string_per_row(checkpointer, kind, rows, filled, tmp_path):
    source = new_storage(kind, tmp_path, checkpointer)
    fill(source, transitions(0, rows))
    assert type(source.checkpointer).__name__ == checkpointer
    source.dumps(tmp_path / "dump")
    target = new_storage(kind, tmp_path, checkpointer)
    if filled:  # other rows and other strings, in cells as wide: all replaced
        fill(target, transitions(0, CAPACITY, stale=True))
    target.loads(tmp_path / "dump")
    want = expected_rows(rows)
    assert len(target) == len(source) == len(want)
    assert_rows_equal(target[:len(want)], want)


@tensorclass
class Step:
    obs: torch.Tensor
    text: str


@pytest.mark.parametrize("checkpointer", CHECKPOINTERS[1:])
@pytest.mark.parametrize("kind", STORAGES[:2])
def test_a_tensorclass_field_and_stacked_tensordicts_keep_their_strings(checkpointer, kind,
                                                                        tmp_path):
    words = [text(i) for i in range(6)]
    stacked = torch.stack([TensorDict(obs=torch.tensor(float(i)), note=w)
                           for i, w in enumerate(words)])
    step = Step(obs=torch.arange(6.0).unsqueeze(-1), text=words, batch_size=[6])
    for data, key in ((stacked, "note"), (step, "text")):
        source = new_storage(kind, tmp_path, checkpointer)
        source.set(range(6), data)
        path = tmp_path / f"dump-{key}"
        source.dumps(path)
        target = new_storage(kind, tmp_path, checkpointer)
        target.loads(path)
        back = target[:6]
        assert list(back.get(key).tolist()) == words
        assert torch.equal(back.get("obs"), data.get("obs"))


@pytest.mark.parametrize("checkpointer", CHECKPOINTERS[1:])
def test_a_2d_storage_keeps_a_string_per_cell(checkpointer, tmp_path):
    data = TensorDict({"obs": torch.arange(12.0).reshape(6, 2),
                       ("next", "obs"): torch.arange(1.0, 13.0).reshape(6, 2),
                       ("next", "done"): torch.zeros(6, 2, 1, dtype=torch.bool)}, batch_size=[6, 2])
    words = [[f"t{t} lane{lane} ✓" for lane in range(2)] for t in range(6)]
    data.set("txt", NonTensorStack.from_list(words))
    source = new_storage("LazyTensorStorage", tmp_path, checkpointer, ndim=2)
    source.set(range(6), data)
    source.dumps(tmp_path / "dump")
    target = new_storage("LazyTensorStorage", tmp_path, checkpointer, ndim=2)
    target.loads(tmp_path / "dump")
    assert target[:6].get("txt").tolist() == words
    assert torch.equal(target[:6].get("obs"), data.get("obs"))


def test_torchrl_loads_the_tensor_keys_of_a_zstore_h5_file_with_strings(tmp_path):
    """The strings are UTF-8 text cells in ``zstore/text``; TorchRL's H5 loader passes over
    them and loads the tensor keys as it loads them from a file without strings."""
    source = new_storage("LazyTensorStorage", tmp_path, "H5StorageCheckpointer")
    data = transitions(0, 10)
    fill(source, data)
    source.dumps(tmp_path / "dump")
    with h5py.File(tmp_path / "dump" / "checkpoint.h5", "r") as f:
        cells = f["zstore/text/txt"][:]
    assert [bytes(row).rstrip(b"\0").decode() for row in cells] == [text(i) for i in range(10)]
    theirs = T.LazyTensorStorage(CAPACITY)
    theirs.checkpointer = T.H5StorageCheckpointer()
    theirs.loads(tmp_path / "dump")
    got = theirs[:10]
    assert "txt" not in got.keys()
    for key in ("obs", ("next", "obs"), ("next", "reward")):
        assert torch.equal(got.get(key), data.get(key)), key


@pytest.mark.parametrize("checkpointer", CHECKPOINTERS[1:])
def test_a_string_longer_than_a_filled_storages_cells_is_refused(checkpointer, tmp_path):
    from zstore import SchemaError

    source = new_storage("LazyTensorStorage", tmp_path, checkpointer)
    fill(source, transitions(0, 4))  # strings of 300 bytes and more
    source.dumps(tmp_path / "dump")
    narrow = new_storage("LazyMemmapStorage-local", tmp_path, checkpointer)
    short = transitions(0, 4)
    for key in STRING_KEYS:
        short.set(key, NonTensorStack.from_list(["a"] * 4))
    narrow.set(range(4), short)  # 256-byte cells
    with pytest.raises(SchemaError, match=r"'txt'.*UTF-8 bytes.*256-byte"):
        narrow.loads(tmp_path / "dump")
    assert narrow[:4].get("txt").tolist() == ["a"] * 4
