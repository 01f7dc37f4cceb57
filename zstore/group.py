"""Create, open and commit a buffer's Zarr group: the one place a commit happens.

Every ``zarr.json`` of a group that zstore writes (a buffer's, an ensemble's index,
a checkpoint tree's, a sealed dataset's consolidated one) is written here:
:func:`create_group` and :func:`commit` for buffers, :func:`new_group`,
:func:`put_attrs` and :func:`consolidate` for the others, and zarr's warnings about
its own metadata are silenced in one place (:func:`open_plain_group`). The lease
(:mod:`zstore.lease`) supplies the conditional write that :func:`put_attrs` uses.

Commit order (DESIGN.md, "Commit protocol"): data chunks are stored first by
the table; then :func:`commit` rewrites the group's ``zarr.json`` — one object —
with the new ``zstore`` block (length, cursor, high-water mark). A reader trusts
only that block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.core.array import AsyncArray
from zarr.core.common import ZARR_JSON
from zarr.core.group import AsyncGroup, ConsolidatedMetadata
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.errors import ContainsArrayError, GroupNotFoundError, NodeNotFoundError
from zarr.storage import LocalStore, MemoryStore, StorePath

from . import _faults
from .credentials import (credentials_error, damaged_in_transfer, named_store_error,
                          unreachable_error)
from .errors import (NoCredentialsError, NotAZStoreError, ReadOnlyError, StoreNotFoundError,
                     ZStoreError, checkpoint_not_a)
from .retry import with_retries
from .signals import shielded
from .store import StoreSpec

if TYPE_CHECKING:  # layout and dtypes import torch: opening a group (zstore info) needs none
    from .layout import StoreMeta
    from .lease import Lease

ZSTORE_ATTR = "zstore"
TENSORDICT_ATTR = "__tensordict__"
_INCOMPLETE_ATTR = "zstore_incomplete"


def _tensordict_attrs(batch_size: list[int]) -> dict[str, Any]:
    return {"batch_size": batch_size, "version": 1}


#: The root attribute of a checkpoint's commit record (written by ``checkpoint._dest``).
CHECKPOINT_ATTR = "zstore_checkpoint"


def read_meta(group: zarr.Group, where: str) -> StoreMeta:
    """The validated ``zstore`` block of ``group`` (a checkpoint's commit record instead is
    refused naming the way to load it)."""
    from .layout import StoreMeta

    block = group.attrs.get(ZSTORE_ATTR)
    record = group.attrs.get(CHECKPOINT_ATTR)
    if block is None and isinstance(record, Mapping):
        raise checkpoint_not_a("buffer", where, dict(record))
    return StoreMeta.from_json(block, where)


def listed_segments(group: zarr.Group, group_name: str) -> list:
    """The log segments of block group ``group_name`` that the store's commit lists now.

    Read afresh (not the attributes cached when ``group`` was opened): a reader
    whose segment was deleted under it asks whether the writer dropped it since.
    """
    fresh = open_plain_group(group.store)
    return list(read_meta(fresh, str(group.store)).tail.get(group_name, ()))


def open_plain_group(store: Any, mode: str = "r", consolidated: bool | None = False) -> zarr.Group:
    """The Zarr v3 group at the root of ``store`` (a zarr store), opened with ``mode``.

    ``consolidated``: read consolidated metadata (``True``), never (``False``, what a
    writer sees), or when present (``None``). zarr's warnings about consolidated
    metadata not being in the v3 spec are silenced. A writer's open (``False``, on the
    background committer's thread too) warns of nothing, and swaps no warning state:
    ``warnings.catch_warnings`` is the process's, and on another thread it clobbered a
    caller's (a ``catch_warnings(record=True)`` lost its warnings).
    """
    if consolidated is False:
        return zarr.open_group(store, mode=mode, use_consolidated=False, zarr_format=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_group(store, mode=mode, use_consolidated=consolidated, zarr_format=3)


def new_group(where: Any, attributes: Mapping[str, Any], overwrite: bool = False,
              path: str | None = None) -> zarr.Group:
    """Create a Zarr v3 group whose ``zarr.json`` holds ``attributes``: at the root of
    ``where`` (a zarr store), or, with ``path``, as that child of ``where`` (a group).
    ``overwrite``: replace whatever is there."""
    if path is not None:
        return where.create_group(path, overwrite=overwrite, attributes=dict(attributes))
    return zarr.create_group(where, attributes=dict(attributes), overwrite=overwrite, zarr_format=3)


def consolidate(group: zarr.Group, lease: "Lease | None" = None) -> zarr.Group:
    """Consolidate every node's metadata into the root ``zarr.json`` (a sealed dataset then
    opens with one request); the group reopened from it. A ``lease`` holder's later
    commits replace this version of ``zarr.json``."""
    with warnings.catch_warnings():  # "consolidated metadata is not in the v3 spec (yet)"
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(group.store)
    if lease is not None:
        lease.read_metadata()
    return open_plain_group(group.store, mode="r+", consolidated=True)


def open_group(spec: StoreSpec) -> tuple[zarr.Group, StoreMeta]:
    """Open the buffer at ``spec``; errors name the URL and say what is wrong."""
    group = open_zarr_group(spec)
    return group, read_meta(group, spec.redacted())


def store_io_error(what: str, exc: Exception, where: str) -> OSError:
    """An ``OSError`` (of ``exc``'s type when it is one) saying ``what`` failed at ``where``
    (the store, named once: an error that starts with it loses that start) and why; botocore's
    missing credentials and a server's refusal as :func:`~zstore.credentials.credentials_error`
    words them, a server out of reach as :func:`~zstore.credentials.unreachable_error` does,
    with the fix."""
    refused = credentials_error(exc, where)
    if isinstance(refused, NoCredentialsError):
        return refused
    if refused is not None:
        return PermissionError(f"{what} {refused}")
    unreachable = unreachable_error(exc, where)
    if unreachable is not None:
        return ConnectionError(f"{what} {unreachable}")
    if isinstance(exc, PermissionError) and exc.filename:  # a local file the OS refused
        return PermissionError(f"{what} {where}: permission denied on {exc.filename}; check the "
                               f"permissions of {where} and of the files in it")
    kind = type(exc) if isinstance(exc, OSError) else OSError
    why = str(exc).removeprefix(f"{where}: ")
    try:
        return kind(f"{what} {where}: {type(exc).__name__}: {why}")
    except Exception:  # an OSError subclass with another signature (botocore's format one)
        return OSError(f"{what} {where}: {type(exc).__name__}: {why}")


def not_found(spec: StoreSpec, what: str = "zstore buffer",
              absent: str = "the location does not exist") -> StoreNotFoundError:
    """The error for no ``what`` at ``spec``: its bucket does not exist (one request asks),
    else ``absent``, the caller's words for what it did not find there."""
    if spec.missing_bucket() is not None:
        return StoreNotFoundError(f"no {what} at {spec.redacted()}: its bucket does not exist; "
                                  "check the URL")
    return StoreNotFoundError(
        f"no {what} at {spec.redacted()}: {absent}"
        + (" (memory:// stores live inside one process)" if spec.is_memory else ""))


def _no_group(spec: StoreSpec) -> NotAZStoreError:
    """The error for a location that exists and holds no Zarr group. When all it holds is a
    write lease, a buffer is being created there, or its creation was killed before it
    wrote its group: say so, and the way on (one listing, on this error path only)."""
    from .lease import LEASE_NAME

    try:
        held = set(spec.objects())
    except OSError:
        held = set()
    if held and held <= {LEASE_NAME}:
        return NotAZStoreError(
            f"{spec.redacted()} holds only a write lease, no buffer yet: a writer is creating "
            "one there (open it once that writer has written its first rows), or its creation "
            "was killed before it wrote anything (create the buffer there again: the lease "
            "is taken over once it expires, at once from a dead process of this machine)")
    if held & {".zgroup", ".zarray"}:
        return NotAZStoreError(
            f"{spec.redacted()} is not a zstore buffer: it holds a Zarr v2 store (.zgroup, "
            ".zarray), and zstore's are Zarr v3 (zarr.json); import its data into a buffer")
    return NotAZStoreError(f"{spec.redacted()} is not a zstore buffer: no Zarr group there")


def _not_a_group(spec: StoreSpec, exc: Exception) -> NotAZStoreError:
    """The error for a root ``zarr.json`` zarr cannot open as a group (``exc``)."""
    if isinstance(exc, ContainsArrayError):
        what = ("it holds one Zarr array, not a group of arrays (a key's column of a buffer? "
                "open the buffer's folder, above it)")
    elif isinstance(exc, json.JSONDecodeError):
        what = f"its zarr.json is not valid JSON ({exc})"
    else:
        what = str(exc)
    return NotAZStoreError(f"{spec.redacted()} is not a zstore buffer: {what}")


def _torn(exc: Exception) -> bool:
    """Whether a remote metadata read that raised ``exc`` may succeed when read again."""
    return isinstance(exc, json.JSONDecodeError) or damaged_in_transfer(exc)


def open_zarr_group(spec: StoreSpec) -> zarr.Group:
    """The Zarr group of the buffer at ``spec``, its ``zstore`` block not yet read.

    One metadata read: whether the location exists is asked only when it holds
    no group (the error then says which).
    """
    if spec.is_local and not spec.exists():  # zarr would create the directory
        raise not_found(spec)
    store = spec.open()

    def read() -> zarr.Group:
        return open_plain_group(store, "r" if spec.read_only else "r+",
                                None if spec.read_only else False)

    try:  # (a remote zarr.json damaged in transfer is read again, and so is one that is not
        # JSON: rclone's server, for one, lets a read see an object it is rewriting cut short)
        group = with_retries(read, _torn) if spec.is_remote else read()
    except (GroupNotFoundError, NodeNotFoundError, FileNotFoundError) as exc:
        if not spec.exists():
            raise not_found(spec) from None
        raise _no_group(spec) from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise _not_a_group(spec, exc) from exc
    except Exception as exc:  # the network after the client's retries: name the store
        if (isinstance(exc, (ZStoreError, OSError)) and spec.redacted() in str(exc)
                and credentials_error(exc, spec.redacted()) is None
                and not getattr(exc, "filename", None)):
            raise  # it names the store already (and a zstore error the fix), not just a file
        raise store_io_error("cannot read", exc, spec.redacted()) from exc
    if group.attrs.get(_INCOMPLETE_ATTR):
        raise NotAZStoreError(f"{spec.redacted()} holds a buffer whose creation never finished")
    return group


def existing_buffer(spec: StoreSpec) -> tuple[zarr.Group, StoreMeta] | None:
    """The group and metadata of the complete zstore buffer at ``spec``, or ``None`` where
    there is none (nothing there, or no buffer): one metadata read when there is one."""
    try:
        return open_group(spec)
    except (StoreNotFoundError, NotAZStoreError):
        return None


def refuse_inside_a_dataset(spec: StoreSpec, action: str) -> None:
    """Raise :class:`ReadOnlyError` when ``spec``'s location is a folder inside a sealed
    dataset (a parent folder's ``zarr.json`` holds a sealed ``zstore`` block): a dataset
    stays as it was published. One look per parent folder: for one-off writes only (a
    checkpoint, a conversion, an import)."""
    fs, path = spec.filesystem()
    path = path.rstrip("/")
    while (parent := fs._parent(path).rstrip("/")) and parent != path:
        path = parent
        try:
            raw = fs.cat_file(f"{parent}/zarr.json")
        except Exception as exc:  # none there; a parent this user may not read is none either
            where = spec.redacted()
            named = None if isinstance(exc, PermissionError) else named_store_error(exc, where)
            if named is not None:  # no server, or no credentials: named, with the fix
                raise named from exc
            if isinstance(exc, OSError):
                continue
            raise
        try:
            block = json.loads(raw)["attributes"][ZSTORE_ATTR]
        except (ValueError, KeyError, TypeError):  # not a zstore block
            continue
        if isinstance(block, Mapping) and block.get("sealed"):
            where = parent if spec.is_local else fs.unstrip_protocol(parent)
            raise ReadOnlyError(f"cannot {action} at {spec.redacted()}: it is inside the sealed, "
                                f"read-only dataset {where}; choose a location outside it")


def create_group(spec: StoreSpec, meta: StoreMeta, lease: "Lease | None" = None,
                 key_separator: str = "/") -> zarr.Group:
    """Create the group and one array per leaf; commit the ``zstore`` block last.

    A location holding something that is not a zstore buffer is refused; a
    creation interrupted earlier (marked incomplete) is overwritten. ``lease``
    (held by the caller) makes the final commit conditional. ``key_separator``:
    the arrays' chunk-key separator (``"/"`` or ``"."``, :data:`row_objects.KEY_SEPARATORS`).
    """
    from .conditional import PROBE_PREFIX
    from .lease import LEASE_NAME

    spec.require_writable("create a buffer")
    spec.check_parent()
    store = spec.open()
    overwrite = False
    if spec.exists():
        try:
            old = open_plain_group(store)
            overwrite = bool(old.attrs.get(_INCOMPLETE_ATTR))
            if not overwrite:
                block = old.attrs.get(ZSTORE_ATTR)
                held = (f"a {block['storage_class']} buffer" if isinstance(block, dict)
                        and block.get("storage_class") else "a Zarr group that is not a zstore buffer")
                raise NotAZStoreError(
                    f"{spec.redacted()} already holds {held}; choose an empty location")
        except (GroupNotFoundError, NodeNotFoundError, FileNotFoundError):
            if not spec.is_empty(ignore=(LEASE_NAME, PROBE_PREFIX)):
                raise NotAZStoreError(
                    f"{spec.redacted()} is not empty and holds no zstore buffer; choose an empty "
                    "location (zstore never writes among other files)") from None
        except ZStoreError:
            raise
        except (ContainsArrayError, ValueError, TypeError, KeyError) as exc:  # (JSON errors)
            raise _not_a_group(spec, exc) from None
    with shielded():  # a Ctrl-C waits for the creation: its writes would go on without it
        try:
            if overwrite:  # an interrupted creation: remove it, but not the caller's lease
                sync(_remove_all_but(store, (LEASE_NAME,)))
            group = _create_arrays(store, meta, key_separator)
        except ZStoreError:
            raise
        except Exception as exc:  # the network after the client's retries: name the store
            raise store_io_error("cannot create a buffer at", exc, spec.redacted()) from exc
        commit(group, meta, lease, spec.redacted())
    return group


async def _remove_all_but(store, keep: tuple[str, ...]) -> None:
    """Delete every object of ``store`` except the top-level names in ``keep``."""
    names = [name async for name in store.list_dir("") if name not in keep]
    for name in names:
        try:
            await store.delete_dir(name)  # a prefix (folder) ...
        except ValueError:  # ... which LocalStore refuses for a file
            pass
        await store.delete(name)  # ... or an object (file)
    fs = getattr(store, "fs", None)
    if fs is not None:  # listings cached before the deletes would still show them
        fs.invalidate_cache()


def _create_arrays(store, meta: StoreMeta, key_separator: str) -> zarr.Group:
    """The group (marked incomplete) and its arrays, before the first commit.

    zarr composes every node's ``zarr.json`` in a scratch memory store (no I/O);
    they are then published to ``store``: the root's first, whose mark tells an
    interrupted creation, then all the others in one concurrent round — instead
    of zarr's existence checks and writes, node by node.
    """
    from .dtypes import storage_numpy_dtype, torch_dtype_name
    from .layout import dimension_names
    from .lease import METADATA_NAME

    lanes = list(meta.schema.lane_shape)
    root_batch = [meta.rows, *lanes, *meta.schema.array_batch]
    draft = MemoryStore()
    group = zarr.create_group(draft, attributes={_INCOMPLETE_ATTR: True,
                                                 TENSORDICT_ATTR: _tensordict_attrs(root_batch)})
    subgroups = meta.schema.group_paths
    parent = group._async_group

    def subgroup(sub: str):
        batch = meta.schema.group_batch.get(sub)
        return parent.create_group(sub, attributes={
            TENSORDICT_ATTR: _tensordict_attrs(root_batch if batch is None else [meta.rows, *batch])})

    async def array(leaf):  # async: an error in its arguments leaves no coroutine unawaited
        np_dtype = storage_numpy_dtype(leaf.dtype)
        chunk_rows, shard_rows = meta.layout[leaf.path]
        return await parent.create_array(
            leaf.path, shape=(meta.rows, *leaf.shape), dtype=np_dtype,
            chunks=(chunk_rows, *leaf.shape),
            shards=None if shard_rows is None else (shard_rows, *leaf.shape),
            compressors=meta.codec_of(leaf.path).compressors(np_dtype.itemsize),
            fill_value=np.zeros((), dtype=np_dtype).item(),
            chunk_key_encoding={"name": "default", "separator": key_separator},
            dimension_names=dimension_names(leaf.path, 1 + len(leaf.shape), len(root_batch)),
            attributes={ZSTORE_ATTR: {"torch_dtype": torch_dtype_name(leaf.dtype)}},
        )

    async def create() -> None:
        for depth in sorted({sub.count("/") for sub in subgroups}):  # parents first
            await asyncio.gather(*[subgroup(sub) for sub in subgroups if sub.count("/") == depth])
        await asyncio.gather(*[array(leaf) for leaf in meta.schema.leaves])
        prototype = default_buffer_prototype()
        documents = {key: await draft.get(key, prototype) async for key in draft.list()}
        root = documents.pop(METADATA_NAME)
        if isinstance(store, LocalStore):  # a few small files: written here, not a thread each
            for key, value in {METADATA_NAME: root, **documents}.items():
                path = Path(store.root, key)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(value.to_bytes())
            return
        await store.set(METADATA_NAME, root)
        await asyncio.gather(*[store.set(key, value) for key, value in documents.items()])

    sync(create())
    return zarr.Group(AsyncGroup(metadata=group.metadata, store_path=StorePath(store)))


#: Codecs an array may name: those zstore writes (and gzip). Anything else — a pickle
#: codec above all — is refused before a byte of the array is decoded.
SAFE_CODECS = frozenset({"bytes", "zstd", "blosc", "gzip", "crc32c", "sharding_indexed"})


def _every_codec(codecs) -> list[dict]:
    """Every codec of an array's ``codecs`` metadata, those inside a sharding codec too."""
    found = []
    for codec in codecs:
        codec = codec if isinstance(codec, dict) else {"name": str(codec)}
        found.append(codec)
        config = codec.get("configuration") or {}
        for inner in ("codecs", "index_codecs"):
            found += _every_codec(config.get(inner, []))
    return found


def checked_arrays(group: zarr.Group, leaves, rows: int,
                   layout: Mapping[str, tuple[int, int | None]], where: str,
                   raw: bool = False) -> dict[str, zarr.Array]:
    """The array of every leaf, verified against the ``zstore`` block (shape, dtype, chunks).

    The arrays' metadata is fetched concurrently (one round trip to an object
    store, not one per key). Metadata that disagrees with the arrays (edited by
    hand, or corrupt) is refused here rather than surfacing later as a shape
    error or a wrong mmap.
    """
    async def fetch(path: str):
        try:
            return await group._async_group.getitem(path)
        except (KeyError, NodeNotFoundError, FileNotFoundError, ValueError, TypeError) as exc:
            return exc

    async def fetch_all():
        return await asyncio.gather(*[fetch(leaf.path) for leaf in leaves])

    return {leaf.path: _checked_array(node, leaf, rows, layout[leaf.path], where, raw)
            for leaf, node in zip(leaves, sync(fetch_all()))}


def _is_zero(value: Any) -> bool:
    """Whether an array's fill value is zero (``False`` for one no number compares with)."""
    try:
        return bool((np.asarray(value) == 0).all())
    except (TypeError, ValueError):
        return False


def _checked_array(node, leaf, rows: int, layout: tuple[int, int | None], where: str,
                   raw: bool) -> zarr.Array:
    from .dtypes import storage_numpy_dtype, torch_dtype_name
    from .row_objects import KEY_SEPARATORS, key_separator

    if isinstance(node, (KeyError, NodeNotFoundError, FileNotFoundError)):
        raise NotAZStoreError(f"{where}: key {leaf.path!r} is in the metadata but has no array")
    if isinstance(node, (ValueError, TypeError)):  # e.g. its zarr.json is not JSON
        raise NotAZStoreError(f"{where}: the array of key {leaf.path!r} has malformed metadata "
                              f"({type(node).__name__}: {node})")
    if not isinstance(node, AsyncArray):
        raise NotAZStoreError(f"{where}: {leaf.path!r} is a group, the metadata says an array")
    array = zarr.Array(node)
    chunk_rows, shard_rows = layout
    expected = {
        "shape": (rows, *leaf.shape),
        "dtype": storage_numpy_dtype(leaf.dtype),
        "chunks": (chunk_rows, *leaf.shape),
        "shards": None if shard_rows is None else (shard_rows, *leaf.shape),
    }
    found = {"shape": tuple(array.shape), "dtype": np.dtype(array.dtype),
             "chunks": tuple(array.chunks), "shards": None if array.shards is None else tuple(array.shards)}
    wrong = [f"{name} {found[name]} (metadata says {value})" for name, value in expected.items()
             if found[name] != value]
    metadata = array.metadata.to_dict()
    codecs = _every_codec(metadata.get("codecs", []))
    unknown = sorted({str(codec.get("name")) for codec in codecs} - SAFE_CODECS)
    if unknown:
        wrong.append(f"codecs {unknown} (zstore reads only {sorted(SAFE_CODECS)})")
    if any((codec.get("configuration") or {}).get("endian") == "big" for codec in codecs
           if codec.get("name") == "bytes" and found["dtype"].itemsize > 1):
        wrong.append("big-endian values (zstore stores little-endian ones)")
    if key_separator(metadata) is None:
        wrong.append(f"chunk key encoding {metadata.get('chunk_key_encoding')} (zstore writes "
                     f"Zarr v3's default, with a separator of {' or '.join(KEY_SEPARATORS)})")
    recorded = metadata.get("attributes")  # (any JSON: a damaged file's too)
    recorded = recorded.get(ZSTORE_ATTR) if isinstance(recorded, dict) else None
    recorded = recorded.get("torch_dtype") if isinstance(recorded, dict) else None
    if recorded is not None and recorded != torch_dtype_name(leaf.dtype):
        wrong.append(f"torch_dtype {recorded!r} (metadata says {torch_dtype_name(leaf.dtype)!r})")
    if not _is_zero(array.fill_value):  # zarr reads unstored chunks as it
        wrong.append(f"fill value {np.asarray(array.fill_value).tolist()!r} (zstore reads rows "
                     "never stored as zeros)")
    if raw and (array.compressors or array.filters):
        wrong.append(f"codecs {array.compressors} (metadata says raw)")
    if wrong:
        raise NotAZStoreError(f"{where}: array of key {leaf.path!r} disagrees with the buffer "
                              "metadata: " + "; ".join(wrong))
    return array


def commit(group: zarr.Group, meta: StoreMeta, lease: "Lease | None" = None,
           where: str = "the buffer") -> None:
    """Write the ``zstore`` block: the single object that makes stored rows visible.

    With a ``lease`` the write is conditional (see :func:`put_attrs`). A failed
    write raises ``OSError`` (``PermissionError`` for a refusal) naming ``where``, or
    :class:`~zstore.errors.LeaseError`; the store then keeps its previous commit.
    """
    attrs = {key: value for key, value in group.attrs.asdict().items() if key != _INCOMPLETE_ATTR}
    attrs[ZSTORE_ATTR] = meta.to_json()
    _faults.crash_point("commit.before")
    try:
        put_attrs(group, attrs, lease)
    except ZStoreError:
        raise
    except Exception as exc:
        kind = PermissionError if isinstance(exc, PermissionError) else OSError
        raise kind(f"cannot commit {where}: writing its zarr.json failed ({type(exc).__name__}: "
                   f"{exc}); the store keeps its previous commit") from exc
    _faults.crash_point("commit.after")


def nodes_metadata(group: zarr.Group, meta: StoreMeta) -> ConsolidatedMetadata | None:
    """A copy of every other node's ``zarr.json`` (Zarr's consolidated metadata), fetched
    concurrently in one round trip; ``None`` when one of them cannot be read."""
    paths = [*meta.schema.group_paths, *(leaf.path for leaf in meta.schema.leaves)]
    store = group.store

    async def fetch():
        prototype = default_buffer_prototype()
        return await asyncio.gather(*[store.get(f"{path}/{ZARR_JSON}", prototype)
                                      for path in paths])

    try:
        documents = sync(fetch())
        return ConsolidatedMetadata.from_dict({
            "kind": "inline", "must_understand": False,
            "metadata": {path: json.loads(doc.to_bytes()) for path, doc in zip(paths, documents)}})
    except Exception:  # noqa: BLE001 - a missing or unreadable node: no copy, readers read them
        return None


def carrying_nodes(group: zarr.Group, nodes: ConsolidatedMetadata) -> zarr.Group:
    """``group``, whose every :func:`commit` from now on also writes ``nodes`` into the root
    ``zarr.json``, so that a reader opens the buffer with one request (docs/format.md §6)."""
    whole = AsyncGroup(dataclasses.replace(group.metadata, consolidated_metadata=nodes),
                       group._async_group.store_path)
    return zarr.Group(whole)


def put_attrs(group: zarr.Group, attrs: dict[str, Any], lease: "Lease | None" = None) -> None:
    """Replace the attributes of the group at the store's root: one ``zarr.json`` write.

    With a ``lease``, the write names the lease holder and is conditional: it
    happens only if ``zarr.json`` is still the version this writer last read or
    wrote (S3 ``If-Match``, a locked compare on local and ``memory://`` stores),
    else :class:`~zstore.errors.LeaseError` and nothing is written.
    """
    if lease is None:
        group.attrs.put(attrs)
        return
    from .lease import METADATA_NAME, WRITER_ATTR

    attrs = {**attrs, WRITER_ATTR: lease.owner}
    metadata = dataclasses.replace(group.metadata, attributes=attrs)
    stored = lease.write_metadata(
        metadata.to_buffer_dict(default_buffer_prototype())[METADATA_NAME].to_bytes(),
        owned=(ZSTORE_ATTR, _INCOMPLETE_ATTR))
    group.metadata.attributes.clear()  # (a user's attribute set meanwhile, kept: zstore.rebase)
    group.metadata.attributes.update(json.loads(stored).get("attributes") or {})
