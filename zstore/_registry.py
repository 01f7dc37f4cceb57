"""Lazy name -> class lookup for checkpointers (no import of ``checkpoint`` at import time).

``zstore.storages`` must not import the ``checkpoint`` package when it is
imported (``checkpoint`` imports ``zstore``). Storages name their default
checkpointer; the class is looked up here the first time one is needed.
"""

from __future__ import annotations

import importlib
from typing import Any


def make_checkpointer(name: str) -> Any:
    """Instantiate the checkpointer class ``name`` from the ``checkpoint`` package."""
    module = importlib.import_module("checkpoint")
    try:
        cls = getattr(module, name)
    except AttributeError:
        raise NotImplementedError(
            f"checkpointer {name!r} is not available in this version of zstore; "
            "use the storage's flush() and zstore.open(url) to persist and reopen it"
        ) from None
    return cls()
