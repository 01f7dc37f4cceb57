"""Every write path on a published dataset raises ReadOnlyError and leaves every object unchanged."""

from __future__ import annotations

import gc
import hashlib
import pickle

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.dataset import open_dataset


def _object_hashes(url: str, options: dict) -> dict[str, str]:
    """sha256 of every object stored at or below ``url``.

    The garbage collector is paused meanwhile: a collection inside fsspec's walk of the
    process-wide memory:// dict can run the finalizer of another test's temporary storage,
    which deletes its objects from that dict mid-iteration.
    """
    fs, root = zstore.StoreSpec.parse(url, options).filesystem()
    gc.disable()
    try:
        return {path: hashlib.sha256(fs.cat_file(path)).hexdigest()
                for path in fs.find(root, withdirs=False)}
    finally:
        gc.enable()


def _publish(location, codec) -> str:
    url = location.new("ds")
    storage = zstore.LazyMemmapStorage(64, scratch_dir=url, storage_options=location.options,
                                       codec=codec)
    done = torch.zeros(48, 1, dtype=torch.bool)
    done[[9, 30]] = True
    storage.set(torch.arange(48), TensorDict({
        "obs": torch.randn(48, 3), ("next", "reward"): torch.ones(48, 1),
        ("next", "done"): done}, batch_size=[48]))
    storage.seal()
    storage.close()
    return url


def _write_attempts(ds, url: str, options: dict):
    """(name, callable) of every way to write to a storage; each must raise ReadOnlyError."""
    item, batch = ds[0], ds[torch.arange(2)]
    writer = zstore.RoundRobinWriter()
    writer.register_storage(ds)
    reopened = zstore.open(url, options, mode="r+")

    def setitem(index, value):
        ds[index] = value

    return [
        ("set one", lambda: ds.set(0, item)),
        ("set many", lambda: ds.set(torch.arange(2), batch)),
        ("set without cursor", lambda: ds.set(slice(0, 2), batch, set_cursor=False)),
        ("setitem", lambda: setitem(3, item)),
        ("setitem cells", lambda: setitem(torch.tensor([3, 4]), batch)),
        ("conditional patch", lambda: ds._apply_conditional_patch(torch.arange(2), batch)),
        ("writer.add", lambda: writer.add(item)),
        ("writer.extend", lambda: writer.extend(batch)),
        ("empty", ds._empty),
        ("loads own url", lambda: ds.loads(url)),
        ("load elsewhere", lambda: ds.load("memory://elsewhere")),
        ("load_state_dict", lambda: ds.load_state_dict(ds.state_dict())),
        ("flush", ds.flush),
        ("seal", ds.seal),
        ("zstore.seal", lambda: zstore.seal(url, options)),
        ("cleanup", ds.cleanup),
        ("zstore.open r+ set", lambda: reopened.set(0, item)),
        ("zstore.open r+ setitem", lambda: reopened.__setitem__(1, item)),
        ("zstore.open r+ empty", reopened._empty),
        ("zstore.open r+ cleanup", reopened.cleanup),
        ("zstore.open r+ seal", reopened.seal),
    ]


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_every_write_path_is_refused_and_nothing_changes(location, codec):
    url = _publish(location, codec)
    before = _object_hashes(url, location.options)
    ds = open_dataset(url, location.options)
    snapshot = ds[:]
    for name, attempt in _write_attempts(ds, url, location.options):
        with pytest.raises(zstore.ReadOnlyError) as info:
            attempt()
        assert url in str(info.value), name
        if name.startswith("zstore.open r+") and not name.endswith("seal"):  # told why not, the way on
            assert "sealed, read-only dataset" in str(info.value), name
            assert f"zstore convert {url} DST --no-seal" in str(info.value), name
    with pytest.raises(ValueError, match="read-only"):  # the Zarr store underneath refuses too
        ds._group.create_array("x", shape=(1,), dtype="f4")
    assert "This dataset doesn't allow writing. Cannot write rows: " in str(pytest.raises(
        zstore.ReadOnlyError, ds.set, 0, ds[0]).value)  # two sentences, each capitalised
    with pytest.raises(RuntimeError, match="doesn't allow writing"):
        immutable = zstore.ImmutableDatasetWriter()
        immutable.register_storage(ds)
        immutable.extend(ds[torch.arange(2)])
    assert len(ds) == 48 and ds.num_episodes == 3
    assert (ds[:] == snapshot).all()
    ds.close()
    assert _object_hashes(url, location.options) == before
    again = open_dataset(url, location.options)
    assert (again[:] == snapshot).all() and len(again) == 48
    clone = pickle.loads(pickle.dumps(again)) if location.kind != "memory" else again
    assert isinstance(clone, zstore.Dataset) and (clone[:] == snapshot).all()
    with pytest.raises(zstore.ReadOnlyError):
        clone.set(0, snapshot[0])


def test_nothing_is_written_inside_a_dataset_folder(location, tmp_path):
    """Regression: a checkpoint, a conversion or an import into a folder inside a sealed
    dataset was written there (94 files became 160): a dataset stays as it was published,
    so each is refused, naming the dataset, before anything is written."""
    import h5py
    import numpy as np

    from zstore.dataset import import_d4rl
    from zstore.dataset.convert import convert

    url = _publish(location, "zstd")
    before = _object_hashes(url, location.options)
    ds = open_dataset(url, location.options)
    source = tmp_path / "d4rl.hdf5"
    with h5py.File(source, "w") as f:
        f["observations"] = np.zeros((11, 2), "float32")
        f["actions"] = np.zeros((11, 1), "float32")
        f["rewards"] = np.ones(11, "float32")
        f["terminals"] = np.arange(11) % 5 == 4
    attempts = {
        "dumps": lambda: ds.dumps(zstore.StoreSpec.parse(f"{url}/ckpt", location.options)),
        "convert": lambda: convert(url, f"{url}/copy", location.options, progress=False),
        "import": lambda: import_d4rl(str(source), f"{url}/sub/imported",
                                      storage_options=location.options, progress=False),
    }
    for name, attempt in attempts.items():
        with pytest.raises(zstore.ReadOnlyError, match="inside the sealed, read-only dataset") as info:
            attempt()
        assert url.split("://")[-1] in str(info.value), name
    assert _object_hashes(url, location.options) == before


def test_a_storage_created_at_a_dataset_is_refused_before_it_takes_a_lease(location,
                                                                        monkeypatch):
    """A LazyMemmapStorage created at a dataset's URL was refused at its first write only
    after it had stored its lease inside the dataset (a PUT and a DELETE in a published
    prefix; an object left there if the process died in between), and its refusal said to
    pass existsok=True, which only led to a ReadOnlyError."""
    from zstore.lease import Lease

    url = _publish(location, "zstd")
    before = _object_hashes(url, location.options)
    taken = []
    ensure = Lease.ensure
    monkeypatch.setattr(Lease, "ensure", lambda lease: taken.append(lease.spec.url) or ensure(lease))
    rows = open_dataset(url, location.options)[torch.arange(4)]
    for existsok, refusal, said in ((False, zstore.StoreExistsError, "zstore.open_dataset"),
                                    (True, zstore.ReadOnlyError, "sealed, read-only dataset")):
        storage = zstore.LazyMemmapStorage(64, scratch_dir=url, storage_options=location.options,
                                           existsok=existsok)
        with pytest.raises(refusal, match=said) as info:
            storage.set(torch.arange(4), rows)
        assert "existsok=True" not in str(info.value)
    assert taken == [] and _object_hashes(url, location.options) == before


def test_a_dataset_whose_root_lost_its_consolidated_metadata_still_opens(location):
    """Regression: annotating a published dataset with zarr (which rewrites the root
    zarr.json without the consolidated metadata) left it unopenable, with contradicting
    errors: open_dataset said "not sealed: seal it", and seal "already a sealed dataset".
    It opens now, with a warning naming the cost and the fix, and serves the same rows."""
    import zarr

    url = _publish(location, "zstd")
    snapshot, episodes = open_dataset(url, location.options)[:], open_dataset(url, location.options).episodes
    group = zarr.open_group(url, mode="r+", use_consolidated=False,
                            storage_options=location.options or None)
    group.attrs["description"] = "my dataset"
    with pytest.warns(UserWarning, match="lost its consolidated metadata.*zstore convert"):
        again = open_dataset(url, location.options)
    assert (again[:] == snapshot).all() and (again.episodes == episodes).all()
