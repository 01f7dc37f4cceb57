"""The version of zstore's on-store format, the check every reader of a ``zstore`` block runs,
and the refusal to write over fields a newer zstore added.

Torch-free, so that ``zstore info`` reads a buffer's metadata without importing torch.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

from .errors import FormatVersionError, NotAZStoreError

#: The format of a store whose commit lists no log segments (every format-1 reader reads it).
FORMAT_VERSION = 1
#: The format of a buffer while its commit lists log segments (``tail``, :mod:`zstore.tail`):
#: a format-1 reader would miss those rows, so it must refuse the store. The newest read here.
TAIL_FORMAT_VERSION = 2


def check_format_version(block: Mapping[str, Any], where: str) -> None:
    """Refuse a ``zstore`` block without a valid ``format_version``, or from a newer zstore."""
    version = block.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise NotAZStoreError(f"{where}: the 'zstore' block has no valid format_version "
                              f"(got {version!r})")
    if version > TAIL_FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} was written in zstore format v{version}; this zstore reads up to "
            f"v{TAIL_FORMAT_VERSION}: upgrade zstore (pip install -U zstore)")


def unknown_fields(block: Mapping[str, Any], known: Collection[str], prefix: str = "") -> list[str]:
    """The fields of ``block`` outside ``known`` (``prefix`` before each name): fields a
    newer zstore added, which the format grows by without a new version (format.md §5)."""
    return [prefix + name for name in sorted(set(block) - set(known))]


def refuse_newer_fields(unknown: list[str], where: str) -> None:
    """Refuse writing where a newer zstore recorded fields this one does not know: a commit
    rewrites the block from the fields it knows, and would drop those for good."""
    if unknown:
        raise FormatVersionError(
            f"{where} holds metadata this zstore does not know ({', '.join(unknown)}): a newer "
            "zstore wrote it, and a write from this one would drop it. Open it read-only "
            "(zstore.open(url, mode='r')), or upgrade zstore (pip install -U zstore) to write")
