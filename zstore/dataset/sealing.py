"""``zstore.seal(url)``: open the buffer at a URL and seal it into a published dataset.

The seal itself (flush, episode index, consolidated metadata, commit last) is
:func:`zstore.storages.sealing.seal_storage`, which ``LazyMemmapStorage.seal()``
runs too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..api import open as open_buffer
from ..errors import NotAZStoreError
from ..storages.memmap import LazyMemmapStorage
from ..storages.sealing import seal_storage


def seal(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> int:
    """Seal the buffer at ``url`` into a published dataset; returns its number of episodes.

    >>> zstore.seal("s3://bucket/run-1/rb", {"endpoint_url": "http://127.0.0.1:9000"})  # doctest: +SKIP
    """
    storage = open_buffer(url, storage_options, mode="r+")
    if not isinstance(storage, LazyMemmapStorage):
        raise NotAZStoreError(
            f"cannot seal {storage.spec.redacted()}: it holds a {type(storage).__name__}; "
            "only LazyMemmapStorage buffers become datasets")
    try:
        return seal_storage(storage)
    finally:
        storage.close()
