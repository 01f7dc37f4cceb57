"""Any key TorchRL stores is stored: a key part named ``"c"`` (Zarr v3's chunk-key prefix) too.

Under Zarr v3's default encoding an array's chunks live at ``<array>/c/...`` and a
group's children at ``<group>/<name>``: a child named ``c`` of a group never meets a
chunk key, so zstore refused such keys for nothing (42 of TorchRL's own tests used
``("b", "c")`` or ``("td", "c")``). The reference is the TensorDict written.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import checkpoint
import zstore

KEYS = [("c",), ("b", "c"), ("td", "c", "c"), ("next", "c")]


def data(n: int = 12) -> TensorDict:
    td = TensorDict(batch_size=[n])
    for i, key in enumerate(KEYS):
        td[key] = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 100 * i
    return td


def assert_same(got: TensorDict, want: TensorDict) -> None:
    def keys(td):
        return {key if isinstance(key, tuple) else (key,) for key in td.keys(True, True)}

    assert keys(got) == keys(want)
    for key in KEYS:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_keys_named_c_round_trip_through_a_buffer_and_a_reopen(location, codec):
    want = data()
    url = location.new()
    storage = zstore.LazyMemmapStorage(20, scratch_dir=url, storage_options=location.options,
                                       codec=codec, chunks=5)
    storage.set(torch.arange(12), want)
    assert_same(storage.get(torch.arange(12)), want)
    storage.flush()
    assert_same(zstore.open(url, location.options, mode="r")[:], want)


def test_keys_named_c_in_a_compressed_list_storage(location):
    want = data(6)
    url = location.new()
    storage = zstore.CompressedListStorage(10, scratch_dir=url, storage_options=location.options)
    storage.set(list(range(6)), want)
    storage.flush()
    again = zstore.open(url, location.options, mode="r")
    assert_same(zstore.stack_items(again.get(list(range(6)))), want)


@pytest.mark.parametrize("name", ["TensorStorageCheckpointer", "FlatStorageCheckpointer",
                                  "NestedStorageCheckpointer", "H5StorageCheckpointer"])
def test_keys_named_c_through_every_tensor_checkpointer(name, tmp_path):
    want = data()
    source = zstore.LazyTensorStorage(20)
    source.checkpointer = getattr(checkpoint, name)()
    source.set(torch.arange(12), want)
    source.dumps(tmp_path / "ckpt")
    target = zstore.LazyTensorStorage(20)
    target.checkpointer = getattr(checkpoint, name)()
    target.loads(tmp_path / "ckpt")
    assert len(target) == 12
    assert_same(target.get(torch.arange(12)), want)


def test_key_parts_that_would_escape_the_group_are_still_refused(tmp_path):
    storage = zstore.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "rb"))
    for bad in ("zarr.json", "..", "a/b"):
        with pytest.raises(zstore.errors.InvalidKeyError, match="cannot be stored"):
            storage.set(torch.arange(2), TensorDict({bad: torch.ones(2)}, batch_size=[2]))


def test_keys_named_as_zstores_own_objects_are_refused_before_anything_is_written(tmp_path):
    """A key named ``zstore-lease.json`` passed the key rules, then the creation failed with
    a ``FileExistsError`` naming no key and left a buffer "whose creation never finished"."""
    from zstore.conditional import PROBE_PREFIX
    from zstore.layout import ZSTORE_OBJECT_PREFIX
    from zstore.lease import LEASE_NAME
    from zstore.tail import TAIL_PREFIX

    assert all(name.startswith(ZSTORE_OBJECT_PREFIX) for name in (LEASE_NAME, PROBE_PREFIX, TAIL_PREFIX))
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(4, scratch_dir=url)
    for data in (TensorDict({LEASE_NAME: torch.ones(2)}, batch_size=[2]),
                 {f"{TAIL_PREFIX}-0": torch.ones(2)}):
        with pytest.raises(zstore.errors.InvalidKeyError, match="zstore's own objects.*rename the key"):
            storage.set(torch.arange(2), data)
    assert not storage.initialized and list((tmp_path / "rb").iterdir()) == []  # (nor a lease)
    storage.set(torch.arange(2), TensorDict({"zstore": torch.ones(2)}, batch_size=[2]))  # not a prefix
    storage.close()
    assert zstore.open(url).get(1)["zstore"].item() == 1


def test_a_dtype_zstore_cannot_store_is_refused_naming_the_key_and_the_way_out(tmp_path):
    """The error named neither the key nor a way out (and left a coroutine never awaited)."""
    storage = zstore.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "rb"))
    data = TensorDict(obs=torch.ones(2, 3), nested=TensorDict(
        spectrum=torch.zeros(2, 8, dtype=torch.complex32), batch_size=[2]), batch_size=[2])
    with pytest.raises(zstore.errors.SchemaError,
                       match=r"key 'nested/spectrum': dtype torch.complex32 cannot be stored .*"
                             r"complex64.*convert the key first, e.g. .to\(torch.complex64\)"):
        storage.set(torch.arange(2), data)
    data["nested", "spectrum"] = data["nested", "spectrum"].to(torch.complex64)
    storage.set(torch.arange(2), data)
    storage.close()
    assert zstore.open(str(tmp_path / "rb")).get(0)["nested", "spectrum"].dtype == torch.complex64


def pytree(n: int = 8):
    """A TorchRL-style pytree: int keys, a nested mix of dicts, tuples and lists."""
    base = torch.arange(n, dtype=torch.float32)
    return {30: base.clone(), "30": base + 1, 0: (base + 2, [base + 3, {1.5: base + 4}]),
            "a": {None: base + 5, True: base + 6}}


def assert_same_tree(got, want) -> None:
    import torch.utils._pytree as tree

    got_flat, got_spec = tree.tree_flatten(got)
    want_flat, want_spec = tree.tree_flatten(want)
    assert got_spec == want_spec
    assert all(torch.equal(g, w) for g, w in zip(got_flat, want_flat))


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_pytree_with_non_string_keys_round_trips_through_a_reopen(location, codec):
    want = pytree()
    url = location.new()
    storage = zstore.LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options,
                                       codec=codec)
    storage.set(torch.arange(8), want)
    assert_same_tree(storage.get(torch.arange(8)), want)
    storage.flush()
    again = zstore.open(url, location.options, mode="r")
    assert_same_tree(again.get(torch.arange(8)), want)
    assert_same_tree(again.get(3), {k: v for k, v in _index(want, 3).items()})


def _index(tree_value, i):
    import torch.utils._pytree as tree

    return tree.tree_map(lambda x: x[i], tree_value)


def test_pytree_keys_that_cannot_be_given_back_exactly_are_refused(tmp_path):
    storage = zstore.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "rb"))
    with pytest.raises(zstore.errors.InvalidKeyError, match=r"\(1, 2\).*tuple"):
        storage.set(torch.arange(2), {(1, 2): torch.ones(2)})
    with pytest.raises(zstore.errors.InvalidKeyError, match="same column twice"):
        storage.set(torch.arange(2), {3: torch.ones(2), "<int>3": torch.ones(2)})


def test_a_key_named_as_the_episode_index_is_refused_and_never_sealed_over(tmp_path, monkeypatch):
    """A key ``__episodes__`` was written, then ``seal()`` replaced its arrays with the episode
    index: the dataset could not be opened at all ("'__episodes__' is a group, the metadata
    says an array"), and an import of a file with such a key left that store behind. A new
    buffer refuses the key before anything is written; one written before is not sealed.
    Storages that are never sealed keep the key, as TorchRL's do."""
    from zstore.errors import InvalidKeyError

    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(4, scratch_dir=url)
    for key in ("__episodes__", ("__episodes__", "start")):
        with pytest.raises(InvalidKeyError, match="'__episodes__' cannot be stored: it is where a "
                                                  "sealed dataset keeps its episode index"):
            storage.set(torch.arange(2), TensorDict({key: torch.ones(2), "obs": torch.ones(2)}, [2]))
    assert not storage.initialized and list((tmp_path / "rb").iterdir()) == []
    td = TensorDict({"__episodes__": torch.arange(2.0), "obs": torch.ones(2)}, [2])
    in_ram = zstore.LazyTensorStorage(4)
    in_ram.set(torch.arange(2), td)
    in_ram.dumps(str(tmp_path / "ckpt"))
    loaded = zstore.LazyTensorStorage(4)
    loaded.loads(str(tmp_path / "ckpt"))
    assert (loaded.get(torch.arange(2)) == td).all()
    compressed = zstore.CompressedListStorage(4, scratch_dir=str(tmp_path / "cls"))
    compressed.set(0, td[0])
    assert (compressed.get(0) == td[0]).all()
    monkeypatch.setattr(zstore.storages.memmap, "refuse_keys_of_a_new_buffer",
                        lambda paths, **how: None)  # (a buffer written before the rule)
    old = zstore.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "old"))
    old.set(torch.arange(2), td)
    with pytest.raises(InvalidKeyError, match=r"cannot seal .*old: its key '__episodes__' is where "
                                              r"a dataset keeps its episode index"):
        old.seal()
    old.close()
    assert zstore.open(str(tmp_path / "old"))[:]["__episodes__"].tolist() == [0.0, 1.0]


def test_an_import_of_a_key_named_as_the_episode_index_leaves_nothing(tmp_path):
    """``import_d4rl`` of a file with a per-step array ``__episodes__`` imported it, then its
    seal made a store nothing could open, left behind: a rerun was refused."""
    h5py = pytest.importorskip("h5py")
    from zstore.dataset import import_d4rl
    from zstore.errors import InvalidKeyError

    source = tmp_path / "d.hdf5"
    with h5py.File(source, "w") as f:
        f["observations"] = torch.arange(12.0).reshape(6, 2).numpy()
        f["actions"] = torch.zeros(6, 1).numpy()
        f["rewards"] = torch.ones(6).numpy()
        f["terminals"] = torch.tensor([0, 0, 1, 0, 0, 1], dtype=torch.bool).numpy()
        f["timeouts"] = torch.zeros(6, dtype=torch.bool).numpy()
        f["__episodes__"] = torch.arange(6).numpy()
    with pytest.raises(InvalidKeyError, match="'__episodes__' cannot be stored"):
        import_d4rl(str(source), str(tmp_path / "ds"))
    assert not (tmp_path / "ds").exists() or list((tmp_path / "ds").iterdir()) == []


@pytest.mark.parametrize("location", ["memory", "local", "s3"], indirect=True)
def test_control_characters_in_keys_are_refused_on_s3_and_shown_escaped(location):
    """A key holding a newline failed on S3 through s3fs ("Not Found", naming no key), and
    obstore refused it only at the first write; ``repr`` and ``zstore info`` printed such
    keys raw, so a newline split the table and an escape sequence reached the terminal.
    Local and in-memory buffers keep them, as TorchRL's storages do."""
    from zstore.errors import InvalidKeyError

    url = location.new()
    storage = zstore.LazyMemmapStorage(4, scratch_dir=url, storage_options=location.options)
    td = TensorDict({"a\nb": torch.ones(2), ("next", "r\tw"): torch.zeros(2),
                     "obs\x1b[2K": torch.arange(2.0)}, [2])
    if location.kind == "s3":
        with pytest.raises(InvalidKeyError, match=r"cannot be stored in a remote store: it holds "
                                                  r"a control character"):
            storage.set(torch.arange(2), td)
        assert not storage.initialized and not zstore.StoreSpec.parse(url, location.options).exists()
        return
    storage.set(torch.arange(2), td)
    storage.close()
    reopened = zstore.open(url, location.options)
    assert (reopened[:] == td).all()
    text = repr(reopened)
    assert "a\\nb" in text and "obs\\x1b[2K" in text and "\x1b" not in text and "a\nb" not in text


@pytest.mark.parametrize("name", ["chunks", "shards"])
def test_per_key_chunks_and_shards_take_a_nested_key_as_a_tuple_as_codec_does(tmp_path, name):
    """``codec={("next", "reward"): None}`` worked; ``chunks={("next", "reward"): 2}`` said
    the data lacked the key it has ("the data does not have ... keys: ['next/reward' ...")."""
    td = TensorDict({"obs": torch.zeros(8, 3), ("next", "reward"): torch.zeros(8, 1)}, [8])
    given = {("next", "reward"): 4 if name == "shards" else 2}
    options = {"chunks": 2, name: given}
    storage = zstore.LazyMemmapStorage(8, scratch_dir=str(tmp_path / "rb"), **options)
    storage.set(torch.arange(8), td)
    storage.close()
    reopened = zstore.open(str(tmp_path / "rb"))
    assert getattr(reopened, name)["next/reward"] == given[("next", "reward")]
    assert (reopened[:] == td).all()
    with pytest.raises(ValueError, match=r"names key 'next/reward' twice"):
        zstore.LazyMemmapStorage(8, **{name: {("next", "reward"): 4, "next/reward": 8}})


@pytest.mark.parametrize("item", [
    TensorDict({"obs": torch.ones(7), ".root": TensorDict({"x": torch.ones(7, 3)}, [7, 3])}, [7]),
    TensorDict({"a.b": TensorDict({"x": torch.ones(2)}, [2]),
                "a": TensorDict({"b": TensorDict({"y": torch.ones(4)}, [4])}, [])}, []),
    TensorDict({("__zstore__", "batch", "a"): torch.ones(1), "obs": torch.ones(2)}, []),
], ids=["root", "a.b-beside-a/b", "__zstore__"])
def test_a_compressed_list_storage_refuses_keys_that_share_a_name_with_its_own(tmp_path, item):
    """Its nested TensorDicts' batch dims live in columns under ``__zstore__/batch``, the
    item's under ``.root``: a sub-TensorDict ``.root`` read back with the wrong batch size
    (an invalid TensorDict), ``a.b`` beside ``("a", "b")`` made every read raise
    ``KeyError``, and a user key under ``__zstore__`` was dropped. Refused at the first
    write, naming the key, and the storage takes other items after."""
    from zstore.errors import InvalidKeyError

    storage = zstore.CompressedListStorage(10, scratch_dir=str(tmp_path / "rb"))
    with pytest.raises(InvalidKeyError, match=r"CompressedListStorage cannot store .*"
                                              r"(rename the key|rename one of them)"):
        storage.set(0, item)
    assert len(storage) == 0
    storage.set(0, TensorDict({"obs": torch.ones(2)}, []))
    assert storage.get(0)["obs"].tolist() == [1.0, 1.0]


def test_a_compressed_list_storage_stores_a_key_named_as_its_plain_tensor_item():
    """A TensorDict with a key ``_-single-tensor-_`` (the name a plain tensor item is stored
    under) was taken once, then every later item was refused as "a tensor, and the first
    item was not"; TorchRL's storage takes them all."""
    from torchrl.data import CompressedListStorage as TorchRLCompressed

    items = [TensorDict({"_-single-tensor-_": torch.full((2,), float(i)), "obs": torch.ones(3) * i}, [])
             for i in range(3)]
    ours, theirs = zstore.CompressedListStorage(5), TorchRLCompressed(5)
    for storage in (ours, theirs):
        for i, item in enumerate(items):
            storage.set(i, item)
    assert len(ours) == len(theirs) == 3
    for i in range(3):
        assert (ours.get(i) == theirs.get(i)).all()
    assert "(tensor)" not in repr(ours)
    with pytest.raises(zstore.SchemaError, match="item 1 of this write is a tensordict, item 0 a "
                                                 r"tensor \(nothing was written\)"):
        zstore.CompressedListStorage(5).set([0, 1], [torch.ones(2), items[0]])
