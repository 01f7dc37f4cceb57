"""StorageEnsemble against TorchRL's own, and as a persistent index reopened by zstore.open."""

from __future__ import annotations

import itertools
import json
import pickle
import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage as TorchRLLazyTensorStorage
from torchrl.data.replay_buffers.storages import (
    StorageEnsemble as TorchRLStorageEnsemble,
)

import zstore
from zstore.errors import (FormatVersionError, NotAZStoreError, ReadOnlyError, StoreExistsError,
                           StoreNotFoundError)
from zstore.store import StoreSpec

SIZES = (5, 7, 4)


def member_rows(member: int, n: int) -> TensorDict:
    """Row ``i`` of member ``m`` holds ``(m, i)``: any mix-up is visible."""
    index = torch.arange(n)
    return TensorDict(x=torch.stack([torch.full((n,), member), index], 1),
                      y=TensorDict(z=index.double() / 10 + member, batch_size=[n]), batch_size=[n])


def filled(storage, member: int, n: int):
    storage.set(torch.arange(n), member_rows(member, n))
    return storage


def reference() -> TorchRLStorageEnsemble:
    return TorchRLStorageEnsemble(*(filled(TorchRLLazyTensorStorage(10), m, n)
                                    for m, n in enumerate(SIZES)))


def members_at(location, base: str) -> list:
    storages = []
    for m, n in enumerate(SIZES):
        storage = zstore.LazyMemmapStorage(10, scratch_dir=f"{base}/member-{m}",
                                           storage_options=location.options, codec="zstd", chunks=4)
        storages.append(filled(storage, m, n))
        storage.flush()
    return storages


def assert_same(ours, theirs) -> None:
    if isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b)
    elif isinstance(theirs, tuple):
        assert ours[0] == theirs[0]
        assert_same(ours[1], theirs[1])
    elif isinstance(theirs, TorchRLStorageEnsemble):
        assert isinstance(ours, zstore.StorageEnsemble) and len(ours) == len(theirs)
        for a, b in zip(ours._storages, theirs._storages):
            assert_same(a, b)
    elif hasattr(theirs, "_storage"):  # a TorchRL member: compare what it holds
        assert len(ours) == len(theirs)
        assert (ours[:] == theirs[:]).all()
    else:
        assert (ours == theirs).all(), (ours, theirs)


INDEXES = [0, 2, -1, slice(None), slice(1, 3), slice(None, None, 2), [2, 0], range(1, 3),
           np.array([0, 2]), torch.tensor([1]),
           (0, slice(1, 3)), (1, torch.tensor([0, 6])), (slice(None), 0), (slice(0, 2), 1),
           (Ellipsis, 1)]


def test_matches_torchrl(location):
    ours = zstore.StorageEnsemble(*members_at(location, location.new("ens")))
    theirs = reference()
    assert len(ours) == len(theirs) == 3
    assert ours.max_size == theirs.max_size == 30
    query = TensorDict(buffer_ids=torch.tensor([2, 0, 2]),
                       index=torch.tensor([[3, 0], [4, 1], [0, 0]]), batch_size=[3])
    assert_same(ours.get(query), theirs.get(query))
    plain = {"buffer_ids": [1, 1], "index": [torch.tensor([6, 5]), 3]}
    assert_same(ours.get(plain), theirs.get(plain))
    for index in INDEXES:
        if isinstance(index, tuple) and index[0] is Ellipsis:
            expected = [m[1] for m in theirs._storages]  # TorchRL nests the tuple here (a bug)
            assert_same(ours[index], expected)
            continue
        assert_same(ours[index], theirs[index])
    assert ours[slice(None)] is ours


def test_errors_match_torchrl(tmp_path):
    ours = zstore.StorageEnsemble(*members_at_local(tmp_path))
    theirs = reference()
    for bad, error in ((torch.tensor([], dtype=torch.int64), IndexError), ([], TypeError),
                       (torch.ones(2, 2, dtype=torch.int64), RuntimeError),
                       (torch.tensor([0.5]), TypeError)):
        with pytest.raises(error) as expected:
            theirs[bad]
        with pytest.raises(error) as got:
            ours[bad]
        assert str(got.value).replace("zstore.storages.ensemble", "X") == \
            str(expected.value).replace("torchrl.data.replay_buffers.storages", "X")
    for method in ("add", "extend"):
        with pytest.raises(RuntimeError) as expected:
            getattr(theirs, method)(member_rows(0, 1))
        assert str(expected.value) == ""  # TorchRL's: a bare RuntimeError()
        with pytest.raises(RuntimeError, match=rf"StorageEnsemble only reads its members: write to one of "
                                               rf"them \(ensemble\[i\].{method}\(...\)\)"):
            getattr(ours, method)(member_rows(0, 1))
    assert theirs.set(0, member_rows(0, 1)) is None  # TorchRL's writes nothing, silently
    with pytest.raises(NotImplementedError, match="StorageEnsemble only reads its members"):
        ours.set(0, member_rows(0, 1))
    with pytest.raises(TypeError, match="transforms must have the same length"):
        zstore.StorageEnsemble(*ours._storages, transforms=[None])


def test_integer_scalars_ellipsis_and_masks_select_members(tmp_path):
    """``ens[np.int64(1)]`` and ``ens[torch.tensor(1)]`` (a buffer id a SamplerEnsemble
    samples) raised "has no len()", ``ens[...]`` too, and a boolean mask selected members
    1, 0, 1 (flags read as ids). Reference: TorchRL's ensemble indexed with the ids they name."""
    ours, theirs = zstore.StorageEnsemble(*members_at_local(tmp_path)), reference()
    for scalar in (np.int64(1), torch.tensor(1), np.array(2), torch.tensor(-1)):
        assert_same(ours[scalar], theirs[int(scalar)])
    assert_same(ours[torch.tensor(1), slice(0, 2)], theirs[1, slice(0, 2)])
    assert ours[...] is ours
    for mask in ([True, False, True], np.array([True, False, True]), torch.tensor([True, False, True])):
        assert_same(ours[mask], theirs[[0, 2]])


def test_bad_member_ids_and_requests_are_named(tmp_path):
    """A buffer id beyond the members raised "tuple index out of range", an int one TorchRL's
    "Expected an index of type ... got <class 'int'>"; ``get`` with fewer buffer ids than
    indexes dropped the extra indexes (TorchRL's does: reference below), and without
    ``buffer_ids`` raised "'NoneType' object is not iterable"."""
    ours, theirs = zstore.StorageEnsemble(*members_at_local(tmp_path)), reference()
    transformed = zstore.StorageEnsemble(*ours._storages, transforms=[None] * 3)
    for ensemble, bad in itertools.product((ours, transformed), (3, -4, torch.tensor([0, 3]), [3])):
        with pytest.raises(IndexError, match=r"member (3|-4) is out of range: the ensemble has 3 members"):
            ensemble[bad]
    for bad in (1.0, None, "a"):  # TorchRL: "object of type 'float' has no len()", ...
        with pytest.raises(IndexError, match="Expected an index of type torch.Tensor, range"):
            ours[bad]
    with pytest.raises(IndexError, match="boolean mask of 2 flags cannot select among 3 members"):
        ours[torch.tensor([True, False])]
    uneven = {"buffer_ids": [1], "index": [torch.tensor([0]), torch.tensor([1])]}
    assert len(theirs.get(uneven)) == 1  # TorchRL: the second index is silently dropped
    with pytest.raises(ValueError, match="1 buffer_ids but 2 entries of index"):
        ours.get(uneven)
    with pytest.raises(IndexError, match="member 5 is out of range"):
        ours.get({"buffer_ids": torch.tensor([1, 5]), "index": [torch.tensor([0]), torch.tensor([0])]})
    for request in ({"index": [torch.tensor([0])]}, [0, 1]):
        with pytest.raises(TypeError, match="takes a mapping with 'buffer_ids' and 'index'"):
            ours.get(request)


def members_at_local(tmp_path) -> list:
    storages = []
    for m, n in enumerate(SIZES):
        storages.append(filled(zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / f"m{m}")), m, n))
    return storages


def test_transforms_rng_and_state_dict(tmp_path):
    def double(td):
        return td.apply(lambda t: t * 2)

    transforms = [double, None, double]
    ours = zstore.StorageEnsemble(*members_at_local(tmp_path), transforms=transforms)
    theirs = TorchRLStorageEnsemble(*reference()._storages, transforms=transforms)
    query = {"buffer_ids": [0, 1, 2], "index": [torch.tensor([4]), torch.tensor([6]), torch.tensor([3])]}
    assert_same(ours.get(query), theirs.get(query))
    sub = ours[[2, 0]]
    assert sub._transforms == [double, double]
    assert_same(sub.get({"buffer_ids": [0], "index": [torch.tensor([1])]}),
                theirs[[2, 0]].get({"buffer_ids": [0], "index": [torch.tensor([1])]}))
    generator = torch.Generator()
    ours._rng = generator
    assert all(member._rng is generator for member in ours._storages)
    state = ours.state_dict()
    assert list(state) == ["0", "1", "2"]
    copy = zstore.StorageEnsemble(*(zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / f"c{m}"))
                                    for m in range(3)))
    copy.load_state_dict(state)
    assert [len(m) for m in copy._storages] == list(SIZES)
    assert_same(copy[1][:], ours[1][:])
    copy._empty()
    assert [len(m) for m in copy._storages] == [0, 0, 0]


def test_recorded_ensemble_reopens_with_zstore_open(location):
    base = location.new("ens")
    members = members_at(location, base)
    elsewhere = zstore.CompressedListStorage(6, scratch_dir=location.new("other"),
                                             storage_options=location.options)
    for i in range(3):
        elsewhere.set(i, TensorDict(obs=torch.full((i + 1,), float(i)), batch_size=[]))
    elsewhere.flush()
    ensemble = zstore.StorageEnsemble(*members, elsewhere, scratch_dir=base,
                                      storage_options=location.options)
    block = json.loads(StoreSpec.parse(base, location.options).filesystem()[0].cat_file(
        StoreSpec.parse(base, location.options).filesystem()[1] + "/zarr.json"))["attributes"]["zstore"]
    assert block["members"][:3] == ["member-0", "member-1", "member-2"]  # relative: the prefix can move
    assert block["members"][3] == elsewhere.spec.url
    assert "secret" not in json.dumps(block) and "endpoint_url" not in json.dumps(block)

    reopened = zstore.open(base, location.options, mode="r")
    assert isinstance(reopened, zstore.StorageEnsemble) and len(reopened) == 4
    assert [len(m) for m in reopened._storages] == [*SIZES, 3]
    query = {"buffer_ids": [2, 0, 3], "index": [torch.tensor([3, 1]), torch.tensor([4]), 2]}
    for (got_id, got), (want_id, want) in zip(reopened.get(query), ensemble.get(query)):
        assert got_id == want_id
        assert (got == want).all() if got_id != 3 else torch.equal(got["obs"], want["obs"])
    with pytest.raises(ReadOnlyError):
        reopened[0].set(5, member_rows(0, 1)[0])

    # members keep growing; a reader that reopens sees their new commits
    members[1].set(torch.arange(7, 9), member_rows(1, 9)[7:])
    members[1].flush()
    assert len(zstore.open(base, location.options, mode="r")[1]) == 9
    # recording again at the same place replaces the member list
    zstore.StorageEnsemble(members[2], scratch_dir=base, storage_options=location.options)
    assert len(zstore.open(base, location.options, mode="r")) == 1
    for member in members:
        member.close()


def test_ensemble_pickles_as_its_members_specs(location):
    base = location.new("ens")
    ensemble = zstore.StorageEnsemble(*members_at(location, base), scratch_dir=base,
                                      storage_options=location.options)
    ensemble._rng = torch.Generator()
    payload = pickle.dumps(ensemble)
    assert b"fsspec" not in payload and b"zarr" not in payload
    copy = pickle.loads(payload)
    assert copy._rng is None and copy.spec == ensemble.spec
    assert_same(copy[(slice(None), 2)], ensemble[(slice(None), 2)])


def test_recording_refuses_what_cannot_be_reopened(tmp_path):
    committed = filled(zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "ok")), 0, 2)
    url = str(tmp_path / "ens")
    with pytest.raises(TypeError, match=r"member 1 \(ListStorage\) does not live in a store"):
        zstore.StorageEnsemble(committed, zstore.ListStorage(3), scratch_dir=url)
    with pytest.raises(ValueError, match="member 1 .* temporary store"):
        zstore.StorageEnsemble(committed, zstore.LazyMemmapStorage(3), scratch_dir=url)
    in_memory = filled(zstore.LazyMemmapStorage(10, scratch_dir=f"memory://ens-{uuid.uuid4().hex}/m"), 0, 2)
    with pytest.raises(ValueError, match=r"member 1 .* this process's memory"):  # (recorded,
        zstore.StorageEnsemble(committed, in_memory, scratch_dir=url)  # it failed every reopen)
    empty = zstore.LazyMemmapStorage(3, scratch_dir=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="nothing committed"):
        zstore.StorageEnsemble(committed, empty, scratch_dir=url)
    assert not StoreSpec.parse(url).exists()
    with pytest.raises(StoreExistsError, match="not a StorageEnsemble"):
        zstore.StorageEnsemble(committed, scratch_dir=str(tmp_path / "ok"))
    assert len(zstore.open(str(tmp_path / "ok"), mode="r")) == 2


def test_a_member_that_cannot_be_reopened_is_named_with_its_ensemble(location):
    """A member deleted after the ensemble was recorded failed ``zstore.open(ensemble)`` with
    "no zstore buffer at .../member-1", which named neither the ensemble nor the way on.
    Reference: the ensemble recorded again without it reads as its members do."""
    base = location.new("ens")
    members = members_at(location, base)
    zstore.StorageEnsemble(*members, scratch_dir=base, storage_options=location.options)
    for member in members:
        member.close()
    fs, path = StoreSpec.parse(base, location.options).filesystem()
    fs.rm(f"{path}/member-1", recursive=True)
    with pytest.raises(StoreNotFoundError, match=(
            r"cannot reopen member 1 \(\S+/member-1\) of the StorageEnsemble at \S+: .*; restore it, "
            r"or record the ensemble again without it \(zstore.StorageEnsemble\(\*members, scratch_dir=")):
        zstore.open(base, location.options, mode="r")
    kept = [zstore.open(members[m].spec.url, location.options) for m in (0, 2)]
    zstore.StorageEnsemble(*kept, scratch_dir=base, storage_options=location.options)
    again = zstore.open(base, location.options, mode="r")
    assert_same(again[(slice(None), slice(None))], [m[:] for m in kept])
    for member in kept:
        member.close()


def test_an_ensemble_that_holds_itself_is_refused_when_recorded_and_when_opened(tmp_path):
    """Two ensembles recorded as each other's member made ``zstore.open`` recurse until
    ``RecursionError``. Recording such a cycle is refused; one written in the store by other
    means fails the open naming the cycle. Reference: the ensembles without it reopen."""
    member = filled(zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "m")), 0, 2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    inner = zstore.StorageEnsemble(member, scratch_dir=a)
    outer = zstore.StorageEnsemble(inner, scratch_dir=b)
    with pytest.raises(ValueError, match=r"member 1 \(StorageEnsemble\) at \S+/b holds this "
                                         r"ensemble, and an ensemble cannot hold itself"):
        zstore.StorageEnsemble(member, outer, scratch_dir=a)
    assert len(zstore.open(b, mode="r")) == 1 and len(zstore.open(a, mode="r")) == 1

    meta_path = tmp_path / "a" / "zarr.json"  # the cycle, written by other means
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["zstore"]["members"].append(b)
    meta_path.write_text(json.dumps(meta))
    for url, cycle in ((a, f"{a} -> {b} -> {a}"), (b, f"{b} -> {a} -> {b}")):
        with pytest.raises(NotAZStoreError) as caught:
            zstore.open(url, mode="r")
        assert f"this StorageEnsemble is its own member, through {cycle}" in str(caught.value)
    member.close()


def test_a_member_error_keeps_its_type_and_fix(tmp_path):
    """A member written by a newer zstore: the error names the member and the ensemble, and
    stays a FormatVersionError that says to upgrade."""
    base = str(tmp_path / "ens")
    member = filled(zstore.LazyMemmapStorage(10, scratch_dir=f"{base}/a"), 0, 2)
    zstore.StorageEnsemble(member, scratch_dir=base)
    member.close()
    meta_path = tmp_path / "ens" / "a" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["zstore"]["format_version"] = 999
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(FormatVersionError, match=r"cannot reopen member 0 \(\S+/a\) of the "
                                                 r"StorageEnsemble at \S+/ens: .*upgrade zstore"):
        zstore.open(base, mode="r")


def test_malformed_index_is_refused(tmp_path):
    committed = filled(zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "ens" / "a")), 0, 2)
    zstore.StorageEnsemble(committed, scratch_dir=str(tmp_path / "ens"))
    path = tmp_path / "ens" / "zarr.json"
    meta = json.loads(path.read_text())
    meta["attributes"]["zstore"]["members"] = ["../escape"]
    path.write_text(json.dumps(meta))
    with pytest.raises(NotAZStoreError, match="malformed StorageEnsemble block"):
        zstore.open(str(tmp_path / "ens"))
