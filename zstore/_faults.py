"""Deterministic crash points for the crash-consistency harness (``tests/crashkit.py``).

The engine calls :func:`crash_point` at a few named *sites* on its write path.
Unarmed (the default), ``crash_point`` is a function that does nothing: one
attribute lookup and one call per chunk store or commit, never per row.
Armed with ``"<site>:<k>"`` — from the environment variable
``ZSTORE_CRASH_AT`` at import, or with :func:`arm` — the process SIGKILLs
itself the ``k``-th time it reaches ``site``: no ``finally``, no ``atexit``,
no flush, exactly what a killed writer leaves behind.

Sites (where they are called):

* ``store.before`` / ``store.unit`` / ``store.after`` — :mod:`zstore.blocks`:
  before a batch of chunk/shard objects is stored, after each one of them is
  stored (the others of the batch may still be in flight), after all.
* ``store.segment`` — :mod:`zstore.blocks`: after each log segment of a commit is
  stored (:mod:`zstore.tail`).
* ``mmap.write`` — :mod:`zstore.table`: after each column of an extend or
  scattered write landed in a memory-mapped chunk file.
* ``commit.before`` / ``commit.after`` — :mod:`zstore.group`: around the one
  metadata write that makes rows visible (also the creation's first commit); and
  :mod:`zstore.storages.compressed`: around a ``CompressedListStorage``'s root block.
* ``checkpoint.*`` — reserved for the ``checkpoint`` package (:data:`CHECKPOINT_SITES`).

With ``ZSTORE_CRASH_CENSUS=<file>`` (or :func:`census`) every site reached is
counted instead, and the counts are written as JSON at interpreter exit: the
harness's list of kill points.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
from collections import Counter

SITES = ("store.before", "store.unit", "store.segment", "store.after", "mmap.write",
         "commit.before", "commit.after")
#: Reserved for the ``checkpoint`` package: call ``crash_point(site)`` before a staged
#: checkpoint is swapped in and after; then add them to :data:`SITES`.
CHECKPOINT_SITES = ("checkpoint.before_swap", "checkpoint.after_swap")


def _off(site: str) -> None:
    """The unarmed crash point: does nothing."""


crash_point = _off
_counts: Counter = Counter()


def arm(spec: str | None) -> None:
    """Kill this process at the ``k``-th hit of ``site`` (``spec = "site:k"``); None disarms."""
    global crash_point
    _counts.clear()
    if not spec:
        crash_point = _off
        return
    site, _, k = spec.rpartition(":")
    if not site or not k.isdigit() or int(k) < 1:
        raise ValueError(f"ZSTORE_CRASH_AT must be '<site>:<k>' with k >= 1, got {spec!r}")
    target = int(k)

    def _armed(name: str) -> None:
        if name == site:
            _counts[name] += 1
            if _counts[name] == target:
                os.kill(os.getpid(), signal.SIGKILL)

    crash_point = _armed


def census(path: str) -> None:
    """Count every site reached; write ``{site: hits}`` to ``path`` at exit (or on :func:`dump`)."""
    global crash_point
    _counts.clear()

    def _count(name: str) -> None:
        _counts[name] += 1

    crash_point = _count
    atexit.register(dump, path)


def counts() -> dict[str, int]:
    """Hits per site since the last :func:`arm` / :func:`census`."""
    return dict(_counts)


def dump(path: str) -> None:
    """Write the census counts to ``path`` as JSON."""
    with open(path, "w") as handle:
        json.dump(counts(), handle)


if os.environ.get("ZSTORE_CRASH_AT"):
    arm(os.environ["ZSTORE_CRASH_AT"])
elif os.environ.get("ZSTORE_CRASH_CENSUS"):
    census(os.environ["ZSTORE_CRASH_CENSUS"])
