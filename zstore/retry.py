"""Bounded retry with exponential backoff for zstore's own remote reads.

What already retries (measured with ``tests/faultproxy.py`` on moto): s3fs
and botocore retry throttling (503 ``SlowDown``), 500s, connection resets and
bodies cut short by a dropped connection, for every request — reads, chunk
writes and the commit (``retries`` / ``config_kwargs={"retries": ...}`` in
``storage_options`` bound them). What they cannot see is a body that arrives
complete by its headers but damaged (a truncating middlebox, a flipped bit):
zstore detects it when decoding (size, codec, crc32c) and retries the read here
a bounded number of times before raising the :class:`~zstore.errors.CorruptChunkError`
that names the key and chunk. Writes are not retried here: a failed write
raises, and no commit follows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Attempts of a remote read whose payload failed to decode (1 = no retry).
READ_ATTEMPTS = 3
#: First backoff in seconds; doubled after each failed attempt.
BASE_DELAY = 0.05


def with_retries(call: Callable[[], T],
                 retry_on: type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool],
                 attempts: int = READ_ATTEMPTS, base_delay: float = BASE_DELAY) -> T:
    """``call()``, repeated after ``base_delay * 2**i`` s while it raises ``retry_on`` (exception
    types, or a predicate of the exception).

    The last attempt's exception propagates unchanged (it names the object).
    """
    wanted = (lambda exc: isinstance(exc, retry_on)) if isinstance(retry_on, (tuple, type)) \
        else retry_on
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:
            if attempt == attempts - 1 or not wanted(exc):
                raise
            time.sleep(base_delay * 2 ** attempt)
    raise ValueError(f"attempts must be >= 1, got {attempts}")
