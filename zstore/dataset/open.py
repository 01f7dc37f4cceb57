"""Published datasets: :func:`open_dataset` and the read-only :class:`Dataset`.

A dataset is a sealed :class:`~zstore.LazyMemmapStorage` (see
:mod:`zstore.dataset.sealing`). Opening it reads one object, the root
``zarr.json`` holding the consolidated metadata of every array; the episode
index is read on first use. Every write path raises :class:`ReadOnlyError`,
and the store underneath is opened read-only as well.
"""

from __future__ import annotations

import json
import math
import operator
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import zarr
from tensordict import TensorDict
from zarr.abc.store import OffsetByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.common import ZARR_JSON
from zarr.core.group import AsyncGroup
from zarr.core.sync import sync
from zarr.errors import GroupNotFoundError, NodeNotFoundError
from zarr.storage import StorePath

from ..cache import DEFAULT_CACHE_BYTES
from ..errors import (NotAZStoreError, ReadOnlyError, ZStoreError, checkpoint_not_a,
                      sealed_dataset)
from ..group import (CHECKPOINT_ATTR, ZSTORE_ATTR, not_found, open_plain_group, read_meta,
                     store_io_error)
from ..storages import LazyMemmapStorage
from ..store import StoreSpec
from ..writers import ImmutableDatasetWriter
from ..storages.episode_index import read_index

#: TorchRL's ImmutableDatasetWriter message, kept in every refusal (SPEC §5.1).
WRITING_ERR = ImmutableDatasetWriter.WRITING_ERR


class Dataset(LazyMemmapStorage):
    """A sealed, read-only dataset: a :class:`~zstore.LazyMemmapStorage` that refuses every write.

    Sampling goes through the storage's hot-chunk cache (or memory maps for
    local raw datasets). Beyond the storage API it offers the episode index:
    :attr:`num_episodes`, :attr:`episodes`, :meth:`episode`, and
    :meth:`sample` / :meth:`sample_slices`. Open one with :func:`open_dataset`.

    Unlike TorchRL's ``ImmutableDatasetWriter`` (SPEC §9.15), which blocks only
    ``add``/``extend``/``empty``, a Dataset also refuses ``set``,
    ``__setitem__``, conditional patches, ``loads``, ``load_state_dict``,
    ``flush``, ``seal`` and ``cleanup``.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("a Dataset is opened, not created: zstore.open_dataset(url); publish a "
                        "LazyMemmapStorage with storage.seal() first")

    def _setup_runtime(self) -> None:
        super()._setup_runtime()
        self._index: TensorDict | None = None

    def _refuse(self, action: str) -> None:
        why = str(sealed_dataset(action, self.spec.redacted()))
        raise ReadOnlyError(f"{WRITING_ERR} {why[:1].upper()}{why[1:]}")

    # -- every write path refuses ---------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        self._refuse("write rows")

    def _write(self, cursor: Any, data: Any) -> None:
        self._refuse("write rows")

    def _empty(self) -> None:
        self._refuse("empty it")

    def loads(self, path: Any) -> None:
        self._refuse("load a checkpoint into it")

    load = loads

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._refuse("load a state dict into it")

    def flush(self) -> None:
        self._refuse("flush or commit")

    def seal(self) -> int:
        self._refuse("seal it again")

    def cleanup(self) -> bool:
        self._refuse("delete it")

    def close(self) -> None:
        """Release the table and cache (nothing to store)."""
        self._uncommitted = False
        super().close()

    # -- episodes -------------------------------------------------------------------------
    @property
    def episodes(self) -> TensorDict:
        """The episode index: ``start``, ``stop``, ``length``, ``return``, ``terminated``,
        ``truncated`` (and ``lane`` when ``ndim > 1``), one row per episode.

        ``rows = (start + arange(length)) % capacity_rows``; an episode with
        neither flag set is *open* (the recording stopped inside it).
        """
        if self._index is None:
            self._index = read_index(self._group, self._meta, self.spec.redacted())
        return self._index

    @property
    def num_episodes(self) -> int:
        """Number of episodes (open ones included)."""
        return int(self._meta.extra.get("episodes", {}).get("count", 0))

    @property
    def source(self) -> dict[str, Any]:
        """What an importer made this dataset from: ``{"layout": "d4rl" | "minari", "file",
        "metadata"}``, the metadata being the file's attributes and D4RL's ``metadata/``
        arrays or Minari's ``metadata.json`` (``env_spec``, ``dataset_id`` ...); ``{}`` for
        a dataset written otherwise."""
        return dict(self._meta.extra.get(SOURCE) or {})

    def _cells(self, rows: torch.Tensor, lanes: torch.Tensor | None) -> Any:
        """``rows`` (mod the capacity) of flat ``lanes``, read through the cache."""
        rows = rows % self._meta.rows
        if self.ndim == 1:
            return self.get(rows)
        coords = torch.unravel_index(lanes, self._schema.lane_shape)
        return self.get((rows, *coords))

    def episode(self, i: int) -> TensorDict:
        """The steps of episode ``i`` (negative counts from the end), oldest first."""
        n = self.num_episodes
        try:
            number = None if isinstance(i, bool) else operator.index(i)
        except TypeError:  # a float, a str, a float tensor
            number = None
        if number is None:
            raise TypeError(f"an episode number is an int, got {i!r}: {self.spec.redacted()} "
                            f"has {n} episodes" + (f", numbered 0 to {n - 1} (ds.episodes lists "
                                                   "them)" if n else ""))
        i = number
        if not -n <= i < n:
            raise IndexError(f"episode {i} is out of range: {self.spec.redacted()} has {n} episodes")
        entry = self.episodes[i]
        rows = int(entry["start"]) + torch.arange(int(entry["length"]))
        lanes = entry["lane"].expand(len(rows)) if self.ndim > 1 else None
        return self._cells(rows, lanes)

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> Any:
        """``batch_size`` transitions drawn uniformly (with replacement) from every filled cell."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size} (sampling "
                             f"{self.spec.redacted()})")
        lanes = math.prod(self._schema.lane_shape)
        cells = torch.randint(self._len_along_dim0 * lanes, (batch_size,), generator=generator)
        if self.ndim == 1:
            return self.get(cells)
        return self._cells(cells // lanes, cells % lanes)

    def sample_slices(self, num_slices: int, slice_len: int,
                      generator: torch.Generator | None = None) -> TensorDict:
        """``num_slices`` windows of ``slice_len`` consecutive steps, batch ``[num_slices, slice_len]``.

        A window never crosses an episode boundary; windows are drawn uniformly
        among all that fit (so long episodes are picked more often). Each
        window is contiguous rows, read as whole chunks through the cache.
        """
        if slice_len < 1 or num_slices < 1:
            raise ValueError(f"num_slices and slice_len must be >= 1, got {num_slices}, {slice_len}")
        index = self.episodes
        fits = (index["length"] - slice_len + 1).clamp(min=0)
        if not bool((fits > 0).any()):
            longest = int(index["length"].max()) if len(index) else 0
            raise ValueError(f"no episode of {self.spec.redacted()} holds slice_len={slice_len} "
                             f"steps (the longest has {longest})")
        pick = torch.multinomial(fits.to(torch.float64), num_slices, replacement=True,
                                 generator=generator)
        offset = (torch.rand(num_slices, generator=generator, dtype=torch.float64)
                  * fits[pick]).long().clamp(max=fits[pick] - 1)
        rows = (index["start"][pick] + offset).unsqueeze(1) + torch.arange(slice_len)
        lanes = index["lane"][pick].unsqueeze(1).expand(-1, slice_len).reshape(-1) \
            if self.ndim > 1 else None
        out = self._cells(rows.reshape(-1), lanes)
        return out.reshape(num_slices, slice_len)


#: The key of a dataset's ``extra`` recording what it was imported from (:attr:`Dataset.source`).
SOURCE = "source"


def _sealed_block(root_json: bytes) -> bool:
    """Whether the root ``zarr.json`` ``root_json`` holds a sealed ``zstore`` block."""
    try:
        block = json.loads(root_json)["attributes"][ZSTORE_ATTR]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(block, dict) and bool(block.get("sealed"))


def _not_a_dataset(where: str, root_json: bytes) -> NotAZStoreError:
    """Why the unconsolidated ``zarr.json`` at ``where`` is no dataset, and the way on: an
    unsealed buffer (seal it), one of a store's arrays, a checkpoint, or a plain group."""
    try:
        node = json.loads(root_json)
    except ValueError:
        node = {}
    node = node if isinstance(node, dict) else {}
    attributes = node.get("attributes")
    attributes = attributes if isinstance(attributes, dict) else {}
    block = attributes.get(ZSTORE_ATTR)
    if node.get("node_type") == "array":
        return NotAZStoreError(f"{where} is one array (a key's column) of a store, not a "
                               "dataset: open the dataset's folder, above it")
    if isinstance(attributes.get(CHECKPOINT_ATTR), dict):
        return checkpoint_not_a("dataset", where, attributes[CHECKPOINT_ATTR])
    if isinstance(block, dict) and block.get("storage_class"):
        try:
            _refuse_unsealed(where, block.get("storage_class"), block.get("length"))
        except NotAZStoreError as exc:
            return exc
    return NotAZStoreError(f"{where} is a Zarr group but not a zstore buffer or dataset (no "
                           "'zstore' block): import its data into a buffer, then seal it")


def _refuse_unsealed(where: str, storage_class: Any, length: Any) -> None:
    """Refuse to open the unsealed buffer at ``where`` as a dataset, naming the fix: seal
    it, or, where it holds no row (what an interrupted import leaves), make it anew."""
    if storage_class == "LazyMemmapStorage" and not length:
        raise NotAZStoreError(
            f"{where} holds an empty, unsealed buffer: no dataset was published there (an "
            "import or `zstore convert` that was interrupted leaves one: delete it and run it "
            "again)")
    raise NotAZStoreError(f"{where} holds a {storage_class} that is not sealed; publish it "
                          "with zstore.seal(url) or `zstore seal URL` first")


def _open_consolidated(spec: StoreSpec) -> zarr.Group:
    """The dataset's group from its root ``zarr.json`` alone: one request.

    The object is fetched as a ranged read from offset 0 (s3fs sends a plain
    ``GET`` after a ``HEAD``; a ranged ``GET`` alone), and the group is built
    from the consolidated metadata it holds, without listing or probing. Transport errors
    (a refusal, an unreachable endpoint) name the store and the fix, as :func:`zstore.open`'s do.
    """
    where = spec.redacted()
    try:
        store = spec.open()
        raw = sync(store.get(ZARR_JSON, default_buffer_prototype(),
                             byte_range=OffsetByteRequest(0)))
    except ZStoreError:
        raise
    except Exception as exc:  # the network after the client's retries, a refused request
        raise store_io_error("cannot read", exc, where) from exc
    if raw is None:
        raise not_found(spec, "dataset", "no zarr.json there")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return zarr.Group(AsyncGroup._from_bytes_v3(StorePath(store), raw,
                                                         use_consolidated=True))
    except ValueError as exc:
        if "consolidated" in str(exc).lower():
            if _sealed_block(raw.to_bytes()):  # a dataset whose root lost the copies: slower
                warnings.warn(
                    f"{where}: this sealed dataset's root zarr.json lost its consolidated metadata "
                    "(rewritten by a tool that does not keep it, e.g. zarr with "
                    "use_consolidated=False), so it opens with a request per key; `zstore "
                    f"convert {where} DST` writes a copy that opens with one", UserWarning,
                    stacklevel=3)
                return open_plain_group(store)
            raise _not_a_dataset(where, raw.to_bytes()) from None
        raise NotAZStoreError(f"{where} is not a zstore dataset: {exc}") from None
    except (GroupNotFoundError, NodeNotFoundError) as exc:
        raise NotAZStoreError(f"{where} is not a zstore dataset: {exc}") from None


def open_dataset(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, cache: str = "host",
                 device: Any = None) -> Dataset:
    """Open a sealed dataset read-only, at a path or any fsspec URL (``s3://``, ``http://`` ...).

    One metadata read (the consolidated root ``zarr.json``); rows are fetched
    on demand through the hot-chunk cache (``cache_bytes``, ``cache`` tier,
    ``device`` as for :func:`zstore.open`).

    >>> ds = zstore.open_dataset("http://127.0.0.1:8000/hopper")  # doctest: +SKIP
    >>> ds.sample_slices(4, 16)["next", "reward"].shape  # doctest: +SKIP
    torch.Size([4, 16, 1])
    """
    spec = StoreSpec.parse(url, storage_options, read_only=True)
    group = _open_consolidated(spec)
    meta = read_meta(group, spec.redacted())
    if not meta.sealed or meta.storage_class != "LazyMemmapStorage":
        _refuse_unsealed(spec.redacted(), meta.storage_class, meta.length)
    return Dataset._from_store(spec, group, meta, cache_bytes=cache_bytes, cache=cache,
                               device=device)
