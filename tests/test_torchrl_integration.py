"""zstore.torchrl: TorchRL's replay buffers over zstore storages, compared with TorchRL's own.

Every test builds the same buffer twice — once over a ``zstore.torchrl`` storage,
once over the TorchRL storage of the same name — feeds both the same data and
checks that they return the same samples under the same seed
(``torch.manual_seed`` before each sample). Persistent storages run on
memory://, a local directory and S3 on loopback.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import zstore
from conftest import LOCATIONS, Location

pytestmark = pytest.mark.torchrl
T = pytest.importorskip("torchrl.data")
zt = pytest.importorskip("zstore.torchrl")

CAPACITY = 50
BATCH = 16
EPISODE_LENGTHS = (5, 9, 3, 12, 7)  # the 3-step episodes are too short for 4-step slices


def transitions(n: int, start: int = 0) -> TensorDict:
    """``n`` TED transitions (steps ``start`` ...) of episodes cycling through EPISODE_LENGTHS."""
    bounds = torch.tensor(EPISODE_LENGTHS).repeat(1 + (start + n) // 3).cumsum(0)
    step = torch.arange(start, start + n)
    episode = torch.searchsorted(bounds, step, right=True)
    done = torch.isin(step + 1, bounds).unsqueeze(-1)
    obs = torch.stack([step.float(), episode.float()], -1)
    return TensorDict({
        "observation": obs, "episode": episode, "action": (step % 3).float().unsqueeze(-1),
        ("next", "observation"): obs + 0.5, ("next", "done"): done,
        ("next", "reward"): step.float().unsqueeze(-1) / 10,
    }, batch_size=[n])


# -- the storages, paired -------------------------------------------------------------------

PERSISTENT = ("LazyMemmapStorage", "CompressedListStorage")
IN_MEMORY = ("ListStorage", "LazyStackStorage", "TensorStorage", "LazyTensorStorage")
LIST_LIKE = ("ListStorage", "CompressedListStorage")  # storage[:] is a list: no SliceSampler


def make_pair(kind: str, location, tmp_path, capacity: int = CAPACITY, **kw):
    """``(zstore.torchrl storage, torchrl storage)`` of class ``kind``."""
    if kind == "TensorStorage":
        full = transitions(capacity)
        return zt.TensorStorage(full.clone(), **kw), T.TensorStorage(full.clone(), **kw)
    ours_cls, theirs_cls = getattr(zt, kind), getattr(T, kind)
    if kind == "LazyMemmapStorage":
        ours = ours_cls(capacity, scratch_dir=location.new(), storage_options=location.options, **kw)
        return ours, theirs_cls(capacity, scratch_dir=tmp_path / "torchrl", **kw)
    if kind == "CompressedListStorage":
        ours = ours_cls(capacity, scratch_dir=location.new(), storage_options=location.options)
        return ours, theirs_cls(capacity)
    return ours_cls(capacity, **kw), theirs_cls(capacity, **kw)


#: Persistent storages run on every location, the others once (they live in RAM).
CASES = [pytest.param(k, place, id=f"{k}-{place}") for k in PERSISTENT
         for place in LOCATIONS] + [pytest.param(k, None, id=k) for k in IN_MEMORY]


all_storages = pytest.mark.parametrize("kind, location", CASES, indirect=["location"])
lazy_storages = pytest.mark.parametrize(  # those that start empty
    "kind, location", [case for case in CASES if case.values[0] != "TensorStorage"],
    indirect=["location"])


SAMPLERS = {
    "random": lambda: T.RandomSampler(),
    "without_replacement": lambda: T.SamplerWithoutReplacement(),
    "slice_traj": lambda: T.SliceSampler(num_slices=4, traj_key="episode"),
    "slice_end": lambda: T.SliceSampler(slice_len=4, end_key=("next", "done")),
    "slice_cached": lambda: T.SliceSampler(num_slices=4, traj_key="episode", cache_values=True),
    "slice_without_replacement": lambda: T.SliceSamplerWithoutReplacement(
        num_slices=4, end_key=("next", "done")),
}


def fill(*buffers, batches=((0, 23), (23, 23), (46, 23))) -> None:
    """Extend every buffer with the same batches (three of 23 rows wrap a 50-row storage)."""
    for start, n in batches:
        data = transitions(n, start)
        for rb in buffers:
            rb.extend(data.clone())


def _sample(rb, seed: int, kw: dict):
    torch.manual_seed(seed)
    try:
        return rb.sample(**kw)
    except RuntimeError as exc:  # e.g. a sampler without replacement that ran dry
        return exc


def assert_same_samples(ours, theirs, rounds: int = 4, **kw) -> None:
    """Same seed, same batch (or the same error) for ``rounds`` samples; at least one batch."""
    batches = 0
    for seed in range(rounds):
        got, want = _sample(ours, seed, kw), _sample(theirs, seed, kw)
        if isinstance(want, Exception):
            assert type(got) is type(want) and str(got) == str(want)
            continue
        assert_equal(got, want)
        batches += 1
    assert batches


def assert_equal(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
        return
    assert set(got.keys(True, True)) == set(want.keys(True, True))
    for key in want.keys(True, True):
        assert torch.equal(got.get(key), want.get(key)), key


# -- the mechanism --------------------------------------------------------------------------

TWINS = ("ListStorage", "LazyStackStorage", "CompressedListStorage", "TensorStorage",
         "LazyTensorStorage", "LazyMemmapStorage")


@pytest.mark.parametrize("name", TWINS)
def test_every_zstore_member_wins_the_mro(name):
    ours, zstore_cls, torchrl_cls = getattr(zt, name), getattr(zstore, name), getattr(T, name)
    assert issubclass(ours, zstore_cls) and issubclass(ours, torchrl_cls)
    zstore_names = {n for c in zstore_cls.__mro__ if c is not object for n in vars(c)}
    for member in zstore_names - {"__dict__", "__weakref__", "__module__", "__doc__"}:
        resolved = next(c for c in ours.__mro__ if member in vars(c))
        assert resolved in zstore_cls.__mro__ or resolved.__module__ == "zstore.torchrl", member
    mro = ours.__mro__
    assert max(mro.index(c) for c in zstore_cls.__mro__[:-1]) < mro.index(torchrl_cls)


def test_import_zstore_does_not_import_torchrl():
    code = ("import sys, zstore; "
            "assert 'torchrl' not in sys.modules and 'zstore.torchrl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_storage_class_name_in_the_store_is_zstores(location):
    storage = zt.LazyMemmapStorage(10, scratch_dir=location.new(), storage_options=location.options)
    rb = T.TensorDictReplayBuffer(storage=storage)
    rb.extend(transitions(4))
    storage.flush()
    plain = zstore.open(storage.scratch_dir, location.options, mode="r")
    assert type(plain) is zstore.LazyMemmapStorage and len(plain) == 4
    again = zt.open(storage.scratch_dir, location.options, mode="r")
    assert type(again) is zt.LazyMemmapStorage
    assert_equal(again.get(torch.arange(4)), storage.get(torch.arange(4)))


# -- samplers and writers -------------------------------------------------------------------

@all_storages
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_tensordict_buffer_samples_like_torchrl(kind, location, sampler, tmp_path):
    ours_storage, theirs_storage = make_pair(kind, location, tmp_path)
    ours = T.TensorDictReplayBuffer(storage=ours_storage, sampler=SAMPLERS[sampler](),
                                    batch_size=BATCH)
    theirs = T.TensorDictReplayBuffer(storage=theirs_storage, sampler=SAMPLERS[sampler](),
                                      batch_size=BATCH)
    if kind != "TensorStorage":  # a TensorStorage is full from the start: sample it as it is
        fill(ours, theirs)
    assert len(ours) == len(theirs)
    if sampler.startswith("slice") and kind in LIST_LIKE:
        for rb in (ours, theirs):  # TorchRL needs storage[:] to be a TensorDict
            with pytest.raises(RuntimeError, match="Could not get a tensordict"):
                rb.sample()
        return
    assert_same_samples(ours, theirs)
    if kind != "TensorStorage":  # later writes reach the samplers (and their caches) alike
        fill(ours, theirs, batches=((69, 17),))
        assert_same_samples(ours, theirs)


@pytest.mark.parametrize("kind_", ["ListStorage", "LazyTensorStorage", "LazyMemmapStorage",
                                   "CompressedListStorage"])
def test_plain_buffer_with_round_robin_writer(kind_, tmp_path):
    location = _memory_location()
    ours_storage, theirs_storage = make_pair(kind_, location, tmp_path)
    ours = T.ReplayBuffer(storage=ours_storage, writer=T.RoundRobinWriter(), batch_size=BATCH)
    theirs = T.ReplayBuffer(storage=theirs_storage, writer=T.RoundRobinWriter(), batch_size=BATCH)
    fill(ours, theirs)
    assert ours.writer._cursor == theirs.writer._cursor == 19
    assert_same_samples(ours, theirs)
    for rb in (ours, theirs):
        rb.add(transitions(1, 69)[0])
    assert_equal(ours[19], theirs[19])


def test_tensor_data_without_tensordict(tmp_path):
    ours = T.ReplayBuffer(storage=zt.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path / "z"),
                          batch_size=BATCH)
    theirs = T.ReplayBuffer(storage=T.LazyMemmapStorage(CAPACITY), batch_size=BATCH)
    for rb in (ours, theirs):
        rb.extend(torch.arange(60).reshape(30, 2))
        rb.extend(torch.arange(60, 100).reshape(20, 2) * 10)
    assert_same_samples(ours, theirs)


def test_immutable_dataset_writer_over_a_reopened_dataset(location):
    data = transitions(CAPACITY)
    writer_side = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                       storage_options=location.options)
    T.TensorDictReplayBuffer(storage=writer_side).extend(data)
    writer_side.flush()
    dataset = zt.open(writer_side.scratch_dir, location.options, mode="r")
    for sampler in ("random", "slice_traj"):
        ours = T.TensorDictReplayBuffer(storage=dataset, writer=T.ImmutableDatasetWriter(),
                                        sampler=SAMPLERS[sampler](), batch_size=BATCH)
        theirs = T.TensorDictReplayBuffer(storage=T.TensorStorage(data.clone()),
                                          writer=T.ImmutableDatasetWriter(),
                                          sampler=SAMPLERS[sampler](), batch_size=BATCH)
        assert_same_samples(ours, theirs)
        for action in (lambda rb: rb.extend(data), lambda rb: rb.add(data[0]), lambda rb: rb.empty()):
            with pytest.raises(RuntimeError, match="This dataset doesn't allow writing."):
                action(ours)
    assert len(dataset) == CAPACITY


def test_ndim2_storage_samples_like_torchrl(tmp_path):
    def rollout(t: int) -> TensorDict:  # [time, env]: 3 envs, one episode ending every 5 steps
        steps = torch.arange(t * 3, (t + 6) * 3).reshape(6, 3)
        return TensorDict({"obs": steps.float().unsqueeze(-1),
                           ("next", "done"): (steps // 3 % 5 == 4).unsqueeze(-1)}, batch_size=[6, 3])

    for sampler in (lambda: T.RandomSampler(), lambda: T.SamplerWithoutReplacement(),
                    lambda: T.SliceSampler(slice_len=3, end_key=("next", "done"))):
        ours = T.TensorDictReplayBuffer(
            storage=zt.LazyMemmapStorage(30, ndim=2, scratch_dir=_memory_location().new()),
            sampler=sampler(), batch_size=12)
        theirs = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(30, ndim=2),
                                          sampler=sampler(), batch_size=12)
        for t in (0, 6):
            ours.extend(rollout(t))
            theirs.extend(rollout(t))
        assert ours.storage.max_size == theirs.storage.max_size == 30
        assert_same_samples(ours, theirs)


def test_prioritized_sampler(tmp_path):
    try:
        T.PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.9)
    except RuntimeError as exc:
        pytest.skip(f"TorchRL's compiled extension does not load here, so its prioritized "
                    f"samplers cannot be constructed: {exc}")
    ours_storage, theirs_storage = make_pair("LazyMemmapStorage", _memory_location(), tmp_path)
    buffers = [T.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=s, batch_size=BATCH)
               for s in (ours_storage, theirs_storage)]
    fill(*buffers)
    for rb in buffers:
        rb.update_priority(torch.arange(10), torch.linspace(0.1, 5, 10))
    assert_same_samples(*buffers)


# -- state: state_dict, empty, pickling, dumps/loads, resuming -------------------------------

@all_storages
def test_state_dict_round_trip(kind, location, tmp_path):
    ours_storage, theirs_storage = make_pair(kind, location, tmp_path)
    ours = T.TensorDictReplayBuffer(storage=ours_storage, batch_size=BATCH)
    theirs = T.TensorDictReplayBuffer(storage=theirs_storage, batch_size=BATCH)
    if kind != "TensorStorage":
        fill(ours, theirs)
    fresh_storage, _ = make_pair(kind, location, tmp_path / "fresh")
    fresh = T.TensorDictReplayBuffer(storage=fresh_storage, batch_size=BATCH)
    fresh.load_state_dict(ours.state_dict())
    assert len(fresh) == len(theirs)
    assert_same_samples(fresh, theirs)
    if kind != "TensorStorage":  # the writer's cursor came along: the next rows land alike
        fill(fresh, theirs, batches=((69, 12),))
        assert_same_samples(fresh, theirs)


@lazy_storages
def test_empty_then_refill(kind, location, tmp_path):
    ours_storage, theirs_storage = make_pair(kind, location, tmp_path)
    ours = T.TensorDictReplayBuffer(storage=ours_storage, batch_size=BATCH)
    theirs = T.TensorDictReplayBuffer(storage=theirs_storage, batch_size=BATCH)
    fill(ours, theirs)
    for rb in (ours, theirs):
        rb.empty()
        assert len(rb) == 0
    fill(ours, theirs, batches=((100, 10),))
    assert len(ours) == len(theirs) == 10
    assert_same_samples(ours, theirs)


def test_buffer_pickles_and_shares_a_persistent_store(location):
    storage = zt.LazyMemmapStorage(CAPACITY, scratch_dir=location.new(),
                                   storage_options=location.options)
    rb = T.TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    fill(rb)
    copy = pickle.loads(pickle.dumps(rb))
    assert type(copy.storage) is zt.LazyMemmapStorage
    assert copy.storage.scratch_dir == storage.scratch_dir and len(copy) == len(rb)
    assert_same_samples(copy, rb)
    assert type(pickle.loads(pickle.dumps(copy)).storage) is zt.LazyMemmapStorage  # twice


def test_reopened_storage_resumes_with_zstore_writer(location):
    url = location.new()
    first = T.TensorDictReplayBuffer(
        storage=zt.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options))
    reference = T.TensorDictReplayBuffer(storage=T.LazyTensorStorage(CAPACITY), batch_size=BATCH)
    fill(first, reference, batches=((0, 23), (23, 23)))
    first.storage.flush()
    again = T.TensorDictReplayBuffer(storage=zt.open(url, location.options),
                                     writer=zt.TensorDictRoundRobinWriter(), batch_size=BATCH)
    assert again.writer._cursor == 46
    fill(again, reference, batches=((46, 23),))
    assert again.writer._cursor == reference.writer._cursor == 19
    assert_same_samples(again, reference)


def test_plain_torchrl_writer_restarts_at_zero(location):
    """Without zstore's writer, TorchRL's starts a reopened buffer over at row 0 (documented)."""
    url = location.new()
    first = T.ReplayBuffer(storage=zt.LazyMemmapStorage(CAPACITY, scratch_dir=url,
                                                        storage_options=location.options))
    first.extend(transitions(30))
    first.storage.flush()
    again = T.ReplayBuffer(storage=zt.open(url, location.options), writer=T.RoundRobinWriter())
    assert again.writer._cursor == 0
    again = T.ReplayBuffer(storage=zt.open(url, location.options), writer=zt.RoundRobinWriter())
    assert again.writer._cursor == 30 and again.writer._write_count == 30


CHECKPOINTED = ("LazyMemmapStorage", "CompressedListStorage", "TensorStorage", "LazyTensorStorage")


@pytest.mark.parametrize("kind_", CHECKPOINTED)
def test_dumps_loads_round_trip(kind_, tmp_path):
    location = _memory_location()
    ours_storage, theirs_storage = make_pair(kind_, location, tmp_path)
    ours = T.TensorDictReplayBuffer(storage=ours_storage, batch_size=BATCH)
    theirs = T.TensorDictReplayBuffer(storage=theirs_storage, batch_size=BATCH)
    if kind_ != "TensorStorage":
        fill(ours, theirs)
    ours.dumps(tmp_path / "ours")
    fresh_storage, _ = make_pair(kind_, location, tmp_path / "fresh")
    fresh = T.TensorDictReplayBuffer(storage=fresh_storage, batch_size=BATCH)
    fresh.loads(tmp_path / "ours")
    assert len(fresh) == len(theirs)
    assert_same_samples(fresh, theirs)


@pytest.mark.parametrize("kind_", ["ListStorage", "LazyStackStorage"])
def test_list_storages_refuse_dumps_like_torchrl(kind_, tmp_path):
    ours_storage, theirs_storage = make_pair(kind_, None, tmp_path)
    for name, storage in (("ours", ours_storage), ("theirs", theirs_storage)):
        rb = T.TensorDictReplayBuffer(storage=storage)
        fill(rb)
        with pytest.raises(NotImplementedError, match="ListStorage doesn't support serialization"):
            rb.dumps(tmp_path / name)


def _memory_location() -> Location:
    return Location("memory", f"memory://zstore-tests/{uuid.uuid4().hex}", {})


@pytest.fixture(autouse=True)
def _quiet_torchrl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def test_torchrl_class_of_a_zstore_subclass():
    class Mine(zstore.LazyMemmapStorage):
        """A user's subclass."""

    twin = zt.torchrl_class(Mine)
    assert issubclass(twin, Mine) and issubclass(twin, T.LazyMemmapStorage)
    assert zt.torchrl_class(Mine) is twin and zt.torchrl_class(twin) is twin
    assert zt.torchrl_class(zstore.ListStorage) is zt.ListStorage
    with pytest.raises(TypeError, match="dict is not a zstore storage class"):
        zt.torchrl_class(dict)


def test_item_assignment_writes_through_like_torchrl(tmp_path):
    """``rb[index] = data`` is the write that reaches a zstore store (docs/torchrl.md §4)."""
    ours_storage, theirs_storage = make_pair("LazyMemmapStorage", _memory_location(), tmp_path)
    buffers = [T.TensorDictReplayBuffer(storage=s, batch_size=BATCH)
               for s in (ours_storage, theirs_storage)]
    fill(*buffers)
    data = transitions(2, 500)
    data["index"] = torch.tensor([3, 7])
    for rb in buffers:
        rb[torch.tensor([3, 7])] = data.clone()
    assert_equal(buffers[0][:], buffers[1][:])
    assert_equal(buffers[0].storage[7], data[1])
    assert buffers[0].writer._cursor == buffers[1].writer._cursor == 19


def test_compressed_storage_collates_with_stack_items():
    ours = T.TensorDictReplayBuffer(storage=zt.CompressedListStorage(CAPACITY),
                                    collate_fn=zstore.stack_items, batch_size=BATCH)
    theirs = T.TensorDictReplayBuffer(storage=T.CompressedListStorage(CAPACITY), batch_size=BATCH)
    fill(ours, theirs)
    torch.manual_seed(0)
    got = ours.sample()
    torch.manual_seed(0)
    want = theirs.sample()
    assert type(got) is TensorDict and got.batch_size == (BATCH,)
    assert_equal(got, want.to_tensordict())


DOCS = Path(__file__).resolve().parents[1] / "docs" / "torchrl.md"
#: Every example but §6's Ray recipe, which names a placeholder bucket endpoint
#: (tests/test_ray.py runs the same calls against moto, in the Ray tests' worker).
DOC_BLOCKS = [block for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
              if "import ray" not in block]


@pytest.mark.parametrize("number", range(len(DOC_BLOCKS)))
def test_docs_examples_run(number, tmp_path):
    """Every example of docs/torchrl.md runs as a script, as written, and prints what its last
    comment says. Run by ``exec`` inside pytest, the multi-process example passed while, as
    a script, its spawned processes died importing it (it lacked its ``__main__`` guard)."""
    block = DOC_BLOCKS[number]
    expected = [line.split("# ")[-1] for line in block.splitlines() if "print(" in line]
    script = tmp_path / f"example_{number}.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected[-1].strip()


@pytest.mark.parametrize("kind_", [*IN_MEMORY, "CompressedListStorage"])
def test_in_memory_buffers_pickle_twice(kind_, tmp_path):
    """TorchRL's Storage.__setstate__ would add multiprocessing counters that refuse a second
    pickling; zstore's state comes back as it was."""
    storage, _ = make_pair(kind_, _memory_location(), tmp_path)
    rb = T.TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    if kind_ != "TensorStorage":
        fill(rb)
    copy = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(rb))))
    assert type(copy.storage) is type(storage)
    assert not hasattr(copy.storage, "_mutation_revision_value")
    assert_same_samples(copy, rb)


@pytest.mark.parametrize("name", ["TensorStorageCheckpointer", "H5StorageCheckpointer",
                                  "FlatStorageCheckpointer", "NestedStorageCheckpointer"])
def test_torchrl_own_checkpointers_are_refused_with_zstore_equivalent(name, tmp_path):
    """They died later with "'NoneType' object has no attribute 'shape'"."""
    from torchrl.data.replay_buffers import checkpointers as trl_ckpt

    storage = zt.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "rb"))
    with pytest.raises(TypeError, match=rf"from checkpoint import {name}"):
        T.TensorDictReplayBuffer(storage=storage, checkpointer=getattr(trl_ckpt, name)())
    with pytest.raises(TypeError, match="TorchRL's"):
        storage.checkpointer = getattr(trl_ckpt, name)()
    import checkpoint

    rb = T.TensorDictReplayBuffer(storage=storage, checkpointer=getattr(checkpoint, name)())
    rb.extend(TensorDict(obs=torch.arange(4.0), batch_size=[4]))
    rb.dumps(tmp_path / "ckpt")
    fresh = T.TensorDictReplayBuffer(storage=zt.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "b")),
                                     checkpointer=getattr(checkpoint, name)())
    fresh.loads(tmp_path / "ckpt")
    assert fresh[:]["obs"].tolist() == [0.0, 1.0, 2.0, 3.0]


def _resident_mib() -> float:
    """This process's resident memory (``VmRSS``), in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_narrow_key_of_a_vast_lazy_buffer_costs_ram_for_its_rows_not_its_capacity():
    """TorchRL's ``SliceSampler`` reads its trajectory key of every row at every sample,
    which zstore keeps in memory (``zstore.columns.ColumnMirror``). The copy was zeroed
    for the whole capacity at the first sample: 1 GiB for 100 rows of a capacity of 2**27
    (16.7 GB and 30 s at 2**31). Its pages now come as rows are written."""
    storage = zt.LazyMemmapStorage(2**27, scratch_dir=f"memory://zstore-tests/{uuid.uuid4().hex}")
    rb = T.TensorDictReplayBuffer(storage=storage, batch_size=8,
                                  sampler=T.SliceSampler(slice_len=4, traj_key="traj"))
    traj = torch.arange(100) // 10
    rb.extend(TensorDict(obs=torch.arange(100.0), traj=traj, batch_size=[100]))
    before = _resident_mib()
    sample = rb.sample()
    assert rb[:]["traj"].tolist() == traj.tolist()
    assert _resident_mib() - before < 256  # (the capacity's copy: 1024)
    windows = sample["traj"].view(2, 4)  # every window inside one trajectory
    assert (windows == windows[:, :1]).all() and torch.equal(sample["obs"] // 10, sample["traj"].float())
    storage.cleanup()


def test_a_key_of_empty_cells_reads_from_a_lazy_slice():
    """A key whose cells hold no element (shape ``[rows, 0]``) passes as narrow, and its
    in-memory copy came from a byte array viewed as its dtype, which torch refuses when
    empty: ``storage[0:4]["empty"]`` raised."""
    storage = zt.LazyMemmapStorage(10, scratch_dir=f"memory://zstore-tests/{uuid.uuid4().hex}")
    storage.set(torch.arange(4), TensorDict(obs=torch.ones(4, 3), empty=torch.zeros(4, 0),
                                            batch_size=[4]))
    assert storage[0:4]["empty"].shape == (4, 0)
    assert storage[0:4]["obs"].tolist() == [[1.0] * 3] * 4
    storage.cleanup()
