"""The prefaulter populates pages ahead of the writer without changing a byte."""

from __future__ import annotations

import sys

import pytest
import torch

from zstore import prefault
from zstore.prefault import Prefaulter

pytestmark = pytest.mark.skipif(prefault._MADVISE is None, reason="madvise needs Linux")


def _mapped(path, rows: int, width: int) -> torch.Tensor:
    with open(path, "ab") as handle:
        handle.truncate(rows * width * 4)
    return torch.from_file(str(path), shared=True, size=rows * width, dtype=torch.float32).view(rows, width)


def _resident_pages() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1])


def test_populates_the_rows_ahead_and_changes_no_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(prefault, "WINDOW_BYTES", 8 << 20)
    rows, width = 64 * 1024, 64                        # 16 MiB per column, 2 columns
    maps = {"a": _mapped(tmp_path / "a", rows, width), "b": _mapped(tmp_path / "b", rows, width)}
    maps["a"][:10] = 1.0
    maps["b"][:10] = 2.0
    before = _resident_pages()
    ahead = Prefaulter(maps, rows, start=10)
    ahead.ahead_of(9)
    ahead.close()                                      # waits for the population
    if not sys.platform.startswith("linux") or ahead._frontier == 10:
        pytest.skip("nothing populated")
    populated = 2 * 2 * (8 << 20) // 2                 # two windows of 8 MiB over 2 columns
    assert _resident_pages() - before >= populated // 4096 // 2
    assert ahead._frontier == 10 + 2 * ((8 << 20) // (2 * width * 4))
    assert bool((maps["a"][:10] == 1).all()) and bool((maps["b"][:10] == 2).all())
    assert not maps["a"][10:].any() and not maps["b"][10:].any()   # still zeros
    ahead.ahead_of(11)                                 # closed: does nothing
    assert ahead._frontier == 10 + 2 * ((8 << 20) // (2 * width * 4))


def test_waits_until_the_writer_is_within_a_window(tmp_path, monkeypatch):
    monkeypatch.setattr(prefault, "WINDOW_BYTES", 1 << 20)
    rows, width = 16 * 1024, 64                        # 4 MiB; a window is 4096 rows
    maps = {"a": _mapped(tmp_path / "a", rows, width)}
    ahead = Prefaulter(maps, rows, start=0)
    ahead.ahead_of(0)
    ahead._pending.result()
    assert ahead._frontier == 1 + 2 * 4096
    ahead.ahead_of(100)                                # far behind the frontier: nothing new
    assert ahead._frontier == 1 + 2 * 4096
    ahead.ahead_of(4097)                               # within a window: two more, to the end
    ahead._pending.result()
    assert ahead._frontier == rows
    ahead.ahead_of(rows - 1)
    ahead.close()
    assert not maps["a"].any()
