"""The rows of an in-RAM ``LazyTensorStorage(shared_init=True)``: files every process maps.

TorchRL's ``shared_init`` lets processes that were handed a storage before its first
write share it: the first one to write allocates the rows, the others open them. Memory
allocated after a process started cannot be handed to it, so the rows are memory-mapped
files in a directory named before the processes start: one raw file per key
(``<i>.bin``, native byte order), and ``rows.json``, which describes them as the key
paths, dtypes and shapes of a :class:`zstore.layout.Schema` (JSON; nothing is pickled).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from tensordict import MemoryMappedTensor

from ..layout import Schema

DESCRIPTION = "rows.json"


def create_shared_rows(directory: str, example: Any, ndim: int, rows: int, max_size: int,
                       device: Any) -> Any:
    """Allocate ``rows`` rows like ``example`` as files in ``directory``; the container
    (a tensor, TensorDict, tensorclass or pytree) whose leaves map them. The description is
    written last, atomically: a process that opens the rows finds every file."""
    schema = Schema.from_example(example, ndim)
    columns = {leaf.path: MemoryMappedTensor.empty((rows, *leaf.shape), dtype=leaf.dtype,
                                                   filename=Path(directory, f"{i}.bin"))
               for i, leaf in enumerate(schema.leaves)}
    description = {"rows": rows, "max_size": max_size, "schema": schema.to_json()}
    staged = Path(directory, f".{DESCRIPTION}.{os.getpid()}")
    staged.write_text(json.dumps(description))
    os.replace(staged, Path(directory, DESCRIPTION))
    return schema.build(columns, (rows, *schema.lane_shape), _cpu(device))


def open_shared_rows(directory: str, device: Any, tensorclass: type | None) -> tuple[Any, int]:
    """The container that another process created in ``directory``, and its ``max_size``
    (rounded up to whole rows for ``ndim > 1``). A tensorclass comes back as ``tensorclass``
    when the caller knows it (a process that writes one), else as a TensorDict."""
    description = json.loads(Path(directory, DESCRIPTION).read_text())
    schema = Schema.from_json(description["schema"])
    schema.tensorclass = tensorclass
    rows = int(description["rows"])
    columns = {leaf.path: MemoryMappedTensor.from_filename(
        Path(directory, f"{i}.bin"), dtype=leaf.dtype, shape=torch.Size((rows, *leaf.shape)))
        for i, leaf in enumerate(schema.leaves)}
    return (schema.build(columns, (rows, *schema.lane_shape), _cpu(device)),
            int(description["max_size"]))


def _cpu(device: Any) -> Any:
    return None if device in (None, "auto") else torch.device(device)
