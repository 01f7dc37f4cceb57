"""Sources and exports at the edges: what an import keeps of a file it did not write, and
what an export writes for keys both layouts would put in one place.

Each import is checked against the HDF5 file's own arrays; each export against the
dataset's rows, read back through the importer of its layout.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore.dataset import export_h5, import_d4rl, import_minari

from test_importers import _write_d4rl, _write_minari


def _sealed(url: str, data: TensorDict) -> zstore.Dataset:
    storage = zstore.LazyMemmapStorage(len(data), scratch_dir=url)
    storage.set(torch.arange(len(data)), data)
    storage.seal()
    storage.close()
    return zstore.open_dataset(url)


def _transitions(n: int = 6) -> TensorDict:
    """TorchRL's Minari layout: an ``info`` beside the ``("next", "info")`` of each step."""
    done = (torch.arange(n) % 3 == 2).unsqueeze(-1)
    return TensorDict({
        "observation": torch.arange(n, dtype=torch.float32).unsqueeze(-1),
        "action": torch.randn(n, 2), "info": {"a": torch.arange(n)},
        "next": {"observation": torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(-1),
                 "reward": torch.randn(n, 1), "done": done, "terminated": done,
                 "truncated": torch.zeros(n, 1, dtype=torch.bool),
                 "info": {"a": 100 + torch.arange(n)}}}, batch_size=[n])


@pytest.mark.parametrize("layout", ["d4rl", "minari"])
def test_an_info_key_and_a_next_info_key_of_one_name_both_survive_an_export(tmp_path, layout):
    """Both went to ``infos/a``: D4RL kept the last written, Minari raised h5py's "name
    already exists" naming nothing."""
    data = _transitions()
    ds = _sealed(str(tmp_path / "ds"), data)
    export_h5(ds, tmp_path / "out.h5", layout=layout, progress=False)
    with h5py.File(tmp_path / "out.h5") as f:
        where = f if layout == "d4rl" else f["episode_0"]
        own, other = (("info", "a"), "next/info/a") if layout == "d4rl" else \
            (("next", "info", "a"), "info/a")
        np.testing.assert_array_equal(where["infos/a"][:], data[own][:len(where["infos/a"])])
        assert other in where
    reader = import_d4rl if layout == "d4rl" else import_minari
    back = reader(tmp_path / "out.h5", str(tmp_path / "back"), progress=False)[:]
    assert torch.equal(back["info", "a"], data["info", "a"])
    assert torch.equal(back["next", "info", "a"], data["next", "info", "a"])


def test_an_export_failing_part_way_leaves_the_file_that_was_there(tmp_path, monkeypatch):
    ds = _sealed(str(tmp_path / "ds"), _transitions())
    (tmp_path / "out.h5").write_bytes(b"an earlier export")
    from zstore.dataset import export

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(export, "_write_d4rl", fail)
    with pytest.raises(OSError, match="disk full"):
        export_h5(ds, tmp_path / "out.h5", progress=False)
    assert (tmp_path / "out.h5").read_bytes() == b"an earlier export"
    assert sorted(os.listdir(tmp_path)) == ["ds", "out.h5"]  # no partial file beside it


def test_an_export_into_a_missing_folder_names_the_folder(tmp_path):
    ds = _sealed(str(tmp_path / "ds"), _transitions())
    with pytest.raises(FileNotFoundError, match="no such folder .*absent$"):  # not a .partial
        export_h5(ds, tmp_path / "absent" / "out.h5", progress=False)


def test_an_export_into_a_sealed_dataset_is_refused(tmp_path):
    ds = _sealed(str(tmp_path / "ds"), _transitions())
    before = sorted(os.listdir(tmp_path / "ds"))
    with pytest.raises(zstore.ReadOnlyError, match="inside the sealed, read-only dataset"):
        export_h5(ds, tmp_path / "ds" / "export.h5", progress=False)
    assert sorted(os.listdir(tmp_path / "ds")) == before


def test_arrays_beside_the_d4rl_fields_are_imported_at_their_paths(tmp_path):
    """``qvel`` and ``goals/xy`` were dropped without a word."""
    path = _write_d4rl(tmp_path / "d.hdf5", next_obs=True)
    rng = np.random.default_rng(1)
    with h5py.File(path, "a") as f:
        f["qvel"] = qvel = rng.standard_normal((200, 3))
        f["goals/xy"] = xy = rng.integers(0, 9, (200, 2))
        f["short"] = np.zeros(3)
        f["next/done"] = np.zeros(200)  # the import writes that key itself
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = import_d4rl(path, str(tmp_path / "out"), progress=False)[:]
    np.testing.assert_array_equal(td["qvel"].numpy(), qvel)
    np.testing.assert_array_equal(td["goals", "xy"].numpy(), xy)
    messages = [str(w.message) for w in caught]
    assert any("left out ['short']" in m and "one value per step (200)" in m for m in messages)
    assert any("left out ['next/done']" in m and "rename them" in m for m in messages)
    assert "short" not in td.keys()


def test_arrays_beside_the_minari_fields_are_imported_at_their_paths(tmp_path):
    path = _write_minari(tmp_path / "m.hdf5", lengths=(3, 4))
    with h5py.File(path, "a") as f:
        for name in ("episode_0", "episode_1"):
            steps = len(f[name]["rewards"])
            f[name]["collector/traj_ids"] = np.full(steps, int(name[-1]))
            f[name]["once"] = np.zeros(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = import_minari(path, str(tmp_path / "out"), progress=False)[:]
    assert td["collector", "traj_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert any("left out ['once']" in str(w.message) for w in caught)


def test_arrays_beside_the_fields_that_cannot_be_imported_never_stop_an_import(tmp_path):
    """Left out with a warning, as before they were dropped: an array of a row per step in
    one Minari episode but not another (its layouts then differed: SchemaError), and one of
    a type zstore does not store (compound values, strings of several per row)."""
    path = _write_minari(tmp_path / "m.hdf5", lengths=(3, 5))
    compound = np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")])
    with h5py.File(path, "a") as f:
        f["episode_0"]["goal"] = np.zeros(3)  # a row per step here, not in episode_1
        f["episode_1"]["goal"] = np.zeros(3)
        f["episode_0"]["render"] = compound
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = import_minari(path, str(tmp_path / "m-out"), progress=False)[:]
    assert len(td) == 8 and "goal" not in td.keys() and "render" not in td.keys()
    assert any("left out ['goal', 'render']" in str(w.message) for w in caught)
    d4rl = _write_d4rl(tmp_path / "d.hdf5")
    with h5py.File(d4rl, "a") as f:
        f["qc"] = np.zeros(200, dtype=[("a", "<f4"), ("b", "<i4")])
        f["names"] = np.array([["a", "b"]] * 200, dtype=h5py.string_dtype())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = import_d4rl(d4rl, str(tmp_path / "d-out"), progress=False)[:]
    assert len(td) == 200 and "qc" not in td.keys()
    assert any("left out ['names', 'qc']" in str(w.message) for w in caught)


def test_big_endian_arrays_are_imported_in_the_machines_byte_order(tmp_path):
    """h5py keeps a file's byte order; torch refused the array, naming neither field nor file."""
    path = tmp_path / "be.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(20, dtype=">f4").reshape(10, 2)
        f["actions"] = np.arange(10, dtype=">i8").reshape(10, 1)
        f["rewards"] = np.arange(10, dtype=">f8")
        f["terminals"] = np.zeros(10, bool)
        f["infos/step"] = np.arange(10, dtype=">i4")
    td = import_d4rl(path, str(tmp_path / "out"), progress=False)[:]
    assert td["observation"].tolist() == np.arange(20).reshape(10, 2)[:9].tolist()
    assert td["action"].reshape(-1).tolist() == list(range(9))
    assert td["next", "reward"].reshape(-1).tolist() == list(range(9))
    assert td["info", "step"].tolist() == list(range(9))


def _damaged(path, n: int = 20_000) -> str:
    """A D4RL file whose compressed observations have one chunk overwritten with zeros."""
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", compression="gzip", chunks=(1000, 8),
                         data=np.random.default_rng(0).normal(size=(n, 8)).astype(np.float32))
        f["actions"] = np.zeros((n, 2), np.float32)
        f["rewards"] = np.zeros(n, np.float32)
        f["terminals"] = np.zeros(n, bool)
        offset = f["observations"].id.get_chunk_info(15).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset + 50: offset + 90] = bytes(40)
    path.write_bytes(bytes(raw))
    return str(path)


def test_a_damaged_source_file_names_the_field_and_the_file(tmp_path):
    path = _damaged(tmp_path / "gz.hdf5")
    with pytest.raises(zstore.SourceFileError,
                       match="cannot read field 'observations' of .*gz.hdf5 .*undamaged copy"):
        import_d4rl(path, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    cli = subprocess.run([sys.executable, "-m", "zstore", "import", "d4rl", path,
                          str(tmp_path / "cli")], capture_output=True, text=True)
    assert cli.returncode == 1
    assert "field 'observations' of" in cli.stderr and "Traceback" not in cli.stderr


def test_the_other_layouts_file_names_the_importer_to_use(tmp_path):
    minari = _write_minari(tmp_path / "m.hdf5")
    with pytest.raises(zstore.MissingKeyError, match="Minari episode groups.*import_minari"):
        import_d4rl(minari, str(tmp_path / "a"), progress=False)
    d4rl = _write_d4rl(tmp_path / "d.hdf5")
    with pytest.raises(zstore.MissingKeyError, match="no episode_<id> groups.*import_d4rl"):
        import_minari(d4rl, str(tmp_path / "b"), progress=False)


def test_a_minari_import_shows_progress_while_it_reads_episodes(tmp_path, capsys, monkeypatch):
    """The bar moved only when 65,536 rows were written: an import of many short episodes
    showed nothing for its whole checking walk, then 0% until the end. (Every update is
    drawn here, not one per tenth of a second.)"""
    from zstore.dataset import importers
    from zstore.progress import progress

    monkeypatch.setattr(importers, "progress_bar",
                        functools.partial(progress, mininterval=0, miniters=1))
    path = tmp_path / "many.hdf5"
    with h5py.File(path, "w") as f:
        for i in range(30):
            g = f.create_group(f"episode_{i}")
            g["observations"] = np.full((3, 2), i, np.float32)
            g["actions"] = np.zeros(2)
            g["rewards"] = np.ones(2)
            g["terminations"] = np.array([False, True])
            g["truncations"] = np.zeros(2, bool)
    import_minari(path, str(tmp_path / "out"), progress=True).close()
    err = capsys.readouterr().err
    assert re.search(r"check minari: +3%.* 1/30 ", err) and "30/30" in err
    assert re.search(r"import minari: +3%.* 2\.00/60\.0 ", err)  # an episode read, not written
