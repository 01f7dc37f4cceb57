"""``zstore.open(url, mode=...)``: reopen a buffer from a URL, with the class it records."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ._registry import reopen
from .cache import DEFAULT_CACHE_BYTES
from .lease import DEFAULT_TTL
from .store import StoreSpec


def open(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
         mode: str = "r+", cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host",
         device: Any = None, lease_ttl: float | None = DEFAULT_TTL,
         autocommit_seconds: float = 5.0):
    """Reopen a buffer written by zstore, with its class, rows, length and cursor.

    Args:
        url: a local path or any fsspec URL.
        storage_options: fsspec options (``endpoint_url``, ``key``, ``secret``, ``anon`` ...).
        mode: ``"r+"`` to keep writing, ``"r"`` for read-only.
        cache_bytes: byte budget of the hot-chunk cache: bytes, or a size ("512MB", "4GiB").
        cache: cache tier: ``"host"``, ``"pinned"`` or ``"cuda"``.
        device: where samples are returned; ``None``: the cache tier's (the CPU; the current
            GPU for ``"cuda"``). A device the tier cannot return samples on is refused.
        lease_ttl: ttl of the single-writer lease a ``"r+"`` storage takes at its
            first write (docs/scaling.md); readers (``"r"``) take none.
        autocommit_seconds: a ``"r+"`` storage commits its rows at most this long after
            they are written, as the constructors' argument of that name. Neither setting
            is stored: pass the run's own again when resuming it.

    >>> rb = zstore.open("s3://bucket/rb", {"endpoint_url": "http://127.0.0.1:9000"})  # doctest: +SKIP
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    from . import storages  # noqa: F401 - registers the storage classes reopen() picks from

    spec = StoreSpec.parse(url, storage_options, read_only=mode == "r")
    return reopen(spec, cache_bytes=cache_bytes, cache=cache, device=device, lease_ttl=lease_ttl,
                  autocommit_seconds=autocommit_seconds)
