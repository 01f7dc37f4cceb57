"""The items of a ``state_dict`` that TorchRL's own ``CompressedListStorage`` wrote.

TorchRL keeps each item compressed in memory, and its ``state_dict`` hands that out:
``{"_storage": [payload], "_metadata": [{"type": ..., "dtype": ..., "shape": ...}]}``,
a payload being a ``uint8`` tensor of zlib bytes (zstd from Python 3.14), or for a
TensorDict a dict of them by key. ``zstore.CompressedListStorage.load_state_dict``
decodes them here into the items they hold, so a state saved with TorchRL loads as
it would there (read as data, the payloads became items of compressed bytes).
"""

from __future__ import annotations

import zlib
from typing import Any

import numcodecs
import torch
from tensordict import TensorDict

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def state_items(state_dict: dict[str, Any]) -> list:
    """The items of a ``CompressedListStorage.state_dict()``: zstore's as they are,
    TorchRL's (the one with ``_metadata``) decompressed (``ValueError`` naming the item
    for a payload that is neither zlib nor zstd: one its ``compression_fn`` made, which
    only TorchRL's storage with that function reads)."""
    if "_metadata" not in state_dict:
        return list(state_dict["_storage"])
    return [_item(payload, meta, i) for i, (payload, meta) in
            enumerate(zip(state_dict["_storage"], state_dict["_metadata"], strict=True))
            if payload is not None]


def _item(payload: Any, meta: dict[str, Any], position: int) -> Any:
    if meta["type"] == "tensor":
        return _tensor(payload, meta, position)
    if meta["type"] == "tensordict":
        item = TensorDict({}, batch_size=meta.get("batch_size", []))
        for key, field in meta["fields"].items():
            item[key] = (field["value"] if field["type"] == "non_tensor"
                         else _tensor(payload[key], field, position))
        return item
    return meta["value"]


def _tensor(payload: torch.Tensor, meta: dict[str, Any], position: int) -> torch.Tensor:
    raw = payload.cpu().contiguous().numpy().tobytes()
    if raw[:4] == _ZSTD_MAGIC:
        data = numcodecs.Zstd().decode(raw)
    else:
        try:
            data = zlib.decompress(raw)
        except zlib.error:
            raise ValueError(
                f"item {position} of this TorchRL state_dict was compressed by a compression_fn "
                "other than TorchRL's default (zlib or zstd): load it into TorchRL's "
                "CompressedListStorage with its decompression_fn, then extend this storage "
                "with its items") from None
    return torch.frombuffer(bytearray(data), dtype=meta["dtype"]).reshape(meta["shape"])
