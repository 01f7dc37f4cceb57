"""Log segments: the committed rows of write units not yet stored whole.

A write unit (a chunk, or a whole shard) is one object, so storing a unit that
is only partly written rewrites everything it already holds. A commit instead
stores the rows written since the last one as a *segment*: one immutable object
``zstore-tail/<group>/<seq>`` holding rows ``[first, stop)`` of every key of a
:class:`~zstore.blocks.BlockGroup`, and lists it in the commit record
(``tail`` in the ``zstore`` block, format.md §6). A reader lays a unit's
segments, in order, over what the unit's object holds. Once the unit is stored
whole, the next commit drops its segments and their objects are deleted.

Object layout: each key's rows ``[first, stop)`` as C-order little-endian bytes
of its storage dtype, keys in the group's order, then the CRC32C of all of it
(4 bytes, little-endian). No pickle, no header: sizes follow from the schema.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import google_crc32c
import numpy as np

from .errors import CorruptChunkError

#: Folder of the segment objects, at the buffer's root.
TAIL_PREFIX = "zstore-tail"


class Segment(NamedTuple):
    """Rows ``[first, stop)`` of a group's keys, stored as object number ``seq``."""

    first: int
    stop: int
    seq: int


def group_id(chunk_rows: int, shard_rows: int) -> str:
    """The name of a block group's segments: its chunk and write-unit lengths."""
    return f"{chunk_rows}x{shard_rows}"


def segment_key(group: str, seq: int) -> str:
    """The object key (relative to the buffer's root) of segment ``seq`` of ``group``."""
    return f"{TAIL_PREFIX}/{group}/{seq}"


def encode(columns: Sequence[np.ndarray]) -> bytes:
    """One segment object from each key's rows (storage dtypes, in the group's order)."""
    body = b"".join(np.ascontiguousarray(column).tobytes() for column in columns)
    return body + google_crc32c.value(body).to_bytes(4, "little")


def decode(data: bytes, specs: Sequence[tuple[np.dtype, tuple[int, ...]]], rows: int,
           where: str) -> list[np.ndarray]:
    """Each key's rows from a segment object; raises ``CorruptChunkError`` naming ``where``."""
    sizes = [rows * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
             for dtype, shape in specs]
    if len(data) != sum(sizes) + 4:
        raise CorruptChunkError(f"log segment {where} holds {len(data)} bytes, expected "
                                f"{sum(sizes) + 4} for {rows} rows: it is truncated or damaged")
    body = data[:-4]
    if google_crc32c.value(body) != int.from_bytes(data[-4:], "little"):
        raise CorruptChunkError(f"log segment {where} fails its CRC32C check: its bytes are damaged")
    out, offset = [], 0
    for (dtype, shape), size in zip(specs, sizes):
        out.append(np.frombuffer(body[offset: offset + size], dtype=dtype).reshape(rows, *shape))
        offset += size
    return out


def record_to_json(segments: dict[str, list[Segment]]) -> dict[str, list[list[int]]]:
    """The commit record's ``tail`` entry: each group's segments as ``[first, stop, seq]``."""
    return {group: [list(segment) for segment in segs] for group, segs in segments.items() if segs}


def record_from_json(data: Any) -> dict[str, list[Segment]]:
    """Parse a commit record's ``tail`` entry (absent: no segments); ``ValueError`` if malformed."""
    if data is None:
        return {}
    out = {str(group): [Segment(*(int(v) for v in item)) for item in items]
           for group, items in dict(data).items()}
    for group, segs in out.items():
        for seg in segs:
            if not 0 <= seg.first < seg.stop or seg.seq < 0:
                raise ValueError(f"bad log segment {list(seg)} of group {group}")
    return out
