"""zstore.ReplayBuffer, RandomSampler and SliceSampler against a plain-TensorDict ring model."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import RandomSampler, ReplayBuffer, SliceSampler
from zstore.samplers import Sampler


def episodes(lengths: list[int], first_episode: int = 0, first_step: int = 0) -> TensorDict:
    """Transitions of consecutive episodes of the given lengths; the last may be unfinished
    (pass its length negated)."""
    parts = []
    for offset, length in enumerate(lengths):
        n = abs(length)
        step = torch.arange(n)
        done = (step == n - 1) & (length > 0)
        parts.append(TensorDict({
            "episode": torch.full((n,), first_episode + offset), "step": step,
            "obs": torch.randn(n, 3),
            ("next", "done"): done.unsqueeze(-1),
        }, batch_size=[n]))
    data = torch.cat(parts)
    data["t"] = torch.arange(first_step, first_step + len(data))  # global write order
    return data


class RingModel:
    """What a ring buffer of ``capacity`` rows must hold: a plain TensorDict."""

    def __init__(self, capacity: int):
        self.capacity, self.rows, self.cursor, self.written = capacity, None, 0, 0

    def extend(self, data: TensorDict) -> None:
        if self.rows is None:
            self.rows = data[:1].expand(self.capacity).clone()
        index = (self.cursor + torch.arange(len(data))) % self.capacity
        self.rows[index] = data
        self.cursor = int(index[-1] + 1) % self.capacity
        self.written += len(data)

    def __len__(self) -> int:
        return min(self.written, self.capacity)


class _Directory:
    """A location in a local directory (for tests that need that one only)."""

    def __init__(self, root):
        self.root, self.options, self.count = root, {}, 0

    def new(self) -> str:
        self.count += 1
        return str(self.root / f"store-{self.count}")


def storage_of(kind: str, location, capacity: int):
    if kind == "LazyMemmapStorage":
        return zstore.LazyMemmapStorage(capacity, scratch_dir=location.new(),
                                        storage_options=location.options)
    if kind == "CompressedListStorage":
        return zstore.CompressedListStorage(capacity, scratch_dir=location.new(),
                                            storage_options=location.options)
    return getattr(zstore, kind)(capacity)


def assert_equal(got: TensorDict, want: TensorDict) -> None:
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert torch.equal(got.get(key), want.get(key)), key


# -- RandomSampler against the model ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "CompressedListStorage"])
def test_random_batches_match_the_model_on_every_store(kind, location):
    _random_batches_match(storage_of(kind, location, 40))


@pytest.mark.parametrize("kind", ["LazyTensorStorage", "ListStorage", "LazyStackStorage"])
def test_random_batches_match_the_model_in_memory(kind):
    _random_batches_match(storage_of(kind, None, 40))


def _random_batches_match(storage) -> None:
    rb, model = ReplayBuffer(storage, sampler=RandomSampler(), batch_size=12), RingModel(40)
    plan = torch.Generator().manual_seed(0)
    for round_ in range(6):  # 6 extends of 3..9 episodes' worth of rows: wraps twice
        lengths = torch.randint(2, 9, (int(torch.randint(1, 4, (1,), generator=plan)),),
                                generator=plan).tolist()
        data = episodes(lengths, first_episode=10 * round_, first_step=model.written)
        index = rb.extend(data)
        model.extend(data)
        assert torch.equal(torch.as_tensor(index), (torch.arange(len(data)) + model.written
                                                    - len(data)) % 40)
        assert len(rb) == len(model)
        draw = torch.Generator().manual_seed(round_)
        batch, info = rb.sample(generator=draw, return_info=True)
        expected = torch.randint(0, len(model), (12,), generator=torch.Generator().manual_seed(round_))
        assert torch.equal(info["index"], expected)  # uniform with replacement over filled rows
        assert_equal(batch, model.rows[info["index"]])
    single = episodes([1], first_episode=99, first_step=model.written)[0]
    assert rb.add(single) == model.cursor
    assert_equal(rb[model.cursor], single)


def test_random_cells_of_an_ndim2_storage(location):
    storage = zstore.LazyMemmapStorage(30, ndim=2, scratch_dir=location.new(),
                                       storage_options=location.options)
    rb = ReplayBuffer(storage, batch_size=64)
    rollout = TensorDict(obs=torch.arange(18.0).reshape(6, 3), batch_size=[6, 3])  # [time, env]
    rb.extend(rollout)
    batch, info = rb.sample(generator=torch.Generator().manual_seed(0), return_info=True)
    time, env = info["index"]
    assert int(time.max()) < 6 and int(env.max()) < 3 and len(set(env.tolist())) == 3
    assert torch.equal(batch["obs"], rollout["obs"][time, env])
    ahead = ReplayBuffer(storage, writer=zstore.ImmutableDatasetWriter(), batch_size=64, prefetch=1)
    for _ in range(2):  # drawn now, then drawn ahead: rows prefetched, cells gathered
        batch, info = ahead.sample(return_info=True)
        assert torch.equal(batch["obs"], rollout["obs"][info["index"]])


def test_random_sampler_refuses_empty_and_needs_a_batch_size():
    rb = ReplayBuffer(zstore.LazyTensorStorage(10))
    with pytest.raises(ValueError, match="batch_size was given neither"):
        rb.sample()
    with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
        rb.sample(4)
    with pytest.raises(TypeError, match="storage must be a zstore storage, got dict"):
        ReplayBuffer({})


# -- SliceSampler -----------------------------------------------------------------------------

def check_windows(batch: TensorDict, num_slices: int, slice_len: int, model: RingModel) -> None:
    """Every window is consecutive steps of one episode, as written, and ends nowhere early."""
    windows = batch.reshape(num_slices, slice_len)
    assert bool((windows["episode"] == windows["episode"][:, :1]).all())
    assert bool((windows["step"].diff(dim=1) == 1).all())
    assert bool((windows["t"].diff(dim=1) == 1).all())  # never the newest row then the oldest
    assert not bool(windows["next", "done"][:, :-1].any())
    for window in windows:  # and it is what the model holds at those rows
        rows = window["t"] % model.capacity
        assert_equal(window, model.rows[rows])


@pytest.mark.parametrize("by", ["end_key", "traj_key"])
def test_one_slice_sampler_serves_two_buffers(by, location):
    """A SliceSampler given to a train and an eval buffer kept the episode ends it read of
    the first and drew windows of the second across them: the two storages' revisions
    count alike, and the sampler told them apart by revision alone."""
    sampler = SliceSampler(slice_len=4, traj_key="episode") \
        if by == "traj_key" else SliceSampler(slice_len=4)
    buffers = [ReplayBuffer(zstore.LazyMemmapStorage(100, scratch_dir=location.new(),
                                                     storage_options=location.options),
                            sampler=sampler, batch_size=8) for _ in range(2)]
    models = [RingModel(100), RingModel(100)]
    for rb, model, length in zip(buffers, models, (50, 5)):
        data = episodes([length] * (100 // length))
        rb.extend(data)
        model.extend(data)
        rb.sample()
    for draw in range(20):
        for rb, model in zip(buffers, models):
            check_windows(rb.sample(generator=torch.Generator().manual_seed(draw)), 2, 4, model)


def test_a_row_without_the_end_key_is_stored_and_refused_at_the_sample():
    """After a sample, ``add`` of an item without the end key stored it, moved the writer,
    then raised KeyError; before any sample the same ``add`` passed. It passes now either
    way (a list storage takes it), and the next sample names the key."""
    rb = ReplayBuffer(zstore.ListStorage(10), sampler=SliceSampler(slice_len=2), batch_size=2)
    rb.extend(list(episodes([2, 2]).unbind(0)))
    rb.sample()
    assert rb.add(TensorDict(obs=torch.ones(3))) == 4 and len(rb) == 5
    with pytest.raises(KeyError, match="end_key"):
        rb.sample()


@pytest.mark.parametrize("by", ["end_key", "traj_key"])
def test_slices_never_cross_episode_ends(by, location):
    storage = zstore.LazyMemmapStorage(120, scratch_dir=location.new(),
                                       storage_options=location.options)
    sampler = SliceSampler(num_slices=6, traj_key="episode") if by == "traj_key" \
        else SliceSampler(slice_len=5)
    rb, model = ReplayBuffer(storage, sampler=sampler, batch_size=30), RingModel(120)
    plan = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 12, (70,), generator=plan).tolist()
    stream = episodes([*lengths, -8])  # ~430 rows; the newest episode is unfinished
    while model.written < len(stream):  # chunks cut episodes anywhere; the ring cuts the oldest
        n = int(torch.randint(20, 60, (1,), generator=plan))
        data = stream[model.written:model.written + n]
        rb.extend(data)
        model.extend(data)
        for draw in range(3):
            check_windows(rb.sample(generator=torch.Generator().manual_seed(model.written + draw)),
                          6, 5, model)
    draw = torch.Generator().manual_seed(0)
    many = torch.cat([rb.sample(generator=draw) for _ in range(100)])
    check_windows(many, 600, 5, model)
    held = model.rows["episode"]
    long_enough = {int(e) for e in held.unique() if int((held == e).sum()) >= 5}
    assert set(many["episode"].tolist()) == long_enough and len(long_enough) > 10


def test_slices_sample_trajectories_uniformly_then_starts():
    rb = ReplayBuffer(zstore.LazyTensorStorage(100), sampler=SliceSampler(slice_len=4))
    rb.extend(episodes([4, 40, 2, 4]))  # three eligible trajectories; one has 37 starts
    counts = torch.bincount(rb.sample(3000, generator=torch.Generator().manual_seed(0))["episode"],
                            minlength=4) / 4
    assert counts[2] == 0
    assert bool(((counts[[0, 1, 3]] - 250).abs() < 60).all())  # uniform over trajectories


def test_slice_sampler_sees_writes_that_bypass_the_buffer():
    storage = zstore.LazyTensorStorage(50)
    rb = ReplayBuffer(storage, sampler=SliceSampler(slice_len=4), batch_size=8)
    rb.extend(episodes([10, 10]))
    rb.sample()
    storage[torch.arange(20)] = episodes([1] * 20)  # every step now ends an episode
    with pytest.raises(ValueError, match="no trajectory has 4 steps or more"):
        rb.sample()
    rb.extend(episodes([6]))  # tracked from the write: only this one is long enough
    assert bool((rb.sample()["t"] >= 0).all())
    assert set(rb.sample(generator=torch.Generator().manual_seed(3))["step"].tolist()) <= set(range(6))


@pytest.mark.parametrize("kind", ["LazyStackStorage", "ListStorage", "CompressedListStorage"])
def test_slices_of_list_storages(kind):
    storage = zstore.CompressedListStorage(100) if kind == "CompressedListStorage" \
        else getattr(zstore, kind)()  # unbounded
    rb = ReplayBuffer(storage, sampler=SliceSampler(slice_len=3), batch_size=6)
    model = RingModel(10**6)
    for lengths in ([4, 5], [2], [6, -3]):  # the newest episode is unfinished
        data = episodes(lengths, first_episode=model.written, first_step=model.written)
        rb.extend(list(data.unbind(0)))
        model.extend(data)
        check_windows(rb.sample(generator=torch.Generator().manual_seed(len(rb))), 2, 3, model)
    assert len(rb) == 20


def test_slice_sampler_arguments_and_errors():
    with pytest.raises(TypeError, match="exactly one of num_slices and slice_len"):
        SliceSampler()
    with pytest.raises(TypeError, match="exactly one of num_slices and slice_len"):
        SliceSampler(num_slices=2, slice_len=3)
    with pytest.raises(ValueError, match="slice_len must be a positive int"):
        SliceSampler(slice_len=0)
    rb = ReplayBuffer(zstore.LazyTensorStorage(50), sampler=SliceSampler(slice_len=4))
    rb.extend(episodes([3, 3]))
    with pytest.raises(ValueError, match="batch_size 6 is not a multiple of slice_len 4"):
        rb.sample(6)
    with pytest.raises(ValueError, match=r"no trajectory has 4 steps or more \(the longest of 2 has 3\)"):
        rb.sample(8)
    other = ReplayBuffer(rb.storage, sampler=SliceSampler(slice_len=2, traj_key="run"))
    with pytest.raises(KeyError, match="traj_key 'run' is not in the data"):
        other.sample(4)
    listed = ReplayBuffer(zstore.ListStorage(10), sampler=SliceSampler(slice_len=2))
    listed.extend(["a", "b", "c"])
    with pytest.raises(TypeError, match="reads its key from TensorDicts; this storage holds other"):
        listed.sample(4)


# -- sample-ahead (prefetch) -----------------------------------------------------------------

class RecordingSampler(Sampler):
    """Draws as ``inner`` does and keeps every index it handed out."""

    def __init__(self, inner: Sampler):
        self.inner, self.draws = inner, []

    def sample(self, storage, batch_size, generator=None):
        index = self.inner.sample(storage, batch_size, generator)
        self.draws.append(index)
        return index

    def mark_update(self, index, data, storage, revision):
        self.inner.mark_update(index, data, storage, revision)


@pytest.mark.parametrize("inner", ["random", "slices"])
def test_batches_drawn_ahead_are_served_next_and_dropped_after_a_write(inner, location):
    storage = zstore.LazyMemmapStorage(60, scratch_dir=location.new(),
                                       storage_options=location.options)
    sampler = RecordingSampler(RandomSampler() if inner == "random" else SliceSampler(slice_len=4))
    rb, model = ReplayBuffer(storage, sampler=sampler, batch_size=16, prefetch=2), RingModel(60)
    data = episodes([9, 12, 7, 15])
    rb.extend(data)
    model.extend(data)
    batch, info = rb.sample(return_info=True)
    assert len(sampler.draws) == 3 and info["index"] is sampler.draws[0]  # now, then 2 ahead
    assert_equal(batch, model.rows[info["index"]])
    batch, info = rb.sample(return_info=True)
    assert info["index"] is sampler.draws[1] and len(sampler.draws) == 4
    assert_equal(batch, model.rows[info["index"]])
    data = episodes([8, 14, 9], first_episode=10, first_step=model.written)  # wraps the ring
    rb.extend(data)
    model.extend(data)
    batch, info = rb.sample(return_info=True)  # the two drawn before the write are dropped
    assert info["index"] is sampler.draws[4] and len(sampler.draws) == 7
    assert_equal(batch, model.rows[info["index"]])
    if inner == "slices":
        check_windows(batch, 4, 4, model)
    batch, info = rb.sample(8, return_info=True)  # another batch size: drawn afresh
    assert info["index"] is sampler.draws[7] and len(info["index"]) == 8
    assert_equal(batch, model.rows[info["index"]])
    draws = len(sampler.draws)
    seeded = rb.sample(generator=torch.Generator().manual_seed(5))  # reproducible, not ahead
    assert len(sampler.draws) == draws + 1
    again = ReplayBuffer(storage, sampler=RecordingSampler(sampler.inner), batch_size=16)
    assert_equal(seeded, again.sample(generator=torch.Generator().manual_seed(5)))


def test_batches_drawn_ahead_load_in_the_background(location, monkeypatch):
    storage = zstore.LazyMemmapStorage(4000, scratch_dir=location.new(),
                                       storage_options=location.options)
    data = TensorDict(obs=torch.randn(4000, 64), batch_size=[4000])
    storage.set(torch.arange(4000), data)
    storage.flush()
    reader = zstore.open(storage.spec.url, location.options, mode="r")
    started = []
    original = reader.prefetch
    monkeypatch.setattr(reader, "prefetch", lambda index, background=False: started.append(
        (index, background, original(index, background))) or started[-1][2])
    rb = ReplayBuffer(reader, writer=zstore.ImmutableDatasetWriter(), batch_size=64, prefetch=1)
    first, info = rb.sample(return_info=True)
    assert torch.equal(first["obs"], data["obs"][info["index"]])
    (ahead, background, future), = started
    assert background and future.result() is None
    misses = reader.cache_stats.misses if reader.cache_stats is not None else None
    second, info = rb.sample(return_info=True)
    assert info["index"] is ahead and torch.equal(second["obs"], data["obs"][ahead])
    if misses is not None:  # a cached store: the batch was loaded before it was asked for
        assert reader.cache_stats.misses == misses
    assert len(started) == 2  # and the next one is on its way


def test_a_failed_draw_ahead_is_raised_by_the_sample_it_belongs_to(tmp_path):
    class Finite(Sampler):  # two batches, then nothing
        calls = 0

        def sample(self, storage, batch_size, generator=None):
            Finite.calls += 1
            if Finite.calls > 2:
                raise RuntimeError("the sampler ran out")
            return torch.arange(batch_size)

    storage = zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "rb"))
    rb = ReplayBuffer(storage, sampler=Finite(), batch_size=4, prefetch=2)
    rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
    assert rb.sample()["obs"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the second draw is ahead
    assert rb.sample()["obs"].tolist() == [0.0, 1.0, 2.0, 3.0]  # served from ahead
    with pytest.raises(RuntimeError, match="the sampler ran out"):
        rb.sample()


def test_prefetch_needs_a_storage_that_loads_ahead():
    with pytest.raises(ValueError, match="a LazyTensorStorage reads its items from memory"):
        ReplayBuffer(zstore.LazyTensorStorage(10), prefetch=1)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="prefetch must be a number of batches"):
            ReplayBuffer(zstore.LazyTensorStorage(10), prefetch=bad)
    assert "prefetch=0" in repr(ReplayBuffer(zstore.LazyTensorStorage(10)))


# -- resuming and checkpoints ----------------------------------------------------------------

def test_resume_after_flush_and_open(location):
    url = location.new()
    storage = zstore.LazyMemmapStorage(60, scratch_dir=url, storage_options=location.options)
    rb = ReplayBuffer(storage, sampler=SliceSampler(num_slices=3, traj_key="episode"), batch_size=12)
    model = RingModel(60)
    for round_ in range(2):
        data = episodes([9, 12, -7], first_episode=3 * round_, first_step=model.written)
        rb.extend(data)
        model.extend(data)
    storage.flush()
    again = ReplayBuffer(zstore.open(url, location.options),
                         sampler=SliceSampler(num_slices=3, traj_key="episode"), batch_size=12)
    assert len(again) == len(rb) == 56 and again.writer._cursor == 56
    for seed in range(3):
        assert_equal(again.sample(generator=torch.Generator().manual_seed(seed)),
                     rb.sample(generator=torch.Generator().manual_seed(seed)))
    data = episodes([8, 8], first_episode=50, first_step=model.written)  # wraps the ring
    again.extend(data)
    model.extend(data)
    assert again.writer._cursor == model.cursor == 12
    check_windows(again.sample(generator=torch.Generator().manual_seed(0)), 3, 4, model)
    assert_equal(again[torch.arange(60)], model.rows)


def test_read_only_dataset_samples_and_refuses_writes(location):
    url = location.new()
    storage = zstore.LazyMemmapStorage(30, scratch_dir=url, storage_options=location.options)
    ReplayBuffer(storage).extend(episodes([10, 10, 10]))
    storage.flush()
    dataset = ReplayBuffer(zstore.open(url, location.options, mode="r"),
                           sampler=SliceSampler(slice_len=10), writer=zstore.ImmutableDatasetWriter())
    batch = dataset.sample(20, generator=torch.Generator().manual_seed(0))
    assert batch["step"].tolist() == list(range(10)) * 2
    with pytest.raises(RuntimeError, match="This dataset doesn't allow writing."):
        dataset.extend(episodes([2]))


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "LazyTensorStorage"])
def test_dumps_loads_round_trip(kind, tmp_path):
    local = _Directory(tmp_path)
    rb = ReplayBuffer(storage_of(kind, local, 40), batch_size=8)
    rb.extend(episodes([20, 30]))
    rb.dumps(tmp_path / "ckpt")
    fresh = ReplayBuffer(storage_of(kind, local, 40), batch_size=8)
    fresh.loads(tmp_path / "ckpt")
    assert len(fresh) == 40 and fresh.writer._cursor == rb.writer._cursor == 10
    assert_equal(fresh[torch.arange(40)], rb[torch.arange(40)])


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "LazyTensorStorage"])
def test_dumps_to_a_store_spec_saves_both_parts_with_its_options(kind, location):
    """Before: the storage part was saved at a bare URL, without the spec's storage options
    (on S3: "bucket ... does not exist" from the default endpoint)."""
    target = zstore.StoreSpec.parse(location.new("save"), location.options)
    rb = ReplayBuffer(storage_of(kind, location, 40), batch_size=8)
    rb.extend(episodes([20, 30]))
    rb.dumps(target)
    fresh = ReplayBuffer(storage_of(kind, location, 40))
    fresh.loads(target)
    assert len(fresh) == 40 and fresh.writer._cursor == rb.writer._cursor == 10
    assert fresh.batch_size == 8
    assert_equal(fresh[torch.arange(40)], rb[torch.arange(40)])


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "LazyTensorStorage"])
def test_a_save_cut_short_after_its_storage_is_refused_not_loaded_half_old(kind, location,
                                                                           monkeypatch):
    """Before: a save cut short between the storage's commit and buffer.json loaded the new
    rows with the old writer state (9 rows, cursor 4: the next extend overwrote the newest)."""
    target = zstore.StoreSpec.parse(location.new("save"), location.options)
    rb = ReplayBuffer(storage_of(kind, location, 10))
    rb.extend(episodes([4]))
    rb.dumps(target)
    rb.extend(episodes([5]))

    def cut_short():
        raise KeyboardInterrupt("killed after the storage's commit")

    monkeypatch.setattr(rb.writer, "state_dict", cut_short)
    with pytest.raises(KeyboardInterrupt):
        rb.dumps(target)
    fresh = ReplayBuffer(storage_of(kind, location, 10))
    with pytest.raises(zstore.StoreNotFoundError, match="is incomplete: its save was cut short"):
        fresh.loads(target)
    monkeypatch.undo()
    rb.dumps(target)  # the next save is whole again
    fresh.loads(target)
    assert len(fresh) == 9 and fresh.writer._cursor == 9
    assert_equal(fresh[torch.arange(9)], rb[torch.arange(9)])


def test_dumps_of_a_list_storage_refuses_and_writes_nothing(tmp_path):
    rb = ReplayBuffer(zstore.ListStorage(10))
    rb.add(torch.zeros(2))
    with pytest.raises(NotImplementedError, match="ListStorage doesn't support serialization"):
        rb.dumps(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "buffer.json").exists()


def test_loads_names_what_is_missing_or_foreign(tmp_path):
    rb = ReplayBuffer(zstore.LazyTensorStorage(10))
    with pytest.raises(zstore.StoreNotFoundError, match="buffer.json is missing"):
        rb.loads(tmp_path / "nothing")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "buffer.json").write_text(json.dumps({"name": "other", "version": 1}))
    with pytest.raises(zstore.FormatVersionError, match="'other' version 1"):
        rb.loads(tmp_path / "foreign")


@pytest.mark.parametrize("own", [None, 3])
def test_loads_restores_the_saved_batch_size(own, tmp_path):
    rb = ReplayBuffer(zstore.LazyTensorStorage(10), batch_size=6)
    rb.extend(episodes([5]))
    rb.dumps(tmp_path / "ckpt")
    fresh = ReplayBuffer(zstore.LazyTensorStorage(10), batch_size=own)
    fresh.loads(tmp_path / "ckpt")
    assert fresh.batch_size == 6 and fresh.sample()["t"].shape == (6,)


def test_a_storage_ensemble_is_refused_with_the_ways_out():
    ensemble = zstore.StorageEnsemble(zstore.LazyTensorStorage(5), zstore.LazyTensorStorage(5))
    for prefetch in (0, 1):
        with pytest.raises(TypeError, match="StorageEnsemble cannot back.*ReplayBufferEnsemble"
                                            ".*one zstore.ReplayBuffer per member"):
            ReplayBuffer(ensemble, writer=zstore.ImmutableDatasetWriter(), prefetch=prefetch)
