"""`zstore info | ls | convert | import | seal`: output, exit codes, one-line errors naming the
culprit and the fix, and a start without torch for `--help`, `ls` and `info`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from conftest import denying_bucket, run_bound_by_file_modes
from test_importers import _write_d4rl, _write_minari
from test_s3_transport import needs_obstore

import zstore
from zstore.cli import main
from zstore.dataset import open_dataset

COMMANDS = ("info", "ls", "convert", "import", "seal", "demo")


def _run(capsys, *argv: str, code: int = 0) -> str:
    got = main(list(argv))
    captured = capsys.readouterr()
    assert got == code, captured.err
    return captured.out if code == 0 else captured.err


def _one_line(err: str, *fragments: str) -> None:
    """``err`` is one ``zstore: error:`` line holding every fragment, and no traceback."""
    assert err.startswith("zstore: error: ") and err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


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


@pytest.mark.parametrize("argv", [["convert", "rb", "memory://copy"],
                                  ["import", "d4rl", "f.hdf5", "memory://ds"],
                                  ["demo", "--url", "memory://rb"]])
def test_a_memory_destination_is_refused_with_the_reason(capsys, argv):
    """`convert` and `import` into memory:// printed their success, and the copy vanished as
    zstore exited; they refuse it as `demo --url` did."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "memory:// lives in one process, " in err and "use a local path or an s3:// URL" in err


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
    assert "copied 200 cells" in out and "lz4:5+crc32c, sealed" in out
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
    _one_line(err, f"{root / 'a'} already exists and holds a zstore buffer: choose another "
                   "destination, or delete it first")
    assert "existsok" not in err  # the Python advice, not the command's
    assert len(open_dataset(root / "a")) == 200  # the existing dataset is untouched
    err = _run(capsys, "convert", str(root / "a"), str(root / "a"), code=1)
    _one_line(err, "already exists")
    assert len(open_dataset(root / "a")) == 200
    err = _run(capsys, "import", "minari", str(d4rl), str(root / "b"), code=1)
    assert "d4rl.hdf5 has no episode_<id> groups" in err
    out = _run(capsys, "ls", str(tmp_path / "sets"))
    assert "\tdataset\t" in out and str(root / "b") not in out


@pytest.mark.parametrize("argv, fragment", [
    (("info", ""), "a store URL must be a non-empty string or path, got ''"),
    (("info", "s3://bucket//rb"), "write it as 's3://bucket/rb'"),
    (("ls", "s3://bucket/rb", "-o", "endpoint_url=localhost:9"), "write it as 'http://localhost:9'"),
    (("info", "s3://bucket/rb", "-o", "secrett=x"), "(did you mean 'secret'?)"),
    (("convert", "s3://bucket//rb", "unused"), "write it as 's3://bucket/rb'"),
])
def test_a_url_that_names_no_store_is_one_line_with_the_fix(capsys, argv, fragment):
    # before: the message said "unexpected", or a second parse of the URL crashed with a traceback
    err = _run(capsys, *argv, code=1)
    _one_line(err, fragment)
    assert "unexpected" not in err


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


@pytest.mark.s3
def test_info_counts_the_rows_in_the_tail_log_in_each_keys_stored_bytes(capsys, s3_bucket,
                                                                      s3_options):
    """A flushed, unclosed bucket buffer keeps its newest rows in log segments (raw), not in
    the keys' chunks: `info` said `obs` held 1.3 KiB stored for 31.2 KiB raw (ratio 24)."""
    url = f"s3://{s3_bucket}/cli/logged"
    storage = zstore.LazyMemmapStorage(100_000, scratch_dir=url, storage_options=s3_options,
                                       codec="zstd")
    for start in range(0, 1000, 200):
        storage.set(torch.arange(start, start + 200),
                    TensorDict(obs=torch.randn(200, 8), batch_size=[200]))
        storage.flush()
    assert storage._meta.tail  # what this test is about: rows committed to the log
    out = _run(capsys, "info", url, *[f"-o{k}={v}" for k, v in s3_options.items()])
    row = next(line.split() for line in out.splitlines() if line.startswith("  obs "))
    raw, stored, ratio = " ".join(row[-5:-3]), " ".join(row[-3:-1]), float(row[-1])
    assert raw == "31.2 KiB" and 0.9 <= ratio <= 1.0, out  # random floats, stored raw in the log
    storage.close()
    out = _run(capsys, "info", url, *[f"-o{k}={v}" for k, v in s3_options.items()])
    row = next(line.split() for line in out.splitlines() if line.startswith("  obs "))
    assert 0.9 <= float(row[-1]) <= 1.2, out  # in zstd chunks now, no log left


def test_info_shows_text_keys_long_keys_and_doubly_flagged_ends(capsys, tmp_path):
    """A string key showed as `uint8 [8]`, a key of 28 characters or more ran into its
    dtype, and an episode end flagged both terminal and timeout counted as -1 open."""
    import h5py
    import numpy as np

    n, long_key = 30, "infos/a_rather_long_goal_name_here"
    with h5py.File(tmp_path / "d.hdf5", "w") as f:
        f["observations"] = np.zeros((n, 2), np.float32)
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = f["timeouts"] = np.arange(n) % 10 == 9
        f[long_key] = np.zeros((n, 2), np.float32)
        f["infos/name"] = np.array(["left", "right"] * 15, dtype=h5py.string_dtype())
    url = str(tmp_path / "ds")
    _run(capsys, "import", "d4rl", str(tmp_path / "d.hdf5"), url, "--no-progress")
    out = _run(capsys, "info", url)
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert rows["info/name"].split()[1:5] == ["str", "(8", "B", "cells)"], out
    assert rows["info/name"].split()[5] == "[]", out  # one string a row
    assert rows["info/a_rather_long_goal_name_here"].split()[1] == "float32", out
    assert "episodes 3: 2 terminated, 2 truncated (2 both), 1 open;" in out, out  # last row dropped


def test_without_h5py_hdf5_work_names_the_extra_to_install(capsys, tmp_path, monkeypatch):
    """Before: the CLI blamed the destination and called it unexpected ("zstore: error:
    ModuleNotFoundError: URL: No module named 'h5py' (unexpected: ...)"), and the Python
    calls raised the bare ModuleNotFoundError."""
    import checkpoint

    (tmp_path / "d.hdf5").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "h5py", None)  # not installed
    err = _run(capsys, "import", "d4rl", str(tmp_path / "d.hdf5"), str(tmp_path / "ds"),
               "--no-progress", code=1)
    _one_line(err, "needs h5py: pip install 'zstore[h5]'")
    assert "unexpected" not in err and not (tmp_path / "ds").exists()
    storage = zstore.LazyTensorStorage(4)
    storage.set(torch.arange(2), TensorDict(x=torch.zeros(2), batch_size=[2]))
    with pytest.raises(ImportError, match=r"pip install 'zstore\[h5\]'"):
        checkpoint.H5StorageCheckpointer().dumps(storage, tmp_path / "ck.h5")


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


def test_info_of_a_storage_ensemble(capsys, tmp_path):
    members = []
    for i in range(2):
        storage = zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "run" / f"c{i}"))
        storage.set(torch.arange(3), TensorDict(obs=torch.zeros(3, 2), batch_size=[3]))
        storage.flush()
        members.append(storage)
    zstore.StorageEnsemble(*members, scratch_dir=str(tmp_path / "run"))
    out = _run(capsys, "info", str(tmp_path / "run"))
    assert out.splitlines()[1].startswith("  StorageEnsemble of 2 storages (c0, c1), capacity 20, ")


# -- one-line errors ------------------------------------------------------------------------

def test_debug_prints_the_traceback_then_the_line(capsys, tmp_path):
    missing = str(tmp_path / "nothing")
    for argv in (["--debug", "info", missing], ["info", missing, "--debug"]):
        err = _run(capsys, *argv, code=1)
        assert err.startswith("Traceback") and "StoreNotFoundError" in err
        assert err.splitlines()[-1] == (f"zstore: error: no zstore buffer at {missing}: the "
                                        "location does not exist")


def test_an_unexpected_error_is_one_line(capsys, monkeypatch, tmp_path):
    def broken(args):
        raise RuntimeError("the disk\nis on fire")

    registered = zstore.cli.COMMANDS
    monkeypatch.setitem(registered, "ls", replace(registered["ls"], run=broken))
    _one_line(_run(capsys, "ls", str(tmp_path), code=1),
              f"RuntimeError: {tmp_path}: the disk is on fire", "zstore --debug")


_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                         "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


@pytest.fixture
def no_credentials(s3_server, monkeypatch):
    """No AWS credentials anywhere (variables, files, instance metadata); yields the endpoint."""
    import s3fs

    for name in _CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # no client made with the credentials
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()  # nor one without them, for later tests


@pytest.mark.s3
@pytest.mark.parametrize("argv", [["info", "{url}"], ["info", "--json", "{url}"], ["seal", "{url}"],
                                  ["ls", "{bucket}"], ["convert", "{url}", "{tmp}"]])
def test_missing_credentials_are_named_with_the_fix(capsys, no_credentials, s3_bucket, tmp_path,
                                                    argv):
    url, bucket = f"s3://{s3_bucket}/cli/none", f"s3://{s3_bucket}"
    where = bucket if "{bucket}" in argv else url
    argv = [arg.format(url=url, bucket=bucket, tmp=tmp_path / "copy") for arg in argv]
    err = _run(capsys, *argv, "-o", f"endpoint_url={no_credentials}", code=1)
    _one_line(err, f"zstore: error: no credentials to access {where} {{'endpoint_url': ",
              "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", "-o key=KEY -o secret=SECRET")


@pytest.mark.s3
def test_missing_credentials_in_a_fresh_process(s3_server, s3_bucket):
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_EC2_METADATA_DISABLED="true")
    url = f"s3://{s3_bucket}/cli/none"
    done = subprocess.run([sys.executable, "-m", "zstore", "info", url, "-o",
                           f"endpoint_url={s3_server}"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    _one_line(done.stderr, f"no credentials to access {url}", "AWS_ACCESS_KEY_ID")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.s3
@pytest.mark.usefixtures("s3fs_transport")  # about s3fs's own wording
@pytest.mark.parametrize("command", ["info", "ls"])
def test_an_unreachable_endpoint_is_named(capsys, command):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    url = "s3://zstore-nowhere/rb"
    err = _run(capsys, command, url, "-o", f"endpoint_url={endpoint}", "-o", "key=k", "-o",
               "secret=s", "-o", 'config_kwargs={"retries": {"max_attempts": 1}}', code=1)
    _one_line(err, f"cannot connect to the server: {url} {{'endpoint_url': '{endpoint}'",
              "'secret': '***'", f'}}: Could not connect to the endpoint URL: "{endpoint}/',
              "check the endpoint (-o endpoint_url=URL)")


@pytest.mark.s3
@pytest.mark.usefixtures("s3fs_transport")  # about s3fs's own wording
def test_a_refused_request_names_the_url(capsys, s3_options):
    """A 403, as S3 answers wrong credentials (moto takes any key, so its bucket policy refuses);
    `ls`, which may list the bucket, names the prefix it may not read and goes on."""
    bucket = denying_bucket(s3_options)
    opts = [f"-o{k}={v}" for k, v in s3_options.items()]
    _one_line(_run(capsys, "info", f"s3://{bucket}/rb", *opts, code=1), "access denied: ",
              f"s3://{bucket}/rb {{", "'secret': '***'}",
              "Forbidden; check the credentials and the bucket's policy")
    assert main(["ls", f"s3://{bucket}", *opts]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"zstore: error: cannot read s3://{bucket}/rb: access denied (Forbidden); its "
                   "buffers, if any, are not listed (check the credentials and the bucket's "
                   "policy)\n")


@pytest.mark.s3
@needs_obstore
def test_obstore_errors_are_one_line_naming_the_store_and_the_fix(capsys, no_credentials, s3_options,
                                                                  s3_bucket, monkeypatch):
    """The obstore transport's failures read as s3fs's do: a missing credential, an
    unreachable server and a refusal each give the CLI's one line with the store and the fix,
    not obstore's message and its multi-line Rust debug dump."""
    # the instance metadata service, were it asked, on a closed port (botocore's chain,
    # which the obstore transport follows, skips it: AWS_EC2_METADATA_DISABLED)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    url = f"s3://{s3_bucket}/cli/none"
    err = _run(capsys, "info", url, "-o", f"endpoint_url={no_credentials}", "-o", "transport=obstore",
               code=1)
    _one_line(err, f"no credentials to access {url} {{'endpoint_url': ", "-o key=KEY -o secret=SECRET")

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    err = _run(capsys, "info", "s3://zstore-nowhere/rb", "-o", f"endpoint_url={endpoint}", "-o",
               "key=k", "-o", "secret=s", "-o", "transport=obstore", "-o",
               'config_kwargs={"retries": {"max_attempts": 1}}', code=1)
    _one_line(err, "cannot connect to the server: s3://zstore-nowhere/rb {", "error sending request",
              "check the endpoint")

    bucket = denying_bucket(s3_options)
    opts = [f"-o{k}={v}" for k, v in s3_options.items()]
    err = _run(capsys, "info", f"s3://{bucket}/rb", *opts, "-otransport=obstore", code=1)
    _one_line(err, f"access denied: cannot read s3://{bucket}/rb {{", "403 Forbidden",
              "check the credentials and the bucket's policy")


# -- start-up without torch -----------------------------------------------------------------

_IMPORTS = """
import contextlib, io, json, sys
from zstore.cli import main
seen = {}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    seen[" ".join(argv)] = [code, [m for m in ("torch", "tensordict") if m in sys.modules]]
print(json.dumps(seen))
"""


def test_help_ls_info_and_demo_help_do_not_import_torch(tmp_path, datasets):
    root, d4rl, _ = datasets
    zstore.dataset.import_d4rl(d4rl, root / "hopper", progress=False).close()
    storage = zstore.LazyMemmapStorage(20, scratch_dir=str(root / "rb"), ndim=2)
    storage.set((torch.arange(3),), TensorDict(obs=torch.zeros(3, 2, 4), batch_size=[3, 2]))
    storage.close()
    compressed = zstore.CompressedListStorage(5, scratch_dir=str(root / "frames"))
    compressed.set(0, TensorDict(pixels=torch.zeros(2, 2, dtype=torch.uint8)))
    compressed.flush()
    runs = [["--help"], ["ls", str(tmp_path)], ["info", str(root / "hopper")],
            ["info", str(root / "rb")], ["info", "--json", str(root / "rb")],
            ["info", str(root / "frames")], ["info", "--help"], ["demo", "--help"]]
    done = subprocess.run([sys.executable, "-c", _IMPORTS, json.dumps(runs)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {" ".join(argv): [0, []] for argv in runs}


def test_public_names_are_imported_on_first_use():
    for name in zstore.__all__:
        assert getattr(zstore, name) is not None and name in dir(zstore)
    from zstore import LazyMemmapStorage, open
    assert zstore.storages.LazyMemmapStorage is LazyMemmapStorage  # a submodule, as before
    assert open is zstore.api.open
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        zstore.nothing_here


@pytest.mark.s3
@needs_obstore
def test_a_refused_creation_through_obstore_names_the_store_once(s3_options):
    """A bucket that refuses the new buffer's ``zarr.json`` objects (but not its lease): the
    error says the creation failed, where, and why, naming the store once."""
    bucket = denying_bucket(s3_options, "s3:PutObject", "new/*zarr.json")
    url = f"s3://{bucket}/new"
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url,
                                       storage_options={**s3_options, "transport": "obstore"})
    with pytest.raises(PermissionError) as caught:
        storage.set(torch.arange(2), TensorDict(obs=torch.zeros(2, 3), batch_size=[2]))
    message = str(caught.value)
    assert message.startswith(f"cannot create a buffer at {url} "), message
    assert message.count(url) == 1 and "403 Forbidden" in message, message



# -- what `ls` and `info` find besides buffers; sources and destinations they cannot use -----

from test_dataset import http_root  # noqa: E402,F401 - the fixture: a directory served over HTTP


def _unfinished_creation(url: str, monkeypatch) -> None:
    """Leave at ``url`` a buffer whose creation stopped just before its first commit, as a
    writer killed there does (the crash point raises instead of SIGKILLing the test)."""
    class Stop(Exception):
        pass

    def crash_point(site: str) -> None:
        if site == "commit.before":
            raise Stop

    with monkeypatch.context() as patch:
        patch.setattr(zstore._faults, "crash_point", crash_point)
        storage = zstore.LazyMemmapStorage(10, scratch_dir=url)
        with pytest.raises(Stop):
            storage.set(torch.arange(2), TensorDict(obs=torch.zeros(2, 3), act=torch.zeros(2),
                                                    batch_size=[2]))


def test_an_unfinished_creation_is_one_line_of_ls_and_info_names_the_fix(capsys, tmp_path,
                                                                          monkeypatch):
    url = str(tmp_path / "runs" / "rb")
    _unfinished_creation(url, monkeypatch)
    # each array's zarr.json has a "zstore" attribute (its torch dtype): not a buffer of its own
    assert _run(capsys, "ls", str(tmp_path)) == f"{url}\t?\tincomplete\t?\n"
    for argv in (["info", url], ["info", "--json", url]):
        _one_line(_run(capsys, *argv, code=1), f"{url} holds a buffer whose creation never "
                  "finished", "delete it, or create the buffer there again")
    storage = zstore.LazyMemmapStorage(10, scratch_dir=url)  # the advice: it replaces the remains
    storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 3), batch_size=[2]))
    storage.close()
    assert _run(capsys, "ls", str(tmp_path)) == f"{url}\tLazyMemmapStorage\tbuffer\t2/10\n"
    from zstore import cli_commands, group  # what `ls` reads without importing zarr

    assert (cli_commands._BUFFER_ATTR, cli_commands._INCOMPLETE_ATTR) == \
        (group.ZSTORE_ATTR, group._INCOMPLETE_ATTR)


def test_ls_and_info_recognise_a_checkpoint(capsys, tmp_path):
    storage = zstore.LazyTensorStorage(10)
    storage.set(torch.arange(3), TensorDict(obs=torch.zeros(3, 2), batch_size=[3]))
    dest = str(tmp_path / "ckpt")
    generation = storage.dumps(dest).generation
    # one line for the checkpoint, not its generation (a buffer) as a buffer of its own
    assert _run(capsys, "ls", str(tmp_path)) == \
        f"{dest}\tTensorStorageCheckpointer\tcheckpoint\t3/10\n"
    err = _run(capsys, "info", dest, code=1)
    _one_line(err, f"{dest} holds a zstore checkpoint (TensorStorageCheckpointer, length 3/10), not "
                   "a buffer: load it with storage.loads(url)", "docs/checkpoints.md",
              f"zstore info {dest}/{generation}")
    assert "length 3 of capacity 10" in _run(capsys, "info", f"{dest}/{generation}")
    from zstore import cli_commands, group

    assert cli_commands._CHECKPOINT_ATTR == group.CHECKPOINT_ATTR  # read without importing zarr
    for argv in (["seal", dest], ["convert", dest, str(tmp_path / "copy")]):  # no "no block"
        _one_line(_run(capsys, *argv, code=1), f"{dest} holds a zstore checkpoint "
                  "(TensorStorageCheckpointer, length 3/10), not a buffer: load it",
                  "storage.loads(url)")


def test_ls_over_http_prints_urls_that_info_opens(capsys, http_root):
    root, base, _ = http_root
    storage = zstore.LazyMemmapStorage(8, scratch_dir=str(root / "sets" / "rb"))
    storage.set(torch.arange(3), TensorDict(obs=torch.zeros(3, 2), batch_size=[3]))
    storage.close()
    for url in (base, base + "/", f"{base}/sets"):
        assert _run(capsys, "ls", url) == f"{base}/sets/rb\tLazyMemmapStorage\tbuffer\t3/8\n"
    assert "length 3 of capacity 8" in _run(capsys, "info", f"{base}/sets/rb")


def test_writes_to_http_are_refused_as_read_only(capsys, http_root, datasets):
    root, base, requests = http_root
    _, d4rl, _ = datasets
    storage = zstore.LazyMemmapStorage(8, scratch_dir=str(root / "rb"))
    storage.set(torch.arange(3), TensorDict(obs=torch.zeros(3, 2), batch_size=[3]))
    storage.close()
    fix = "write to a local path or a bucket (s3://...) instead"
    err = _run(capsys, "seal", f"{base}/rb", code=1)
    _one_line(err, f"cannot seal {base}/rb: http:// stores are read-only; copy it to a local path "
                   f"or a bucket and seal the copy: zstore convert {base}/rb DST --seal")
    err = _run(capsys, "convert", str(root / "rb"), f"{base}/copy", "--no-progress", code=1)
    _one_line(err, f"cannot write the copy to {base}/copy: http:// stores are read-only; {fix}")
    err = _run(capsys, "import", "d4rl", str(d4rl), f"{base}/hopper", "--no-progress", code=1)
    _one_line(err, f"cannot import into {base}/hopper: http:// stores are read-only; {fix}")
    assert {method for method, _ in requests} <= {"GET", "HEAD"}  # refused before any write


def test_import_names_the_bad_source_file_and_the_fix(capsys, tmp_path, datasets):
    _, d4rl, _ = datasets
    (tmp_path / "text.hdf5").write_text("not hdf5")
    (tmp_path / "cut.hdf5").write_bytes(d4rl.read_bytes()[:3000])
    (tmp_path / "folder").mkdir()
    d4rl_fix, minari_fix = ("pass the .hdf5 file of a D4RL dataset",
                            "pass a Minari dataset's folder or its main_data.hdf5")
    out = str(tmp_path / "out")
    for layout, name, fragments in [
            ("d4rl", "nope.hdf5", ["no such file: {file}", d4rl_fix]),
            ("d4rl", "folder", ["{file} is a directory, not an HDF5 file", d4rl_fix]),
            ("d4rl", "text.hdf5", ["{file} is not an HDF5 file", d4rl_fix]),
            ("d4rl", "cut.hdf5", ["cannot read {file} as HDF5 (", "truncated file",
                                  "pass a complete, undamaged copy of the .hdf5 file of a D4RL"]),
            ("minari", "text.hdf5", ["{file} is not an HDF5 file", minari_fix]),
            ("minari", "folder", ["the Minari dataset folder {file} holds no main_data.hdf5"])]:
        file = str(tmp_path / name)
        err = _run(capsys, "import", layout, file, out, code=1)
        _one_line(err, *(fragment.format(file=file) for fragment in fragments))
        assert out not in err  # the destination is not to blame
    assert not os.path.exists(out)


# -- a file where a folder belongs, another storage in the way, an http server down ---------

def _small_buffer(url: str) -> None:
    storage = zstore.LazyMemmapStorage(10, scratch_dir=url)
    storage.set(torch.arange(2), TensorDict(obs=torch.zeros(2), batch_size=[2]))
    storage.close()


def test_a_file_where_a_folder_belongs_is_named_with_the_fix(capsys, tmp_path, datasets):
    """`info`, `ls`, `convert` and `import` on a regular file: zstore.open's words and each
    command's fix (they printed the OS's bare `[Errno 20] Not a directory` or `[Errno 17]`)."""
    _, d4rl, _ = datasets
    _small_buffer(str(tmp_path / "rb"))
    file = tmp_path / "afile"
    file.write_text("hello")
    is_a_file = f"{file} is a file; a zstore buffer or dataset is a directory: "
    for argv, fix in [(["info", str(file)], "pass the buffer's folder"),
                      (["ls", str(file)], "pass the folder to search for buffers"),
                      (["convert", str(tmp_path / "rb"), str(file), "--no-progress"],
                       "choose a new or empty folder instead"),
                      (["import", "d4rl", str(d4rl), str(file), "--no-progress"],
                       "choose a new or empty folder instead")]:
        err = _run(capsys, *argv, code=1)
        _one_line(err, is_a_file + fix)
        assert "Errno" not in err
    assert file.read_text() == "hello"


def test_convert_refuses_a_source_holding_no_rows(capsys, tmp_path):
    """An emptied buffer: `convert` failed with an "unexpected" AttributeError ('NoneType'
    object has no attribute 'sealed'), and the Python convert() returned having written
    nothing; both refuse it now, as `seal` does, naming the source."""
    from zstore.dataset.convert import convert

    src, dst = tmp_path / "emptied", tmp_path / "copy"
    _small_buffer(str(src))
    storage = zstore.open(str(src))
    storage._empty()
    storage.close()
    refusal = f"cannot convert {src}: it holds no rows (length 0), so there is nothing to copy"
    _one_line(_run(capsys, "convert", str(src), str(dst), "--no-progress", code=1), refusal)
    with pytest.raises(zstore.NotAZStoreError, match=re.escape(refusal)):
        convert(src, dst)
    assert not dst.exists()


def test_a_destination_holding_another_storage_is_named_by_its_class(capsys, tmp_path):
    """`convert` onto a CompressedListStorage names it (it said "a Zarr group that is not a
    zstore buffer", which `ls` lists as a CompressedListStorage buffer)."""
    _small_buffer(str(tmp_path / "rb"))
    frames = str(tmp_path / "frames")
    storage = zstore.CompressedListStorage(10, scratch_dir=frames)
    storage.set(0, TensorDict(obs=torch.zeros(2)))
    storage.close()
    err = _run(capsys, "convert", str(tmp_path / "rb"), frames, "--no-progress", code=1)
    _one_line(err, f"{frames} already holds a CompressedListStorage buffer; choose an empty location")
    assert "not a zstore buffer" not in err
    assert _run(capsys, "ls", frames) == f"{frames}\tCompressedListStorage\tbuffer\t1/10\n"


def test_an_unreachable_http_server_gets_advice_for_http(capsys):
    """An http:// URL whose server is down: check the URL's host and port, not S3's
    `-o endpoint_url=URL`, which does not apply to it."""
    url = f"http://127.0.0.1:{_closed_port()}/ds"
    for command in ("info", "ls"):
        err = _run(capsys, command, url, code=1)
        _one_line(err, f"cannot connect to the server: {url}: ",
                  "; check the host and port in the URL and that the server is up")
        assert "endpoint_url" not in err


# -- file modes: a folder this user may not write or read ----------------------------------

def _unprivileged(*argv: str) -> subprocess.CompletedProcess:
    """``python -m zstore ARGV`` in a process that file modes bind (as root too)."""
    return run_bound_by_file_modes("-m", "zstore", *argv)


def _chmod_all(root: Path, mode: int) -> None:
    for path in (root, *root.rglob("*")):
        path.chmod(mode if path.is_dir() else mode & 0o666)


def test_a_local_folder_without_write_access_gets_the_chmod_fix(tmp_path):
    """`zstore seal` on a read-only local buffer: one line naming it and the chmod fix, without
    the S3 advice (credentials, bucket policy) nor Python's `mode='r'`, no option of the CLI."""
    url = tmp_path / "rb"
    _small_buffer(str(url))
    _chmod_all(url, 0o555)
    try:
        done = _unprivileged("seal", str(url))
    finally:
        _chmod_all(url, 0o755)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    _one_line(done.stderr, f"zstore: error: access denied: cannot write to the store {url}: "
                           f"permission denied on {url}/", f"(chmod -R u+w {url})")
    for stray in ("bucket", "AWS_", "-o key=", "mode='r'"):
        assert stray not in done.stderr, stray


def test_ls_lists_every_readable_buffer_and_names_the_unreadable_folders(tmp_path):
    """A sub-folder `ls` may not read is named on stderr with the fix and the walk goes on,
    exit code 1 (as GNU ls does); it ended the listing there with one error line."""
    for name in ("a", "private/rb", "z/rb"):
        _small_buffer(str(tmp_path / name))
    private = tmp_path / "private"
    private.chmod(0o000)
    try:
        done = _unprivileged("ls", str(tmp_path))
    finally:
        private.chmod(0o755)
    assert done.returncode == 1, done.stderr
    assert done.stdout == (f"{tmp_path / 'a'}\tLazyMemmapStorage\tbuffer\t2/10\n"
                           f"{tmp_path / 'z' / 'rb'}\tLazyMemmapStorage\tbuffer\t2/10\n")
    assert done.stderr == (f"zstore: error: cannot read {private}: permission denied; its "
                           "buffers, if any, are not listed (give this user read access to list "
                           "them)\n")


def test_a_local_file_refused_by_the_os_is_named_with_the_fix(tmp_path):
    """`info` on a buffer whose metadata this user may not read: the file and the fix, not the
    OS's `[Errno 13]` with "check the file's permissions" alone."""
    url = tmp_path / "rb"
    _small_buffer(str(url))
    (url / "zarr.json").chmod(0o000)
    try:
        done = _unprivileged("info", str(url))
    finally:
        (url / "zarr.json").chmod(0o644)
    assert done.returncode == 1, done.stderr
    _one_line(done.stderr, f"zstore: error: access denied: permission denied on {url}/zarr.json; "
                           f"check the permissions of {url} and of the files in it (chmod -R "
                           f"u+rwX {url} gives its owner access)")
    assert "Errno" not in done.stderr and "bucket" not in done.stderr


def test_a_ctrl_c_after_the_work_is_reported_does_not_end_the_program_as_killed(tmp_path,
                                                                               monkeypatch):
    """A Ctrl-C after a conversion or import printed its result, while the interpreter shut
    down (joining upload threads), ended ``zstore`` as killed by SIGINT (exit 130 in a shell):
    a script checking it redid a complete copy. The program now ignores SIGINT once its work
    is reported; ``main(argv)`` called as a function leaves the caller's handler alone."""
    import signal

    from zstore.cli import main

    previous = signal.getsignal(signal.SIGINT)
    try:
        assert main(["ls", str(tmp_path)]) == 0
        assert signal.getsignal(signal.SIGINT) is previous
        monkeypatch.setattr(sys, "argv", ["zstore", "ls", str(tmp_path)])
        assert main() == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_while_the_arguments_are_declared_is_one_line(capsys, monkeypatch):
    """A Ctrl-C in `zstore demo`'s first seconds (its arguments were declared outside main's
    handler, importing torch) printed a KeyboardInterrupt traceback and died by SIGINT."""
    def interrupted(only=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(zstore.cli, "build_parser", interrupted)
    assert main(["demo", "-n", "1000"]) == 130
    assert capsys.readouterr().err == "zstore: interrupted\n"


def _piped_to_a_reader_gone(*argv: str) -> subprocess.CompletedProcess:
    """``python -m zstore ARGV`` writing to a pipe whose reader has left, its stdout buffered
    (as a user's is: ``PYTHONUNBUFFERED`` unset)."""
    reader, writer = os.pipe()
    os.close(reader)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    try:
        return subprocess.run([sys.executable, "-m", "zstore", *argv], stdout=writer,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
    finally:
        os.close(writer)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["demo", "--help"], ["ls", "{dir}"],
                                  ["info", "{dir}/rb"]])
def test_output_to_a_reader_that_left_is_dropped_quietly(tmp_path, argv):
    """`zstore ls DIR | head`: output still buffered at exit (all of a short one) was written
    after main's handler, so Python said "Exception ignored ... BrokenPipeError" and exited 120."""
    _small_buffer(str(tmp_path / "rb"))
    done = _piped_to_a_reader_gone(*(arg.format(dir=tmp_path) for arg in argv))
    assert (done.returncode, done.stderr) == (0, "")


def test_info_on_other_zarr_stores_says_what_is_there(capsys, tmp_path):
    """Regression: ``zstore info`` on a plain Zarr array said zarr's "An array already exists
    in store ... at path .", on a Zarr v2 store "no Zarr group there" (false), and on a
    malformed zarr.json gave the JSON parser's message alone."""
    import numpy as np
    import zarr

    zarr.create_array(str(tmp_path / "array"), data=np.arange(5))
    zarr.open_group(str(tmp_path / "v2"), mode="w", zarr_format=2).create_array("a", data=np.arange(3))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "zarr.json").write_text("{bad")
    for name, said in (("array", "it holds one Zarr array, not a group of arrays"),
                       ("v2", "it holds a Zarr v2 store (.zgroup, .zarray)"),
                       ("bad", "its zarr.json is not valid JSON")):
        _one_line(_run(capsys, "info", str(tmp_path / name), code=1),
                  f"{tmp_path / name} is not a zstore buffer: {said}")


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_info_of_a_group_that_is_no_buffer_fails_with_or_without_json(capsys, tmp_path, json_flag):
    """`info --json` printed `{}` with exit 0 for a key folder inside a buffer or a plain
    Zarr group, which `info` refuses as no buffer."""
    import zarr

    storage = zstore.LazyMemmapStorage(10, scratch_dir=str(tmp_path / "nested"))
    storage.set(torch.arange(2), TensorDict({"next": {"obs": torch.zeros(2)}}, batch_size=[2]))
    storage.close()
    zarr.open_group(str(tmp_path / "plain"), mode="w").attrs["x"] = 1
    for url in (tmp_path / "nested" / "next", tmp_path / "plain"):
        err = _run(capsys, "info", *json_flag, str(url), code=1)
        _one_line(err, f"{url} is not a zstore buffer: no 'zstore' block in its attributes")


@pytest.mark.parametrize("damage", ["a length that is no count", "zarr.json not JSON"])
def test_ls_names_a_malformed_buffer_and_lists_the_others(capsys, tmp_path, damage):
    """One buffer's ``"length": "many"`` stopped the listing ("Cannot specify ',' with 's'",
    exit 1, the buffers after it never listed); a zarr.json that is no JSON hid its buffer."""
    urls = [str(tmp_path / name) for name in ("a", "b", "c")]
    for url in urls:
        storage = zstore.LazyMemmapStorage(10, scratch_dir=url)
        storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 3), batch_size=[2]))
        storage.close()
    node = Path(urls[1]) / "zarr.json"
    if damage == "zarr.json not JSON":
        node.write_text("{ cut short")
        why = "its zarr.json is not valid JSON"
    else:
        document = json.loads(node.read_text())
        document["attributes"]["zstore"]["length"] = "many"
        node.write_text(json.dumps(document))
        why = "its zarr.json is malformed: length is 'many', not a count"
    got = main(["ls", str(tmp_path)])
    captured = capsys.readouterr()
    assert got == 1
    assert captured.out == "".join(f"{url}\tLazyMemmapStorage\tbuffer\t2/10\n"
                                   for url in (urls[0], urls[2]))
    _one_line(captured.err, f"{urls[1]}: {why}; not listed (zstore info {urls[1]} says more)")


def test_info_names_a_raw_chunk_cut_short(capsys, tmp_path):
    """`info` printed its table with exit 0 for a raw buffer one of whose chunk files was cut
    to 5 bytes; reading it raises CorruptChunkError."""
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(40, scratch_dir=url, chunks=10)
    storage.set(torch.arange(30), TensorDict(obs=torch.randn(30, 3), batch_size=[30]))
    storage.close()
    (Path(url) / "obs" / "c" / "1" / "0.3f2a9c0d.partial").write_bytes(bytes(7))  # a killed
    # write's leftover (zarr writes a chunk file beside it, then renames it): no damage
    assert "raw+nocrc" in _run(capsys, "info", url)  # every chunk whole: exit 0
    os.truncate(Path(url) / "obs" / "c" / "2" / "0", 5)
    got = main(["info", url])
    captured = capsys.readouterr()
    assert got == 1 and "obs" in captured.out  # the table, then what is damaged
    _one_line(captured.err, f"{url}: key 'obs': its chunk c/2/0 holds 5 bytes, not 120: it is "
                            "damaged", "restore the store from a copy or a checkpoint")
    with pytest.raises(zstore.CorruptChunkError):
        zstore.open(url, mode="r")[:]


def test_info_names_the_objects_a_sealed_dataset_lost(capsys, tmp_path):
    """`info` of a dataset whose episode index lost a chunk, or its whole folder, printed
    statistics read as zeros ("length mean 0.0") with exit 0, and a lost data chunk went
    unmentioned; `open_dataset(url).episodes` raises CorruptChunkError."""
    import shutil

    from zstore.row_objects import REBUILD_INDEX

    url, no_index = tmp_path / "ds", tmp_path / "no-index"
    _small_buffer(str(url))
    zstore.seal(str(url))
    assert "length mean 2.0" in _run(capsys, "info", str(url))
    shutil.copytree(url, no_index)
    shutil.rmtree(no_index / "__episodes__")
    (url / "__episodes__" / "length" / "c" / "0").unlink()
    (url / "obs" / "c" / "0").unlink()
    errors = {}
    for damaged in (url, no_index):
        got = main(["info", str(damaged)])
        captured = capsys.readouterr()
        assert got == 1 and "episodes 1 (no statistics: the index is damaged)" in captured.out
        assert "length mean" not in captured.out
        errors[damaged] = captured.err.splitlines()
    assert errors[url][0].startswith(f"zstore: error: {url}: key 'obs' lost 'obs/c/0': ")
    assert errors[url][1].startswith(f"zstore: error: {url}: the episode index lost "
                                     "'__episodes__/length/c/0'. ")
    assert errors[no_index] == [f"zstore: error: {no_index}: the episode index lost "
                                f"'__episodes__/length/c/0' and 5 more. {REBUILD_INDEX}"]
    with pytest.raises(zstore.CorruptChunkError, match="the episode index lost"):
        open_dataset(no_index).episodes


def test_info_names_a_key_whose_array_is_gone_before_printing_its_table(capsys, tmp_path):
    """It printed half the table, then "malformed metadata (KeyError('obs'))"."""
    import shutil

    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url)
    storage.set(torch.arange(2), TensorDict(obs=torch.ones(2, 3), act=torch.ones(2),
                                            batch_size=[2]))
    storage.close()
    shutil.rmtree(Path(url) / "obs")
    got = main(["info", url])
    captured = capsys.readouterr()
    assert got == 1 and captured.out == f"{url}\n"  # no table
    _one_line(captured.err, f"{url}: key 'obs' is in its metadata but has no array",
              "restore the store from a copy or a checkpoint")
    assert "malformed" not in captured.err and captured.err.count(url) == 1


def test_ls_of_a_memory_url_says_where_memory_stores_live(capsys):
    _one_line(_run(capsys, "ls", "memory://nothing-here", code=1),
              "no such location: memory://nothing-here (memory:// stores live inside one process")
