"""A commit of a store's ``zarr.json`` rebased on the version that replaced the one it read.

A writer replaces ``zarr.json`` only if it is still the version it last read or wrote
(:mod:`zstore.lease`). When it is not, and the writer still holds the store's lease, no
other writer committed: another hand wrote it, e.g. a user's attribute set with plain Zarr
(``group.attrs["note"] = ...``), which rewrites the whole ``zarr.json`` from the copy its
handle read (maybe before the writer's last commit), or ``zarr.consolidate_metadata``.
The commit is then applied on top of that version: the writer's own attributes (its
``zstore`` block, its name) and the other fields it changed are its, the rest is theirs.
JSON only, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

_ABSENT = object()


def rebased(base: bytes, mine: bytes, theirs: bytes, owned: Iterable[str]) -> bytes | None:
    """``mine`` (a commit made over ``base``) applied on ``theirs`` (what replaced ``base``):
    the ``zarr.json`` to store instead, its ``owned`` attributes ``mine``'s; ``None`` when
    one of them is no JSON object."""
    try:
        old, new, current = (json.loads(doc) for doc in (base, mine, theirs))
    except ValueError:
        return None
    if not all(isinstance(doc, dict) for doc in (old, new, current)):
        return None
    owned = set(owned)
    new_attrs = new.get("attributes") or {}
    attributes = {key: value for key, value in (current.get("attributes") or {}).items()
                  if key not in owned}
    attributes.update({key: new_attrs[key] for key in owned if key in new_attrs})
    merged: dict[str, Any] = dict(current)
    for key in set(old) | set(new):  # the other fields this commit changes are its
        if key != "attributes" and old.get(key, _ABSENT) != new.get(key, _ABSENT):
            if key in new:
                merged[key] = new[key]
            else:
                merged.pop(key, None)
    merged["attributes"] = attributes
    return json.dumps(merged).encode()
