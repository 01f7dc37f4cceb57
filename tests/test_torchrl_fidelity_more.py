"""TorchRL's own tests' scenarios over zstore.torchrl's storages, compared with TorchRL's storages.

Issue #20's remaining causes: ``torch.compile`` (a compiled ``extend`` + ``sample`` must not
recompile at every step, where TorchRL's does not), extending with a
``LazyStackedTensorDict`` of items of different shapes (then ``update_at_`` through it),
a storage before its first write, and tensorclasses with non-tensor fields.
Each test runs TorchRL's buffer, sampler and writer over zstore's storage and over TorchRL's
own with the same seed, and compares what they return.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, tensorclass

import zstore
from zstore.errors import MissingKeyError, SchemaError

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

WARMUP, STEPS, ITEMS = 3, 7, 3  # TorchRL's test: 3 calls not counted, then 7 counted


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def compiled_run(make_storage, avoid_max_size: bool):
    """TorchRL's ``test_extend_sample_recompile``: a compiled ``rb.extend(data); rb.sample()``
    called ``WARMUP + STEPS`` times. Returns (recompile log messages after the warm-up,
    the samples, len(rb))."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    capacity = (WARMUP + STEPS + 1) * ITEMS if avoid_max_size else 2 * ITEMS
    rb = T.ReplayBuffer(storage=make_storage(capacity), sampler=T.RandomSampler(),
                        writer=T.RoundRobinWriter(compilable=True), batch_size=ITEMS,
                        compilable=True)

    @torch.compile
    def extend_and_sample(data):
        rb.extend(data)
        return rb.sample()

    data = torch.arange(ITEMS, dtype=torch.float32).unsqueeze(-1)
    samples = [extend_and_sample(data + 10 * step) for step in range(WARMUP)]
    records, logger = _Records(), logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(records)
    try:
        samples += [extend_and_sample(data + 10 * step) for step in range(WARMUP, WARMUP + STEPS)]
    finally:
        torch._logging.set_logs()
        logger.removeHandler(records)
    return records.messages, torch.stack(samples), len(rb)


_REFERENCE: dict[bool, tuple] = {}


def torchrl_reference(avoid_max_size: bool):
    """TorchRL's own LazyTensorStorage, compilable, through the same steps (computed once)."""
    if avoid_max_size not in _REFERENCE:
        _REFERENCE[avoid_max_size] = compiled_run(
            lambda n: T.LazyTensorStorage(n, compilable=True), avoid_max_size)
    return _REFERENCE[avoid_max_size]


def assert_compiles_as_torchrl(make_storage, avoid_max_size: bool) -> None:
    want_recompiles, want_samples, want_len = torchrl_reference(avoid_max_size)
    recompiles, samples, length = compiled_run(make_storage, avoid_max_size)
    assert len(recompiles) <= len(want_recompiles), recompiles[:1]
    assert length == want_len
    assert torch.equal(samples, want_samples)  # the same draws of the same rows


def test_compiled_extend_sample_does_not_recompile():
    """The length grows at every step (once full it no longer changes, and nothing recompiles
    either way): a compiled frame guarding it would recompile at every step."""
    assert_compiles_as_torchrl(lambda n: zt.LazyTensorStorage(n, compilable=True),
                               avoid_max_size=True)


@pytest.mark.parametrize("avoid_max_size", [False, True])
def test_compiled_extend_sample_over_a_store(location, avoid_max_size):
    """A Zarr-backed storage's I/O is one graph break (run eagerly), not a recompile per step."""
    assert_compiles_as_torchrl(
        lambda n: zt.LazyMemmapStorage(n, compilable=True, scratch_dir=location.new(),
                                       storage_options=location.options), avoid_max_size)


def test_compiled_list_storage_recompiles_no_more_than_torchrls():
    """ListStorage: its list grows at every write; TorchRL's and zstore's both run outside
    the graph. The reference is TorchRL's ListStorage (samples are stacked items)."""
    def run(cls):
        return compiled_run(lambda n: cls(n, compilable=True), avoid_max_size=True)

    want_recompiles, want_samples, want_len = run(T.ListStorage)
    recompiles, samples, length = run(zt.ListStorage)
    assert len(recompiles) <= len(want_recompiles), recompiles[:1]
    assert length == want_len and torch.equal(samples, want_samples)


def ragged_lazy_stack(n: int, offset: float = 0.0) -> LazyStackedTensorDict:
    """TorchRL's ``test_extend_lazystack`` data: two TensorDicts whose ``a`` differ in shape,
    stacked along dim 1 (batch ``[n, 2]``)."""
    g = torch.Generator().manual_seed(int(offset))
    td1 = TensorDict(a=torch.rand(n, 4, 8, generator=g) + offset, batch_size=n)
    td2 = TensorDict(a=torch.rand(n, 3, 8, generator=g) + offset, batch_size=n)
    return LazyStackedTensorDict(td1, td2, stack_dim=1)


def assert_same_lazy_stacks(got, want) -> None:
    assert type(got) is type(want) and got.batch_size == want.batch_size
    for a, b in zip(got.get("a", as_list=True), want.get("a", as_list=True), strict=True):
        assert torch.equal(a, b)


def test_extend_lazy_stack_as_torchrl():
    rbs = [T.ReplayBuffer(storage=cls(6), batch_size=2)
           for cls in (zt.LazyTensorStorage, T.LazyTensorStorage)]
    for rb in rbs:
        rb.extend(ragged_lazy_stack(5))
    ours, theirs = rbs
    assert len(ours) == len(theirs) == 5
    assert type(ours.storage._storage) is type(theirs.storage._storage) is LazyStackedTensorDict
    for _ in range(3):
        torch.manual_seed(7)
        want = theirs.sample(3)
        torch.manual_seed(7)
        assert_same_lazy_stacks(ours.sample(3), want)
    for rb in rbs:  # wraps around: rows 5, 0, 1, 2
        rb.extend(ragged_lazy_stack(4, offset=100.0))
    for index in (0, 4, slice(None), torch.tensor([5, 0, 3])):
        assert_same_lazy_stacks(ours.storage[index], theirs.storage[index])
    assert "[2, -1, 8]" in repr(ours.storage)  # the summary names the ragged dim


def assert_same_stacks_of_members(got, want) -> None:
    """Both lazy stacks along the same dim, with equal members (every key of each)."""
    assert type(got) is type(want) is LazyStackedTensorDict
    assert got.batch_size == want.batch_size and got.stack_dim == want.stack_dim
    for ours, theirs in zip(got.tensordicts, want.tensordicts, strict=True):
        assert ours.batch_size == theirs.batch_size
        assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
        for key in theirs.keys(True, True):
            assert torch.equal(ours[key], theirs[key]), key


def test_a_memmap_storage_keeps_a_ragged_lazy_stack_as_torchrl(location, tmp_path):
    """TorchRL's test_extend_lazystack on LazyMemmapStorage: each stacked TensorDict's keys
    get arrays of their own (``0/a``, ``1/a``), and reads are lazy stacks again; it was
    refused before (tensordict's "Failed to stack tensors"). Compared with TorchRL's own
    memory-mapped storage, through a wrap-around and a reopen."""
    storage = zt.LazyMemmapStorage(6, scratch_dir=location.new(), storage_options=location.options)
    ours = T.ReplayBuffer(storage=storage, batch_size=2)
    theirs = T.ReplayBuffer(storage=T.LazyMemmapStorage(6, scratch_dir=str(tmp_path / "t")),
                            batch_size=2)
    for rb in (ours, theirs):
        rb.extend(ragged_lazy_stack(5))
        rb.extend(ragged_lazy_stack(4, offset=100.0))  # wraps around: rows 5, 0, 1, 2
    assert len(ours) == len(theirs) == 6
    assert storage._storage.shape == theirs.storage._storage.shape == torch.Size([6, 2])
    for seed in range(3):
        torch.manual_seed(seed)
        want = theirs.sample()
        torch.manual_seed(seed)
        assert_same_stacks_of_members(ours.sample(), want)
    for index in (0, 4, slice(None), torch.tensor([5, 0, 3])):
        got, want = storage[index], theirs.storage[index]
        if isinstance(index, int):
            assert torch.equal(got.tensordicts[1]["a"], want.tensordicts[1]["a"])
        else:
            assert_same_stacks_of_members(got, want)
    storage.flush()
    again = zstore.open(storage.scratch_dir, location.options, mode="r")
    assert_same_stacks_of_members(again.get(torch.tensor([1, 4])),
                                  theirs.storage[torch.tensor([1, 4])])


def test_a_ragged_lazy_stack_that_cannot_be_columns_is_refused(location):
    """Refused with a SchemaError naming the keys, before anything is written: ragged items
    stacked along the rows, into a buffer of dense items, or a dense write into a buffer of
    stacks; a later write that fits still lands."""
    dense = zt.LazyMemmapStorage(6, scratch_dir=location.new(), storage_options=location.options)
    rb = T.ReplayBuffer(storage=dense, writer=zt.RoundRobinWriter(), batch_size=2)
    rb.extend(TensorDict(a=torch.ones(5, 2, 3), batch_size=[5, 2]))
    with pytest.raises(SchemaError, match=r"\['a'\].*differ in shape.*nothing was written"):
        rb.extend(ragged_lazy_stack(2))
    assert len(rb) == 5 and torch.equal(dense.get(torch.arange(5))["a"], torch.ones(5, 2, 3))

    stacked = zt.LazyMemmapStorage(6, scratch_dir=location.new(), storage_options=location.options)
    stacked.set(torch.arange(3), ragged_lazy_stack(3))
    with pytest.raises(SchemaError, match="lazy stacks of 2 TensorDicts along dim 1"):
        stacked.set(torch.arange(3, 5), TensorDict(a=torch.ones(2, 2, 3), batch_size=[2, 2]))
    assert len(stacked) == 3

    along_rows = LazyStackedTensorDict.lazy_stack([TensorDict(a=torch.ones(4)),
                                                   TensorDict(a=torch.ones(3))])
    rows = zt.LazyMemmapStorage(6, scratch_dir=location.new(), storage_options=location.options)
    with pytest.raises(SchemaError, match=r"\['a'\]"):
        rows.set(torch.arange(2), along_rows)


def test_update_at_on_a_lazy_stack_as_torchrl():
    storages = [cls(6) for cls in (zt.LazyTensorStorage, T.LazyTensorStorage)]
    patch = ragged_lazy_stack(2, offset=-50.0)
    for storage in storages:
        rb = T.ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(ragged_lazy_stack(5))
        storage[:].update_at_(patch, torch.tensor([1, 3]))
    ours, theirs = storages
    assert_same_lazy_stacks(ours[:], theirs[:])
    assert_same_lazy_stacks(ours[torch.tensor([1, 3])], patch)


BEFORE_DATA = ("shape", "_total_shape", "_len_along_dim0", "initialized", "_is_full")


def _before_data(storage) -> dict:
    """What a storage answers before its first write (each attribute, ``len``, ``get``)."""
    out = {name: getattr(storage, name) for name in BEFORE_DATA}
    out["len"] = len(storage)
    with pytest.raises(RuntimeError) as info:
        storage.get(0)
    out["get"] = str(info.value)
    return out


@pytest.mark.parametrize("ndim", [1, 2])
def test_storage_before_data_as_torchrl(location, ndim):
    want = _before_data(T.LazyTensorStorage(10, ndim=ndim))
    assert want["_total_shape"] is None and want["shape"] is None
    ours = [zt.LazyTensorStorage(10, ndim=ndim),
            zt.LazyMemmapStorage(10, ndim=ndim, scratch_dir=location.new(),
                                 storage_options=location.options)]
    for storage in ours:
        assert _before_data(storage) == want, type(storage).__name__
    td = TensorDict(obs=torch.arange(6.0).reshape(3, 2), batch_size=[3, 2][:ndim])
    for storage in ours:  # then as TorchRL's after a first write
        theirs = T.LazyTensorStorage(10, ndim=ndim)
        for s in (storage, theirs):
            s.set(torch.arange(3) if ndim == 1 else slice(0, 3), td)
        assert (storage.shape, storage._total_shape, storage._len_along_dim0, len(storage)) == \
            (theirs.shape, theirs._total_shape, theirs._len_along_dim0, len(theirs))


@tensorclass
class Tagged:
    """TorchRL's ``test_storage_dumps_loads`` tensorclass: a tensor, a TensorDict, a string."""

    tensor: torch.Tensor
    td: TensorDict
    text: str


def test_tensorclass_with_a_string_as_torchrl():
    data = Tagged(tensor=torch.arange(3), td=TensorDict(c=torch.arange(3) * 10, batch_size=[3]),
                  text="some text", batch_size=[3])
    rbs = [T.ReplayBuffer(storage=cls(10), batch_size=4)
           for cls in (zt.LazyTensorStorage, T.LazyTensorStorage)]
    samples = []
    for rb in rbs:
        rb.extend(data)
        torch.manual_seed(3)
        samples.append(rb.sample())
    (ours, theirs), (got, want) = rbs, samples
    assert type(got) is type(want) is Tagged and got.batch_size == want.batch_size
    assert torch.equal(got.tensor, want.tensor) and torch.equal(got.td["c"], want.td["c"])
    assert list(got.text) == list(want.text) == ["some text"] * 4  # one string per row
    assert list(ours.storage._storage.text) == list(theirs.storage._storage.text)


def test_a_persistent_storage_stores_a_string_field_and_refuses_a_new_key(location):
    """A string field (a tensorclass's) was dropped by a zstore LazyMemmapStorage (read back
    as None), then refused: now it is stored, one string per row as TorchRL's
    LazyTensorStorage keeps it; a field left None is no value, and a string key the buffer
    lacks is refused, naming it, with nothing written."""
    ours = zt.LazyMemmapStorage(10, scratch_dir=location.new(), storage_options=location.options)
    rb = T.ReplayBuffer(storage=ours, writer=zt.RoundRobinWriter(), batch_size=2)
    reference = T.ReplayBuffer(storage=T.LazyTensorStorage(10), batch_size=2)
    tagged = Tagged(tensor=torch.arange(3), td=TensorDict(c=torch.arange(3), batch_size=[3]),
                    text="some text", batch_size=[3])
    for buffer in (rb, reference):
        buffer.extend(tagged)
    assert list(rb[:].text) == list(reference[:].text) == ["some text"] * 3

    plain = TensorDict(tensor=torch.arange(3, 5), td=TensorDict(c=torch.zeros(2, dtype=torch.int64),
                                                                 batch_size=[2]), batch_size=[2])
    plain.set_non_tensor("note", "kept nowhere")
    with pytest.raises(MissingKeyError, match=r"'note'"):
        ours.set(torch.arange(3, 5), plain)
    ours.flush()
    reopened = zstore.open(ours.scratch_dir, storage_options=location.options)
    assert len(ours) == len(reopened) == 3
    assert list(reopened.get(torch.arange(3)).text) == ["some text"] * 3  # as the tensorclass

    empty = zt.LazyMemmapStorage(10, scratch_dir=location.new(), storage_options=location.options)
    empty.set(torch.arange(2), Tagged(tensor=torch.arange(2), td=TensorDict(
        c=torch.arange(2), batch_size=[2]), text=None, batch_size=[2]))
    assert "text" not in empty._schema.by_path  # no value: no column


_ROWS = [1, slice(0, 3), torch.tensor([0, 2, 3]), torch.tensor([[0, 1], [2, 3]])]
_LANES = [2, slice(0, 2), torch.tensor([0, 2, 1]), torch.tensor([1, 0])]


@pytest.mark.parametrize("kind", ["pytree", "tensordict"])
def test_rows_and_lanes_index_a_two_dim_storage_as_torchrl(location, kind, tmp_path):
    """``storage[rows, lanes]`` of an ``ndim=2`` storage, every pairing of an int, a slice
    and 1-D / 2-D tensors: the same values as TorchRL's LazyMemmapStorage, and the same
    IndexError where TorchRL's tensors cannot broadcast (zstore took every lane of every
    row there, and paired only tensors of equal shape)."""
    data = {"a": torch.arange(24.0).reshape(4, 3, 2), "b": (torch.arange(12).reshape(4, 3),)}
    if kind == "tensordict":
        data = TensorDict(a=data["a"], b=data["b"][0], batch_size=[4, 3])
    ours = zt.LazyMemmapStorage(12, ndim=2, scratch_dir=location.new(),
                                storage_options=location.options)
    theirs = T.LazyMemmapStorage(12, ndim=2, scratch_dir=tmp_path / "torchrl")
    for storage in (ours, theirs):
        storage.set(torch.arange(4), data)

    def leaves(x):
        return [x["a"], x["b"]] if kind == "tensordict" else [x["a"], x["b"][0]]

    for rows in _ROWS:
        for lanes in _LANES:
            try:
                want = leaves(theirs[rows, lanes])
            except (IndexError, RuntimeError):  # tensordict raises RuntimeError, torch IndexError
                with pytest.raises(IndexError, match="shape mismatch"):
                    ours[rows, lanes]
                continue
            got = leaves(ours[rows, lanes])
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (rows, lanes)
    ours.close()


@tensorclass
class Agents:
    pos: torch.Tensor
    team: TensorDict


def _with_own_batch_dims(rows: int, ndim: int) -> TensorDict:
    """Rows whose items have batch dims of their own (3 agents; in ``ndim=2``, 3 lanes of 2
    agents), a nested TensorDict with them, and one with a further batch dim (2 arms)."""
    lead = (rows, 3) if ndim == 1 else (rows, 3, 2)
    n = torch.Size(lead).numel()
    return TensorDict({
        "obs": torch.arange(n * 5.0).reshape(*lead, 5),
        "next": TensorDict(obs=-torch.arange(n * 5.0).reshape(*lead, 5), batch_size=lead),
        "arms": TensorDict(x=torch.arange(n * 8).reshape(*lead, 2, 4), batch_size=(*lead, 2)),
    }, batch_size=lead)


@pytest.mark.parametrize("ndim", [1, 2])
def test_an_items_own_batch_dims_come_back_as_torchrl(location, ndim, tmp_path):
    """A ``[N, 3]`` TensorDict in an ``ndim=1`` LazyMemmapStorage (and ``[N, 3, 2]`` in
    ``ndim=2``) samples back with TorchRL's batch dims, nested ones included, from the
    storage, from ``_storage`` and after a reopen; zstore returned ``[B]`` (the 3 kept only
    as a feature dim of every key)."""
    data = _with_own_batch_dims(4, ndim)
    ours = zt.LazyMemmapStorage(12, ndim=ndim, scratch_dir=location.new(),
                                storage_options=location.options)
    theirs = T.LazyMemmapStorage(12, ndim=ndim, scratch_dir=tmp_path / "torchrl")
    samples = []
    for storage in (ours, theirs):
        rb = T.ReplayBuffer(storage=storage, batch_size=5)
        rb.extend(data)
        torch.manual_seed(0)
        samples.append(rb.sample())
    got, want = samples
    assert got.batch_size == want.batch_size and got["arms"].batch_size == want["arms"].batch_size
    assert (got == want).all()
    assert ours._storage.shape == theirs._storage.shape
    index = 1 if ndim == 1 else (1, 0)
    assert ours[index].batch_size == theirs[index].batch_size
    assert (ours[index] == theirs[index]).all()
    ours.flush()
    reopened = zstore.open(ours.scratch_dir, storage_options=location.options)
    rows = torch.tensor([2, 0])
    assert reopened._storage.shape == theirs._storage.shape
    assert (reopened.get(rows) == theirs[rows]).all()
    assert reopened.get(rows)["arms"].batch_size == theirs[rows]["arms"].batch_size
    ours.close()


def test_a_tensorclass_keeps_its_own_batch_dims(location):
    """A tensorclass of ``[N, 3]`` agents is read back with ``batch_size [B, 3]``, as from
    TorchRL's LazyTensorStorage."""
    data = Agents(pos=torch.arange(24.0).reshape(4, 3, 2),
                  team=TensorDict(id=torch.arange(12).reshape(4, 3), batch_size=[4, 3]),
                  batch_size=[4, 3])
    ours = zt.LazyMemmapStorage(10, scratch_dir=location.new(), storage_options=location.options)
    theirs = T.LazyTensorStorage(10)
    for storage in (ours, theirs):
        storage.set(torch.arange(4), data)
    rows = torch.tensor([2, 0, 3])
    got, want = ours.get(rows), theirs.get(rows)
    assert type(got) is Agents and got.batch_size == want.batch_size == torch.Size([3, 3])
    assert torch.equal(got.pos, want.pos) and got.team.batch_size == want.team.batch_size
    assert torch.equal(got.team["id"], want.team["id"])
    ours.close()


@pytest.mark.parametrize("dim", [0, 1])
def test_a_lazy_stack_of_equal_shapes_reads_back_as_torchrl(location, dim, tmp_path):
    """Extending with a lazy stack of three ``[4]`` TensorDicts (stacked along dim 0 or 1):
    the same rows, dense, with the same batch dims as TorchRL's memory-mapped storage."""
    parts = [TensorDict(obs=torch.arange(20.0).reshape(4, 5) + 100 * i, batch_size=[4])
             for i in range(3)]
    data = LazyStackedTensorDict.lazy_stack(parts, dim=dim)
    ours = zt.LazyMemmapStorage(20, scratch_dir=location.new(), storage_options=location.options)
    theirs = T.LazyMemmapStorage(20, scratch_dir=tmp_path / "torchrl")
    for storage in (ours, theirs):
        T.ReplayBuffer(storage=storage, batch_size=2).extend(data)
    rows = torch.tensor([2, 0])
    got, want = ours[rows], theirs[rows]
    assert len(ours) == len(theirs) and got.batch_size == want.batch_size
    assert ours._storage.shape == theirs._storage.shape
    assert torch.equal(got["obs"], want["obs"])
    ours.close()


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("data_type", ["tensor", "pytree"])
def test_a_zstore_dump_of_tensors_fills_a_storage_never_written(kind, data_type, tmp_path):
    """Where TorchRL refuses ("Cannot fill a non-initialized pytree-based TensorStorage":
    its dump does not record the structure), a zstore dump records its schema, so a new
    storage loads it (TorchRL's test_storage_dumps_loads expects the error)."""
    def new(name):
        return zt.LazyTensorStorage(10) if kind == "LazyTensorStorage" else \
            zt.LazyMemmapStorage(10, scratch_dir=str(tmp_path / name))

    data = torch.randint(10, (3,)) if data_type == "tensor" else \
        {"a": torch.randint(10, (3,)), "b": {"c": [torch.ones(3), (-torch.ones(3, 2),)]},
         30: -torch.ones(3, 1)}
    storage = new("rb")
    storage.set(range(3), data)
    storage.dumps(tmp_path / "dump")
    recovered = new("recovered")
    recovered.loads(tmp_path / "dump")
    assert len(recovered) == 3
    for got, want in zip(torch.utils._pytree.tree_leaves(recovered[:]),
                         torch.utils._pytree.tree_leaves(storage[:]), strict=True):
        assert torch.equal(got, want)
