"""``zstore demo`` and the ``zstore`` command line: exit codes and the report's key lines."""

from __future__ import annotations

import pytest

import zstore
from zstore.cli import main


def _demo(capsys, *args: str) -> str:
    code = main(["demo", "--transitions", "2000", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _assert_report(out: str) -> None:
    assert "zstore demo: 2,000 transitions from 8 point-mass envs" in out
    for key in ("observation", "action", "next.observation", "next.reward", "next.done",
                "next.terminated", "next.truncated"):
        assert f"\n  {key} " in out
    assert "LazyMemmapStorage, len 2,000, cursor 1,999  ok" in out
    assert "a new process" in out
    assert "keys match the written data" in out
    assert "obs chain ok" in out
    for step in ("fill (writer.extend)", "flush", "reopen", "first sample", "warm sample"):
        assert step in out
    assert "transitions/s" in out


def test_demo_local(capsys):
    out = _demo(capsys)
    _assert_report(out)
    assert "temporary store removed" in out


def test_demo_wraps_around_with_zstd_keeps_url_and_refuses_to_overwrite(capsys, tmp_path):
    url = tmp_path / "rb"
    out = _demo(capsys, "--capacity", "1500", "--codec", "zstd", "--url", str(url))
    assert "codec zstd:1+crc32c, capacity 1,500" in out
    assert "len 1,500, cursor 499  ok" in out
    assert f"kept at {url}" in out
    assert (url / "zarr.json").exists()
    # a second demo at the kept URL refuses it, and leaves the buffer as it was
    assert main(["demo", "-n", "600", "--url", str(url)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zstore: error: ") and "already exists" in err
    assert len(zstore.open(str(url), mode="r")) == 1500


@pytest.mark.s3
def test_demo_s3(capsys):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    out = _demo(capsys, "--s3")
    _assert_report(out)
    assert "S3 on loopback (moto)" in out
    assert "'secret': '***'" in out
    assert "server stopped" in out


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["demo", "-h"]])
def test_help(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: zstore")
    assert ("--transitions" in out) == (argv[0] == "demo")


@pytest.mark.parametrize("argv", [
    [], ["demo", "--bogus"], ["nosuchcommand"], ["demo", "--transitions", "0"],
    ["demo", "--codec", "nope"], ["demo", "--url", "memory://rb"], ["demo", "--s3", "--keep"],
    ["demo", "--s3", "--url", "/tmp/x"], ["demo", "-o", "anon=true"],
])
def test_usage_errors(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "usage: zstore" in captured.err and "error:" in captured.err
    assert captured.out == ""
