"""A small replay buffer for users without TorchRL: a storage, a writer and a sampler.

It does what a training loop needs — ``add``, ``extend``, ``sample``, ``len``,
``dumps``/``loads`` — and nothing more (no transforms, priorities or
prefetch threads). With TorchRL installed, use its buffers over
``zstore.torchrl`` storages instead.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tensordict import is_tensor_collection

from .errors import FormatVersionError, StoreNotFoundError
from .samplers import RandomSampler, Sampler
from .storages import Storage, stack_items
from .store import StoreSpec
from .writers import RoundRobinWriter, Writer

#: File written next to the storage's checkpoint by :meth:`ReplayBuffer.dumps`.
BUFFER_FILE = "buffer.json"
_FORMAT = {"name": "zstore-replay-buffer", "version": 1}


def _collate(items: Any) -> Any:
    """A list of tensors / TensorDicts becomes one batch; anything else is returned as is."""
    if isinstance(items, list) and items and all(
            isinstance(x, torch.Tensor) or is_tensor_collection(x) for x in items):
        return stack_items(items)
    return items


class ReplayBuffer:
    """A storage, a writer (where items go) and a sampler (which rows a batch reads).

    Args:
        storage: any zstore storage (a :class:`~zstore.LazyMemmapStorage` at a URL
            makes the buffer persistent).
        sampler: default :class:`~zstore.RandomSampler`; :class:`~zstore.SliceSampler`
            for trajectory windows.
        writer: default :class:`~zstore.RoundRobinWriter` (a ring buffer; it continues
            after the last cursor of a reopened storage);
            :class:`~zstore.ImmutableDatasetWriter` for read-only datasets.
        batch_size: the default of :meth:`sample`.

    >>> rb = ReplayBuffer(zstore.LazyTensorStorage(100), batch_size=4)
    >>> _ = rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
    >>> len(rb), rb.sample()["obs"].shape
    (10, torch.Size([4]))
    """

    def __init__(self, storage: Storage, sampler: Sampler | None = None,
                 writer: Writer | None = None, batch_size: int | None = None):
        if not isinstance(storage, Storage):
            raise TypeError(f"storage must be a zstore storage, got {type(storage).__name__}")
        self.storage = storage
        self.sampler = sampler if sampler is not None else RandomSampler()
        self.writer = writer if writer is not None else RoundRobinWriter()
        self.writer.register_storage(storage)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.storage)

    def __getitem__(self, index: Any) -> Any:
        return _collate(self.storage[index])

    def add(self, data: Any) -> Any:
        """Write one item; returns its index."""
        return self._write(self.writer.add, data)

    def extend(self, data: Any) -> Any:
        """Write a batch (its first dim indexes the items); returns their indices."""
        return self._write(self.writer.extend, data)

    def _write(self, write, data: Any) -> Any:
        revision = self.storage._mutation_revision
        index = write(data)
        if self.storage.ndim == 1:
            self.sampler.mark_update(index, data, self.storage, revision)
        return index

    def sample(self, batch_size: int | None = None, *, generator: torch.Generator | None = None,
               return_info: bool = False) -> Any:
        """A batch of ``batch_size`` items (default: the buffer's), drawn by the sampler.

        ``generator`` makes the draw reproducible; with ``return_info=True`` the
        result is ``(batch, {"index": indices})``.
        """
        batch_size = self.batch_size if batch_size is None else batch_size
        if batch_size is None:
            raise ValueError("batch_size was given neither to sample() nor to the ReplayBuffer")
        index = self.sampler.sample(self.storage, batch_size, generator)
        batch = _collate(self.storage.get(index))
        return (batch, {"index": index}) if return_info else batch

    # -- checkpoints ------------------------------------------------------------------------
    def dumps(self, path: str | os.PathLike) -> None:
        """Save the storage (``storage.dumps(path/storage)``), then the writer's state in
        ``path/buffer.json`` — written last, so a partial save is never loaded."""
        spec = StoreSpec.parse(path)
        self.storage.dumps(f"{spec.url}/storage")
        fs, root = spec.filesystem()
        fs.makedirs(root, exist_ok=True)
        state = {**_FORMAT, "writer": self.writer.state_dict(), "batch_size": self.batch_size}
        fs.pipe_file(f"{root}/{BUFFER_FILE}", json.dumps(state).encode())

    def loads(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`dumps` saved at ``path``."""
        spec = StoreSpec.parse(path)
        fs, root = spec.filesystem()
        try:
            state = json.loads(fs.cat_file(f"{root}/{BUFFER_FILE}"))
        except FileNotFoundError:
            raise StoreNotFoundError(f"no replay buffer saved at {spec.url} "
                                     f"({BUFFER_FILE} is missing)") from None
        if state.get("name") != _FORMAT["name"] or state.get("version", 0) > _FORMAT["version"]:
            raise FormatVersionError(f"{spec.url}/{BUFFER_FILE} is not a replay buffer this "
                                     f"zstore reads ({state.get('name')!r} version "
                                     f"{state.get('version')!r})")
        self.storage.loads(f"{spec.url}/storage")
        self.writer.load_state_dict(state["writer"])

    def __repr__(self) -> str:
        storage = repr(self.storage).replace("\n", "\n    ")
        return (f"ReplayBuffer(\n    storage={storage},\n    sampler={self.sampler!r},\n"
                f"    writer={self.writer!r},\n    batch_size={self.batch_size})")
