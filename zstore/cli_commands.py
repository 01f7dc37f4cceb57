"""Bodies of ``zstore info | ls | convert | import | seal``, and the argument types shared by all subcommands.

Each subcommand is a pair of functions: ``<name>_arguments(parser)`` declares
its options, ``<name>_run(args)`` runs it and returns the exit code. They are
registered in :mod:`zstore.cli`, which also maps errors to exit codes (a
:class:`UsageError` is exit code 2). :func:`positive_int`, :func:`codec_name`
and :func:`add_storage_options` serve ``zstore demo`` (in :mod:`zstore.cli`) too, as does
:data:`DEFAULT_TRANSITIONS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable

from .errors import (CorruptChunkError, NotAZStoreError, ReadOnlyError, StoreNotFoundError,
                     ZStoreError, checkpoint_not_a, filled)
from .format_version import check_format_version

PROG = "zstore"

#: Transitions ``zstore demo`` writes by default (and :func:`zstore.demo.run_demo`): here, not
#: in :mod:`zstore.demo`, which imports torch, so that ``zstore demo --help`` starts fast.
DEFAULT_TRANSITIONS = 50_000

#: Root attributes that tell what a Zarr group is, read as JSON by ``ls`` and ``info`` without
#: importing their modules (``zstore.group`` imports zarr, the ``checkpoint`` package torch);
#: tests/test_cli.py checks they match ``group.ZSTORE_ATTR``, ``group._INCOMPLETE_ATTR`` and
#: ``group.CHECKPOINT_ATTR`` (which the checkpointers write).
_BUFFER_ATTR, _INCOMPLETE_ATTR = "zstore", "zstore_incomplete"
_CHECKPOINT_ATTR = "zstore_checkpoint"


class UsageError(Exception):
    """A subcommand was called with options that do not fit together (exit code 2)."""


# -- argument types shared by subcommands ---------------------------------------------------

def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (``50_000`` and ``50k`` accepted)."""
    raw = text.strip().lower().replace("_", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(raw[-1:], 1)
    try:
        value = int(raw[:-1] if scale > 1 else raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def codec_name(text: str) -> str | None:
    """An argparse type: a codec preset (``none``, ``zstd``, ``lz4``, ``blosc-zstd``, ``zstd:5``)."""
    from .codecs import CodecSpec

    try:
        CodecSpec.parse(text)
    except ValueError as exc:
        if str(exc).startswith("codec level"):  # a known codec, a level it does not take
            raise argparse.ArgumentTypeError(str(exc)) from None
        raise argparse.ArgumentTypeError(
            f"unknown codec {text!r}: choose none, zstd, lz4 or blosc-zstd, optionally "
            "NAME:LEVEL (e.g. zstd:3)") from None
    return None if text == "none" else text


def lasting_url(why: str) -> Callable[[str], str]:
    """An argparse type: a URL whose store outlives this process, not ``memory://`` (the
    refusal says ``why`` that matters)."""
    def url(text: str) -> str:
        if text.startswith("memory://"):
            raise argparse.ArgumentTypeError(
                f"memory:// lives in one process, {why}; use a local path or an s3:// URL")
        return text

    return url


def storage_option(text: str) -> tuple[str, Any]:
    """An argparse type: ``KEY=VALUE`` (VALUE read as JSON when it parses, else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """Add ``-o/--storage-option KEY=VALUE`` (repeatable) as ``args.storage_options``."""
    parser.add_argument("-o", "--storage-option", dest="storage_options", action="append",
                        type=storage_option, default=[], metavar="KEY=VALUE",
                        help="an fsspec storage option, e.g. -o endpoint_url=http://127.0.0.1:9000 "
                             "(repeatable; VALUE is JSON when it parses)")


# -- helpers of these subcommands ---------------------------------------------------------

#: The fix for a write destination that takes no writes.
_WRITE_ELSEWHERE = "write to a local path or a bucket (s3://...) instead"

#: The fix for a write destination that is a file.
_CHOOSE_ANOTHER = "choose a new or empty folder instead"

#: ``--codec`` not given (``--codec none`` means raw, so None cannot mark it).
_DEFAULT = object()


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(args.storage_options)


def _progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="no progress bar (default: shown when stderr is a terminal)")


def _url(parser: argparse.ArgumentParser, name: str = "url", help: str = "",
         type: Callable[[str], str] = str) -> None:
    parser.add_argument(name, metavar=name.upper(), type=type,
                        help=help or "a local path or fsspec URL (s3://bucket/rb, http://host/ds ...)")


#: The argparse type of a destination written by this process alone.
_DESTINATION = lasting_url("so what zstore writes there is gone when it exits")


def _require_writable(url: str, options: dict[str, Any], action: str, fix: str):
    """Refuse, before any work, to write at an ``http(s)://`` URL: a web server serves files and
    takes no writes (it would answer the first PUT with 501); the URL's :class:`StoreSpec`."""
    from .store import StoreSpec

    spec = StoreSpec.parse(url, options)
    if spec.protocol in ("http", "https"):
        raise ReadOnlyError(f"cannot {action} {spec.redacted()}: {spec.protocol}:// stores are "
                            f"read-only; {fix}")
    return spec


def _node(fs, path: str) -> tuple[str, dict[str, Any]] | None:
    """What the ``zarr.json`` at ``path`` holds, as ``(kind, block)``: ``("buffer", its zstore
    block)``, ``("checkpoint", its commit record)``, ``("incomplete", {})`` (a buffer whose
    creation never finished), ``("array", {})``, ``("group", {})`` or ``("malformed",
    {"error": why})`` (not JSON); ``None`` without one."""
    try:
        node = json.loads(fs.cat_file(f"{path.rstrip('/')}/zarr.json"))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except ValueError:  # bytes that are not JSON (UnicodeDecodeError is a ValueError too)
        return "malformed", {"error": "its zarr.json is not valid JSON"}
    if not isinstance(node, dict):
        return None
    if node.get("node_type") == "array":  # an array's own zstore attribute is its torch dtype
        return "array", {}
    attrs = node.get("attributes")
    attrs = attrs if isinstance(attrs, dict) else {}
    for kind, name in (("buffer", _BUFFER_ATTR), ("checkpoint", _CHECKPOINT_ATTR)):
        if isinstance(attrs.get(name), dict):
            return kind, attrs[name]
    return ("incomplete" if attrs.get(_INCOMPLETE_ATTR) else "group"), {}


def _not_a_buffer(spec, kind: str, block: dict[str, Any]) -> NotAZStoreError | None:
    """The error for ``info`` on an unfinished creation or a checkpoint: what it is and the fix."""
    where = spec.redacted()
    if kind == "incomplete":
        return NotAZStoreError(
            f"{where} holds a buffer whose creation never finished (its writer stopped before the "
            "first commit, so it holds no rows): delete it, or create the buffer there again with "
            "the API (e.g. zstore.LazyMemmapStorage(N, scratch_dir=URL)), which replaces it")
    if kind == "checkpoint":
        generation = block.get("generation") if block.get("form") == "buffer" else None
        inspect = (f", or inspect its current generation, a buffer: {PROG} info "
                   f"{spec.url}/{generation}" if generation else "")
        return checkpoint_not_a("buffer", where, block, inspect)
    return None


def _codec_and_chunks(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--codec", type=codec_name, metavar="NAME", default=_DEFAULT,
                        help="compression: none, zstd, lz4, blosc-zstd, optionally NAME:LEVEL and "
                             f"+crc32c (default: {default})")
    parser.add_argument("--chunks", type=positive_int, metavar="ROWS",
                        help="rows per chunk (default: about 1 MiB of each key)")


# -- zstore info ----------------------------------------------------------------------------

def info_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `zstore info URL`."""
    _url(parser)
    parser.add_argument("--json", action="store_true", help="print the zstore block as JSON")
    add_storage_options(parser)


def info_run(args: argparse.Namespace) -> int:
    """Run `zstore info URL` (a buffer's class, rows, keys, codecs and sizes); the exit code."""
    from .group import ZSTORE_ATTR, open_zarr_group
    from .store import StoreSpec

    spec = StoreSpec.parse(args.url, _options(args), read_only=True)
    spec.refuse_a_file("pass the buffer's folder")  # the OS would name PATH/zarr.json
    try:
        group = open_zarr_group(spec)
    except NotAZStoreError:
        found = _node(*spec.filesystem())  # read again only to name what is there instead
        if found and (error := _not_a_buffer(spec, *found)):
            raise error from None
        raise
    attrs = group.attrs.asdict()
    block = attrs.get(ZSTORE_ATTR)
    if not isinstance(block, dict) and isinstance(attrs.get(_CHECKPOINT_ATTR), dict):
        raise _not_a_buffer(spec, "checkpoint", attrs[_CHECKPOINT_ATTR])
    where = spec.redacted()
    if not isinstance(block, dict):
        raise NotAZStoreError(f"{where} is not a zstore buffer: no 'zstore' block in its attributes")
    if args.json:
        print(json.dumps(block, indent=2))
        return 0
    check_format_version(block, where)
    print(where)
    try:
        damaged = _print_block(spec, group, block)
    except ZStoreError:
        raise  # already says what is wrong (a key without its array)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise NotAZStoreError(f"{where}: malformed metadata ({exc!r})") from None
    for problem in damaged:  # after the table, as `ls` names what it could not read
        print(f"{PROG}: error: {where}: {problem}", file=sys.stderr)
    return 1 if damaged else 0


def _print_block(spec, group, block: dict[str, Any]) -> list[str]:
    """What the ``zstore`` block of a storage says (read as JSON: no torch, so ``info`` starts
    fast); returns the damage seen on the way (:func:`_print_buffer`)."""
    from .display import format_bytes
    from .lease import LEASE_NAME

    name = block["storage_class"]
    if name == "LazyMemmapStorage":
        return _print_buffer(spec, group, block)
    stored = format_bytes(spec.stored_bytes(ignore=(LEASE_NAME,)))
    if name == "StorageEnsemble":
        members = block["members"]
        print(f"  StorageEnsemble of {len(members):,} storages ({', '.join(members)}), capacity "
              f"{block['max_size']:,}, {stored} stored")
    else:
        items = block["length"]
        print(f"  {name}: {items:,} item{'s' if items != 1 else ''} of {block['max_size']:,}, "
              f"{stored} stored")
    return []


def _print_buffer(spec, group, block: dict[str, Any]) -> list[str]:
    """The schema table and counters of a LazyMemmapStorage; returns the raw chunks whose
    size is not a chunk's (cut short or grown: a read of them raises), one line each."""
    from .codecs import CodecSpec
    from .display import format_bytes, text_dtype
    from .tail import group_id, record_from_json

    fs, root = spec.filesystem()
    # rows committed to the tail log, not yet in their chunks: per block group (format.md §6)
    logged = {group: sum(seg.stop - seg.first for seg in segments)
              for group, segments in record_from_json(block.get("tail")).items()}
    schema, length, ndim = block["schema"], int(block["length"]), int(block["ndim"])
    lanes = [int(n) for n in schema.get("lane_shape", [])]
    kind = "sealed dataset" if block.get("sealed") else \
        "read-only buffer" if block.get("read_only") else "buffer"
    created = block.get("created") or {}
    itemsizes = {}  # of every key's array, before a line is printed
    for leaf in schema["leaves"]:
        try:
            itemsizes[leaf["path"]] = group[leaf["path"]].dtype.itemsize
        except KeyError:
            raise NotAZStoreError(
                f"{spec.redacted()}: key {leaf['path']!r} is in its metadata but has no array "
                "(its folder or zarr.json is missing): restore the store from a copy or a "
                "checkpoint") from None
    print(f"  {block['storage_class']} ({kind}), format v{block['format_version']}, created "
          f"{created.get('time', '?')} by zstore {created.get('zstore_version', '?')}")
    print(f"  length {length:,} of capacity {block['max_size']:,} (rows {block['rows']:,}, "
          f"ndim {ndim}{', lanes ' + str(lanes) if ndim > 1 else ''})"
          f", last cursor {block['last_cursor']:,}")
    filled = -(-length // math.prod(lanes))
    texts = set(schema.get("texts", []))
    width = max([28, *(len(leaf["path"]) + 2 for leaf in schema["leaves"])])  # long keys too
    dtypes = {leaf["path"]: text_dtype(leaf["shape"][-1]) if leaf["path"] in texts
              else leaf["dtype"] for leaf in schema["leaves"]}
    dtype_width = max([10, *(len(name) + 2 for name in dtypes.values())])
    header = f"  {'key':<{width}}{'dtype':<{dtype_width}}{'shape':<12}{'codec':<16}{'chunk':>8}" \
             f"{'shard':>8}{'raw':>11}{'stored':>11}{'ratio':>7}"
    print("\n" + header)
    codecs = block.get("codecs") or {}
    total_raw = total_stored = 0
    damaged = []
    for leaf in schema["leaves"]:
        path, shape = leaf["path"], leaf["shape"]
        chunk, shard = block["chunks"][path]
        row_bytes = math.prod(shape) * itemsizes[path]
        raw = filled * row_bytes
        # its chunks, and its rows in the log's segments (stored raw, beside every key's)
        stored = _du(fs, f"{root}/{path}") + logged.get(group_id(chunk, shard or chunk), 0) * row_bytes
        total_raw, total_stored = total_raw + raw, total_stored + stored
        codec = CodecSpec.parse(codecs.get(path, block["codec"]))
        if codec.is_raw and not shard and spec.is_local:  # memory-mapped chunk files: each
            # holds exactly a chunk's bytes (a read of another raises)
            damaged += [f"key {path!r}: its chunk {name} holds {size:,} bytes, not "
                        f"{chunk * row_bytes:,}: it is damaged (cut short or overwritten); "
                        "restore the store from a copy or a checkpoint"
                        for name, size in _chunk_files(os.path.join(spec.url, path))
                        if size != chunk * row_bytes]
        ratio = f"{raw / stored:.1f}" if stored else "-"
        cells = shape[len(lanes):-1] if path in texts else shape[len(lanes):]  # a string each
        print(f"  {path:<{width}}{dtypes[path]:<{dtype_width}}{str(cells):<12}{codec!s:<16}"
              f"{chunk:>8}{shard or '-':>8}{format_bytes(raw):>11}{format_bytes(stored):>11}"
              f"{ratio:>7}")
    all_stored = _du(fs, root)
    print(f"  {'total (all objects)':<{width + dtype_width + 44}}{format_bytes(total_raw):>11}"
          f"{format_bytes(all_stored):>11}{total_raw / all_stored if all_stored else 0:>7.1f}")
    if block.get("sealed"):
        damaged += _lost_data_objects(group, block, filled)
        index_damage = _lost_index_objects(spec, group, block, math.prod(lanes))
        count = block["extra"]["episodes"]["count"]
        print(f"\n  episodes {count:,} (no statistics: the index is damaged)" if index_damage
              else _episodes_line(group, block, math.prod(lanes)))
        damaged += [index_damage] if index_damage else []
    source = (block.get("extra") or {}).get("source")
    if isinstance(source, dict):
        fields = source.get("metadata") or {}
        named = f", dataset_id {fields['dataset_id']}" if "dataset_id" in fields else ""
        print(f"  imported from the {source.get('layout')} file {source.get('file')}: "
              f"{len(fields)} metadata fields{named} (all in `zstore info --json`)")
    return damaged


def _stores_every_object(block: dict[str, Any]) -> bool:
    """Whether a sealed dataset stores every object of its rows, so that one missing is damage
    (in a dataset sealed before ``all_chunks_stored``, it is an all-zero one Zarr skipped)."""
    from .row_objects import ALL_CHUNKS_STORED

    return bool((block.get("extra") or {}).get(ALL_CHUNKS_STORED))


def _lost_data_objects(group, block: dict[str, Any], filled: int) -> list[str]:
    """One line per key of a sealed dataset missing objects of its ``filled`` rows (a read of
    them raises)."""
    from .row_objects import first_of, missing_row_objects

    if not _stores_every_object(block):
        return []
    lost = []
    for leaf in block["schema"]["leaves"]:
        if missing := missing_row_objects([group[leaf["path"]]], filled):
            lost.append(f"key {leaf['path']!r} lost {first_of(missing)}: this dataset stores "
                        "every chunk of its rows, so it was copied in part, or the object was "
                        "deleted; copy the dataset again whole, or restore it from a backup")
    return lost


def _lost_index_objects(spec, group, block: dict[str, Any], lanes: int) -> str | None:
    """What a sealed dataset's episode index lost, in ``open_dataset(url).episodes``'s words
    (Zarr would read it as zeros: invented statistics), or None."""
    from .row_objects import require_index_stored

    if not _stores_every_object(block):
        return None
    index = block["extra"]["episodes"]
    arrays = [array for _, array in sorted(group[index["path"]].arrays())]
    try:
        require_index_stored(arrays, -(-int(index["count"]) // lanes), spec.redacted())
    except CorruptChunkError as exc:
        return str(exc).removeprefix(f"{spec.redacted()}: ")
    return None


def _episodes_line(group, block: dict[str, Any], lanes: int) -> str:
    """Counts and means of a sealed dataset's episodes, from its stored index."""
    import numpy as np

    index = block["extra"]["episodes"]
    n = int(index["count"])
    used = -(-n // lanes)  # rows holding episodes: episode i is at flat position i
    column = {}
    for name in ("length", "return", "terminated", "truncated"):
        array = group[f"{index['path']}/{name}"]
        column[name] = np.asarray(array[:used]).reshape(used * lanes, *array.shape[block["ndim"]:])[:n]
    ended = column["terminated"].astype(bool) | column["truncated"].astype(bool)
    terminated, truncated = int(column["terminated"].sum()), int(column["truncated"].sum())
    both = terminated + truncated - int(ended.sum())  # an end flagged both ways (some D4RL files)
    return (f"\n  episodes {n:,}: {terminated:,} terminated, {truncated:,} truncated"
            f"{f' ({both:,} both)' if both else ''}, {n - int(ended.sum()):,} open; length mean "
            f"{column['length'].mean() if n else math.nan:.1f}, "
            f"return mean {column['return'].astype(np.float64).mean() if n else math.nan:.3f}")


def _du(fs, path: str) -> int:
    try:
        return int(fs.du(path, total=True))
    except (FileNotFoundError, NotImplementedError):
        return 0


def _chunk_files(folder: str) -> list[tuple[str, int]]:
    """``(name relative to folder, bytes)`` of a local array's chunk files (``c/...``, or
    ``c.0.0`` with the ``.`` key separator), not the files a write in flight (or killed)
    leaves before its rename (``*.partial``)."""
    found = []
    for where, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(where, name)
            relative = os.path.relpath(path, folder)
            if relative[:2] in ("c/", "c.") and not name.endswith(".partial"):
                found.append((relative, os.path.getsize(path)))
    return sorted(found)


# -- zstore ls ------------------------------------------------------------------------------

def ls_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `zstore ls URL`."""
    _url(parser, help="a local directory or fsspec prefix to search for buffers")
    parser.add_argument("--depth", type=positive_int, default=4,
                        help="how many directory levels to descend (default: %(default)s)")
    add_storage_options(parser)


def ls_run(args: argparse.Namespace) -> int:
    """Run `zstore ls URL` (every buffer below a prefix); the exit code: 1 when a folder below
    it could not be read or holds a malformed ``zarr.json`` (named on stderr, as GNU ls
    does, after listing the others)."""
    from .store import StoreSpec

    spec = StoreSpec.parse(args.url, _options(args), read_only=True)
    spec.refuse_a_file("pass the folder to search for buffers")
    fs, root = spec.filesystem()
    try:
        fs.info(root)  # unlike fs.exists, lets a missing credential or endpoint through
    except FileNotFoundError as exc:
        if isinstance(exc.__cause__, OSError) and not isinstance(exc.__cause__, FileNotFoundError):
            raise  # fsspec's HTTP: an unreachable server, said as "not found"
        raise StoreNotFoundError(f"no such location: {spec.redacted()}" + (
            " (memory:// stores live inside one process: list them from it)" if spec.is_memory
            else "")) from None
    found = unreadable = 0
    for path, kind, block in _buffers(fs, root, args.depth):
        if kind == "unreadable":
            unreadable += 1
            why, fix = (("permission denied", "give this user read access to list them")
                        if spec.is_local else (f"access denied ({block['error']})",
                                               "check the credentials and the bucket's policy"))
            print(f"{PROG}: error: cannot read {_child_url(spec, fs, root, path)}: {why}; its "
                  f"buffers, if any, are not listed ({fix})", file=sys.stderr)
            continue
        why = block.get("error") if kind == "malformed" else _malformed(block)
        if why:  # reported as a folder that cannot be read: the others are still listed
            unreadable += 1
            url = _child_url(spec, fs, root, path)
            print(f"{PROG}: error: {url}: {why}; not listed ({PROG} info {url} says more)",
                  file=sys.stderr)
            continue
        found += 1
        name = block.get("checkpointer" if kind == "checkpoint" else "storage_class", "?")
        if kind == "buffer" and block.get("sealed"):
            kind = "dataset"
        episodes = (block.get("extra") or {}).get("episodes", {}).get("count")
        note = f", {episodes:,} episodes" if episodes is not None else ""
        print(f"{_child_url(spec, fs, root, path)}\t{name}\t{kind}\t{filled(block)}{note}")
    if not found and not unreadable:
        print(f"no zstore buffer under {spec.redacted()}")
    return 1 if unreadable else 0


def _malformed(block: dict[str, Any]) -> str | None:
    """What makes a zstore block or checkpoint record unfit to list (a count that is no
    integer), or None."""
    extra = block.get("extra")
    episodes = extra.get("episodes") if isinstance(extra, dict) else None
    counts = {"length": block.get("length"), "max_size": block.get("max_size", 0),
              "the episode count": episodes.get("count") if isinstance(episodes, dict) else None}
    for name, value in counts.items():
        if value is not None and (type(value) is not int or value < 0):
            return f"its zarr.json is malformed: {name} is {value!r}, not a count"
    if extra is not None and not isinstance(extra, dict) or \
            episodes is not None and not isinstance(episodes, dict):
        return "its zarr.json is malformed: its extra block is not an object"
    return None


def _buffers(fs, root: str, depth: int):
    """``(path, kind, block)`` (see :func:`_node`) of every buffer, unfinished buffer and
    checkpoint at or below ``root``, not looking inside them nor inside arrays; a folder below
    ``root`` that refuses to be read is ``(path, "unreadable", {"error": why})`` and the walk
    goes on (``root``'s own refusal is raised)."""
    found = _node(fs, root)
    if found and found[0] != "group":
        if found[0] != "array":
            yield root, *found
        return
    if depth <= 0:
        return
    for entry in sorted(fs.ls(root, detail=True), key=lambda e: e["name"]):
        if entry.get("type") == "directory":
            try:  # a refusal inside the walk below it ends at that folder's own call
                yield from _buffers(fs, entry["name"], depth - 1)
            except PermissionError as exc:
                yield entry["name"], "unreadable", {"error": str(exc)}


def _child_url(spec, fs, root: str, path: str) -> str:
    """The URL of ``path``, a name ``fs`` listed below ``root``, spelt as ``spec.url`` is
    (``fs.ls`` gives bucket paths on S3 but whole URLs over HTTP)."""
    path, root = path.rstrip("/"), root.rstrip("/")
    if path == root or path.startswith(root + "/"):
        return spec.url.rstrip("/") + path[len(root):]
    return path if spec.is_local else fs.unstrip_protocol(path)


# -- zstore convert -------------------------------------------------------------------------

def convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `zstore convert SRC DST`."""
    _url(parser, "src", "the buffer or dataset to copy")
    _url(parser, "dst", "where to write the copy (must be empty)", _DESTINATION)
    _codec_and_chunks(parser, "the source's; +crc32c when the copy is sealed")
    parser.add_argument("--shards", type=positive_int, metavar="ROWS",
                        help="rows per shard object (default: about 32 MiB on object stores)")
    parser.add_argument("--seal", action=argparse.BooleanOptionalAction, default=None,
                        help="seal the copy (default: when the source is sealed)")
    add_storage_options(parser)
    parser.add_argument("-O", "--dst-option", dest="dst_options", action="append", default=None,
                        type=storage_option, metavar="KEY=VALUE",
                        help="a storage option for DST only (default: the -o options)")
    _progress(parser)


def convert_run(args: argparse.Namespace) -> int:
    """Run `zstore convert SRC DST` (a copy with another codec or chunking); the exit code."""
    from .dataset.convert import _KEEP, convert

    if args.shards and args.chunks and args.shards % args.chunks:
        raise UsageError(f"--shards {args.shards} must be a multiple of --chunks {args.chunks}")
    dst_options = None if args.dst_options is None else dict(args.dst_options)
    _require_writable(args.dst, _options(args) if dst_options is None else dst_options,
                      "write the copy to", _WRITE_ELSEWHERE).refuse_a_file(_CHOOSE_ANOTHER)
    copy = convert(args.src, args.dst, _options(args), dst_options=dst_options,
                   codec=_KEEP if args.codec is _DEFAULT else args.codec,
                   chunks=args.chunks, shards=args.shards, seal=args.seal, progress=args.progress)
    per_key = "".join(f", {path}: {spec}" for path, spec in copy.key_codecs.items())
    print(f"copied {len(copy):,} cells to {copy.spec.redacted()} (codec {copy.codec}{per_key}"
          f"{', sealed' if copy._meta.sealed else ''})")
    return 0


# -- zstore import --------------------------------------------------------------------------

def import_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `zstore import LAYOUT FILE URL`."""
    parser.add_argument("layout", choices=("d4rl", "minari"), help="the HDF5 file's layout")
    parser.add_argument("file", metavar="FILE",
                        help="the HDF5 file to import (minari: also the dataset's folder)")
    _url(parser, help="where to write the dataset (must be empty)", type=_DESTINATION)
    _codec_and_chunks(parser, "zstd+crc32c")
    add_storage_options(parser)
    _progress(parser)


def import_run(args: argparse.Namespace) -> int:
    """Run `zstore import LAYOUT FILE URL` (a D4RL or Minari HDF5 file as a sealed dataset); the exit code."""
    from .dataset import import_d4rl, import_minari
    from .dataset.importers import DEFAULT_CODEC, source_file

    source_file(args.layout, args.file)  # before the destination is looked at
    _require_writable(args.url, _options(args), "import into",
                      _WRITE_ELSEWHERE).refuse_a_file(_CHOOSE_ANOTHER)
    run = import_d4rl if args.layout == "d4rl" else import_minari
    dataset = run(args.file, args.url, _options(args), codec=DEFAULT_CODEC if args.codec is _DEFAULT else args.codec,
                  chunks=args.chunks, progress=args.progress)
    print(f"imported {len(dataset):,} transitions, {dataset.num_episodes:,} episodes from "
          f"{args.file} into {dataset.spec.redacted()} (sealed)")
    dataset.close()
    return 0


# -- zstore seal ----------------------------------------------------------------------------

def seal_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `zstore seal URL`."""
    _url(parser, help="the buffer to publish as a read-only dataset")
    add_storage_options(parser)


def seal_run(args: argparse.Namespace) -> int:
    """Run `zstore seal URL` (publish a buffer as a read-only dataset); the exit code."""
    from .dataset import seal
    from .store import StoreSpec

    _require_writable(args.url, _options(args), "seal",
                      f"copy it to a local path or a bucket and seal the copy: {PROG} convert "
                      f"{args.url} DST --seal")
    episodes = seal(args.url, _options(args))
    print(f"sealed {StoreSpec.parse(args.url, _options(args)).redacted()}: {episodes:,} episodes")
    return 0
