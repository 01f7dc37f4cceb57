"""`zstore info | ls | convert | import | seal`: output, exit codes, errors naming the culprit."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict
from test_importers import _write_d4rl, _write_minari

import zstore
from zstore.cli import main
from zstore.dataset import open_dataset

COMMANDS = ("info", "ls", "convert", "import", "seal", "demo")


def _run(capsys, *argv: str, code: int = 0) -> str:
    got = main(list(argv))
    captured = capsys.readouterr()
    assert got == code, captured.err
    return captured.out if code == 0 else captured.err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(capsys, command):
    out = _run(capsys, command, "--help")
    assert out.startswith(f"usage: zstore {command}")
    if command != "demo":
        assert "-o KEY=VALUE" in out


@pytest.mark.parametrize("argv", [
    ["info"], ["ls"], ["seal"], ["convert", "a"], ["import", "d4rl", "f"],
    ["import", "hdf5", "f", "u"], ["convert", "a", "b", "--chunks", "0"],
    ["convert", "a", "b", "--codec", "gzip9"], ["info", "x", "-o", "novalue"],
    ["convert", "a", "b", "--chunks", "3", "--shards", "10"],
])
def test_usage_errors_exit_2(capsys, argv):
    assert main(argv) == 2
    assert "usage: zstore" in capsys.readouterr().err


@pytest.fixture
def datasets(tmp_path):
    """A D4RL and a Minari import under one directory."""
    root = tmp_path / "sets"
    d4rl, minari = _write_d4rl(tmp_path / "d4rl.hdf5"), _write_minari(tmp_path / "m.hdf5")
    return root, d4rl, minari


def test_import_info_ls_convert_seal(capsys, datasets, tmp_path):
    root, d4rl, minari = datasets
    out = _run(capsys, "import", "d4rl", str(d4rl), str(root / "hopper"), "--no-progress")
    ds = open_dataset(root / "hopper")
    assert f"imported 200 transitions, {ds.num_episodes} episodes" in out and "(sealed)" in out
    _run(capsys, "import", "minari", str(minari), str(root / "mini"), "--codec", "none",
         "--chunks", "8")
    out = _run(capsys, "info", str(root / "hopper"))
    assert "LazyMemmapStorage (sealed dataset)" in out
    assert "length 200 of capacity 200" in out
    assert out.count("zstd:1+crc32c") == 9  # one line per key: published data is checksummed
    for key, dtype, shape in [("observation", "float32", "[3]"), ("next/done", "bool", "[1]"),
                              ("info/goal/xy", "int64", "[2]")]:
        line = next(line for line in out.splitlines() if line.strip().startswith(key + " "))
        assert line.split()[:3] == [key, dtype, shape]
    index = ds.episodes
    terminated, truncated = int(index["terminated"].sum()), int(index["truncated"].sum())
    assert (f"episodes {ds.num_episodes}: {terminated} terminated, {truncated} truncated, "
            f"{ds.num_episodes - terminated - truncated} open") in out
    block = json.loads(_run(capsys, "info", str(root / "hopper"), "--json"))
    assert block["sealed"] and block["read_only"] and block["length"] == 200
    assert block["extra"]["episodes"] == {"count": ds.num_episodes, "path": "__episodes__"}
    out = _run(capsys, "ls", str(tmp_path))
    assert out.splitlines() == [
        f"{root / 'hopper'}\tLazyMemmapStorage\tdataset\t200/200, {ds.num_episodes} episodes",
        f"{root / 'mini'}\tLazyMemmapStorage\tdataset\t29/29, 4 episodes"]
    out = _run(capsys, "convert", str(root / "hopper"), str(tmp_path / "copy"), "--codec", "lz4",
               "--chunks", "16", "--no-progress")
    assert "copied 200 cells" in out and "lz4:5, sealed" in out
    copy = open_dataset(tmp_path / "copy")
    assert (copy[:] == ds[:]).all() and (copy.episodes == ds.episodes).all()
    assert copy._meta.layout["observation"] == (16, None)
    out = _run(capsys, "convert", str(root / "mini"), str(tmp_path / "plain"), "--no-seal")
    assert "codec raw" in out and "sealed" not in out
    out = _run(capsys, "seal", str(tmp_path / "plain"))
    assert out == f"sealed {tmp_path / 'plain'}: 4 episodes\n"
    err = _run(capsys, "seal", str(tmp_path / "plain"), code=1)
    assert err == f"zstore: error: cannot seal {tmp_path / 'plain'}: it is already a sealed dataset\n"


def test_runtime_errors_exit_1_and_name_the_culprit(capsys, tmp_path, datasets):
    root, d4rl, _ = datasets
    missing = tmp_path / "nothing"
    assert str(missing) in _run(capsys, "info", str(missing), code=1)
    assert str(missing) in _run(capsys, "ls", str(missing), code=1)
    assert "nope.hdf5" in _run(capsys, "import", "d4rl", str(tmp_path / "nope.hdf5"),
                               str(root / "x"), code=1)
    _run(capsys, "import", "d4rl", str(d4rl), str(root / "a"))
    err = _run(capsys, "import", "d4rl", str(d4rl), str(root / "a"), code=1)
    assert err.startswith("zstore: error: The file") and str(root / "a") in err
    assert len(open_dataset(root / "a")) == 200  # the existing dataset is untouched
    err = _run(capsys, "convert", str(root / "a"), str(root / "a"), code=1)
    assert "already exists" in err and len(open_dataset(root / "a")) == 200
    err = _run(capsys, "import", "minari", str(d4rl), str(root / "b"), code=1)
    assert "d4rl.hdf5 has no episode_<id> groups" in err
    out = _run(capsys, "ls", str(tmp_path / "sets"))
    assert "\tdataset\t" in out and str(root / "b") not in out


def test_seal_a_buffer_written_elsewhere(capsys, tmp_path):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(20, scratch_dir=url)
    done = torch.zeros(12, 1, dtype=torch.bool)
    done[4] = True
    storage.set(torch.arange(12), TensorDict({"obs": torch.arange(12.0), ("next", "done"): done},
                                             batch_size=[12]))
    storage.close()
    assert _run(capsys, "seal", url) == f"sealed {url}: 2 episodes\n"
    out = _run(capsys, "info", url)
    assert "episodes 2: 1 terminated, 0 truncated, 1 open" in out


@pytest.mark.s3
def test_cli_on_s3_with_storage_options(capsys, s3_bucket, s3_options, tmp_path):
    d4rl = _write_d4rl(tmp_path / "d4rl.hdf5")
    opts = [f"-o{k}={v}" for k, v in s3_options.items()]
    url = f"s3://{s3_bucket}/cli/hopper"
    out = _run(capsys, "import", "d4rl", str(d4rl), url, *opts, "--no-progress")
    assert "'secret': '***'" in out and "testing'" not in out.replace("'***'", "")
    out = _run(capsys, "info", url, *opts)
    assert "sealed dataset" in out and "episodes" in out
    out = _run(capsys, "ls", f"s3://{s3_bucket}/cli", *opts)
    assert out.startswith(f"s3://{s3_bucket}/cli/hopper\tLazyMemmapStorage\tdataset\t200/200")
    out = _run(capsys, "convert", url, str(tmp_path / "local"), *opts, "-O", "auto_mkdir=true",
               "--no-progress")
    assert (open_dataset(tmp_path / "local")[:] == open_dataset(url, s3_options)[:]).all()
    err = _run(capsys, "info", f"s3://{s3_bucket}/cli/none", *opts, code=1)
    assert f"s3://{s3_bucket}/cli/none" in err and "'secret': '***'" in err


def test_info_and_ls_on_a_compressed_list_storage(capsys, tmp_path):
    url = str(tmp_path / "frames")
    storage = zstore.CompressedListStorage(50, scratch_dir=url)
    for i in range(7):
        storage.set(i, TensorDict(pixels=torch.zeros(4, 8, 8, dtype=torch.uint8)))
    storage.flush()
    out = _run(capsys, "info", url)
    assert out.splitlines()[1].startswith("  CompressedListStorage: 7 items of 50, ")
    assert _run(capsys, "ls", str(tmp_path)) == \
        f"{url}\tCompressedListStorage\tbuffer\t7/50\n"
    assert json.loads(_run(capsys, "info", url, "--json"))["storage_class"] == \
        "CompressedListStorage"
    err = _run(capsys, "seal", url, code=1)
    assert f"cannot seal {url}: it holds a CompressedListStorage" in err
