"""Codec presets as standard Zarr v3 codecs (checksums included), and default chunk and shard sizing.

A preset is chosen by name — ``None`` (raw bytes), ``"zstd"``, ``"lz4"``,
``"blosc-zstd"`` — optionally with a level (``"zstd:3"``). Every preset is
expressed as standard Zarr v3 codecs (``zstd``, ``blosc``), so any Zarr reader
decodes the data. A checksum is the standard ``crc32c`` codec: compressed chunks
carry one by default, raw chunks on remote stores too (:func:`with_default_checksum`);
``"+nocrc"`` opts out, ``"+crc32c"`` opts in.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any, Mapping

from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

if TYPE_CHECKING:
    from .store import StoreSpec

_DEFAULT_LEVELS = {"zstd": 1, "lz4": 5, "blosc-zstd": 3}
#: The levels each preset's compressor takes (zstd's negative levels are its fast ones).
_LEVEL_RANGES = {"zstd": (-131072, 22), "lz4": (0, 9), "blosc-zstd": (0, 9)}
#: Preset-name suffixes and the checksum they choose.
_SUFFIXES = {"+crc32c": True, "+nocrc": False}

#: Target size of one chunk of the widest column (bytes).
TARGET_CHUNK_BYTES = 1 << 20
#: Target size of one shard object on object stores (bytes).
TARGET_SHARD_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """A named compression preset: ``CodecSpec.parse("zstd:3")``.

    ``checksum``: whether chunks carry a crc32c. Compressed presets default to
    ``True``; ``"+nocrc"`` turns it off (``"+crc32c"`` on). A raw preset leaves it
    ``None`` unless given — the store decides (:func:`with_default_checksum`).

    >>> str(CodecSpec.parse("zstd:3")), str(CodecSpec.parse("zstd:3+nocrc"))
    ('zstd:3+crc32c', 'zstd:3+nocrc')
    """

    name: str | None = None
    level: int | None = None
    checksum: bool | None = None

    def __post_init__(self) -> None:
        if self.checksum is None and self.name is not None:
            object.__setattr__(self, "checksum", True)

    @classmethod
    def parse(cls, value: "str | None | CodecSpec | dict[str, Any]") -> "CodecSpec":
        """Accept a preset name (``"zstd"``, ``"zstd:5+nocrc"``, ``None``), a spec, or its JSON.

        The JSON form is taken as written (an old store's ``"checksum": false`` stays
        off); a missing ``checksum`` means none, ``null`` an undecided raw preset.
        """
        if isinstance(value, CodecSpec):
            return value
        if isinstance(value, dict):
            stored = value.get("checksum", False)
            return cls(value.get("name"), value.get("level"), None if stored is None else bool(stored))
        if value is None:
            return cls()
        if not isinstance(value, str):
            raise ValueError(f"codec must be a preset name or None, got {value!r}")
        text, checksum = value, None
        for suffix, flag in _SUFFIXES.items():
            if text.endswith(suffix):
                text, checksum = text[: -len(suffix)], flag
                break
        if text in ("none", "raw"):
            return cls(None, None, checksum)
        name, _, level = text.partition(":")
        if name not in _DEFAULT_LEVELS:
            raise ValueError(
                f"unknown codec preset {value!r}; choose one of "
                f"{[None, *sorted(_DEFAULT_LEVELS)]}, optionally with ':level' and "
                f"'+crc32c' or '+nocrc' (no checksum)"
            )
        try:
            lvl = int(level) if level else _DEFAULT_LEVELS[name]
        except ValueError:
            raise ValueError(f"codec level in {value!r} must be an integer") from None
        low, high = _LEVEL_RANGES[name]
        if not low <= lvl <= high:
            raise ValueError(f"codec level in {value!r} must be from {low} to {high}")
        return cls(name, lvl, checksum)

    @property
    def is_raw(self) -> bool:
        """True when chunks are stored as plain little-endian bytes (mmap-able)."""
        return self.name is None and not self.checksum

    def compressors(self, itemsize: int) -> list:
        """The Zarr v3 bytes-to-bytes codecs of this preset."""
        out: list = []
        if self.name == "zstd":
            out.append(ZstdCodec(level=self.level))
        elif self.name == "lz4":
            out.append(BloscCodec(cname="lz4", clevel=self.level, shuffle="shuffle",
                                  typesize=itemsize))
        elif self.name == "blosc-zstd":
            out.append(BloscCodec(cname="zstd", clevel=self.level, shuffle="shuffle",
                                  typesize=itemsize))
        if self.checksum:
            out.append(Crc32cCodec())
        return out

    def to_json(self) -> dict[str, Any]:
        """JSON form recorded in the ``zstore`` block."""
        return {"name": self.name, "level": self.level, "checksum": self.checksum}

    def __str__(self) -> str:
        text = "raw" if self.name is None else f"{self.name}:{self.level}"
        return text + {True: "+crc32c", False: "+nocrc", None: ""}[self.checksum]


def with_default_checksum(spec: CodecSpec, *, remote: bool) -> CodecSpec:
    """``spec`` with an undecided checksum settled: crc32c on remote stores, none elsewhere.

    Only raw presets are undecided (compressed ones default to a checksum); local raw
    buffers stay plain bytes so they can be memory-mapped.
    """
    if spec.checksum is not None:
        return spec
    return dataclasses.replace(spec, checksum=remote)


def is_remote(store: StoreSpec) -> bool:
    """Whether ``store`` is remote: neither a local directory nor ``memory://``."""
    return store.is_remote


def parse_codecs(value: Any, *, remote: bool) -> "tuple[CodecSpec, dict[str, CodecSpec]]":
    """A storage's ``codec`` argument as (default preset, ``{key path: preset}`` overrides).

    ``value`` is a preset (``"zstd:3"``, ``None`` ...) or a mapping
    ``{key path or tuple key: preset, "default": preset}`` (``"default"`` falls back
    to raw); overrides equal to the default are dropped. Every preset's checksum is
    settled for a ``remote`` store or not (:func:`with_default_checksum`).

    >>> default, per_key = parse_codecs({"default": "zstd", "next/reward": None}, remote=True)
    >>> str(default), {k: str(v) for k, v in per_key.items()}
    ('zstd:1+crc32c', {'next/reward': 'raw+crc32c'})
    """
    def settle(preset: Any) -> CodecSpec:
        return with_default_checksum(CodecSpec.parse(preset), remote=remote)

    if not isinstance(value, Mapping):
        return settle(value), {}
    default = settle(value.get("default"))
    overrides = {}
    for key, preset in value.items():
        if key == "default":
            continue
        path = key if isinstance(key, str) else "/".join(key)
        spec = settle(preset)
        if spec != default:
            overrides[path] = spec
    return default, overrides


def choose_layout(leaves, rows: int, *, mmap: bool, object_store: bool,
                  chunks: "int | Mapping[str, int] | None" = None,
                  shards: "int | Mapping[str, int] | None" = None) -> dict[str, tuple[int, int | None]]:
    """Rows per chunk and per shard of every key: ``{path: (chunk_rows, shard_rows or None)}``.

    Defaults: one chunk per key when the buffer is memory-mapped; otherwise
    about :data:`TARGET_CHUNK_BYTES` per chunk *of that key* (narrow keys get
    long chunks, so they cost few requests), sharded at about
    :data:`TARGET_SHARD_BYTES` on object stores. ``chunks`` / ``shards``
    override (one int for every key, or a ``{key path: rows}`` mapping).
    """
    layout = {}
    for leaf in leaves:
        chunk = _override(chunks, leaf.path)
        if chunk is None:
            chunk = rows if mmap else default_chunk_rows(leaf.row_bytes, rows)
        chunk = max(1, min(int(chunk), rows))
        shard = _override(shards, leaf.path)
        if shard is None:
            shard = default_shard_rows(chunk, leaf.row_bytes, rows) if object_store else chunk
        shard = max(chunk, int(shard) // chunk * chunk)
        # a key whose rows hold no element stores no object: never sharded (zarr cannot
        # shard a chunk with a dimension of 0)
        layout[leaf.path] = (chunk, None if shard == chunk or not leaf.row_bytes else shard)
    return layout


def checked_rows_per(name: str,
                     value: "int | Mapping[Any, int] | None") -> "int | dict[str, int] | None":
    """A ``chunks=`` / ``shards=`` argument (``name``): a positive row count, or a mapping of
    them by key path or tuple key, returned by key path; else ``ValueError`` naming the key."""
    given = value.items() if isinstance(value, Mapping) else [(None, value)]
    for path, rows in given:
        if rows is None:
            continue
        try:
            count = operator.index(rows)
        except TypeError:
            count = 0
        if isinstance(rows, bool) or count < 1:
            where = f"{name}={value!r}" if path is None else f"{name}[{path!r}]={rows!r}"
            raise ValueError(f"{where}: rows per {name[:-1]} must be a whole number of at least "
                             f"1 (or None for the default)")
    if not isinstance(value, Mapping):
        return value
    by_path: dict[Any, int] = {}
    for key, rows in value.items():
        path = "/".join(key) if isinstance(key, tuple) and all(
            isinstance(part, str) for part in key) else key
        if path in by_path:
            raise ValueError(f"{name}={value!r} names key {path!r} twice (as a path and as a "
                             f"tuple): give it once")
        by_path[path] = rows
    return by_path


def _override(value: "int | Mapping[str, int] | None", path: str) -> int | None:
    if value is None or isinstance(value, int):
        return value
    return value.get(path)


def default_chunk_rows(row_bytes: int, rows: int, target: int = TARGET_CHUNK_BYTES) -> int:
    """Rows per chunk so that the widest column's chunk is about ``target`` bytes."""
    return max(1, min(rows, target // max(1, row_bytes)))


def default_shard_rows(chunk_rows: int, row_bytes: int, rows: int,
                       target: int = TARGET_SHARD_BYTES) -> int:
    """Rows per shard: a whole number of chunks, about ``target`` bytes, at most ``rows``."""
    per_chunk = max(1, chunk_rows * row_bytes)
    n_chunks = max(1, target // per_chunk)
    whole = -(-rows // chunk_rows)
    return chunk_rows * max(1, min(n_chunks, whole))
