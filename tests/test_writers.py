"""Writers (SPEC §1.4, §5): ring indices, writer state, and resuming a reopened buffer."""

from __future__ import annotations

import json
import multiprocessing as mp
import random

import pytest
import torch
from tensordict import TensorDict, tensorclass

import zstore
from zstore import (
    ImmutableDatasetWriter,
    LazyMemmapStorage,
    LazyTensorStorage,
    RoundRobinWriter,
    TensorDictRoundRobinWriter,
)

torchrl_data = pytest.importorskip("torchrl.data")


@tensorclass
class Step:
    obs: torch.Tensor


def steps(n: int, start: int = 0, lanes: tuple[int, ...] = ()) -> TensorDict:
    values = torch.arange(start, start + n).reshape(n, *[1] * len(lanes)).expand(n, *lanes).clone()
    return TensorDict(step=values, obs=values.unsqueeze(-1).float(), batch_size=values.shape)


def pair(ours_storage, theirs_storage, writer_cls=RoundRobinWriter, theirs_cls=None):
    ours, theirs = writer_cls(), (theirs_cls or getattr(torchrl_data, writer_cls.__name__))()
    ours.register_storage(ours_storage)
    theirs.register_storage(theirs_storage)
    return ours, theirs


# -- RoundRobinWriter ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_round_robin_matches_torchrl(seed):
    rng = random.Random(seed)
    ours, theirs = pair(LazyTensorStorage(7), torchrl_data.LazyTensorStorage(7))
    written = 0
    for _ in range(25):
        if rng.random() < 0.4:
            got, want = ours.add(steps(1, written)[0]), theirs.add(steps(1, written)[0])
            written += 1
            assert got == want and isinstance(got, int)
        else:
            n = rng.randrange(1, 6)
            got, want = ours.extend(steps(n, written)), theirs.extend(steps(n, written))
            written += n
            assert torch.equal(got, want)
        assert ours._cursor == theirs._cursor and ours._write_count == theirs._write_count
        assert len(ours._storage) == len(theirs._storage)
        assert torch.equal(ours._storage[:]["step"], theirs._storage[:]["step"])
    assert ours.state_dict() == {"_cursor": theirs._cursor, "_write_count": written}


def test_add_returns_ring_positions():
    w = RoundRobinWriter()
    w.register_storage(LazyTensorStorage(3))
    assert [w.add(torch.zeros(1)) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert w._cursor == 2 and w._write_count == 5


def test_extend_larger_than_capacity_keeps_the_last_items():
    w = RoundRobinWriter()
    w.register_storage(LazyTensorStorage(5))
    index = w.extend(steps(12))
    assert index.tolist() == [i % 5 for i in range(12)]
    assert w._storage[:]["step"].tolist() == [10, 11, 7, 8, 9]
    assert w._cursor == 2 and w._write_count == 12


def test_extend_empty_batch():
    w = RoundRobinWriter()
    w.register_storage(LazyTensorStorage(5))
    with pytest.raises(RuntimeError, match="Expected at least one element in extend"):
        w.extend(steps(0))
    assert w._cursor == 0 and w._write_count == 0


def test_extend_with_list_and_pytree():
    w = RoundRobinWriter()
    w.register_storage(LazyTensorStorage(5))
    assert w.extend([torch.ones(2), torch.zeros(2)]).tolist() == [0, 1]
    v = RoundRobinWriter()
    v.register_storage(LazyTensorStorage(5))
    assert v.extend({"a": torch.ones(3, 2), "b": (torch.zeros(3),)}).tolist() == [0, 1, 2]


def test_ndim2_coordinates_match_torchrl():
    ours, theirs = pair(LazyTensorStorage(9, ndim=2), torchrl_data.LazyTensorStorage(9, ndim=2))
    for w in (ours, theirs):
        w.extend(steps(2, lanes=(3,)))
    got, want = ours.add(steps(1, 2, lanes=(3,))[0]), theirs.add(steps(1, 2, lanes=(3,))[0])
    assert torch.equal(got, want) and got.shape == (3, 2)
    got, want = ours.extend(steps(2, 3, lanes=(3,))), theirs.extend(steps(2, 3, lanes=(3,)))
    assert torch.equal(got, want) and got.shape == (6, 2)
    assert ours._cursor == theirs._cursor == 2
    assert torch.equal(ours._storage[:]["step"], theirs._storage[:]["step"])


def test_write_at_does_not_move_the_cursor():
    w = RoundRobinWriter()
    storage = LazyTensorStorage(8)
    w.register_storage(storage)
    w.extend(steps(2))
    w.write_at(torch.tensor([5]), steps(1, 50))
    assert w._cursor == 2 and len(storage) == 6 and storage[5]["step"].item() == 50
    w.write_at(torch.tensor([9 % 8]), steps(1, 60))
    assert len(storage) == 6


def test_mark_update_reaches_attached_entities():
    class Reader:
        def __init__(self):
            self.seen = []

        def mark_update(self, index):
            self.seen.append(index)

    storage = LazyTensorStorage(4)
    reader = Reader()
    storage.attach(reader)
    storage.attach(reader)  # once only
    w = RoundRobinWriter()
    w.register_storage(storage)
    w.add(steps(1)[0])
    w.extend(steps(2))
    assert reader.seen[0] == 0 and reader.seen[1].tolist() == [1, 2] and len(reader.seen) == 2


def test_state_dict_dumps_loads_empty_and_repr(tmp_path):
    w = RoundRobinWriter()
    storage = LazyTensorStorage(4)
    w.register_storage(storage)
    w.extend(steps(6))
    assert w.state_dict() == {"_cursor": 2, "_write_count": 6}
    w.dumps(tmp_path / "writer")
    meta = json.loads((tmp_path / "writer" / "metadata.json").read_text())
    assert meta == {"cursor": 2, "write_count": 6}
    assert repr(w) == "RoundRobinWriter(cursor=2, full_storage=True)"
    other = RoundRobinWriter()
    other.loads(tmp_path / "writer")
    assert other.state_dict() == w.state_dict()
    third = RoundRobinWriter()
    third.load_state_dict(w.state_dict())
    assert third._cursor == 2
    w._empty(empty_write_count=False)
    assert (w._cursor, w._write_count) == (0, 6)
    w._empty()
    assert (w._cursor, w._write_count) == (0, 0)


def test_counters_are_64_bit():
    w = RoundRobinWriter()
    w.register_storage(LazyTensorStorage(10))
    w._write_count = 2**31 - 1
    w.extend(steps(3))
    assert w._write_count == 2**31 + 2  # TorchRL's int32 counter would wrap (SPEC §9.3)


# -- TensorDictRoundRobinWriter --------------------------------------------------------------------------

def test_tensordict_writer_stores_index_without_touching_the_input():
    storage = LazyTensorStorage(4)
    w = TensorDictRoundRobinWriter()
    w.register_storage(storage)
    batch = steps(3)
    keys_before = set(batch.keys())
    w.extend(batch)
    item = steps(1, 3)[0]
    w.add(item)
    w.extend(steps(2, 4))
    assert set(batch.keys()) == keys_before and "index" not in item.keys()  # not mutated (SPEC §9.22)
    stored = storage[:]
    assert stored["index"].dtype == torch.int64
    assert stored["index"].tolist() == [0, 1, 2, 3]
    assert stored["step"].tolist() == [4, 5, 2, 3]


def test_tensordict_writer_index_matches_torchrl_storage():
    ours, theirs = pair(LazyTensorStorage(5), torchrl_data.LazyTensorStorage(5),
                        TensorDictRoundRobinWriter)
    for w in (ours, theirs):
        w.extend(steps(3))
        w.add(steps(1, 3)[0])
        w.extend(steps(4, 4))
    assert torch.equal(ours._storage[:]["index"], theirs._storage[:]["index"])


def test_tensordict_writer_ndim2_index_is_expanded():
    storage = LazyTensorStorage(6, ndim=2)
    w = TensorDictRoundRobinWriter()
    w.register_storage(storage)
    w.extend(steps(2, lanes=(3,)))
    assert storage[:]["index"].tolist() == [[0, 0, 0], [1, 1, 1]]


def test_tensordict_writer_skips_tensorclasses_and_tensors():
    storage = LazyTensorStorage(4)
    w = TensorDictRoundRobinWriter()
    w.register_storage(storage)
    w.extend(Step(obs=torch.ones(2, 3), batch_size=[2]))
    assert isinstance(storage[:], Step) and len(storage) == 2
    t = TensorDictRoundRobinWriter()
    t.register_storage(LazyTensorStorage(4))
    assert t.extend(torch.ones(2, 3)).tolist() == [0, 1]


# -- ImmutableDatasetWriter ----------------------------------------------------------------------------

def test_immutable_writer_refuses_writes(tmp_path):
    storage = LazyTensorStorage(4)
    storage.set(torch.arange(2), steps(2))
    w = ImmutableDatasetWriter()
    w.register_storage(storage)
    for call in (lambda: w.add(steps(1)[0]), lambda: w.extend(steps(2)), lambda: w._empty()):
        with pytest.raises(RuntimeError, match="This dataset doesn't allow writing."):
            call()
    assert len(storage) == 2 and storage._mutation_revision == 1
    assert ImmutableDatasetWriter.WRITING_ERR == "This dataset doesn't allow writing."
    assert w.state_dict() == {} and repr(w) == "ImmutableDatasetWriter()"
    w.load_state_dict({})
    w.dumps(tmp_path / "writer")
    w.loads(tmp_path / "writer")
    assert not (tmp_path / "writer").exists()
    assert w.generations_of(torch.tensor([0, 1])).tolist() == [-1, -1]
    assert w.tracks_generations is False
    assert not hasattr(w, "_cursor")


# -- resuming a reopened buffer ---------------------------------------------------------------------

@pytest.mark.parametrize("n_before", [3, 10, 17])  # partial, exactly full, wrapped
def test_resume_after_reopen_continues_at_cursor(location, n_before):
    url = location.new()
    storage = LazyMemmapStorage(10, scratch_dir=url, storage_options=location.options, chunks=4,
                                shards=4)
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    ref = RoundRobinWriter()
    ref.register_storage(LazyTensorStorage(10))
    for w in (writer, ref):
        w.extend(steps(n_before - 1))
        w.add(steps(1, n_before - 1)[0])
    storage.close()

    again = zstore.open(url, location.options)
    resumed = RoundRobinWriter()
    resumed.register_storage(again)
    assert resumed._cursor == writer._cursor == n_before % 10
    got, want = resumed.extend(steps(4, 100)), ref.extend(steps(4, 100))
    assert torch.equal(got, want)
    assert resumed.add(steps(1, 200)[0]) == ref.add(steps(1, 200)[0])
    assert len(again) == len(ref._storage)
    assert again[:]["step"].tolist() == ref._storage[:]["step"].tolist()
    again.flush()
    assert zstore.open(url, location.options, mode="r")[:]["step"].tolist() == \
        ref._storage[:]["step"].tolist()


@pytest.mark.parametrize("n_before", [3, 10, 13])  # partial, exactly full, wrapped
@pytest.mark.parametrize("writer_module", ["zstore", "zstore.torchrl"])
def test_a_reopened_compressed_list_storage_resumes_after_its_newest_item(location, n_before,
                                                                          writer_module):
    """A list storage keeps no last cursor; its commits record the newest item instead. The
    writer resumed at item 0 there, overwriting the oldest items of a partial ring and the
    newest of a wrapped one."""
    url = location.new()
    writer = pytest.importorskip(writer_module).RoundRobinWriter()
    writer.register_storage(location.compressed(10, scratch_dir=url))
    ring = [None] * 10  # the model: which step each item holds
    for step in range(n_before):
        writer.add(steps(1, step)[0])
        ring[step % 10] = step
    writer._storage.close()

    again = zstore.open(url, location.options)
    resumed = pytest.importorskip(writer_module).RoundRobinWriter()
    resumed.register_storage(again)
    assert (resumed._cursor, resumed._write_count) == (n_before % 10, min(n_before, 10))
    assert resumed.add(steps(1, 100)[0]) == n_before % 10
    ring[n_before % 10] = 100
    assert [again.get(i)["step"].item() for i in range(len(again))] == \
        ring[:min(n_before + 1, 10)]


def _older_writer(url: str, options: dict, opened, go, done) -> None:
    """Another process's writer: commits rows 0..9, then (once told) 10..19, and leaves."""
    storage = LazyMemmapStorage(30, scratch_dir=url, storage_options=options)
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(steps(10))
    storage.flush()
    opened.set()
    go.wait()
    writer.extend(steps(10, 10))
    storage.close()
    done.set()


def _zstore_writer():
    return RoundRobinWriter()


def _torchrl_writer():
    return pytest.importorskip("zstore.torchrl").RoundRobinWriter()


@pytest.mark.parametrize("location", ["local", "s3"], indirect=True)
@pytest.mark.parametrize("make_writer", [_zstore_writer, _torchrl_writer])
def test_a_writer_continues_from_what_another_committed_after_its_open(location, make_writer):
    """A buffer opened while another process was still writing took its cursor at the open;
    its first extend took the lease and reloaded the committed length (20), but wrote at the
    stale cursor (10): it overwrote the other writer's rows 10..14 and committed rows 20..24,
    never written, as data (zeros that samplers drew)."""
    url = location.new()
    ctx = mp.get_context("spawn")
    opened, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    older = ctx.Process(target=_older_writer, args=(url, location.options, opened, go, done))
    older.start()
    try:
        assert opened.wait(120)
        storage = zstore.open(url, location.options)
        writer = make_writer()
        writer.register_storage(storage)
        go.set()
        assert done.wait(120)
        writer.extend(steps(5, 100))
        storage.close()
    finally:
        older.join(120)
    assert zstore.open(url, location.options, mode="r")[:]["step"].tolist() == \
        [*range(20), *range(100, 105)]


def test_resume_tensordict_writer_ndim2(tmp_path):
    url = str(tmp_path / "rb")
    storage = LazyMemmapStorage(12, scratch_dir=url, ndim=2, chunks=2)
    w = TensorDictRoundRobinWriter()
    w.register_storage(storage)
    w.extend(steps(5, lanes=(3,)))  # 4 rows: wraps to cursor 1
    storage.close()
    again = zstore.open(url)
    resumed = TensorDictRoundRobinWriter()
    resumed.register_storage(again)
    assert resumed._cursor == w._cursor == 1
    index = resumed.extend(steps(1, 9, lanes=(3,)))
    assert index.tolist() == [[1, 0], [1, 1], [1, 2]]
    assert again[:]["step"][:, 0].tolist() == [4, 9, 2, 3]
    assert again[:]["index"][:, 0].tolist() == [0, 1, 2, 3]
