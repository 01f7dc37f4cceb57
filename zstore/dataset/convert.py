"""Copy a buffer to a new location with another codec or chunking (``zstore convert``)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import NotAZStoreError
from ..group import refuse_inside_a_dataset
from ..progress import progress as progress_bar
from ..signals import shielded
from ..storages import LazyMemmapStorage
from ..store import StoreSpec
from ..text import TEXT_BYTES
from .open import SOURCE

#: Rows copied per batch.
BATCH_ROWS = 1 << 15
_KEEP = object()


def convert(src: str | os.PathLike, dst: str | os.PathLike,
            storage_options: Mapping[str, Any] | None = None, *,
            dst_options: Mapping[str, Any] | None = None, codec: Any = _KEEP,
            chunks: Any = None, shards: Any = None, seal: bool | None = None,
            progress: bool | None = None) -> LazyMemmapStorage:
    """Copy the buffer at ``src`` to a new buffer at ``dst``, re-chunked and re-compressed.

    Rows keep their positions, so the length, cursor and ring order are those
    of the source. ``codec`` defaults to the source's presets, with a crc32c
    checksum added when the copy is sealed; ``chunks`` / ``shards`` to zstore's defaults at the
    destination. A sealed source gives a sealed copy (``seal=None``); the
    copy is returned closed. A source holding no rows is refused (``NotAZStoreError``).
    """
    from ..api import open as open_buffer

    source = open_buffer(src, storage_options, mode="r")
    try:
        if not isinstance(source, LazyMemmapStorage):
            raise NotAZStoreError(f"cannot convert {source.spec.redacted()}: it holds a "
                                  f"{type(source).__name__}; convert copies LazyMemmapStorage "
                                  "buffers and datasets")
        if len(source) == 0:  # no row to copy: a copy would be a store never created
            raise NotAZStoreError(
                f"cannot convert {source.spec.redacted()}: it holds no rows (length 0), so "
                "there is nothing to copy; write rows to it first")
        meta = source._meta
        seal = meta.sealed if seal is None else seal
        if codec is _KEEP:  # the source's presets; a published copy is always checksummed
            codec = {"default": meta.codec, **meta.key_codecs}
            if seal:
                codec = {path: dataclasses.replace(spec, checksum=True)
                         for path, spec in codec.items()}
        refuse_inside_a_dataset(StoreSpec.parse(
            dst, dst_options if dst_options is not None else storage_options), "convert")
        # text cells as wide as the source's widest (the first batch may not hold its longest
        # string, which a later batch would then not fit)
        widths = [leaf.shape[-1] for leaf in meta.schema.leaves if leaf.path in meta.schema.texts]
        # committed only whole: a copy killed part way holds no row (not a truncated buffer)
        target = LazyMemmapStorage(meta.max_size, scratch_dir=dst, ndim=meta.ndim,
                                   storage_options=dst_options if dst_options is not None
                                   else storage_options, codec=codec, chunks=chunks,
                                   shards=shards, auto_cleanup=False, autocommit_seconds=math.inf,
                                   text_bytes=max(widths, default=TEXT_BYTES))
        rows = meta.rows if len(source) >= meta.max_size else source._len_along_dim0
        bar = progress_bar(rows, "convert", enabled=progress, unit="rows", unit_scale=True, leave=False)
        created = False  # whether this copy created the store (existsok=False): then its own
        try:
            try:
                for start in range(0, rows, BATCH_ROWS):
                    stop = min(start + BATCH_ROWS, rows)
                    target.set(torch.arange(start, stop), source.get(slice(start, stop)))
                    created = True
                    bar.update(stop - start)
            finally:
                bar.close()
            target._len_value, target._last_cursor_value = meta.length, meta.last_cursor
            if SOURCE in meta.extra and target._meta is not None:  # what it was imported from
                target._meta.extra = {**target._meta.extra, SOURCE: meta.extra[SOURCE]}
            if seal:
                target.seal()
            else:
                target.flush()
            target.close()
        except BaseException:  # interrupted or failed, up to the close: remove the copy
            if created or target.initialized:
                discard_copy(target)
            raise
        return target
    finally:
        source.close()


def discard_copy(target: LazyMemmapStorage) -> None:
    """Delete the copy ``target`` that a conversion or an import created, wherever it
    stopped: while copying rows, or once sealed (read-only) or closed. A Ctrl-C or SIGTERM
    meanwhile is raised once it is deleted (a second Ctrl-C stops the deletion)."""
    with shielded():
        if target.spec.read_only:  # sealed: every row stored, the lease given back
            dataclasses.replace(target.spec, read_only=False, sealed=False).delete()
        else:
            target.cleanup()
