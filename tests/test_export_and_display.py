"""HDF5 export of dict (nested) spaces read back by the importers; dataset and string-key reprs.

Exports are checked against the dataset's own rows and the HDF5 file written; string keys
against the strings stored.
"""

from __future__ import annotations

import html

import h5py
import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import zstore
from zstore.dataset import export_h5, import_d4rl, import_minari

from test_importers import _write_minari

LENGTHS = (4, 7, 3)


def _minari_dict_spaces(path):
    """A Minari file whose observations and actions are dict spaces (HDF5 sub-groups)."""
    return _write_minari(path, LENGTHS, dict_actions=True, infos=False)


def _assert_same(again, ds) -> None:
    """Every key, row and episode of two datasets equal."""
    a, b = again[:], ds[:]
    assert sorted(a.keys(include_nested=True, leaves_only=True)) == \
        sorted(b.keys(include_nested=True, leaves_only=True))
    assert (a == b).all()
    assert (again.episodes == ds.episodes).all()


@pytest.mark.parametrize("layout", ["d4rl", "minari"])
def test_export_of_dict_spaces_round_trips(tmp_path, layout):
    ds = import_minari(_minari_dict_spaces(tmp_path / "m.hdf5"), str(tmp_path / "a"),
                       progress=False)
    export_h5(ds, tmp_path / "out.hdf5", layout=layout, progress=False)
    reader = import_d4rl if layout == "d4rl" else import_minari
    again = reader(tmp_path / "out.hdf5", str(tmp_path / "b"), progress=False)
    _assert_same(again, ds)
    again.close()
    ds.close()


def test_d4rl_export_writes_dict_spaces_as_groups(tmp_path):
    ds = import_minari(_minari_dict_spaces(tmp_path / "m.hdf5"), str(tmp_path / "a"),
                       progress=False)
    export_h5(ds, tmp_path / "out.hdf5", layout="d4rl", progress=False)
    td = ds[:]
    with h5py.File(tmp_path / "out.hdf5", "r") as f:
        assert sorted(f) == ["actions", "next_observations", "observations", "rewards",
                             "terminals", "timeouts"]
        for key in ("pos", "image"):
            np.testing.assert_array_equal(f["observations"][key][:], td["observation", key].numpy())
            np.testing.assert_array_equal(f["next_observations"][key][:],
                                          td["next", "observation", key].numpy())
        for key in ("move", "grip"):
            np.testing.assert_array_equal(f["actions"][key][:], td["action", key].numpy())
        np.testing.assert_array_equal(f["rewards"][:], td["next", "reward"].numpy()[:, 0])
    ds.close()


@pytest.mark.parametrize("next_obs", [True, False])
def test_d4rl_import_reads_dict_observation_groups(tmp_path, next_obs):
    n, rng = 30, np.random.default_rng(1)
    path = tmp_path / "d.hdf5"
    with h5py.File(path, "w") as f:
        f["observations/pos"] = rng.standard_normal((n, 2)).astype(np.float32)
        f["observations/goal/xy"] = rng.integers(0, 9, (n, 2))
        if next_obs:
            f["next_observations/pos"] = rng.standard_normal((n, 2)).astype(np.float32)
            f["next_observations/goal/xy"] = rng.integers(0, 9, (n, 2))
        f["actions"] = rng.standard_normal((n, 3)).astype(np.float32)
        f["rewards"] = rng.standard_normal(n).astype(np.float32)
        f["terminals"] = np.arange(n) % 10 == 9
        raw = {k: f[k][:] for k in ("observations/pos", "observations/goal/xy", "actions",
                                    "rewards", "terminals")}
        nxt = {k: (f[f"next_{k}"][:] if next_obs else raw[k][1:])
               for k in ("observations/pos", "observations/goal/xy")}
    ds = import_d4rl(path, str(tmp_path / "ds"), progress=False)
    rows = n if next_obs else n - 1
    td = ds[:]
    assert len(ds) == rows
    for key, nested in (("observations/pos", ("pos",)), ("observations/goal/xy", ("goal", "xy"))):
        np.testing.assert_array_equal(td["observation", *nested].numpy(), raw[key][:rows])
        np.testing.assert_array_equal(td["next", "observation", *nested].numpy(), nxt[key][:rows])
    np.testing.assert_array_equal(td["action"].numpy(), raw["actions"][:rows])
    np.testing.assert_array_equal(td["next", "reward"].numpy()[:, 0], raw["rewards"][:rows])
    np.testing.assert_array_equal(td["next", "terminated"].numpy()[:, 0], raw["terminals"][:rows])
    ds.close()


def test_d4rl_import_names_a_group_member_of_another_length(tmp_path):
    path = tmp_path / "bad.hdf5"
    with h5py.File(path, "w") as f:
        f["observations/pos"] = np.zeros((5, 2), np.float32)
        f["observations/vel"] = np.zeros((4, 2), np.float32)
        f["actions"] = np.zeros((5, 1), np.float32)
        f["rewards"] = np.zeros(5, np.float32)
        f["terminals"] = np.zeros(5, bool)
    with pytest.raises(zstore.SchemaError, match=r"'observations/vel' has 4 rows, "
                                                 r"'observations/pos' 5"):
        import_d4rl(path, str(tmp_path / "x"), progress=False)
    assert not (tmp_path / "x").exists()


# -- reprs ----------------------------------------------------------------------------------

def test_dataset_repr_shows_episodes_once(tmp_path):
    ds = import_minari(_minari_dict_spaces(tmp_path / "m.hdf5"), str(tmp_path / "a"),
                       progress=False)
    text = repr(ds)
    assert ds.num_episodes == len(LENGTHS)
    assert text.count("episodes=") == 1 and f"episodes={len(LENGTHS)}" in text
    assert f"len={sum(LENGTHS)}, max_size={sum(LENGTHS)}" in text
    page = ds._repr_html_()
    assert page.count('<td class="zs-fact">episodes</td>') == 1
    assert f'<td class="zs-fact">episodes</td><td>{len(LENGTHS)}</td>' in page
    ds.close()


STRINGS = ["step 0", "étape un", "x"]


def _with_strings() -> TensorDict:
    td = TensorDict(obs=torch.randn(3, 2), batch_size=[3])
    td["text"] = NonTensorStack(*[NonTensorData(s) for s in STRINGS])
    td["meta", "note"] = NonTensorStack(*[NonTensorData(s[::-1]) for s in STRINGS])
    return td


def _row(text: str, key: str) -> str:
    """The key table line of ``key`` in a text repr, columns split."""
    return next(line.split() for line in text.splitlines() if line.split()[:1] == [key])


@pytest.mark.parametrize("cls", ["LazyTensorStorage", "ListStorage", "LazyStackStorage"])
def test_string_keys_are_listed_as_str(cls):
    s = getattr(zstore, cls)(10)
    td = _with_strings()
    if cls == "LazyTensorStorage":
        s.set(torch.arange(3), td)
    else:
        for i in range(3):
            s.set(i, td[i])
    assert s.get(0)["text"] == STRINGS[0]  # stored: so it must be shown
    text, page = repr(s), s._repr_html_()
    rows = {row.key: row for row in s.summary().rows}
    assert set(rows) == {"obs", "text", "meta/note"}
    for key in ("text", "meta/note"):
        assert (rows[key].shape, rows[key].dtype) == ((), "str")
        assert _row(text, key)[:3] == [key, "[]", "str"]
        assert f"<tr><td><code>{html.escape(key)}</code></td><td>[]</td><td>str</td>" \
            in page.replace(' class=""', "")
    if cls == "LazyTensorStorage":  # bytes: cells as wide as the longest string
        width = max(len(v.encode()) for v in STRINGS)
        assert rows["text"].stored_bytes == 10 * width
        assert rows["text"].raw_bytes == 3 * width


def test_a_memory_mapped_buffer_lists_string_keys_as_str_cells(tmp_path):
    """A LazyMemmapStorage stores strings as uint8 cells of UTF-8: its table says ``str`` and
    the cells' width, not ``uint8 [256]`` (the storage's encoding)."""
    s = zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "rb"))
    s.set(torch.arange(3), _with_strings())
    rows = {row.key: row for row in s.summary().rows}
    for key in ("text", "meta/note"):
        assert (rows[key].shape, rows[key].dtype) == ((), "str (256 B cells)")
        assert _row(repr(s), key)[:5] == [key, "[]", "str", "(256", "B"]
    assert (rows["obs"].shape, rows["obs"].dtype) == ((2,), "float32")
