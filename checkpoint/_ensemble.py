"""StorageEnsembleCheckpointer: every member of a StorageEnsemble under one atomic commit.

Works with any ensemble exposing ``_storages`` (TorchRL's attribute; zstore's
``StorageEnsemble`` keeps it). Member ``i`` is staged in ``member-<i>/`` with its
own checkpointer (a new generation, uncommitted); the ensemble's commit record
then names every member's generation at once, and only after it each member's
own commit record is updated and its old generations deleted. A crash at any
point leaves the previous ensemble checkpoint loadable, and tensor members dump
incrementally. Empty members are recorded as such (TorchRL's
``empty_members``) and emptied on load. Transforms are not saved (TorchRL
pickles them; zstore never pickles into a store).
"""

from __future__ import annotations

import time
from typing import Any

from ._base import _Configured
from ._dest import CheckpointError, Destination
from ._result import DumpResult

MEMBER = "member-"


def _members(storage: Any) -> list:
    members = getattr(storage, "_storages", None)
    if members is None:
        raise TypeError(f"{type(storage).__name__} is not a StorageEnsemble (no _storages)")
    return list(members)


def _is_empty(member: Any) -> bool:
    return (hasattr(member, "initialized") and not member.initialized) or len(member) == 0


class StorageEnsembleCheckpointer(_Configured):
    """Checkpoints of a StorageEnsemble: one sub-destination per member, one commit."""

    def dumps(self, storage: Any, path: Any) -> DumpResult:
        start = time.perf_counter()
        dest = self._dest(path)
        dest.check_writable(allowed=(MEMBER,))
        members = _members(storage)
        records, empty = {}, []
        for i, member in enumerate(members):
            if _is_empty(member):
                empty.append(i)
                continue
            ckpt = member.checkpointer
            if not hasattr(ckpt, "_stage"):
                raise CheckpointError(f"member {i} ({type(member).__name__}) uses "
                                      f"{type(ckpt).__name__}, which cannot join an ensemble checkpoint")
            sub = Destination(dest.child(f"{MEMBER}{i}"))
            records[str(i)] = ckpt._stage(member, sub)
        gen = dest.new_generation()
        dest.commit({"checkpointer": type(self).__name__, "form": "ensemble", "generation": gen,
                     "members": len(members), "empty_members": empty, "records": records})
        for i, record in records.items():
            members[int(i)].checkpointer._finish(members[int(i)], Destination(
                dest.child(f"{MEMBER}{i}")), record)
        for name in dest.children():
            if name.startswith(MEMBER) and name[len(MEMBER):] not in records:
                dest.remove(name)
        seconds = time.perf_counter() - start
        results = {int(i): DumpResult.of(Destination(dest.child(f"{MEMBER}{i}")).redacted(),
                                         record, seconds) for i, record in records.items()}
        return DumpResult(url=dest.redacted(), checkpointer=type(self).__name__, generation=gen,
                          incremental=bool(results) and all(r.incremental for r in results.values()),
                          bytes_written=sum(r.bytes_written for r in results.values()),
                          length=len(storage), seconds=seconds, members=results)

    def loads(self, storage: Any, path: Any) -> None:
        dest = self._dest(path)
        record = dest.read_commit()
        if record is None or record.get("form") != "ensemble":
            raise CheckpointError(f"no committed StorageEnsemble checkpoint at {dest.redacted()}")
        members = _members(storage)
        if int(record["members"]) != len(members):
            raise CheckpointError(f"{dest.redacted()} holds {record['members']} members; this "
                                  f"ensemble has {len(members)}")
        loads = []  # every member checked before the first is touched: none half loaded
        for i, member in enumerate(members):
            if i in record["empty_members"]:
                continue
            ckpt = member.checkpointer
            if not hasattr(ckpt, "_check_record"):
                raise CheckpointError(f"member {i} ({type(member).__name__}) uses "
                                      f"{type(ckpt).__name__}, which cannot load an ensemble "
                                      "checkpoint; nothing was loaded")
            sub = Destination(dest.child(f"{MEMBER}{i}"))
            try:
                ckpt._check_record(member, sub, record["records"][str(i)])
            except CheckpointError as exc:
                raise CheckpointError(f"member {i}: {exc}; nothing was loaded") from None
            loads.append((member, sub, record["records"][str(i)]))
        for i in record["empty_members"]:
            members[i]._empty()  # TorchRL's name (its StorageEnsembleCheckpointer calls it too)
        for member, sub, member_record in loads:
            member.checkpointer._load_record(member, sub, member_record)
            member.checkpoint_loaded()
