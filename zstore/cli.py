"""The ``zstore`` console command.

Subcommands live in :data:`COMMANDS`, one :class:`Command` each: its name, help
text, a function that adds its arguments to an :mod:`argparse` parser, and a
function that runs it and returns an exit code. To add one, write those two
functions and call :func:`register`.

Exit codes: 0 success, 1 runtime error (a :class:`~zstore.ZStoreError` or an
OS error, printed as ``zstore: error: <message>``), 2 usage error, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Sequence

from . import __version__
from .errors import ZStoreError

PROG = "zstore"


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments(parser)`` declares its options, ``run(args)`` runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


class UsageError(Exception):
    """A subcommand was called with options that do not fit together (exit code 2)."""


#: The subcommands, by name, in the order ``zstore --help`` lists them.
COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add (or replace) a subcommand of ``zstore``."""
    COMMANDS[command.name] = command
    return command


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
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown codec {text!r}: choose none, zstd, lz4 or blosc-zstd, optionally "
            "NAME:LEVEL (e.g. zstd:3)") from None
    return None if text == "none" else text


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


# -- zstore demo ----------------------------------------------------------------------------

def _demo_url(text: str) -> str:
    if text.startswith("memory://"):
        raise argparse.ArgumentTypeError(
            "memory:// lives in one process, and the demo reads the buffer back from another; "
            "use a local path or an s3:// URL")
    return text


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import DEFAULT_TRANSITIONS

    parser.add_argument("-n", "--transitions", type=positive_int, default=DEFAULT_TRANSITIONS,
                        metavar="N", help="transitions to write (default: %(default)s)")
    parser.add_argument("--capacity", type=positive_int, metavar="N",
                        help="buffer capacity; below --transitions the ring wraps around "
                             "(default: --transitions)")
    parser.add_argument("--codec", type=codec_name, default=None, metavar="NAME",
                        help="compression: none, zstd, lz4, blosc-zstd, optionally NAME:LEVEL "
                             "(default: none)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", type=_demo_url,
                       help="where to write the buffer: a local path or fsspec URL; it is kept "
                            "(default: a temporary directory)")
    where.add_argument("--s3", action="store_true",
                       help="write to a bucket on an S3 server (moto) started on 127.0.0.1")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary buffer and print where it is")
    add_storage_options(parser)


def _demo_run(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.keep and args.s3:
        raise UsageError("--keep cannot keep a --s3 buffer: its server stops when the demo ends")
    if args.storage_options and args.url is None:
        raise UsageError("-o/--storage-option needs --url")
    return run_demo(args.transitions, capacity=args.capacity, url=args.url,
                    storage_options=dict(args.storage_options), s3=args.s3, codec=args.codec,
                    seed=args.seed, keep=args.keep)


register(Command(
    "demo", "write a replay buffer of simulated transitions, read it back from another process",
    _demo_arguments, _demo_run,
    description="Fill a LazyMemmapStorage with transitions of 8 simulated point-mass "
                "environments (TED layout) through a RoundRobinWriter, reopen it read-only in a "
                "new Python process, sample random batches and trajectory slices, and report "
                "sizes and timings."))


# -- datasets and inspection (bodies in zstore.cli_commands) --------------------------------

from . import cli_commands as _commands  # after the helpers it imports

register(Command(
    "info", "show a buffer's or dataset's keys, dtypes, shapes, codecs, sizes and episodes",
    _commands.info_arguments, _commands.info_run,
    description="Print the schema table of the buffer or dataset at URL (key, dtype, shape, "
                "codec, chunk and shard rows, raw and stored bytes), its length, capacity and "
                "cursor, and for a sealed dataset its episodes."))
register(Command(
    "ls", "list the buffers and datasets under a directory or prefix",
    _commands.ls_arguments, _commands.ls_run))
register(Command(
    "convert", "copy a buffer or dataset with another codec or chunking",
    _commands.convert_arguments, _commands.convert_run,
    description="Copy the buffer at SRC to the empty location DST, re-compressed (--codec) and "
                "re-chunked (--chunks, --shards), keeping length, cursor and row order. A sealed "
                "source gives a sealed, checksummed copy."))
register(Command(
    "import", "import a D4RL or Minari HDF5 file as a sealed TED dataset",
    _commands.import_arguments, _commands.import_run,
    description="Read an HDF5 file in the D4RL layout (flat observations, actions, rewards, "
                "terminals, timeouts ...) or the Minari layout (one group per episode) and write "
                "it at URL as a sealed TED dataset (codec zstd+crc32c by default)."))
register(Command(
    "seal", "publish a buffer as a read-only dataset (episode index, consolidated metadata)",
    _commands.seal_arguments, _commands.seal_run,
    description="Flush-committed rows stay; the episode index is computed from the TED done "
                "flags and stored, the metadata consolidated, and the buffer marked sealed and "
                "read-only (zstore.open_dataset then opens it with one metadata read)."))


# -- entry point ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``zstore`` parser with one subparser per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="zstore: TorchRL replay-buffer storages on Zarr v3 at any "
                               "fsspec URL.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND",
                                required=True)
    for command in COMMANDS.values():
        child = sub.add_parser(command.name, help=command.help,
                               description=command.description or command.help)
        command.add_arguments(child)
        child.set_defaults(_command=command, _parser=child)
    return parser


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zstore`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return _exit_code(exc)
    try:
        return args._command.run(args)
    except UsageError as exc:
        args._parser.print_usage(sys.stderr)
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout left (`zstore info URL | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ZStoreError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
