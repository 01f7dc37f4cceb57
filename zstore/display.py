"""Text and HTML reprs of storages, rendered from one :class:`Summary` value.

A storage describes itself with ``summary()`` (plain facts: keys, shapes,
dtypes, codecs, bytes, fill, cursor, store location, cache counters); this
module is the one place that turns a summary into ``__repr__`` text or the
``_repr_html_`` table a notebook shows. A new storage class only implements
``summary()``.

Credentials never reach the output: a summary holds the :class:`StoreSpec`
itself, and both renderers print only :meth:`StoreSpec.redacted`. Every piece
of user data (keys, URLs, item reprs) is HTML-escaped.

>>> from zstore.display import KeyRow, Summary, render_text
>>> print(render_text(Summary("Example", length=2, capacity=8,
...                           rows=(KeyRow("obs", (4,), "float32"),))))
Example(
    len=2, max_size=8
    keys:
        obs  [4]  float32
)
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import TYPE_CHECKING, Any

from .store import StoreSpec

if TYPE_CHECKING:  # torch is imported where tensors are walked: the CLI formats without it
    import torch

    from .cache import CacheStats

#: Longest item repr shown for storages of arbitrary objects.
MAX_ITEM_REPR = 80
#: The dtype column of a string key (``NonTensorData`` / ``NonTensorStack`` of ``str``).
TEXT_DTYPE = "str"


@dataclasses.dataclass(frozen=True)
class KeyRow:
    """One key (column) of a storage.

    ``shape`` is the per-cell feature shape (a tuple, or text such as
    ``"ragged"``); ``dtype`` a tensor dtype's name, or :func:`text_dtype` for a
    string key (its shape then leaves out the text cells' width); byte counts
    are ``None`` where they are unknown or too costly to measure (e.g. listing
    an object store).
    """

    key: str
    shape: tuple[int, ...] | str
    dtype: str
    codec: str | None = None
    stored_bytes: int | None = None
    raw_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a storage shows about itself; rendered by :func:`render_text` / :func:`render_html`.

    Args:
        kind: the class name.
        length: cells written; ``capacity`` the most it holds (``None``: unbounded).
        cursor: the last index written (``None`` when unknown or nothing written).
        spec: where the data lives (shown redacted).
        rows: one :class:`KeyRow` per key; empty when nothing is written yet.
        stored_bytes, raw_bytes: totals (stored as encoded, raw as tensors).
        episodes: episodes in the storage, where the storage knows it cheaply.
        cache_tier, cache_budget, cache_stats: the hot-chunk cache, if any.
        facts: further ``(name, value)`` header facts (shape, device, codec ...).
        parts: summaries of member storages (e.g. of an ensemble).
    """

    kind: str
    length: int
    capacity: int | None
    cursor: int | None = None
    spec: StoreSpec | None = dataclasses.field(default=None, repr=False)  # repr: credentials
    rows: tuple[KeyRow, ...] = ()
    stored_bytes: int | None = None
    raw_bytes: int | None = None
    episodes: int | None = None
    cache_tier: str | None = None
    cache_budget: int | None = None
    cache_stats: CacheStats | None = None
    facts: tuple[tuple[str, str], ...] = ()
    parts: tuple[Summary, ...] = ()

    @property
    def url(self) -> str | None:
        """The store location with every credential replaced by ``***``."""
        return None if self.spec is None else self.spec.redacted()

    @property
    def compression_ratio(self) -> float | None:
        """Raw over stored bytes, when both are known and something is stored."""
        if self.stored_bytes and self.raw_bytes is not None:
            return self.raw_bytes / self.stored_bytes
        return None


# -- building summaries ---------------------------------------------------------------------

def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float32`` -> ``'float32'``; a name already (``'str'``) is kept."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def text_dtype(width: int | None = None) -> str:
    """The dtype column of a string key: ``'str'``, or ``'str (256 B cells)'`` for strings
    stored as fixed-width UTF-8 cells of ``width`` bytes (:mod:`zstore.text`)."""
    return TEXT_DTYPE if width is None else f"{TEXT_DTYPE} ({width} B cells)"


@dataclasses.dataclass(frozen=True)
class TextLeaf:
    """A string leaf of a tensor collection, as :func:`tensor_leaves` lists it.

    It offers what a key table reads of a tensor: ``shape`` (the leaf's batch
    shape: one string per cell), ``dtype`` (``'str'``, or ``'object'`` for other
    non-tensor values) and ``numel() * element_size()``, its bytes as cells as
    wide as its longest UTF-8 string (``width``).
    """

    shape: tuple[int, ...]
    width: int
    dtype: str = TEXT_DTYPE

    def numel(self) -> int:
        """Cells (strings) in the leaf."""
        return math.prod(self.shape)

    def element_size(self) -> int:
        """Bytes of one cell: the longest string's UTF-8 length."""
        return self.width


def _text_leaf(value: Any) -> TextLeaf:
    """The :class:`TextLeaf` of a non-tensor leaf (``NonTensorData`` / ``NonTensorStack``)."""
    from .text import is_text, longest

    shape = tuple(value.batch_size)
    if not is_text(value):
        return TextLeaf(shape, 0, "object")
    return TextLeaf(shape, longest(value))


def tensor_leaves(data: Any) -> list[tuple[str, torch.Tensor | TextLeaf]]:
    """``(key path, tensor)`` of every leaf of a tensor, TensorDict, tensorclass or pytree;
    a tensor collection's string (non-tensor) leaves come as :class:`TextLeaf`."""
    import torch
    from tensordict import is_non_tensor, is_tensor_collection, is_tensorclass
    from torch.utils import _pytree as pytree

    if isinstance(data, torch.Tensor):
        return [("(tensor)", data)]
    if is_tensor_collection(data):
        td = data._tensordict if is_tensorclass(data) else data
        return [("/".join(key) if isinstance(key, tuple) else key,
                 _text_leaf(value) if is_non_tensor(value) else value)
                for key, value in td.items(include_nested=True)
                if isinstance(value, torch.Tensor) or is_non_tensor(value)]
    flat, _ = pytree.tree_flatten_with_path(data)
    return [(pytree.keystr(path), value) for path, value in flat if isinstance(value, torch.Tensor)]


def item_note(item: Any) -> str:
    """A short repr of an arbitrary stored object (for storages of non-tensor items)."""
    text = " ".join(repr(item).split())
    return text if len(text) <= MAX_ITEM_REPR else text[: MAX_ITEM_REPR - 3] + "..."


# -- formatting -----------------------------------------------------------------------------

def format_bytes(n: int | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; ``None`` -> ``'?'``."""
    if n is None:
        return "?"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def _shape_text(shape: tuple[int, ...] | str) -> str:
    return shape if isinstance(shape, str) else str(list(shape))


def _capacity_text(capacity: int | None) -> str:
    return "unbounded" if capacity is None else f"{capacity:,}"


def _cache_text(s: Summary) -> str | None:
    if s.cache_tier is None:
        return None
    stats = s.cache_stats
    if stats is None:  # no budget to show: nothing is cached
        return f"{s.cache_tier} (memory-mapped, no cache)"
    text = s.cache_tier
    if s.cache_budget is not None:
        text += f", budget {format_bytes(s.cache_budget)}"
    text += f", {format_bytes(stats.resident_bytes)} resident"
    lookups = stats.hits + stats.misses
    if lookups:
        text += f", hit rate {stats.hit_rate:.1%} ({stats.hits:,} / {lookups:,})"
    return text


def _header(s: Summary) -> list[tuple[str, str]]:
    """The header facts, in display order, as ``(name, text)``."""
    out = []
    if s.url is not None:
        out.append(("url", s.url))
    fill = f"{s.length:,} / {_capacity_text(s.capacity)}"
    if s.capacity:
        fill += f" ({s.length / s.capacity:.0%})"
    out.append(("fill", fill))
    if s.cursor is not None:
        out.append(("cursor", f"{s.cursor:,} (last index written)"))
    if s.episodes is not None:
        out.append(("episodes", f"{s.episodes:,}"))
    out.extend(s.facts)
    if s.stored_bytes is not None or s.raw_bytes is not None:
        text = f"{format_bytes(s.stored_bytes)} stored, {format_bytes(s.raw_bytes)} raw"
        if s.compression_ratio is not None:
            text += f" (compression ratio {s.compression_ratio:.3g})"
        out.append(("bytes", text))
    cache = _cache_text(s)
    if cache is not None:
        out.append(("cache", cache))
    return out


def _shown_key(key: str) -> str:
    """``key`` with what a terminal would act on (a newline, an escape sequence ...) written
    as Python escapes it: a key of someone else's store cannot break or rewrite the table."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in key)


def _row_cells(row: KeyRow, with_codec: bool, with_bytes: bool) -> list[str]:
    cells = [_shown_key(row.key), _shape_text(row.shape), row.dtype]
    if with_codec:
        cells.append(row.codec or "")
    if with_bytes:
        cells += [format_bytes(row.stored_bytes), format_bytes(row.raw_bytes)]
    return cells


def _columns(s: Summary) -> tuple[bool, bool]:
    """Whether the key table has a codec column, and byte columns."""
    return (any(r.codec for r in s.rows),
            any(r.stored_bytes is not None or r.raw_bytes is not None for r in s.rows))


# -- text -----------------------------------------------------------------------------------

def render_text(s: Summary, indent: int = 0) -> str:
    """The plain ``__repr__`` of a summary (credentials redacted)."""
    pad = " " * (indent + 4)
    facts = [f"len={s.length}", f"max_size={s.capacity if s.capacity is not None else 'unbounded'}"]
    if s.cursor is not None:
        facts.append(f"cursor={s.cursor}")
    if s.episodes is not None:
        facts.append(f"episodes={s.episodes}")
    lines = [f"{pad}url={s.url}"] if s.url is not None else []
    lines.append(pad + ", ".join(facts))
    if s.facts:
        lines.append(pad + ", ".join(f"{name}={value}" for name, value in s.facts))
    if s.stored_bytes is not None or s.raw_bytes is not None:
        sizes = f"nbytes={s.stored_bytes}, raw_nbytes={s.raw_bytes}"
        if s.compression_ratio is not None:
            sizes += f", compression_ratio={s.compression_ratio:.3g}"
        lines.append(pad + sizes)
    cache = _cache_text(s)
    if cache is not None:
        lines.append(f"{pad}cache={cache}")
    if s.rows:
        lines.append(f"{pad}keys:")
        with_codec, with_bytes = _columns(s)
        table = [_row_cells(r, with_codec, with_bytes) for r in s.rows]
        if with_bytes:
            table = [cells[:-2] + [f"stored={cells[-2]}", f"raw={cells[-1]}"] for cells in table]
        widths = [max(len(cells[i]) for cells in table) for i in range(len(table[0]))]
        for cells in table:
            lines.append(pad + "    " + "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    elif not s.parts and not s.length:
        lines.append(f"{pad}<empty>")
    for i, part in enumerate(s.parts):
        lines.append(f"{pad}[{i}] {render_text(part, indent + 4).lstrip()}")
    return f"{s.kind}(\n" + "\n".join(lines) + "\n" + " " * indent + ")"


# -- HTML -----------------------------------------------------------------------------------

_STYLE = (
    "<style>"
    ".zstore-repr{font-family:var(--jp-content-font-family,sans-serif);font-size:13px}"
    ".zstore-repr table{border-collapse:collapse;margin:2px 0 6px 0}"
    ".zstore-repr td,.zstore-repr th{padding:1px 10px 1px 0;text-align:left;"
    "vertical-align:top;border:none}"
    ".zstore-repr th{border-bottom:1px solid currentColor;font-weight:600}"
    ".zstore-repr .zs-num{text-align:right;font-variant-numeric:tabular-nums}"
    ".zstore-repr .zs-fact{opacity:.7;padding-right:14px}"
    ".zstore-repr .zs-bar{display:inline-block;width:120px;height:8px;margin-left:8px;"
    "border:1px solid currentColor;vertical-align:middle}"
    ".zstore-repr .zs-bar>span{display:block;height:100%;background:currentColor;opacity:.5}"
    ".zstore-repr .zs-part{margin-left:16px;border-left:2px solid currentColor;padding-left:8px}"
    "</style>"
)


def _fill_bar(s: Summary) -> str:
    if not s.capacity:
        return ""
    percent = min(100.0, 100.0 * s.length / s.capacity)
    return f'<span class="zs-bar"><span style="width:{percent:.1f}%"></span></span>'


def _html_body(s: Summary) -> str:
    e = html.escape
    out = [f"<div><strong>{e(s.kind)}</strong></div><table>"]
    for name, text in _header(s):
        cell = f"<code>{e(text)}</code>" if name == "url" else e(text)
        if name == "fill":
            cell += _fill_bar(s)
        out.append(f'<tr><td class="zs-fact">{e(name)}</td><td>{cell}</td></tr>')
    out.append("</table>")
    if s.rows:
        with_codec, with_bytes = _columns(s)
        heads = ["key", "shape", "dtype"] + (["codec"] if with_codec else []) \
            + (["stored", "raw"] if with_bytes else [])
        out.append("<table><tr>" + "".join(
            f'<th class="{"zs-num" if h in ("stored", "raw") else ""}">{h}</th>' for h in heads)
            + "</tr>")
        for row in s.rows:
            cells = _row_cells(row, with_codec, with_bytes)
            tds = [f"<td><code>{e(cells[0])}</code></td>"]
            tds += [f'<td class="{"zs-num" if heads[i] in ("stored", "raw") else ""}">{e(c)}</td>'
                    for i, c in enumerate(cells[1:], 1)]
            out.append("<tr>" + "".join(tds) + "</tr>")
        out.append("</table>")
    elif not s.parts and not s.length:
        out.append("<div><em>empty: nothing written yet</em></div>")
    for part in s.parts:
        out.append(f'<div class="zs-part">{_html_body(part)}</div>')
    return "".join(out)


def render_html(s: Summary) -> str:
    """The ``_repr_html_`` of a summary: header facts, a fill bar and the key table."""
    return f'{_STYLE}<div class="zstore-repr">{_html_body(s)}</div>'

