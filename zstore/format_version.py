"""The version of zstore's on-store format, and the check every reader of a ``zstore`` block runs.

Torch-free, so that ``zstore info`` reads a buffer's metadata without importing torch.
"""

from __future__ import annotations

from typing import Any, Mapping

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
