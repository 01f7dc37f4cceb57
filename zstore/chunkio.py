"""Direct block reads: byte-range requests straight to the Zarr store.

zarr-python pays milliseconds of Python per ``getitem`` and, for sharded
arrays, re-reads the shard index on every call. For the cache's cold path
zstore instead reads chunk objects itself: shard indexes are fetched once and
cached, the byte ranges of the wanted inner chunks are coalesced (neighbours
within :data:`COALESCE_GAP` become one request), all requests of a batch are in
flight at once, and chunks are decoded with the codecs the array's own
metadata names. Arrays whose codecs it does not know fall back to zarr.

A read that decompresses more than one chunk (and :data:`PARALLEL_BYTES` or more in all)
decompresses them on a shared pool of ``os.cpu_count()`` threads (zstd releases the GIL:
1.8x on two cores). A chunk is decoded straight into the caller's destination (a cache
slot) when it has one: zstd decompresses into it, an uncompressed chunk is copied into
it. That copy goes to the pool too from :data:`POOL_COPY_BYTES` a chunk, so a bulk read
copies while its other requests are in flight (4,000 Atari rows from moto through
obstore: 131 -> 107-115 ms); a smaller chunk's check and copy stay on the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import google_crc32c
import numcodecs
import numpy as np
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import LocalStore

from ._pools import SharedPool
from .errors import CorruptChunkError, StoreNotFoundError
from .row_objects import chunk_key, key_separator

#: Ranges closer than this many bytes are fetched in one request.
COALESCE_GAP = 1 << 20
#: Most requests in flight at once per batch.
MAX_IN_FLIGHT = 64
#: A read decoding fewer bytes than this (or one chunk) decodes them on the calling thread.
PARALLEL_BYTES = 1 << 20
#: An uncompressed chunk copied into its destination from this size is copied on the pool.
POOL_COPY_BYTES = 256 << 10
#: A reader that wants this share of a shard's chunks, its index not at hand, fetches the
#: shard whole in one request: one round trip where the index and then the ranges took two.
WHOLE_SHARD_SHARE = 0.75
_EMPTY = np.uint64(2**64 - 1)
_PROTOTYPE = default_buffer_prototype()
_WHOLE = OffsetByteRequest(0)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DECODERS = SharedPool("zstore-decode", lambda: os.cpu_count() or 1)
#: Stores whose server was found to ignore Range requests, warned about once.
_IGNORED_RANGE: set[str] = set()


def decode_pool() -> ThreadPoolExecutor | None:
    """The process's shared chunk-decoding pool (``os.cpu_count()`` threads; None on one core)."""
    return _DECODERS.get() if (os.cpu_count() or 1) > 1 else None


def zstd_content_size(frame) -> int | None:
    """The decompressed size a zstd frame's header declares (None: not declared, or no frame)."""
    head = bytes(frame[:18])
    if len(head) < 6 or head[:4] != _ZSTD_MAGIC:
        return None
    descriptor = head[4]
    single_segment = (descriptor >> 5) & 1
    at = 5 + (not single_segment) + (0, 1, 2, 4)[descriptor & 3]
    size = (single_segment, 2, 4, 8)[descriptor >> 6]
    if not size or len(head) < at + size:
        return None
    value = int.from_bytes(head[at:at + size], "little")
    return value + 256 if size == 2 else value


class Throttle:
    """At most ``limit`` requests in flight; counts requests, bytes and peak concurrency."""

    def __init__(self, limit: int = MAX_IN_FLIGHT):
        self._semaphore = asyncio.Semaphore(limit)
        self.in_flight = 0
        self.peak = 0
        self.requests = 0
        self.bytes = 0

    @contextlib.asynccontextmanager
    async def slot(self):
        """Hold one of the ``limit`` request slots."""
        async with self._semaphore:
            self.in_flight += 1
            self.requests += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                yield
            finally:
                self.in_flight -= 1


def _checksum_stripper(where: Callable[[], str]) -> Callable[[bytes], bytes]:
    def strip(payload: bytes) -> bytes:
        if len(payload) < 4:
            raise CorruptChunkError(f"{where()}: {len(payload)} bytes cannot hold a crc32c checksum")
        # google_crc32c takes bytes or an array, not a memoryview: an array view of the
        # payload is checked where it lies (``bytes(...)`` copied every chunk read first)
        data = np.frombuffer(payload, dtype=np.uint8)
        if google_crc32c.value(data[:-4]) != int.from_bytes(data[-4:].tobytes(), "little"):
            raise CorruptChunkError(f"{where()}: crc32c checksum mismatch (corrupt chunk)")
        return payload[:-4]
    return strip


def _bytes_decoders(codecs: list[dict[str, Any]], where) -> list[Callable[[bytes], bytes]] | None:
    """Decoders (applied in order) for a list of bytes->bytes codecs, or None if unknown."""
    out: list[Callable[[bytes], bytes]] = []
    for codec in reversed(codecs):
        name = codec["name"]
        if name == "zstd":
            out.append(numcodecs.Zstd().decode)
        elif name == "blosc":
            out.append(numcodecs.Blosc().decode)
        elif name == "gzip":
            out.append(numcodecs.GZip().decode)
        elif name == "crc32c":
            out.append(_checksum_stripper(where))
        else:
            return None
    return out


class ColumnReader:
    """Reads whole row blocks (chunks along dim 0) of one array written by zstore.

    Build it with :meth:`for_array`, which returns ``None`` when the array's
    layout or codecs are not ones it decodes (the caller then uses zarr).
    """

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int,
                 per_shard: int, sharded: bool, decoders: list, where: str, separator: str = "/",
                 compressor: str | None = None, local_root: str | None = None):
        self.path = path
        #: the store's directory when it is local (:meth:`_exists` stats there); None on other
        #: stores, asked for the key instead
        self.local_root = local_root
        #: objects found missing so far, and the last one's key (:meth:`read` checks once)
        self._absent, self._absent_key = 0, ""
        #: whether every object of the rows read is stored (a sealed dataset's, :data:`~zstore.
        #: row_objects.ALL_CHUNKS_STORED`): a missing one is then damage, not rows of zeros
        self.all_stored = False
        self.ndim = len(shape)
        self.separator = separator
        self.rows = shape[0]
        self.block_shape = (chunk_rows, *shape[1:])
        self.block_numel = math.prod(self.block_shape)
        self.dtype = dtype
        self.per_shard = per_shard
        self.sharded = sharded
        self.decoders = decoders
        #: whether a chunk is decompressed (else its decode is a checksum: not worth a thread)
        self.compressed = compressor is not None
        # the last decoder is zstd's and the values native: it can decode into a destination
        self.decodes_into = compressor == "zstd" and dtype.isnative
        self.block_nbytes = self.block_numel * dtype.itemsize
        self.where = where
        self.indexes: dict[int, np.ndarray | None] = {}

    def worth_a_thread(self, copying: bool) -> bool:
        """Whether decoding a chunk costs more than handing it to another thread: it is
        decompressed, or copied into a destination (``copying``) from
        :data:`POOL_COPY_BYTES` on. A checksum alone is cheaper than the hand-off."""
        return self.compressed or (copying and self.block_nbytes >= POOL_COPY_BYTES)

    @classmethod
    def for_array(cls, array: zarr.Array, where: str) -> "ColumnReader | None":
        """A reader for ``array``, or None if its metadata is outside what it decodes."""
        meta = array.metadata.to_dict()
        separator = key_separator(meta)
        if separator is None:
            return None
        shape = tuple(meta["shape"])
        grid = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        if grid[1:] != shape[1:]:
            return None
        codecs = list(meta["codecs"])
        sharded = codecs[0]["name"] == "sharding_indexed"
        label = f"{where}/{array.path}"
        if sharded:
            config = codecs[0]["configuration"]
            inner = tuple(config["chunk_shape"])
            index_codecs = [c["name"] for c in config["index_codecs"]]
            if (inner[1:] != shape[1:] or grid[0] % inner[0] or config.get("index_location") != "end"
                    or index_codecs != ["bytes", "crc32c"]):
                return None
            codecs, chunk_rows, per_shard = list(config["codecs"]), inner[0], grid[0] // inner[0]
        else:
            chunk_rows, per_shard = grid[0], 1
        if codecs[0]["name"] != "bytes":
            return None
        endian = codecs[0].get("configuration", {}).get("endian", "little")
        dtype = np.dtype(array.dtype).newbyteorder("<" if endian == "little" else ">")
        decoders = _bytes_decoders(codecs[1:], lambda: label)
        if decoders is None:
            return None
        compressor = codecs[1]["name"] if len(codecs) > 1 and codecs[1]["name"] != "crc32c" else None
        return cls(array.path, shape, dtype, chunk_rows, per_shard, sharded, decoders, label,
                   separator, compressor,
                   str(array.store.root) if isinstance(array.store, LocalStore) else None)

    # -- decoding ---------------------------------------------------------------------------
    def _decode(self, payload: bytes, block: int, out: np.ndarray | None = None) -> np.ndarray:
        """The values of ``block``; decoded straight into ``out`` (a writable native array of
        one block) when the last codec is zstd and the frame declares exactly its size, or
        copied into it when the chunk is uncompressed (then ``out`` is returned)."""
        data = payload
        last = len(self.decoders) - 1
        try:
            for step, decode in enumerate(self.decoders):
                if step == last and out is not None and self.decodes_into \
                        and zstd_content_size(data) == out.nbytes == self.block_nbytes:
                    return decode(data, out=out)
                data = decode(data)
        except CorruptChunkError as exc:
            raise CorruptChunkError(f"key {self.path!r}, chunk {block}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any codec failure means a corrupt chunk
            raise CorruptChunkError(
                f"{self.where}: key {self.path!r}, chunk {block} cannot be decoded "
                f"({type(exc).__name__}: {exc})") from None
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size != self.block_nbytes:  # (a size no value divides could not be viewed)
            raise CorruptChunkError(
                f"{self.where}: key {self.path!r}, chunk {block} holds {raw.size} bytes, "
                f"expected {self.block_nbytes} ({self.block_numel} values)")
        array = raw.view(self.dtype)
        if (out is not None and self.dtype.isnative and out.flags.c_contiguous
                and out.nbytes == self.block_nbytes):
            np.copyto(out.reshape(-1).view(np.uint8), array.view(np.uint8))
            return out
        if not self.dtype.isnative:
            array = array.astype(self.dtype.newbyteorder("="))
        return array.reshape(self.block_shape)

    # -- fetching ---------------------------------------------------------------------------
    def _key(self, chunk: int) -> str:
        return chunk_key(self.path, self.ndim, chunk, self.separator)

    async def _get(self, store: Store, key: str, byte_range, limit: "Throttle"):
        async with limit.slot():
            buffer = await store.get(key, _PROTOTYPE, byte_range=byte_range)
        if buffer is None:
            self._absent, self._absent_key = self._absent + 1, key
            return None
        payload = memoryview(buffer.as_numpy_array()).cast("B")
        limit.bytes += len(payload)
        return self._requested(payload, byte_range, key)

    async def _confirm_store(self, store: Store, key: str) -> None:
        """Return when ``key``, found missing, was never stored (its rows read as zeros, as
        Zarr defines): the array's own ``zarr.json`` is still there. A store moved or
        deleted under its reader raises instead of reading as zeros, and so does one that
        lost the array's folder (a partial copy), saying so. One look per read that met a
        missing object (a stat locally, one request on a bucket), two when it raises."""
        if await self._exists(store, f"{self.path}/zarr.json"):
            return
        if await self._exists(store, "zarr.json"):  # the store is there, the array's folder not
            raise StoreNotFoundError(
                f"{self.where}: {key!r} and the array's zarr.json are missing, while the store's "
                "own zarr.json is there: the store was copied in part, or the folder of key "
                f"{self.path!r} was deleted. Copy the store again whole ('zstore convert', or a "
                "sync that reports every failure)")
        raise StoreNotFoundError(
            f"{self.where}: {key!r} and the array's zarr.json are gone: the store was moved "
            "or deleted while it was open. Reopen it where it is now")

    async def _exists(self, store: Store, key: str) -> bool:
        """Whether ``key`` of the store exists (a stat in a local directory)."""
        if self.local_root is not None:
            return os.path.exists(os.path.join(self.local_root, key))
        return await store.exists(key)

    def _requested(self, payload: memoryview, byte_range, key: str) -> memoryview:
        """The bytes ``byte_range`` asked for. A server that ignores ``Range`` (``python -m
        http.server``) answers with the whole object: its bytes are cut out of it, and a
        warning says what that costs and the fix (every such read fetches the whole shard)."""
        if isinstance(byte_range, RangeByteRequest):
            wanted = slice(byte_range.start, byte_range.end)
            asked = byte_range.end - byte_range.start
        elif isinstance(byte_range, SuffixByteRequest):
            wanted, asked = slice(len(payload) - byte_range.suffix, None), byte_range.suffix
        else:
            return payload
        if len(payload) <= asked:
            return payload
        store = self.where.removesuffix(f"/{self.path}")
        if store not in _IGNORED_RANGE:  # once per store and process: reads go on alike
            _IGNORED_RANGE.add(store)
            warnings.warn(
                f"{store}: the server answered a ranged read of {key!r} with the whole "
                f"object ({len(payload)} bytes for {asked}): it ignores Range requests, so every "
                "read of a sharded array fetches whole shards (warned once per store). Serve "
                "the store with a server that honours Range, or serve an unsharded copy "
                "('zstore convert SRC DIR --chunks ROWS' to a local directory writes one)",
                RuntimeWarning, stacklevel=2)
        return payload[wanted]

    @property
    def _index_nbytes(self) -> int:
        """Bytes of a shard's index at its end: an (offset, nbytes) pair per chunk, CRC32C."""
        return 16 * self.per_shard + 4

    def _parse_index(self, raw, shard: int) -> np.ndarray:
        body = _checksum_stripper(
            lambda: f"{self.where}: key {self.path!r}, shard {shard} index")(raw)
        return np.frombuffer(body, dtype="<u8").reshape(self.per_shard, 2)

    async def _shard_index(self, store: Store, shard: int, limit) -> np.ndarray | None:
        if shard not in self.indexes:
            raw = await self._get(store, self._key(shard), SuffixByteRequest(self._index_nbytes),
                                  limit)
            self.indexes[shard] = None if raw is None else self._parse_index(raw, shard)
        return self.indexes[shard]

    async def _whole_shard(self, store: Store, shard: int, limit):
        """The whole object of ``shard`` in one request (its index cached from its end), or
        None where it was never stored."""
        raw = await self._get(store, self._key(shard), _WHOLE, limit)
        if raw is not None and len(raw) < self._index_nbytes:
            raise CorruptChunkError(f"{self.where}: key {self.path!r}, shard {shard} holds "
                                    f"{len(raw)} bytes, less than its index (truncated object)")
        self.indexes[shard] = None if raw is None else self._parse_index(
            raw[len(raw) - self._index_nbytes:], shard)
        return raw

    async def read(self, store: Store, blocks: list[int], limit: "Throttle",
                   into: list[np.ndarray | None] | None = None, parallel: bool = False) -> list:
        """Decoded ``[chunk_rows, ...]`` arrays for ``blocks`` (None where never written).

        ``into[i]``: where block ``i`` may be decoded to (the result is then that array);
        ``parallel``: decode on :func:`decode_pool`. Every decode has ended when this returns
        or raises (the first error, in block order).
        """
        into = into or [None] * len(blocks)
        pool = decode_pool() if parallel else None
        absent = self._absent
        if not self.sharded:
            # a ranged read of the whole object: s3fs sends a plain GET after a HEAD, a
            # ranged one alone (measured: twice the throughput on the loopback server)
            payloads = await _settled([self._get(store, self._key(b), _WHOLE, limit)
                                       for b in blocks])
            await self._refuse_absent(store, absent)
            return await _settled([self._decoded(p, b, o, pool)
                                   for p, b, o in zip(payloads, blocks, into)])
        by_shard: dict[int, list[int]] = {}
        for position, block in enumerate(blocks):
            by_shard.setdefault(block // self.per_shard, []).append(position)
        out: list = [None] * len(blocks)
        await _settled([self._read_shard(store, shard, positions, blocks, out, limit, into, pool)
                        for shard, positions in by_shard.items()])
        await self._refuse_absent(store, absent)
        return out

    async def _refuse_absent(self, store: Store, absent: int) -> None:
        """Raise when an object was found missing since the count was ``absent``, unless it
        was never stored (:meth:`_confirm_store`) in an array that may skip objects."""
        if self._absent == absent:
            return
        await self._confirm_store(store, self._absent_key)
        if self.all_stored:
            raise CorruptChunkError(
                f"{self.where}: {self._absent_key!r} is missing, while this dataset stores every "
                "chunk of its rows: it was copied in part, or the object was deleted. Copy the "
                "dataset again whole ('zstore convert', or a sync that reports every failure)")

    async def _decoded(self, payload, block: int, out: np.ndarray | None,
                       pool: ThreadPoolExecutor | None) -> np.ndarray | None:
        """:meth:`_decode` of ``payload`` (None stays None), on ``pool`` when given."""
        if payload is None:
            return None
        if pool is not None:
            try:
                future = asyncio.get_running_loop().run_in_executor(
                    pool, self._decode, payload, block, out)
            except RuntimeError:  # the pool is shut down (interpreter exit): decode here
                pass
            else:
                return await future
        return self._decode(payload, block, out)

    async def _read_shard(self, store, shard, positions, blocks, out, limit, into, pool) -> None:
        # most of a shard whose index is not at hand: the whole object in one request, its
        # index read from its end, instead of a round trip for the index, then the ranges
        whole = None
        if shard not in self.indexes and len(positions) >= WHOLE_SHARD_SHARE * self.per_shard:
            whole = await self._whole_shard(store, shard, limit)
        index = await self._shard_index(store, shard, limit)
        if index is None:
            return
        wanted = []
        for position in positions:
            offset, nbytes = index[blocks[position] % self.per_shard]
            if offset != _EMPTY:
                wanted.append((int(offset), int(offset + nbytes), position))
        wanted.sort()
        groups: list[list[tuple[int, int, int]]] = []
        for item in wanted:
            if groups and (whole is not None or item[0] - groups[-1][-1][1] <= COALESCE_GAP):
                groups[-1].append(item)
            else:
                groups.append([item])

        async def fetch(group):
            start, stop = group[0][0], max(end for _, end, _ in group)
            if whole is None:
                raw = await self._get(store, self._key(shard), RangeByteRequest(start, stop), limit)
            else:
                raw = whole[start:]
            if raw is None:
                await self._confirm_store(store, self._key(shard))
            if raw is None or len(raw) < stop - start:
                raise CorruptChunkError(f"{self.where}: key {self.path!r}, shard {shard} is "
                                        "shorter than its index says (truncated object)")
            decoded = await _settled([self._decoded(raw[begin - start: end - start],
                                                    blocks[position], into[position], pool)
                                      for begin, end, position in group])
            for (_, _, position), array in zip(group, decoded):
                out[position] = array

        await _settled([fetch(group) for group in groups])

    def forget(self, blocks: list[int]) -> None:
        """Drop cached shard indexes of ``blocks`` (their shards were rewritten)."""
        for block in blocks:
            self.indexes.pop(block // self.per_shard, None)


async def _settled(aws: list) -> list:
    """``asyncio.gather(*aws)``, but every awaitable has ended before the first error (in
    order) is raised: no decode still writes into a destination the caller reuses."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
