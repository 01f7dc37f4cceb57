"""Which row objects (chunks, or shards) of a buffer's arrays a store holds, and their keys.

A sealed dataset stores every object of its rows (``all_chunks_stored``), all-zero ones
included, so one missing is damage that Zarr would read as zeros. Torch-free: ``zstore
info`` checks a dataset with these.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from zarr.core.sync import sync

from .errors import CorruptChunkError

if TYPE_CHECKING:
    import zarr

#: Flag (a checkpoint's commit record and tree attributes; a sealed dataset's ``extra``): every
#: chunk or shard object of the rows is stored, all-zero ones included (Zarr skips those by
#: default), so a missing object is damage (a partial copy, a deleted file), not zeros.
ALL_CHUNKS_STORED = "all_chunks_stored"


#: Chunk-key separators of Zarr v3's default encoding that zstore reads and writes: "/"
#: (one directory per chunk on a filesystem) and "." (checkpoint generations: every chunk
#: of an array in one directory, so carrying a chunk over is one hard link, no mkdir).
KEY_SEPARATORS = ("/", ".")


def chunk_key(path: str, ndim: int, index: int, separator: str = "/") -> str:
    """The object key of row-chunk ``index`` of the ``ndim``-D array at ``path`` (Zarr v3
    default chunk-key encoding; one chunk spans every other dimension)."""
    return f"{path}/c{separator}{index}" + f"{separator}0" * (ndim - 1)


def row_object_keys(path: str, shape: Sequence[int], separator: str, rows: int,
                    rows_per_object: int) -> list[str]:
    """The keys of the objects (chunks, or shards) holding rows ``[0, rows)`` of the array
    of ``shape`` at ``path``, chunked along rows only, ``rows_per_object`` rows an object:
    none where the array has no element (Zarr stores no data for it), ``c`` for a 0-D one."""
    if math.prod(shape) == 0:
        return []
    if not shape:
        return [f"{path}/c"]
    return [chunk_key(path, len(shape), i, separator) for i in range(-(-rows // rows_per_object))]


def key_separator(array_meta: Mapping[str, Any]) -> str | None:
    """The separator of an array's chunk keys (from its metadata as a dict), or None when
    they are not in Zarr v3's default encoding with a separator zstore knows."""
    encoding = array_meta.get("chunk_key_encoding") or {}
    separator = (encoding.get("configuration") or {}).get("separator", "/")
    if array_meta.get("zarr_format") != 3 or encoding.get("name") != "default" \
            or separator not in KEY_SEPARATORS:
        return None
    return separator


#: What to do about a damaged episode index (in errors).
REBUILD_INDEX = ("The dataset was copied in part, or edited: copy it again whole, or rebuild "
                 "its index with 'zstore convert SRC DEST', which computes it again")


def missing_row_objects(arrays: Sequence[zarr.Array], rows: int) -> list[str]:
    """The keys of the objects holding rows ``[0, rows)`` of ``arrays`` (one store's) that
    the store lacks, all looked up at once."""
    keys = [key for array in arrays
            for key in row_object_keys(array.path, array.shape, key_separator(
                array.metadata.to_dict()) or "/", rows, (array.shards or array.chunks)[0])]
    if not keys:
        return []
    store = arrays[0].store

    async def look() -> list[bool]:
        return await asyncio.gather(*[store.exists(key) for key in keys])

    return [key for key, found in zip(keys, sync(look())) if not found]


def first_of(keys: Sequence[str]) -> str:
    """The first of ``keys`` (objects found missing), and how many more: what errors name."""
    return f"{keys[0]!r}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def require_index_stored(arrays: Sequence[zarr.Array], rows: int, where: str) -> None:
    """Raise :class:`~zstore.errors.CorruptChunkError` naming ``where`` unless every object of
    rows ``[0, rows)`` of the episode index ``arrays`` is stored."""
    missing = missing_row_objects(arrays, rows)
    if missing:
        raise CorruptChunkError(f"{where}: the episode index lost {first_of(missing)}. "
                                f"{REBUILD_INDEX}")
