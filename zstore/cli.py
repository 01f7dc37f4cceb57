"""The ``zstore`` console command: its subcommands, one error line per failure, exit codes.

Subcommands live in :data:`COMMANDS`, one :class:`Command` each: its name, help
text, a function that adds its arguments to an :mod:`argparse` parser, and a
function that runs it and returns an exit code. To add one, write those two
functions and call :func:`register`. Only the chosen command's arguments are
declared, and torch is imported only by the commands that need it, so ``--help``,
``ls`` and ``info`` start fast.

Exit codes: 0 success, 1 runtime error, 2 usage error, 130 when interrupted.
Every failure is one line, ``zstore: error: <what failed, where, the fix>``
(:func:`error_message`); ``--debug`` prints the traceback first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Callable, Sequence

from . import __version__
from . import cli_commands as _commands
from .cli_commands import (DEFAULT_TRANSITIONS, PROG, UsageError, add_storage_options, codec_name,
                           lasting_url, positive_int)
from .credentials import CHECK_CREDENTIALS, CHECK_ENDPOINT
from .errors import OPEN_READ_ONLY, InvalidURLError, StoreExistsError, ZStoreError

if TYPE_CHECKING:
    from .store import StoreSpec


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments(parser)`` declares its options, ``run(args)`` runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


#: The subcommands, by name, in the order ``zstore --help`` lists them.
COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add (or replace) a subcommand of ``zstore``."""
    COMMANDS[command.name] = command
    return command


# -- zstore demo ----------------------------------------------------------------------------

def _demo_arguments(parser: argparse.ArgumentParser) -> None:
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
    where.add_argument("--url", type=lasting_url("and the demo reads the buffer back from another"),
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

register(Command(
    "info", "show a buffer's or dataset's keys, dtypes, shapes, codecs, sizes and episodes",
    _commands.info_arguments, _commands.info_run,
    description="Print the schema table of the buffer or dataset at URL (key, dtype, shape, "
                "codec, chunk and shard rows, raw and stored bytes), its length, capacity and "
                "cursor, and for a sealed dataset its episodes."))
register(Command(
    "ls", "list the buffers and datasets under a directory or prefix",
    _commands.ls_arguments, _commands.ls_run,
    description="Print one line per buffer, dataset and checkpoint at or below URL (its URL, class "
                "or checkpointer, kind, length/capacity), and per buffer whose creation never "
                "finished (kind 'incomplete'), without looking inside them."))
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


# -- errors ---------------------------------------------------------------------------------

_CREDENTIALS = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
                "-o key=KEY -o secret=SECRET")


def _cause(exc: BaseException | None, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception in ``exc``'s chain (itself, then what it was raised from or while
    handling) that passes ``test``."""
    while exc is not None and not test(exc):
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return exc


def _named(*names: str) -> Callable[[BaseException], bool]:
    """A test for exceptions of a class named in ``names`` (botocore's, aiohttp's and the
    builtins, matched by name: neither library is imported)."""
    return lambda exc: any(cls.__name__ in names for cls in type(exc).__mro__)


def _unreachable(exc: BaseException) -> bool:
    """A client's error for a server it could not reach; not zstore's wording of one (it
    comes from the client's, and gives the fix for Python callers), used only where no
    client error names the cause (obstore's is a generic one)."""
    return (_named("ConnectionError", "ClientConnectionError")(exc)
            and not str(exc).endswith(CHECK_ENDPOINT))


def _denied(exc: BaseException) -> bool:
    """A ``PermissionError`` (s3fs's 403), or a botocore ``ClientError`` with HTTP status 403."""
    response = getattr(exc, "response", None)
    return isinstance(exc, PermissionError) or (
        isinstance(response, dict)
        and response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403)


def _refused_locally(cause: BaseException, stores: list[StoreSpec]) -> StoreSpec | None:
    """The local store a refusal concerns, or ``None`` when it concerns a remote one: the store
    the error names (in its file or its text), else, for an OS error (it names a file) or when
    no store given is remote, the first local one."""
    named = [spec for spec in stores
             if spec.url in f"{getattr(cause, 'filename', None) or ''} {cause}"]
    if named:
        return named[0] if named[0].is_local else None
    local = [spec for spec in stores if spec.is_local]
    if local and (getattr(cause, "filename", None) or not any(spec.is_remote for spec in stores)):
        return local[0]
    return None


def _connection_fix(stores: list[StoreSpec]) -> str:
    """What to check when a server cannot be reached, for the kinds of store given: the S3
    endpoint option, or the host and port of an http(s) URL."""
    checks = ["the endpoint (-o endpoint_url=URL)"] * any(
        spec.protocol in ("s3", "s3a") for spec in stores)
    if any(spec.protocol not in ("s3", "s3a") and spec.is_remote for spec in stores) or not checks:
        checks.append("the host and port in the URL")
    return f"check {', '.join(checks)} and that the server is up"


def _stores(args: argparse.Namespace) -> list[StoreSpec]:
    """The stores a command was given (``URL``, ``SRC``, ``DST``) with their storage options,
    less any whose URL or options name no store (their error says so)."""
    from .store import StoreSpec

    options = dict(getattr(args, "storage_options", ()))
    dst_options = getattr(args, "dst_options", None)
    stores = []
    for name in ("url", "src", "dst"):
        if url := getattr(args, name, None):
            try:
                stores.append(StoreSpec.parse(
                    url, dict(dst_options) if name == "dst" and dst_options is not None
                    else options))
            except InvalidURLError:
                continue
    return stores


def error_message(exc: BaseException, args: argparse.Namespace) -> str:
    """One line for a failed command: what failed, where (credentials redacted), the fix.

    zstore's own errors say all three; those of the storage client (botocore, s3fs,
    aiohttp) and of the OS get the store they concern and the CLI's fix.
    """
    stores = _stores(args)
    where = " and ".join(spec.redacted() for spec in stores) or "the store"
    remote = " and ".join(spec.redacted() for spec in stores
                          if spec.is_remote) or where
    names = [name for name in (getattr(args, "file", None), *(spec.url for spec in stores)) if name]

    def about(error: BaseException | str) -> str:  # the error, with the store unless it names one
        return str(error) if any(name in str(error) for name in names) else f"{where}: {error}"

    if _cause(exc, _named("NoCredentialsError", "PartialCredentialsError")):
        text = f"no credentials to access {remote}: {_CREDENTIALS} (-o anon=true for a public bucket)"
    elif cause := _cause(exc, _unreachable) or _cause(exc, _named("ConnectionError")):
        reason = str(cause).removesuffix(f"; {CHECK_ENDPOINT}")  # the fix for Python callers
        text = f"cannot connect to the server: {about(reason)}; {_connection_fix(stores)}"
    elif isinstance(exc, StoreExistsError):  # its advice (existsok=True) is for Python callers
        destination = stores[-1].redacted() if stores else where  # DST, or the command's URL
        text = (f"{destination} already exists and holds a zstore buffer: choose another "
                "destination, or delete it first")
    elif isinstance(exc, ZStoreError) or (isinstance(exc, ImportError)
                                          and "pip install" in str(exc)):
        text = str(exc)  # (a missing extra: the error names it)
    elif (cause := _cause(exc, _denied)) and (local := _refused_locally(cause, stores)):
        # errors.folder_not_writable's (it names the folder, the file and the fix: kept, less
        # the Python-only option), or the OS's (a bare errno, maybe under advice for S3)
        own = str(cause).endswith(OPEN_READ_ONLY)
        denied = None if own else _cause(cause, lambda error: bool(getattr(error, "filename", None)))
        refusal = (f"permission denied on {denied.filename}" if denied
                   else str(cause).removesuffix(OPEN_READ_ONLY))
        text = f"access denied: {about(refusal)}" + ("" if own else (
            f"; check the permissions of {local.url} and of the files in it (chmod -R u+rwX "
            f"{local.url} gives its owner access)"))
    elif cause:  # an S3 server's, in the CLI's words, not those for Python callers
        refusal = str(cause).removesuffix(f"; {CHECK_CREDENTIALS}")
        text = (f"access denied: {about(refusal)}; check the credentials and the bucket's policy; "
                f"for other credentials, {_CREDENTIALS}")
    elif isinstance(exc, FileNotFoundError):
        text = f"not found: {about(exc)}"
    elif isinstance(exc, OSError):
        text = about(exc)
    else:
        text = f"{type(exc).__name__}: {about(exc)} (unexpected: `{PROG} --debug ...` shows where)"
    return " ".join(text.split())


# -- entry point ----------------------------------------------------------------------------

def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``zstore`` parser with one subparser per entry of :data:`COMMANDS`; with ``only``,
    the arguments of that command alone are declared (another's may import torch)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="zstore: TorchRL replay-buffer storages on Zarr v3 at any "
                               "fsspec URL.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    debug = {"action": "store_true", "help": "on an error, print the traceback too"}
    parser.add_argument("--debug", **debug)
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND",
                                required=True)
    for command in COMMANDS.values():
        child = sub.add_parser(command.name, help=command.help,
                               description=command.description or command.help)
        if only in (None, command.name):
            command.add_arguments(child)
        child.add_argument("--debug", default=argparse.SUPPRESS, **debug)  # keeps `zstore --debug CMD`
        child.set_defaults(_command=command, _parser=child)
    return parser


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``zstore`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit, where a reader gone (`| head`) cannot be caught
        return code
    except BrokenPipeError:  # the reader of stdout left (`zstore info URL | head`): not an error
        _discard_stdout()
        return 0
    except KeyboardInterrupt:  # while parsing too (a command's arguments may import torch)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _discard_stdout() -> None:
    """Point stdout at the null device, so that the output still buffered for a reader that
    left is dropped at exit instead of raising ``BrokenPipeError`` there."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _run(argv: Sequence[str] | None) -> int:
    """Parse ``argv`` and run its command; the exit code (a failure is one line on stderr;
    a Ctrl-C and a reader of stdout gone are :func:`main`'s)."""
    argv_given = argv
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((arg for arg in argv if not arg.startswith("-")), "")  # no option takes a value
    try:
        args = build_parser(only=chosen).parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return _exit_code(exc)
    try:
        code = args._command.run(args)
        if argv_given is None:  # the program: its work is done and reported, so a Ctrl-C
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # now must not end it as killed
        return code
    except UsageError as exc:
        args._parser.print_usage(sys.stderr)
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # main's: not a failure of the command
    except Exception as exc:  # noqa: BLE001 - every failure is one line, --debug adds the traceback
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: error: {error_message(exc, args)}", file=sys.stderr)
        return 1

if __name__ == "__main__":
    sys.exit(main())
