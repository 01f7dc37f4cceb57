"""Top-level entry points: :func:`open` a buffer from a URL."""

from __future__ import annotations

import os
from typing import Any, Mapping

from .cache import DEFAULT_CACHE_BYTES
from .errors import NotAZStoreError
from .group import ZSTORE_ATTR, open_zarr_group, read_meta
from .lease import DEFAULT_TTL
from .store import StoreSpec


def open(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
         mode: str = "r+", cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host",
         device: Any = None, lease_ttl: float | None = DEFAULT_TTL):
    """Reopen a buffer written by zstore, with its class, rows, length and cursor.

    Args:
        url: a local path or any fsspec URL.
        storage_options: fsspec options (``endpoint_url``, ``key``, ``secret``, ``anon`` ...).
        mode: ``"r+"`` to keep writing, ``"r"`` for read-only.
        cache_bytes: byte budget of the hot-chunk cache.
        cache: cache tier: ``"host"``, ``"pinned"`` or ``"cuda"``.
        device: CUDA device for the ``"cuda"`` tier.
        lease_ttl: ttl of the single-writer lease a ``"r+"`` storage takes at its
            first write (docs/scaling.md); readers (``"r"``) take none.

    >>> rb = zstore.open("s3://bucket/rb", {"endpoint_url": "http://127.0.0.1:9000"})  # doctest: +SKIP
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    from .storages import PERSISTENT_CLASSES

    spec = StoreSpec.parse(url, storage_options, read_only=mode == "r")
    group = open_zarr_group(spec)
    block = group.attrs.get(ZSTORE_ATTR)
    name = block.get("storage_class") if isinstance(block, Mapping) else None
    if hasattr(PERSISTENT_CLASSES.get(name), "_from_group"):  # a container of buffers
        return PERSISTENT_CLASSES[name]._from_group(spec, group, dict(block), cache_bytes=cache_bytes,
                                                    cache=cache, device=device, lease_ttl=lease_ttl)
    meta = read_meta(group, spec.redacted())
    try:
        cls = PERSISTENT_CLASSES[meta.storage_class]
    except KeyError:
        raise NotAZStoreError(
            f"{spec.redacted()} records storage class {meta.storage_class!r}, which this zstore "
            f"cannot open (known: {sorted(PERSISTENT_CLASSES)})") from None
    return cls._from_store(spec, group, meta, cache_bytes=cache_bytes, cache=cache, device=device,
                           lease_ttl=lease_ttl)
