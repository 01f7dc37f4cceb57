"""A small replay buffer for users without TorchRL: a storage, a writer and a sampler.

It does what a training loop needs — ``add``, ``extend``, ``sample``, ``len``,
``dumps``/``loads``, and drawing the next batches ahead so that their chunks
load while the caller trains — and nothing more (no transforms or priorities).
With TorchRL installed, use its buffers over ``zstore.torchrl`` storages instead.
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any

import torch
from tensordict import is_tensor_collection

from .errors import FormatVersionError, StoreNotFoundError
from .samplers import RandomSampler, Sampler
from .storages import Storage, StorageEnsemble, stack_items
from .store import StoreSpec
from .writers import RoundRobinWriter, Writer

#: File written next to the storage's checkpoint by :meth:`ReplayBuffer.dumps`.
BUFFER_FILE = "buffer.json"
_FORMAT = {"name": "zstore-replay-buffer", "version": 1}


def _storage_spec(spec: StoreSpec) -> StoreSpec:
    """Where :meth:`ReplayBuffer.dumps` saves the storage of a save at ``spec``: its
    ``storage`` folder, with the same storage options."""
    return StoreSpec(f"{spec.url}/storage", dict(spec.storage_options))


def _collate(items: Any) -> Any:
    """A list of tensors / TensorDicts becomes one batch; anything else is returned as is."""
    if isinstance(items, list) and items and all(
            isinstance(x, torch.Tensor) or is_tensor_collection(x) for x in items):
        return stack_items(items)
    return items


class ReplayBuffer:
    """A storage, a writer (where items go) and a sampler (which rows a batch reads).

    Args:
        storage: any zstore storage but a :class:`~zstore.StorageEnsemble` (a
            :class:`~zstore.LazyMemmapStorage` at a URL makes the buffer persistent).
        sampler: default :class:`~zstore.RandomSampler`; :class:`~zstore.SliceSampler`
            for trajectory windows.
        writer: default :class:`~zstore.RoundRobinWriter` (a ring buffer; it continues
            after the last cursor of a reopened storage);
            :class:`~zstore.ImmutableDatasetWriter` for read-only datasets.
        batch_size: the default of :meth:`sample`.
        prefetch: batches drawn ahead. After each :meth:`sample`, the indices of
            the next ``prefetch`` batches are drawn and their rows made ready in
            the background (``storage.prefetch``: chunks loaded into the cache,
            or a memory-mapped buffer's pages read from the disk) while the
            caller trains. A write to the buffer discards the drawn batches, so
            every batch is drawn from the buffer as it is when sampled; a call
            with another batch size or a ``generator`` draws afresh. Needs a
            storage with ``prefetch`` (:class:`~zstore.LazyMemmapStorage`, a
            :class:`~zstore.dataset.Dataset`).

    >>> rb = ReplayBuffer(zstore.LazyTensorStorage(100), batch_size=4)
    >>> _ = rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
    >>> len(rb), rb.sample()["obs"].shape
    (10, torch.Size([4]))
    """

    def __init__(self, storage: Storage, sampler: Sampler | None = None,
                 writer: Writer | None = None, batch_size: int | None = None,
                 prefetch: int = 0):
        if not isinstance(storage, Storage):
            raise TypeError(f"storage must be a zstore storage, got {type(storage).__name__}")
        if isinstance(storage, StorageEnsemble):
            raise TypeError(
                f"a {type(storage).__name__} cannot back a zstore.ReplayBuffer: its len() counts "
                "members and its get() takes {'buffer_ids', 'index'}, while the samplers draw "
                "row indices. Use TorchRL's ReplayBufferEnsemble over zstore.torchrl storages, "
                "or one zstore.ReplayBuffer per member (ensemble[i])")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"prefetch must be a number of batches (an int >= 0), "
                             f"got {prefetch!r}")
        if prefetch and not callable(getattr(storage, "prefetch", None)):
            raise ValueError(f"prefetch={prefetch} needs a storage that loads rows ahead "
                             f"(LazyMemmapStorage, a Dataset); a {type(storage).__name__} "
                             "reads its items from memory")
        self.storage = storage
        self.sampler = sampler if sampler is not None else RandomSampler()
        self.writer = writer if writer is not None else RoundRobinWriter()
        self.writer.register_storage(storage)
        self.batch_size = batch_size
        self.prefetch = prefetch
        #: batches drawn ahead: (storage revision when drawn, batch size, index)
        self._ahead: deque[tuple[int, int, Any]] = deque()

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
        index = None if generator is not None else self._drawn_ahead(batch_size)
        if index is None:
            index = self.sampler.sample(self.storage, batch_size, generator)
        batch = _collate(self.storage.get(index))
        if generator is None:
            self._draw_ahead(batch_size)
        return (batch, {"index": index}) if return_info else batch

    def _drawn_ahead(self, batch_size: int) -> Any:
        """The next batch drawn ahead, if it still fits (no write since, same size)."""
        if self._ahead:
            revision, size, index = self._ahead.popleft()
            if revision == self.storage._mutation_revision and size == batch_size:
                return index
            self._ahead.clear()
        return None

    def _draw_ahead(self, batch_size: int) -> None:
        """Draw batches up to :attr:`prefetch` ahead and start getting their rows ready.

        A draw that fails stops the drawing: the next :meth:`sample` that draws
        raises it again, from the call the batch belongs to."""
        while len(self._ahead) < self.prefetch:
            try:
                index = self.sampler.sample(self.storage, batch_size)
            except Exception:  # noqa: BLE001 - the next sample() that draws raises it again
                return
            self._ahead.append((self.storage._mutation_revision, batch_size, index))
            self.storage.prefetch(index[0] if isinstance(index, tuple) else index,
                                  background=True)

    # -- checkpoints ------------------------------------------------------------------------
    def dumps(self, path: str | os.PathLike | StoreSpec) -> None:
        """Save the storage at ``path/storage`` (``storage.dumps``), then the writer's state
        and ``batch_size`` in ``path/buffer.json``. That file is removed first and written
        last, so :meth:`loads` refuses a save cut short instead of loading it half old; a
        save replaces the one before it as it begins (alternate two paths to keep a whole
        one meanwhile). ``path``: a local path, an fsspec URL, or a
        :class:`~zstore.StoreSpec` (a URL with its storage options)."""
        spec = StoreSpec.parse(path)
        fs, root = spec.filesystem()
        try:
            fs.rm_file(f"{root}/{BUFFER_FILE}")
        except FileNotFoundError:
            pass
        self.storage.dumps(_storage_spec(spec))
        fs.makedirs(root, exist_ok=True)
        state = {**_FORMAT, "writer": self.writer.state_dict(), "batch_size": self.batch_size}
        fs.pipe_file(f"{root}/{BUFFER_FILE}", json.dumps(state).encode())

    def loads(self, path: str | os.PathLike | StoreSpec) -> None:
        """Restore what :meth:`dumps` saved at ``path``: the storage, the writer's state and
        ``batch_size`` (the saved one replaces the buffer's, as in TorchRL's ``loads``)."""
        spec = StoreSpec.parse(path)
        fs, root = spec.filesystem()
        try:
            state = json.loads(fs.cat_file(f"{root}/{BUFFER_FILE}"))
        except FileNotFoundError:
            if _storage_spec(spec).exists():
                raise StoreNotFoundError(
                    f"the replay buffer saved at {spec.redacted()} is incomplete: its save was "
                    f"cut short ({BUFFER_FILE}, written last, is missing); save it again, or "
                    "load an intact copy") from None
            raise StoreNotFoundError(f"no replay buffer saved at {spec.redacted()} "
                                     f"({BUFFER_FILE} is missing)") from None
        if state.get("name") != _FORMAT["name"] or state.get("version", 0) > _FORMAT["version"]:
            raise FormatVersionError(f"{spec.redacted()}/{BUFFER_FILE} is not a replay buffer this "
                                     f"zstore reads ({state.get('name')!r} version "
                                     f"{state.get('version')!r})")
        self.storage.loads(_storage_spec(spec))
        self.writer.load_state_dict(state["writer"])
        self.batch_size = state.get("batch_size", self.batch_size)

    def __repr__(self) -> str:
        storage = repr(self.storage).replace("\n", "\n    ")
        return (f"ReplayBuffer(\n    storage={storage},\n    sampler={self.sampler!r},\n"
                f"    writer={self.writer!r},\n    batch_size={self.batch_size},\n"
                f"    prefetch={self.prefetch})")
