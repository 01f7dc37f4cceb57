"""What a ``dumps`` call did, returned to the caller (TorchRL's dumps return nothing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class DumpResult:
    """The outcome of one ``storage.dumps(dest)``.

    Attributes:
        url: the destination (credentials never included).
        checkpointer: the checkpointer class that wrote it.
        generation: the committed generation's name (None for an H5 file).
        incremental: whether unchanged chunks were carried over from the previous dump.
        bytes_written: bytes sent to the store by this process (carried-over chunks excluded).
        length: the storage's length at the dump.
        seconds: wall time of the whole dump, commit included.
        members: one result per non-empty member of a StorageEnsemble, by member index.
    """

    url: str
    checkpointer: str
    generation: str | None
    incremental: bool
    bytes_written: int
    length: int
    seconds: float
    members: Mapping[int, DumpResult] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, url: str, record: Mapping[str, Any], seconds: float) -> DumpResult:
        """The result of a dump that committed ``record`` at ``url``."""
        return cls(url=url, checkpointer=str(record["checkpointer"]),
                   generation=record.get("generation"),
                   incremental=bool(record.get("incremental", False)),
                   bytes_written=int(record.get("bytes_written", 0)),
                   length=int(record.get("length", 0)), seconds=seconds)

    def __str__(self) -> str:
        from zstore.display import format_bytes

        kind = "incremental" if self.incremental else "full"
        return (f"{self.checkpointer}: {kind} dump of {self.length} items to {self.url}, "
                f"{format_bytes(self.bytes_written)} written in {self.seconds:.2f} s")
