"""zstore.display: the text and HTML reprs of every storage, from one Summary.

Each storage is filled with the same TED batch (one key named ``<script>``);
its repr and HTML are checked against facts computed here from the data
(lengths, cursors, per-key raw bytes, stored bytes listed with fsspec), and
credentials given in ``storage_options`` must never appear.
"""

from __future__ import annotations

import doctest
import html
import io
import math
from html.parser import HTMLParser

import fsspec
import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import display, plots, progress
from zstore.display import KeyRow, Summary, format_bytes, render_html, render_text

N, CAPACITY = 12, 16
SCRIPT = "<script>"
SECRET, KEY_ID = "s3cr3t-Zst0re-value", "AKIAZSTORETESTKEY"


def ted(n: int = N, start: int = 0) -> TensorDict:
    """A TED batch: done every 5th row, a uint8 key named like an HTML tag."""
    t = torch.arange(start, start + n)
    return TensorDict({
        "obs": t.float().unsqueeze(-1).expand(n, 4).clone(),
        SCRIPT: (t % 256).to(torch.uint8),
        ("next", "reward"): t.float().unsqueeze(-1),
        ("next", "done"): (t % 5 == 4).unsqueeze(-1),
    }, batch_size=[n])


LEAVES = {"obs": ([4], "float32", 16), SCRIPT: ([], "uint8", 1),
          "next/reward": ([1], "float32", 4), "next/done": ([1], "bool", 1)}


class _Tags(HTMLParser):
    """Collects the tags of an HTML fragment and checks that they nest."""

    VOID = frozenset({"br", "hr", "img"})

    def __init__(self):
        super().__init__()
        self.tags, self.stack = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing"


def check_html(storage) -> str:
    """The storage's HTML: well nested, with no tag but the renderer's own."""
    text = storage._repr_html_()
    parser = _Tags()
    parser.feed(text)
    parser.close()
    assert not parser.stack
    assert set(parser.tags) <= {"style", "div", "strong", "table", "tr", "td", "th", "code",
                                "span", "em"}
    return text


def check_keys(storage, n_rows: int, *, codec: str | None = None, sizes: bool = True) -> None:
    """Every key in both reprs, with its shape, dtype and raw bytes; ``<script>`` escaped."""
    text, page = repr(storage), check_html(storage)
    rows = {row.key: row for row in storage.summary().rows}
    assert set(rows) == set(LEAVES)
    for key, (shape, dtype, row_bytes) in LEAVES.items():
        row = rows[key]
        assert (list(row.shape), row.dtype) == (shape, dtype)
        assert f"\n        {key}  " in text  # a row of the key table
        assert f"<code>{html.escape(key)}</code>" in page
        if sizes:
            assert row.raw_bytes == n_rows * row_bytes
            assert format_bytes(row.raw_bytes) in page
        if codec is not None:
            assert row.codec == codec
    assert SCRIPT not in page and "&lt;script&gt;" in page


def du(url: str, options: dict | None = None) -> int:
    """Bytes stored under ``url``, leaving out the writer's lease (bookkeeping, not data)."""
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    return int(sum(size for name, size in fs.du(path, total=False).items()
                   if not name.endswith("/zstore-lease.json")))


# -- in-RAM storages --------------------------------------------------------------------------

def test_list_storage_of_objects_and_of_tensordicts():
    s = zstore.ListStorage(CAPACITY)
    assert "len=0, max_size=16" in repr(s) and "<empty>" in repr(s)
    assert "empty: nothing written yet" in check_html(s)
    s.set(0, "<b>bold</b> item")
    assert "item 0='<b>bold</b> item'" in repr(s)
    page = check_html(s)
    assert "&lt;b&gt;bold&lt;/b&gt; item" in page and "<b>" not in page
    s = zstore.ListStorage()
    for i in range(3):
        s.set(i, ted()[i])
    assert "len=3, max_size=unbounded" in repr(s) and "3 / unbounded" in check_html(s)
    check_keys(s, 3, sizes=False)


def test_lazy_stack_storage():
    s = zstore.LazyStackStorage(CAPACITY)
    for i in range(5):
        s.set(i, ted()[i])
    assert "len=5, max_size=16" in repr(s)
    assert "5 / 16 (31%)" in check_html(s)
    check_keys(s, 5, sizes=False)


@pytest.mark.parametrize("cls", ["TensorStorage", "LazyTensorStorage"])
def test_tensor_storages(cls):
    if cls == "TensorStorage":  # over a container: full from the start
        s, filled = zstore.TensorStorage(ted(CAPACITY)), CAPACITY
        s.set(torch.arange(N), ted())
    else:
        s, filled = zstore.LazyTensorStorage(CAPACITY), N
        assert "<empty>" in repr(s)
        s.set(torch.arange(N), ted())
    check_keys(s, filled)
    summary = s.summary()
    assert (summary.length, summary.capacity, summary.cursor) == (filled, CAPACITY, N - 1)
    # stored = allocated (capacity rows), raw = filled rows
    assert summary.stored_bytes == CAPACITY * sum(b for _, _, b in LEAVES.values())
    assert summary.raw_bytes == filled * sum(b for _, _, b in LEAVES.values())
    done = int(ted(filled)["next", "done"].sum())
    assert summary.episodes == done and f"episodes={done}" in repr(s)
    assert f"cursor={N - 1}" in repr(s) and f"{N - 1} (last index written)" in check_html(s)


def test_cursor_follows_the_ring():
    s = zstore.LazyTensorStorage(CAPACITY)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(s)
    writer.extend(ted(10))
    writer.extend(ted(10, start=10))  # wraps: rows 10..15 then 0..3
    assert s.summary().cursor == 3 and "len=16, max_size=16, cursor=3" in repr(s)
    assert "16 / 16 (100%)" in check_html(s)


def test_an_ensemble_shows_the_rows_its_members_hold():
    """Its fill is the members' rows over their capacities (len() of an ensemble counts its
    members, as TorchRL's does: two members showed "fill 2 / 28")."""
    small, large = zstore.LazyTensorStorage(4), zstore.LazyTensorStorage(CAPACITY + 8)
    small.set(torch.arange(1), ted(1))
    large.set(torch.arange(N), ted())
    ensemble = zstore.StorageEnsemble(small, large)
    assert len(ensemble) == 2
    summary = ensemble.summary()
    assert (summary.length, summary.capacity) == (1 + N, 4 + CAPACITY + 8)
    assert "13 / 28 (46%)" in check_html(ensemble) and "len=13, max_size=28" in render_text(summary)
    assert [(part.kind, part.length) for part in summary.parts] == [
        ("LazyTensorStorage", 1), ("LazyTensorStorage", N)]  # docs/notebooks.md: nested
    assert check_html(ensemble).count("1 / 4 (25%)") == 1


# -- persistent storages ----------------------------------------------------------------------

def test_lazy_memmap_storage(location):
    url = location.new()
    s = zstore.LazyMemmapStorage(CAPACITY, scratch_dir=url, storage_options=location.options,
                                 codec="zstd", chunks=4)
    assert "<empty>" in repr(s) and s.spec.redacted() in repr(s)
    s.set(torch.arange(N), ted())
    s.get(torch.arange(8))
    check_keys(s, N, codec="zstd:1+crc32c")
    summary, text, page = s.summary(), repr(s), check_html(s)
    assert (summary.length, summary.capacity, summary.cursor) == (N, CAPACITY, N - 1)
    assert "len=12, max_size=16, cursor=11" in text and "12 / 16 (75%)" in page
    stats = s.cache_stats
    assert summary.cache_stats == stats and summary.cache_tier == "host"
    assert f"hit rate {stats.hit_rate:.1%} ({stats.hits:,} / {stats.hits + stats.misses:,})" in page
    if location.kind == "s3":  # never lists an object store for a repr
        assert summary.stored_bytes is None and all(r.stored_bytes is None for r in summary.rows)
        assert "not listed on s3://" in text
    else:
        s.flush()  # commits the length: the metadata grows by a few bytes
        summary, text, page = s.summary(), repr(s), check_html(s)
        assert summary.stored_bytes == du(url)
        for row in summary.rows:
            path = "_-single-tensor-_" if row.key == "(tensor)" else row.key
            assert row.stored_bytes == du(f"{url}/{path}")
        assert f"nbytes={du(url)}" in text and format_bytes(du(url)) in page
    s.flush()
    reader = zstore.open(url, storage_options=location.options, mode="r")
    assert "mode=read-only" in repr(reader) and "len=12, max_size=16, cursor=11" in repr(reader)
    reader.close()
    assert "closed" in repr(reader) and "len=12" in repr(reader)


def test_local_raw_buffer_is_memory_mapped(tmp_path):
    s = zstore.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path / "rb")
    s.set(torch.arange(N), ted())
    check_keys(s, N, codec="raw+nocrc")
    assert "cache=host (memory-mapped, no cache)" in repr(s)  # not a budget no cache uses


def test_compressed_list_storage(location):
    url = location.new()
    s = zstore.CompressedListStorage(CAPACITY, scratch_dir=url, storage_options=location.options)
    assert "<empty>" in repr(s)
    for i in range(N):
        s.set(i, ted()[i])
    check_keys(s, N, codec="zstd:3+crc32c")
    summary = s.summary()
    assert summary.raw_bytes == s.raw_nbytes == N * sum(b for _, _, b in LEAVES.values())
    assert "len=12, max_size=16" in repr(s)
    if location.kind != "s3":
        assert summary.stored_bytes == du(url) == s.nbytes
        assert f"compression_ratio={s.raw_nbytes / du(url):.3g}" in repr(s)


def test_compressed_list_storage_ragged_key():
    s = zstore.CompressedListStorage(CAPACITY)
    for n in (2, 5, 3):
        s.set(len(s), TensorDict(obs=torch.ones(n, 3), batch_size=[n]))
    (row,) = s.summary().rows
    assert (row.key, row.shape) == ("obs", "ragged")
    assert row.raw_bytes == (2 + 5 + 3) * 3 * 4
    assert "ragged" in repr(s) and "ragged" in check_html(s)


# -- credentials ------------------------------------------------------------------------------

@pytest.mark.s3
@pytest.mark.parametrize("cls", ["LazyMemmapStorage", "CompressedListStorage"])
def test_credentials_never_shown(s3_server, s3_bucket, cls):
    options = {"endpoint_url": s3_server, "key": KEY_ID, "secret": SECRET,
               "client_kwargs": {"aws_session_token": "token-" + SECRET}}
    url = f"s3://{s3_bucket}/secret-{cls}"
    s = getattr(zstore, cls)(CAPACITY, scratch_dir=url, storage_options=options)
    for i in range(3):
        s.set(i, ted()[i])
    s.flush()
    for text in (repr(s), check_html(s)):
        assert SECRET not in text and KEY_ID not in text
        assert url in text and "***" in text and s3_server in text
    assert SECRET not in repr(s.summary()) and KEY_ID not in repr(s.summary())
    assert SECRET not in repr(s.spec) and KEY_ID not in repr(s.spec) and url in repr(s.spec)
    reader = zstore.open(url, storage_options=options, mode="r")
    assert SECRET not in repr(reader) + reader._repr_html_()
    assert KEY_ID not in repr(reader) + reader._repr_html_()


# -- the summary API --------------------------------------------------------------------------

def test_episodes_from_a_storage_that_knows_them():
    class Episodic(zstore.LazyTensorStorage):
        num_episodes = 7  # as a sealed Dataset exposes it

    s = Episodic(CAPACITY)
    s.set(torch.arange(3), ted(3))
    assert s.summary().episodes == 7
    assert "episodes=7" in repr(s) and '<td class="zs-fact">episodes</td><td>7</td>' in check_html(s)


def test_parts_render_nested():
    part = Summary("Part", 2, 4, rows=(KeyRow("<a>", (1,), "int64"),))
    whole = Summary("Ensemble", 4, 8, parts=(part, Summary("Part", 2, 4)))
    text, page = render_text(whole), render_html(whole)
    assert text.count("Part(") == 2 and "<empty>" not in text.split("Part(")[1]
    assert page.count("<strong>Part</strong>") == 2 and "&lt;a&gt;" in page


def test_format_bytes():
    assert [format_bytes(n) for n in (None, 0, 1023, 1536, 5 << 20, 3 << 40)] == \
        ["?", "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB"]
    assert math.isclose(Summary("S", 1, 1, stored_bytes=2, raw_bytes=5).compression_ratio, 2.5)


@pytest.mark.parametrize("module", [display, plots, progress])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted and not result.failed


def test_progress_is_quiet_off_a_terminal():
    with progress.progress(3, desc="rows") as bar:  # pytest captures stderr: not a TTY
        assert bar.disable and bar.total == 3
    assert list(progress.progress(range(4), enabled=False)) == [0, 1, 2, 3]
    out = io.StringIO()
    bar = progress.progress(range(2), desc="on", enabled=True, file=out)
    assert not bar.disable and list(bar) == [0, 1] and "on: 100%" in out.getvalue()
    assert not progress.in_notebook()
