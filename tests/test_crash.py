"""Crash consistency: a writer SIGKILLed at deterministic crash points leaves the last commit.

Each kill point runs the scenario of :mod:`crashkit` in a forked child that
kills itself at the ``k``-th hit of a crash site (``zstore._faults``), then
reopens the store and checks exactly the guarantee of ``docs/format.md`` §6,
and that writing continues. Local stores run every kill point of the
scenario (50+ each) and S3 on moto (15-20 ms a request here) a spread of them
in the ``campaign`` run (``make campaign``, which ``.ci/run`` runs too);
``make test`` runs a spread per kind (16 locally, 10 on S3), the first hit of every
crash site included. ``benchmarks/reliability_long.py`` runs them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import crashkit
import pytest

from zstore import _faults

# kind -> (kill points run, minimum required): the campaign's, then make test's spread
CAMPAIGN = {"mmap": (None, 50), "chunked": (55, 50), "s3": (52, 50)}
SPREAD = {"mmap": (16, 16), "chunked": (16, 16), "s3": (10, 10)}  # S3: each site's first hit + 4


def place(kind: str, tmp_path, request, name: str) -> tuple[str, dict]:
    """(URL, storage options) of a fresh location: S3 on moto for ``"s3"``, else local."""
    if kind == "s3":
        return (f"s3://{request.getfixturevalue('s3_bucket')}/{name}-{tmp_path.name}",
                request.getfixturevalue("s3_options"))
    return str(tmp_path / name), {}


@pytest.mark.parametrize("budget", [
    pytest.param(SPREAD, id="spread", marks=pytest.mark.timeout(900)),
    pytest.param(CAMPAIGN, id="campaign", marks=[pytest.mark.campaign,
                                                  pytest.mark.timeout(3600)]),
])
@pytest.mark.parametrize("kind", ["mmap", "chunked", "s3"])
def test_killed_writer_leaves_the_last_commit_and_writing_continues(kind, budget, tmp_path,
                                                                     request):
    base, options = place(kind, tmp_path, request, "crash")
    limit, minimum = budget[kind]
    campaign = crashkit.run_campaign(kind, base, options, limit=limit, workdir=str(tmp_path))
    assert not campaign.failures, json.dumps(campaign.failures, indent=1)
    assert len(campaign.outcomes) >= minimum
    sites = {point.rpartition(":")[0] for point in campaign.points}
    expected = {"commit.before", "commit.after"} | ({"mmap.write"} if kind == "mmap" else
                                                    {"store.before", "store.unit", "store.segment",
                                                     "store.after"})
    assert expected <= sites
    # the kills really fell before creation, between commits and after the last one
    outcomes = set(campaign.outcomes.values())
    assert "uncreated" in outcomes and "commit@0" in outcomes
    assert len(outcomes) >= 3


def test_model_matches_an_uninterrupted_run(tmp_path):
    """The checker's reference: its last commit is what a run without kills commits."""
    model = crashkit.Model()
    url = str(tmp_path / "rb")
    crashkit.writer(url, {}, crashkit.LAYOUTS["chunked"], str(tmp_path / "log"), None)
    import zstore

    reader = zstore.open(url, mode="r")
    last = model.commits[-1]
    assert len(reader) == last.length == crashkit.CAPACITY
    codes = crashkit.decode(reader[:])
    for column in codes.values():
        assert column.tolist() == [last.codes[row] for row in range(last.length)]


def test_checker_catches_uncommitted_and_torn_rows(tmp_path):
    """The checker fails on a store that shows rows past the commit or a torn row."""
    import zstore

    model = crashkit.Model()
    url = str(tmp_path / "rb")
    log = str(tmp_path / "log")
    crashkit.writer(url, {}, crashkit.LAYOUTS["chunked"], log, None)
    with open(log, "a") as handle:  # pretend the kill hit while flushing step 16
        handle.write("B 16\n")
    with pytest.raises(AssertionError, match="length|cursor"):  # step 16's commit is visible
        crashkit.verify(url, {}, crashkit.LAYOUTS["chunked"], model, log, "commit.before")
    url2 = str(tmp_path / "rb2")
    crashkit.writer(url2, {}, crashkit.LAYOUTS["mmap"], str(tmp_path / "log2"), None)
    storage = zstore.open(url2)
    row = storage[5]
    row["a"] += 1  # a torn row: column "a" disagrees with the others
    storage.set(5, row, set_cursor=False)
    storage.close()
    with pytest.raises(AssertionError, match="row 5 column a"):
        crashkit.verify(url2, {}, crashkit.LAYOUTS["mmap"], model, str(tmp_path / "log2"), "-")


def test_crash_point_is_a_no_op_unless_armed():
    assert _faults.crash_point is _faults._off
    with pytest.raises(ValueError, match="site"):
        _faults.arm("commit.after")
    with pytest.raises(ValueError, match="k >= 1"):
        _faults.arm("commit.after:0")
    assert _faults.crash_point is _faults._off


def test_environment_variable_kills_a_plain_subprocess(tmp_path):
    """``ZSTORE_CRASH_AT`` arms the hook at import: the process dies by SIGKILL there."""
    code = ("import torch, zstore; from tensordict import TensorDict;"
            f"s = zstore.LazyMemmapStorage(8, scratch_dir={str(tmp_path / 'rb')!r});"
            "s.set(torch.arange(3), TensorDict(x=torch.ones(3), batch_size=[3])); s.flush();"
            "print('survived')")
    env = dict(os.environ, ZSTORE_CRASH_AT="commit.after:2",
               PYTHONPATH=os.path.dirname(os.path.dirname(_faults.__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False,
                          timeout=120)
    assert done.returncode == -9 and "survived" not in done.stdout
    import zstore

    assert len(zstore.open(str(tmp_path / "rb"), mode="r")) == 3  # the second commit landed


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["mmap", "chunked", pytest.param("s3", marks=pytest.mark.campaign)])
def test_readers_during_writes_never_see_uncommitted_rows(kind, tmp_path, request):
    """Four reader processes reopen and read while a writer appends and commits."""
    url, options = place(kind, tmp_path, request, "readers")
    results = crashkit.readers_during_writes(url, options, crashkit.LAYOUTS[kind], str(tmp_path),
                                             rounds=5 if kind == "s3" else 20)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    seen = set().union(*(r["lengths"] for r in results))
    assert len(seen) >= 3  # the readers really overlapped several commits
