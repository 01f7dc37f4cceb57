"""String leaves (a tensorclass's ``str`` field, ``set_non_tensor`` strings) are stored.

A ``LazyMemmapStorage`` stores them as text cells, a ``uint8`` Zarr column of UTF-8
(``zstore.text``); reads give one string per row. Every test compares with TorchRL's
in-RAM ``LazyTensorStorage`` fed the same data (it keeps one string per row; TorchRL's
memory-mapped storage keeps only the first string it is given), through TorchRL's buffer
with the same seed, on memory://, a local directory and S3 on loopback. Bad input (too long
a string, an object, a NUL) is refused naming the key, and nothing is written.
"""

from __future__ import annotations

import pytest
import torch
import zarr
from tensordict import TensorDict, tensorclass

import zstore
from zstore import MissingKeyError, SchemaError

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

CAPACITY = 64


@tensorclass
class Step:
    obs: torch.Tensor
    text: str


def steps(first: int, n: int, texts=None) -> Step:
    """``n`` steps; their texts one per row (``texts``), else one for all of them."""
    obs = torch.arange(first, first + n).float().unsqueeze(-1)
    return Step(obs=obs, text=texts if texts is not None else f"run {first}", batch_size=[n])


BATCHES = [steps(0, 5), steps(5, 4, ["héllo wörld", "", "ünïcode ✓", "x" * 200]),
           steps(9, 3, ["a", "bb", "ccc"])]


def buffers(location, **kwargs):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options, **kwargs)
    return (T.ReplayBuffer(storage=storage, batch_size=6),
            T.ReplayBuffer(storage=T.LazyTensorStorage(CAPACITY), batch_size=6))


def test_a_tensorclass_string_field_comes_back_row_by_row(location):
    rb, reference = buffers(location)
    for batch in BATCHES:
        rb.extend(batch)
        reference.extend(batch)
    for seed in range(3):
        torch.manual_seed(seed)
        got = rb.sample()
        torch.manual_seed(seed)
        want = reference.sample()
        assert isinstance(got, Step)
        assert list(got.text) == list(want.text) and torch.equal(got.obs, want.obs)
    assert list(rb[:].text) == list(reference[:].text)
    assert rb.storage[6].text == reference.storage[6].text == ""
    storage = rb.storage
    storage.flush()
    again = zstore.open(storage.scratch_dir, location.options, mode="r")
    assert list(again.get(slice(None)).text) == list(reference[:].text)  # as the tensorclass


def test_set_non_tensor_strings_of_nested_keys(location):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options)
    reference = T.LazyTensorStorage(CAPACITY)
    for lo, note in ((0, "first"), (4, "second")):
        td = TensorDict(obs=torch.arange(lo, lo + 4.0), batch_size=[4])
        td.set_non_tensor(("meta", "note"), note)
        for target in (storage, reference):
            target.set(range(lo, lo + 4), td)
    got, want = storage.get(torch.tensor([7, 0, 3, 4])), reference.get(torch.tensor([7, 0, 3, 4]))
    assert got.get(("meta", "note")).tolist() == want.get(("meta", "note")).tolist() \
        == ["second", "first", "first", "second"]
    assert storage.get(5)["meta", "note"] == "second"


def test_slices_and_slice_samples_of_tensordict_string_keys(location):
    """``rb[:]``, ``rb[a:b]`` and TorchRL's ``SliceSampler`` (which reads ``storage[:]``) over
    TensorDict rows carrying a string each, as TorchRL's storage gives them (a store read by
    copies used to fail building its rows' template from an empty stack of strings)."""
    sampler = dict(num_slices=2, traj_key="episode")
    rb = T.TensorDictReplayBuffer(storage=zt.LazyMemmapStorage(
        CAPACITY, scratch_dir=location.new(), storage_options=location.options),
        sampler=T.SliceSampler(**sampler), batch_size=6)
    reference = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(CAPACITY),
                                         sampler=T.SliceSampler(**sampler), batch_size=6)
    data = torch.stack([TensorDict(obs=torch.tensor(float(i)), episode=torch.tensor(i // 5),
                                   note=f"step {i}") for i in range(20)])
    for target in (rb, reference):
        target.extend(data)
    assert list(rb[:]["note"]) == list(reference[:]["note"])
    assert list(rb[3:7]["note"]) == list(reference[3:7]["note"]) == [f"step {i}" for i in range(3, 7)]
    for seed in range(3):
        torch.manual_seed(seed)
        got = rb.sample()
        torch.manual_seed(seed)
        want = reference.sample()
        assert torch.equal(got["obs"], want["obs"]) and list(got["note"]) == list(want["note"])


def test_a_2d_storage_keeps_a_string_per_cell(location):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options, ndim=2)
    data = Step(obs=torch.zeros(3, 2, 1), text=[["a0", "a1"], ["b0", "b1"], ["c0", "c1"]],
                batch_size=[3, 2])
    storage.set(torch.arange(3), data)
    assert storage[1].text == ["b0", "b1"]
    assert storage.get((torch.tensor([2, 0]), torch.tensor([1, 0]))).text == ["c1", "a0"]


def test_too_long_a_string_is_refused_naming_the_key_and_nothing_is_written(location):
    rb, _ = buffers(location)
    rb.extend(steps(0, 4))
    before = rb[:].obs.clone()
    with pytest.raises(SchemaError, match=r"'text'.*300 UTF-8 bytes.*256-byte.*text_bytes="):
        rb.storage.set(torch.arange(2), steps(40, 2, ["ok", "é" * 150]))
    assert torch.equal(rb[:].obs, before) and list(rb[:].text) == ["run 0"] * 4


def test_text_bytes_and_the_first_write_set_the_cell_width(location):
    wide = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                storage_options=location.options, text_bytes=1024)
    wide.set(range(2), steps(0, 2, ["a", "b" * 1000]))
    assert wide.get(1).text == "b" * 1000
    grown = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                 storage_options=location.options)
    grown.set(range(1), steps(0, 1, ["c" * 700]))  # the first write's longest: 1024 bytes
    grown.set(range(1, 2), steps(1, 1, ["d" * 1024]))
    assert grown.get(torch.tensor([0, 1])).text == ["c" * 700, "d" * 1024]
    grown.flush()
    meta = zarr.open_group(grown.scratch_dir, mode="r",
                           storage_options=location.options or None).attrs["zstore"]
    leaf = next(leaf for leaf in meta["schema"]["leaves"] if leaf["path"] == "text")
    assert meta["schema"]["texts"] == ["text"] and leaf == {"path": "text", "dtype": "uint8",
                                                            "shape": [1024]}


def test_zarr_reads_the_text_cells_as_utf8_bytes(tmp_path):
    url = str(tmp_path / "rb")
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=url)
    storage.set(range(3), steps(0, 3, ["ä", "bc", ""]))
    storage.close()
    cells = zarr.open_array(f"{url}/text", mode="r")[:3]
    assert [bytes(row).rstrip(b"\0").decode() for row in cells] == ["ä", "bc", ""]


@pytest.mark.parametrize("value", [{"not": "a string"}, 3, "nul\0inside"])
def test_other_non_tensor_values_are_refused_and_nothing_is_written(location, value):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options)
    storage.set(range(2), steps(0, 2, ["a", "b"]))
    td = TensorDict(obs=torch.ones(2, 1), batch_size=[2])
    td.set_non_tensor("text", value)
    with pytest.raises(SchemaError, match="text"):
        storage.set(range(2), Step.from_tensordict(td))
    assert storage.get(torch.tensor([0, 1])).text == ["a", "b"]


def test_a_string_key_the_buffer_lacks_is_refused(location):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options)
    storage.set(range(2), TensorDict(obs=torch.ones(2), batch_size=[2]))
    td = TensorDict(obs=torch.ones(2), batch_size=[2])
    td.set_non_tensor("note", "new")
    with pytest.raises(MissingKeyError, match="'note'"):
        storage.set(range(2), td)


def test_invalid_utf8_in_a_text_cell_names_the_key(tmp_path):
    url = str(tmp_path / "rb")
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=url)
    storage.set(range(2), steps(0, 2, ["a", "b"]))
    storage.close()
    zarr.open_array(f"{url}/text", mode="r+")[1, :2] = [0xC3, 0x28]  # a broken 2-byte char
    with pytest.raises(zstore.CorruptChunkError, match=r"'text'.*not UTF-8"):
        zstore.open(url, mode="r").get(1)


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "LazyTensorStorage"])
@pytest.mark.parametrize("filled", [True, False])
def test_checkpoints_keep_the_strings(kind, filled, tmp_path):
    """TorchRL's ``test_storage_dumps_loads`` with a tensorclass: a dump keeps the string
    field, into a filled storage and into a new one (where it was lost before)."""
    def new():
        if kind == "LazyTensorStorage":
            return zt.LazyTensorStorage(CAPACITY)
        return zt.LazyMemmapStorage(CAPACITY, scratch_dir=str(tmp_path / f"rb{next(names)}"))

    names = iter(range(10))
    storage = new()
    data = steps(0, 4, ["one", "two", "three", "x" * 300])
    storage.set(range(4), data)
    storage.dumps(tmp_path / "dump")
    recovered = new()
    if filled:
        recovered.set(range(4), steps(0, 4, ["", "", "", "y" * 260]))  # cells as wide
    recovered.loads(tmp_path / "dump")
    back = recovered[:4]  # a new storage has no tensorclass to build: a TensorDict
    text = back.get("text")
    assert list(getattr(text, "tolist", lambda: text)()) == ["one", "two", "three", "x" * 300]
    assert torch.equal(back.get("obs"), data.obs)


def test_a_checkpoint_string_longer_than_a_filled_storages_cells_is_refused(tmp_path):
    storage = zt.LazyTensorStorage(CAPACITY)
    storage.set(range(2), steps(0, 2, ["short", "z" * 400]))
    storage.dumps(tmp_path / "dump")
    narrow = zt.LazyMemmapStorage(CAPACITY, scratch_dir=str(tmp_path / "rb"))
    narrow.set(range(2), steps(0, 2, ["a", "b"]))
    with pytest.raises(SchemaError, match=r"'text'.*400 UTF-8 bytes.*256-byte"):
        narrow.loads(tmp_path / "dump")
    assert narrow.get(torch.tensor([0, 1])).text == ["a", "b"]
