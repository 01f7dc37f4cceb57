"""ListStorage and LazyStackStorage: Python lists of arbitrary items (SPEC §2.2, §2.3)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection, lazy_stack
from torch.utils._pytree import tree_map

from ..display import KeyRow, Summary, dtype_name, item_note, tensor_leaves
from .base import Storage, refuse_spawn_sharing

_INT_TYPES = (int, np.integer)


def _as_int(cursor: Any) -> int | None:
    """``cursor`` as one int (a bool is one, as in TorchRL), else ``None``."""
    if isinstance(cursor, _INT_TYPES):
        return int(cursor)
    if isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0:
        return int(cursor)
    return None


def _is_mask(index: Any) -> bool:
    """Whether ``index`` is a boolean mask: a bool tensor or array, or a list of bools."""
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, np.ndarray):
        return index.dtype == np.bool_
    return isinstance(index, list) and bool(index) and all(
        isinstance(flag, (bool, np.bool_)) for flag in index)


def _flagged(mask: Any, n: int) -> list[int]:
    """The positions a 1-D boolean ``mask`` (:func:`_is_mask`) flags among ``n`` items;
    ``IndexError`` unless it holds one flag per item."""
    flags = mask.tolist() if isinstance(mask, (torch.Tensor, np.ndarray)) else mask
    if np.ndim(flags) != 1 or len(flags) != n:
        held = f"{len(flags)} flags" if np.ndim(flags) == 1 else f"shape {np.shape(flags)}"
        raise IndexError(f"a boolean mask of {held} cannot index a storage of {n} items: "
                         "give one flag per item")
    return [i for i, flag in enumerate(flags) if flag]


def _positions(index: Any, n: int) -> list[int]:
    """The item positions a list, range, tensor or array ``index`` names among ``n`` items;
    a boolean mask (one flag per item) names those it flags, as in a tensor storage."""
    if isinstance(index, (torch.Tensor, np.ndarray)) and index.ndim != 1:
        raise IndexError(f"a list storage takes a 1-D index, got one of shape {tuple(index.shape)}: "
                         "flatten it (index.reshape(-1)) and reshape the items")
    if _is_mask(index):
        return _flagged(index, n)
    positions = index.tolist() if isinstance(index, (torch.Tensor, np.ndarray)) else index
    try:
        return [operator.index(i) for i in positions]
    except TypeError:
        raise TypeError(f"a list storage takes integer indices, got {index!r}: cast it "
                        "(index.long()) where it holds whole numbers") from None


def _check_in_range(positions: list[int], n: int) -> None:
    """Raise ``IndexError`` naming the first of ``positions`` that ``n`` items do not hold."""
    for position in positions:
        if not -n <= position < n:
            held = f"holds {n} items (indices {-n} to {n - 1})" if n else "is empty"
            raise IndexError(f"index {position} is out of range: the storage {held}")


def checked_positions(positions: Any, length: int, max_size: int) -> list[int]:
    """The item positions of one write to ``length`` items, all checked before any is
    written, each as TorchRL's list storages check one (an append at most one item past
    the end, within ``max_size``; a negative position counts from the end), counting the
    appends before it in the same write. Negative positions come back from the start."""
    checked, n = [], length
    for position in positions:
        position = int(position)
        if position > n:
            before = f", after the {n - length} this write appends first" if n > length else ""
            raise RuntimeError(
                "Cannot append data located more than one item away from the storage size: "
                f"the storage size is {length}{before}, and the index of the item to be set is "
                f"{position}; nothing was written. (After a write this storage refused, "
                "TorchRL's writers have moved past the items it did not store; "
                "zstore.torchrl.RoundRobinWriter moves only once a write is stored.)")
        if position >= max_size:
            raise RuntimeError(
                f"Cannot append data to the list storage: maximum capacity is {max_size} "
                f"and the index of the item to be set is {position}; nothing was written.")
        if position < 0:
            if position < -n:
                raise IndexError(f"Index {position} out of bounds or not set")
            position += n
        n += position == n
        checked.append(position)
    return checked


def refuse_unpaired(positions: list, data: Any) -> None:
    """Refuse a write of a number of items other than its positions, before any is written
    (``ValueError``, as the ``zip(strict=True)`` that pairs them)."""
    if len(positions) != len(data):
        raise ValueError(f"zip() argument 2 is longer or shorter than argument 1: "
                         f"{len(positions)} cursors for {len(data)} items; nothing was written")


class ListStorage(Storage):
    """A storage holding items in a Python list (any object; no preallocation).

    Args:
        max_size: capacity; ``None`` means unbounded (``2**63 - 1``).
        device: items are moved there (``.to(device)``) before being stored.

    >>> s = ListStorage(3); s.set(0, "a"); s.get(0)
    'a'
    """

    _default_checkpointer = "ListStorageCheckpointer"
    _newest: int | None = None  # the item written last by a write that moves the cursor

    def __init__(self, max_size: int | None = None, *, compilable: bool = False, device: Any = None):
        if max_size is None:
            max_size = torch.iinfo(torch.int64).max
        super().__init__(max_size, compilable=compilable)
        self._storage: list = []
        self.device = torch.device(device) if device is not None and device != "auto" else device

    def __getstate__(self) -> dict[str, Any]:
        refuse_spawn_sharing(self, "Cannot share a storage of type {cls} between processes.",
                             "Its items live in this process's memory, so the new process would "
                             "write into a copy: give both processes a LazyMemmapStorage at one "
                             "URL, or write through a zstore.ray actor.")
        return super().__getstate__()

    def _move(self, item: Any) -> Any:
        if self.device is None or self.device == "auto":
            return item
        if isinstance(item, torch.Tensor) or is_tensor_collection(item):
            return item.to(self.device)
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, item)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        index = _as_int(cursor)
        if index is not None:
            if index > len(self._storage):
                raise RuntimeError(
                    "Cannot append data located more than one item away from the storage size: "
                    f"the storage size is {len(self)} and the index of the item to be set is {index}."
                )
            if index >= self.max_size:
                raise RuntimeError(
                    f"Cannot append data to the list storage: maximum capacity is {self.max_size} "
                    f"and the index of the item to be set is {index}."
                )
            data = self._move(data)
            if index == len(self._storage):
                self._storage.append(data)
            else:
                self._storage[index] = data
            if set_cursor:
                self._newest = index % len(self._storage)
            self._bump_mutation_revision()
            return
        if isinstance(cursor, slice):
            self._storage[cursor] = [self._move(x) for x in data]
            written = range(*cursor.indices(len(self._storage)))
            if set_cursor and written:
                self._newest = written[-1]
            self._bump_mutation_revision()
            return
        if not isinstance(data, (list, tuple, torch.Tensor, TensorDictBase, range, set, np.ndarray)) \
                and not is_tensor_collection(data):
            raise TypeError(
                f"Cannot extend a {type(self)} with data of type {type(data)}. Provide a list, tuple, "
                "set, range, np.ndarray, tensor or tensordict subclass instead."
            )
        if isinstance(data, set):
            data = list(data)
        positions = _positions(cursor, len(self._storage))
        refuse_unpaired(positions, data)
        positions = checked_positions(positions, len(self._storage), self.max_size)
        for index, item in zip(positions, data, strict=True):
            self.set(index, item, set_cursor=set_cursor)

    def _newest_row(self) -> int | None:
        """The item written last by a write that moves the cursor (a writer's extend), which
        zstore's samplers order a full ring by. TorchRL's list storages record no
        ``_last_cursor_index``, and neither do these: TorchRL's samplers see what they see."""
        return self._newest

    def get(self, index: Any) -> Any:
        if isinstance(index, tuple):
            if len(index) != 1:
                raise RuntimeError("ListStorage can only be indexed with one-length tuples.")
            index = index[0]
        as_int = _as_int(index)
        if as_int is not None:
            _check_in_range([as_int], len(self._storage))
            return self._storage[as_int]
        if isinstance(index, slice):
            return self._storage[index]
        positions = _positions(index, len(self._storage))
        _check_in_range(positions, len(self._storage))
        return [self._storage[i] for i in positions]

    def __len__(self) -> int:
        return len(self._storage)

    @torch.compiler.disable()
    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        """Random indices, outside compiled code (as TorchRL's): a compiled frame would guard
        the length, which changes at every write, and recompile at every step."""
        return super()._rand_given_ndim(batch_size)

    def _empty(self) -> None:
        self._storage = []
        self._newest = None
        self._bump_mutation_revision()

    def contains(self, item: Any) -> Any:
        """Whether index ``item`` (an int or a tensor of them, negative ones counted from the
        end) holds an item, as TorchRL's ``ListStorage.contains``."""
        n = len(self)
        if isinstance(item, int):
            if item < 0:
                item += n
            return 0 <= item < n
        if isinstance(item, torch.Tensor):
            wrapped = torch.where(item < 0, item + n, item)
            return (wrapped >= 0) & (wrapped < n)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    def state_dict(self) -> dict[str, Any]:
        return {"_storage": [x.state_dict() if hasattr(x, "state_dict") else x for x in self._storage]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        items = []
        for item in state_dict["_storage"]:
            if isinstance(item, torch.Tensor):
                items.append(item.clone())
            elif isinstance(item, dict):  # TensorDict.state_dict: nested keys are "a.b"
                items.append(TensorDict().load_state_dict(item, strict=False).clone())
            else:
                raise TypeError(f"Objects of type {type(item)} are not supported by "
                                "ListStorage.load_state_dict")
        self._storage = items
        self._bump_mutation_revision()

    def summary(self) -> Summary:
        """Fill, and the keys / shapes / dtypes of the first item (items may differ)."""
        base = super().summary()
        if not self._storage:
            return base
        first = self._storage[0]
        leaves = tensor_leaves(first)
        facts = () if self.device is None else (("device", str(self.device)),)
        if not leaves:
            return dataclasses.replace(base, facts=facts + (("item 0", item_note(first)),))
        rows = tuple(KeyRow(key, tuple(value.shape), dtype_name(value.dtype)) for key, value in leaves)
        return dataclasses.replace(base, rows=rows, facts=facts + (("items", "keys and shapes of item 0"),))


class LazyStackStorage(ListStorage):
    """A ListStorage whose multi-item reads come back as one lazily stacked TensorDict.

    Args:
        stack_dim: the dim along which items are stacked (negative counts from the end).
    """

    def __init__(self, max_size: int | None = None, *, compilable: bool = False,
                 stack_dim: int = 0, device: Any = None):
        super().__init__(max_size, compilable=compilable, device=device)
        self.stack_dim = stack_dim

    def get(self, index: Any) -> Any:
        out = super().get(index)
        if isinstance(out, list):
            if not out:
                raise RuntimeError(f"index {index!r} selects none of the {len(self)} items, and a lazy "
                                   "stack needs one at least: check that the selection is not empty")
            stack_dim = self.stack_dim
            if stack_dim < 0:
                stack_dim = out[0].ndim + 1 + stack_dim
            return lazy_stack(out, stack_dim)
        return out
