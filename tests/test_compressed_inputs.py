"""CompressedListStorage against TorchRL's own, for inputs a batch write once got wrong:
lazy stacks of differing items, refused writes, float and 2-D indexes, and TorchRL's
own ``state_dict``. Each case runs on memory://, a local directory and S3."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict, lazy_stack

import zstore

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")
TorchRLCompressedListStorage, ReplayBuffer, TensorDictReplayBuffer = \
    T.CompressedListStorage, T.ReplayBuffer, T.TensorDictReplayBuffer


def compressed(location, capacity: int):
    """zstore's CompressedListStorage, as TorchRL's buffers take it, at ``location``."""
    return zt.CompressedListStorage(capacity, scratch_dir=location.new(),
                                    storage_options=location.options)


def items_of(rb) -> list:
    return [rb.storage.get(i) for i in range(len(rb))]


def assert_items_equal(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert sorted(g.keys(True, True)) == sorted(e.keys(True, True))
        for key in e.keys(True, True):
            assert g[key].dtype == e[key].dtype and g[key].equal(e[key]), key


def test_an_items_own_batch_dims_are_kept_where_torchrl_drops_them(location):
    """The documented difference (docs/torchrl.md §4): the same values and leaf shapes,
    with the item's batch dims on zstore's side only."""
    items = [TensorDict(obs=torch.randn(2, 5), batch_size=[2]) for _ in range(4)]
    ours = ReplayBuffer(storage=compressed(location, 10))
    theirs = ReplayBuffer(storage=TorchRLCompressedListStorage(10))
    for rb in (ours, theirs):
        rb.extend(items)
    index = torch.tensor([0, 2, 3])
    assert ours[index].batch_size == (3, 2) and theirs[index].batch_size == (3,)
    assert ours[0].batch_size == (2,) and theirs[0].batch_size == ()
    assert ours[index]["obs"].equal(theirs[index]["obs"])


@pytest.mark.parametrize("buffer", [ReplayBuffer, TensorDictReplayBuffer])
def test_a_lazy_stack_of_items_of_different_shapes_is_stored_item_by_item(location, buffer):
    """zstore refused the stack ("Failed to stack tensors"), storing nothing; TorchRL's
    stores each item, and a plain list of the same items worked."""
    items = [TensorDict(obs=torch.arange(float(1 + i % 3))) for i in range(7)]
    ours = buffer(storage=compressed(location, 5))
    theirs = buffer(storage=TorchRLCompressedListStorage(5))
    assert ours.extend(lazy_stack(items)).tolist() == theirs.extend(lazy_stack(items)).tolist()
    assert_items_equal(items_of(ours), items_of(theirs))


def test_a_lazy_stack_whose_items_differ_in_keys_is_refused_whole(location):
    """zstore stored the stack with only the keys all items share, silently dropping
    ``x`` of items 1 and 2. Now it is refused as the same items in a list are (keys are
    the first item's: docs/torchrl.md §4), and nothing of it is written."""
    items = [TensorDict(o=torch.ones(2) * i, **({"x": torch.full((1,), 10. * i)} if i else {}))
             for i in range(3)]
    for data in (lazy_stack(items), items):
        rb = ReplayBuffer(storage=compressed(location, 10))
        with pytest.raises(zstore.MissingKeyError, match=r"item 1 of this write adds \['x'\]"):
            rb.extend(data)
        assert len(rb) == 0 and len(rb.storage) == 0


def test_a_refused_item_leaves_the_items_before_it_unwritten(location):
    """An extend refused at its third item had written the first two (len 2, holding
    rows no writer counted); now the whole write is refused first."""
    rb = ReplayBuffer(storage=compressed(location, 10))
    rb.extend([torch.zeros(3), torch.ones(3)])
    bad = [torch.full((3,), 2.), torch.full((3,), 3.), torch.full((3,), 4, dtype=torch.int64)]
    with pytest.raises(zstore.SchemaError, match="item 2 of this write"):
        rb.extend(bad)
    assert len(rb.storage) == 2
    assert [t.tolist() for t in items_of(rb)] == [[0.] * 3, [1.] * 3]
    with pytest.raises(zstore.SchemaError, match="nothing was written"):
        rb.storage.set(slice(0, 2), [torch.full((3,), 5.), torch.full((3,), 5, dtype=torch.int8)])
    assert [t.tolist() for t in items_of(rb)] == [[0.] * 3, [1.] * 3]


@pytest.mark.parametrize("bad", [{"a": torch.tensor(9.)}, None, "text"], ids=["dict", "None", "str"])
def test_a_write_refused_at_a_non_tensor_item_writes_none_of_it(location, bad):
    """A write whose later item is no tensor (a dict, None, a string) stored the items ahead
    of it, then raised: the storage held an item no writer counted, which samplers drew and
    the next extend overwrote. A state dict with such an item emptied the storage first."""
    rb = ReplayBuffer(storage=compressed(location, 10), writer=zt.RoundRobinWriter())
    first = [TensorDict(a=torch.tensor(0.)), TensorDict(a=torch.tensor(1.))]
    rb.extend(first)
    with pytest.raises(TypeError, match="item 1 of this write: .*nothing was written"):
        rb.extend([TensorDict(a=torch.tensor(10.)), bad])
    assert len(rb) == 2 and rb.writer._cursor == 2
    with pytest.raises(TypeError, match="item 1 of this write"):
        rb.storage.set([2, 3], [TensorDict(a=torch.tensor(10.)), bad])
    if not isinstance(bad, dict):  # a state dict's dict items are TensorDicts to it
        with pytest.raises(TypeError, match="item 1 of this write"):
            rb.storage.load_state_dict({"_storage": [TensorDict(a=torch.tensor(5.)), bad]})
    assert_items_equal(items_of(rb), first)
    rb.extend([TensorDict(a=torch.tensor(2.))])  # the next write lands at the cursor
    assert [item["a"].item() for item in items_of(rb)] == [0., 1., 2.]


@pytest.mark.parametrize("item", [TensorDict(a=torch.tensor(9.)), torch.tensor(9.)],
                         ids=["TensorDict", "0-d tensor"])
def test_a_slice_set_to_one_item_is_refused_not_dropped(location, item):
    """``set(slice(1, 3), one item)`` wrote nothing and raised nothing where the item was a
    TensorDict without a batch dim (its length, 0, took no position); TorchRL raises
    ("generator raised StopIteration"). Now refused, naming the way: an int index."""
    storage = compressed(location, 5)
    like = [TensorDict(a=torch.tensor(float(i))) if isinstance(item, TensorDict)
            else torch.tensor(float(i)) for i in range(4)]
    storage.set([0, 1, 2, 3], like)
    with pytest.raises(TypeError, match=r"writes 2 item\(s\).*index it with an int"):
        storage.set(slice(1, 3), item)
    stored = [storage.get(i) for i in range(4)]
    assert [(x["a"] if isinstance(x, TensorDict) else x).item() for x in stored] == [0., 1., 2., 3.]
    storage.set(slice(2, 2), item)  # no position: nothing to write, as TorchRL
    storage.set(1, item)
    got = storage.get(1)
    assert (got["a"] if isinstance(item, TensorDict) else got).item() == 9.


@pytest.mark.parametrize("index", [torch.tensor([1.7, 2.9]), torch.tensor([[0, 1], [2, 3]])],
                         ids=["float", "2-D"])
def test_float_and_2d_indexes_are_refused(location, index):
    """A float index was truncated (items 1 and 2 for 1.7 and 2.9) and a 2-D one flattened
    (4 items); TorchRL's raises on both, as zstore's ListStorage already did."""
    ours = ReplayBuffer(storage=compressed(location, 10))
    theirs = ReplayBuffer(storage=TorchRLCompressedListStorage(10))
    for rb in (ours, theirs):
        rb.extend(torch.arange(12).reshape(4, 3))
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        theirs.storage.get(index)
    error = TypeError if index.is_floating_point() else IndexError
    with pytest.raises(error, match="integer indices" if error is TypeError else "1-D index"):
        ours.storage.get(index)


def test_torchrls_own_state_dict_loads_as_items(location):
    """TorchRL's state_dict holds its items zlib-compressed, with their metadata: zstore
    stored the compressed bytes as the items (uint8 tensors), and the next extend then
    failed. Now they are decoded, tensors and TensorDicts alike."""
    for make in (lambda i: torch.arange(3.) + i,
                 lambda i: TensorDict(obs=torch.arange(4, dtype=torch.int16) * i,
                                      reward=torch.tensor([float(i)]))):
        source = ReplayBuffer(storage=TorchRLCompressedListStorage(6))
        source.extend([make(i) for i in range(4)])
        rb = ReplayBuffer(storage=compressed(location, 6))
        rb.load_state_dict(source.state_dict())
        expected = items_of(source)
        got = items_of(rb)
        if isinstance(expected[0], torch.Tensor):
            assert [g.tolist() for g in got] == [e.tolist() for e in expected]
        else:
            assert_items_equal(got, expected)
        rb.extend([make(9)])
        assert len(rb) == 5


def test_zstores_state_dict_moves_to_torchrls_storage_through_its_items(location):
    """zstore's state_dict holds the items decoded (no ``_metadata``), which TorchRL's
    load_state_dict cannot take (KeyError '_metadata'): extending TorchRL's storage with
    them, as docs/torchrl.md §4 says, gives the same items."""
    rb = ReplayBuffer(storage=compressed(location, 6))
    rb.extend([TensorDict(obs=torch.arange(4.) * i) for i in range(4)])
    state = rb.storage.state_dict()
    with pytest.raises(KeyError, match="_metadata"):
        TorchRLCompressedListStorage(6).load_state_dict(state)
    theirs = ReplayBuffer(storage=TorchRLCompressedListStorage(6))
    theirs.extend(state["_storage"])
    assert_items_equal(items_of(theirs), items_of(rb))


def test_a_state_dict_compressed_by_another_function_is_refused_naming_the_way(location):
    source = ReplayBuffer(storage=TorchRLCompressedListStorage(
        6, compression_fn=lambda t: t.reshape(-1).view(torch.uint8).clone(),
        decompression_fn=lambda p, meta: p.view(meta["dtype"]).reshape(meta["shape"])))
    source.extend([torch.arange(3.)])
    rb = ReplayBuffer(storage=compressed(location, 6))
    rb.extend([torch.ones(2)])
    with pytest.raises(ValueError, match="compression_fn other than TorchRL's default"):
        rb.load_state_dict(source.state_dict())
    assert [t.tolist() for t in items_of(rb)] == [[1., 1.]]  # the content stays


def test_a_storage_emptied_before_its_first_commit_reopens_empty(location):
    """`rb.empty()` before any flush left the store holding only its lease: reopening it
    said "no buffer yet", where a LazyMemmapStorage in the same steps reopens empty."""
    storage = compressed(location, 10)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(TensorDict(obs=torch.arange(7.), batch_size=[7]))
    rb.empty()
    storage.flush()
    assert len(zt.open(storage.spec.url, location.options, mode="r")) == 0
    rb.extend(TensorDict(obs=torch.arange(3.) + 10, batch_size=[3]))
    storage.flush()
    again = zt.open(storage.spec.url, location.options, mode="r")
    assert [again.get(i)["obs"].item() for i in range(len(again))] == [10., 11., 12.]


def test_a_key_holding_a_slash_is_refused_not_renamed(location):
    """Before: "a/b" came back as the nested key ("a", "b"), and next to a nested ("a", "b")
    one of the two was dropped; nothing was raised. LazyMemmapStorage refuses it too."""
    for data in (TensorDict({"a/b": torch.zeros(2), "obs": torch.ones(3)}),
                 TensorDict({"a/b": torch.zeros(2), ("a", "b"): torch.ones(2)})):
        for storage in (zt.CompressedListStorage(4), compressed(location, 4)):
            with pytest.raises(zstore.InvalidKeyError, match="key 'a/b' cannot be stored"):
                storage.set(0, data)
            assert len(storage) == 0
            storage.set(0, TensorDict(obs=torch.ones(3)))  # still takes a first item
            assert storage.get(0)["obs"].tolist() == [1.0] * 3


def test_a_writers_item_replaces_the_item_it_overwrites_whole(location):
    """Before: once the ring wrapped, an extend lacking "reward" kept the evicted item's
    reward (item 0 read {obs: 7, reward: 10}); the same extend before the wrap is refused,
    and so is it now. An update in place (rb[i] = td) still keeps the keys it leaves out."""
    rb = ReplayBuffer(storage=compressed(location, 3), batch_size=2)
    full = TensorDict(obs=torch.arange(3.0), reward=torch.arange(10.0, 13.0), batch_size=[3])
    rb.extend(full)
    with pytest.raises(zstore.MissingKeyError, match=r"lacks \['reward'\]"):
        rb.extend(TensorDict(obs=torch.tensor([7.0]), batch_size=[1]))
    assert [item["reward"].item() for item in items_of(rb)] == [10.0, 11.0, 12.0]
    assert rb.storage.get(0)["obs"].item() == 0.0
    rb[1] = TensorDict(obs=torch.tensor(5.0))
    assert rb.storage.get(1)["obs"].item() == 5.0 and rb.storage.get(1)["reward"].item() == 11.0


@pytest.mark.parametrize("where", ["in RAM", "at a URL"])
def test_a_first_write_that_fails_leaves_the_storage_empty_and_usable(location, where):
    """Before: a first write failing inside compression_fn left the first item's layout
    chosen: reads raised AttributeError and good items were refused for lacking its keys."""
    failing = {"on": True}

    def compress(t: torch.Tensor) -> torch.Tensor:
        if failing["on"]:
            raise RuntimeError("compressor hiccup")
        return t.contiguous().reshape(-1).view(torch.uint8).clone()

    def decompress(b: torch.Tensor, metadata: dict) -> torch.Tensor:
        return b.view(metadata["dtype"]).reshape(metadata["shape"])

    options = {"compression_fn": compress, "decompression_fn": decompress}
    storage = zt.CompressedListStorage(10, **options) if where == "in RAM" else \
        zt.CompressedListStorage(10, scratch_dir=location.new(), storage_options=location.options,
                                 **options)
    with pytest.raises(RuntimeError, match="compressor hiccup"):
        storage.set(0, TensorDict(obs=torch.ones(3), extra=torch.zeros(2)))
    assert len(storage) == 0 and storage.get(slice(None)) == []
    failing["on"] = False
    storage.set(0, TensorDict(obs=torch.full((3,), 5.0)))
    assert len(storage) == 1 and list(storage.get(0).keys()) == ["obs"]
    assert storage.get(0)["obs"].tolist() == [5.0] * 3


def test_a_write_past_a_refused_one_names_the_writer_to_use(location):
    """TorchRL's writer moves its cursor before the storage refuses a batch (a string key
    here, which TorchRL's CompressedListStorage keeps): the next extends are refused with
    TorchRL's "more than one item away", which said nothing of why; zstore's writer stays."""
    text = TensorDict(obs=torch.zeros(3), batch_size=[3])
    text.set("txt", NonTensorStack("a", "b", "c"))
    theirs = ReplayBuffer(storage=compressed(location, 10), batch_size=2)
    ours = ReplayBuffer(storage=compressed(location, 10), batch_size=2,
                        writer=zt.RoundRobinWriter())
    for rb in (theirs, ours):
        rb.extend(TensorDict(obs=torch.ones(2), batch_size=[2]))
        with pytest.raises(TypeError, match="stores tensors only"):
            rb.extend(text)
    with pytest.raises(RuntimeError, match="more than one item away .* TorchRL's writers have "
                                           "moved past .* zstore.torchrl.RoundRobinWriter"):
        theirs.extend(TensorDict(obs=torch.ones(2), batch_size=[2]))
    ours.extend(TensorDict(obs=torch.full((2,), 2.0), batch_size=[2]))
    assert [item["obs"].item() for item in items_of(ours)] == [1.0, 1.0, 2.0, 2.0]
