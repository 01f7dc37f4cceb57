"""The TED compact form (SPEC §4), lossless, and TorchRL's hook names for it.

A TED TensorDict stores most observations twice: ``obs`` at step t and
``("next", "obs")`` at step t, equal to ``obs`` at t + 1 inside a trajectory.
The compact form stores such a key once per step plus one row per segment end.
Unlike TorchRL's, this compaction loses nothing:

* a segment ends where ``("next", "done")`` is set, at the end of each lane,
  **and wherever ``("next", k)`` differs (bitwise) from the next step's ``k``**
  for some compacted key, so no ``("next", obs)`` is ever rewritten;
* root-level done flags are kept (dropped only when all false, and then
  restored as zeros); keys present only under ``"next"`` are stored as such;
* only the filled rows are compacted; with the write cursor known, the
  ongoing trajectory ends at the cursor and full buffers are unrolled from the
  oldest row;
* lanes (``ndim >= 2``) are compacted one after the other (lane-major);
* string leaves (one string per row) are stored as text cells (``zstore.text``: UTF-8
  in ``uint8`` rows, one width for all of them), compacted as any other key, and
  decoded back; nothing is pickled.

Compact TensorDict (batch ``[]``): compacted keys at their own key,
``[steps + segments, *feature]``; other root keys at their key, ``[steps, ...]``;
next-only keys under ``"next"``; ``"_ted"`` holds the segment-end mask ``end``
(``[steps]``) and JSON metadata (``shift``, ``is_full``, ``storage_shape``,
``expanded``, ``zero_root``, ``texts``: the paths of the string leaves).

:func:`from_torchrl` converts TorchRL's own compact form (Flat/Nested memmap
directories, H5 files) back to TED, reproducing TorchRL's Flat2TED.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection

from zstore import text
from zstore.dtypes import torch_dtype_from_name, torch_dtype_name

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")
META = "_ted"


def _keyset(keys: Iterable[Any]) -> set[tuple[str, ...]]:
    return {(k,) if isinstance(k, str) else tuple(k) for k in keys}


def _path(key: tuple[str, ...]) -> str:
    return "/".join(key)


def _leaves(td: TensorDictBase) -> dict[tuple[str, ...], torch.Tensor]:
    out = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            out[key] = value
    return out


def with_text_cells(data: TensorDictBase) -> tuple[TensorDict, list[str]]:
    """TED rows with their string leaves as text cells (``[*batch, width]`` ``uint8``, one
    width for all), and the paths of those leaves; a non-string value raises, naming its key."""
    out = TensorDict(_leaves(data), batch_size=data.batch_size)
    width = max(1, text.widest(data))
    texts = []
    for key, value in text.non_tensor_leaves(data):
        key = (key,) if isinstance(key, str) else tuple(key)
        out.set(key, text.encode(value, width, key))
        texts.append(_path(key))
    return out, texts


def _lane_major(x: torch.Tensor, lane_ndim: int) -> torch.Tensor:
    """``[T, *lanes, *feat]`` -> ``[lanes * T, *feat]``, all steps of lane 0 first."""
    steps, feat = x.shape[0], x.shape[1 + lane_ndim:]
    lanes = math.prod(x.shape[1:1 + lane_ndim])
    if lanes == 1:
        return x.reshape(steps, *feat)
    return x.reshape(steps, lanes, *feat).transpose(0, 1).reshape(steps * lanes, *feat)


def _time_major(x: torch.Tensor, steps: int, lane_shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`_lane_major`."""
    lanes = math.prod(lane_shape)
    feat = x.shape[1:]
    if lanes == 1:
        return x.reshape(steps, *lane_shape, *feat)
    return x.reshape(lanes, steps, *feat).transpose(0, 1).reshape(steps, *lane_shape, *feat)


#: Dtypes torch cannot scatter into (``index_put``): their pairs are stored as two keys,
#: root and next, not compacted into one.
_NO_INDEX_PUT = (torch.uint16, torch.uint32, torch.uint64)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` as bytes (bitwise comparison: NaNs, -0.0 and bfloat16 included)."""
    flat = x.contiguous().reshape(len(x), -1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def _starts(end: torch.Tensor) -> torch.Tensor:
    """Position of each step's value in a compacted key: step + segment ends before it."""
    ends = end.to(torch.int64)
    return torch.arange(len(end)) + torch.cumsum(ends, 0) - ends


def compact(data: TensorDictBase, *, shift: int, is_full: bool,
            done_key: Any = ("next", "done"), done_keys: Iterable[Any] = DEFAULT_DONE_KEYS,
            reward_keys: Iterable[Any] = ("reward",)) -> TensorDict:
    """TED rows ``[T, *lanes]`` (ring order) -> the lossless compact TensorDict."""
    if not is_tensor_collection(data):
        raise ValueError("Only tensor collections are supported.")
    if META in data:
        raise KeyError(f"key {META!r} is reserved by the TED compact form")
    steps, lane_shape = data.batch_size[0], tuple(data.batch_size[1:])
    lanes = math.prod(lane_shape)
    data, texts = with_text_cells(data)
    if is_full and steps and shift % steps:
        data = torch.cat([data[shift % steps:], data[: shift % steps]], 0)
    leaves = {k: _lane_major(v, len(lane_shape)) for k, v in _leaves(data).items()}
    done_set, reward_set = _keyset(done_keys), _keyset(reward_keys)
    nxt = {k[1:]: v for k, v in leaves.items() if k[0] == "next" and len(k) > 1}
    root = {k: v for k, v in leaves.items() if k[0] != "next"}
    expanded = [k for k, v in nxt.items()
                if k in root and k not in done_set | reward_set
                and root[k].dtype == v.dtype and root[k].shape == v.shape
                and v.dtype not in _NO_INDEX_PUT]
    n = steps * lanes
    end = torch.zeros(n, dtype=torch.bool)
    if steps:
        end[steps - 1:: steps] = True
    done_key = (done_key,) if isinstance(done_key, str) else tuple(done_key)
    if done_key in leaves and n:
        end |= leaves[done_key].reshape(n, -1).any(-1)
    for k in expanded:
        if n > 1:
            end[:-1] |= (_bits(nxt[k][:-1]) != _bits(root[k][1:])).any(-1)
    starts = _starts(end)
    n_seg = int(end.sum())
    out = TensorDict(batch_size=[])
    for k in expanded:
        r, x = root[k], nxt[k]
        buf = torch.empty((n + n_seg, *r.shape[1:]), dtype=r.dtype, device=r.device)
        buf[starts] = r
        buf[starts[end] + 1] = x[end]
        out.set(k, buf)
    zero_root = []
    for k, v in root.items():
        if k in expanded:
            continue
        if k in done_set and not bool(v.any()):
            zero_root.append({"path": _path(k), "dtype": torch_dtype_name(v.dtype),
                              "shape": list(v.shape[1:])})
            continue
        out.set(k, v)
    for k, v in nxt.items():
        if k not in expanded:
            out.set(("next", *k), v)
    meta = TensorDict(end=end, batch_size=[])
    meta.set_non_tensor("info", {"shift": int(shift), "is_full": bool(is_full),
                                 "storage_shape": [steps, *lane_shape],
                                 "expanded": [_path(k) for k in expanded], "zero_root": zero_root,
                                 "texts": texts})
    out.set(META, meta)
    return out


def info_of(compact_td: TensorDictBase) -> dict[str, Any]:
    """The JSON metadata of a compact TensorDict."""
    return dict(compact_td.get(META).get_non_tensor("info"))


def expand(compact_td: TensorDictBase) -> TensorDict:
    """Inverse of :func:`compact`: TED rows ``[T, *lanes]`` in ring order."""
    info = info_of(compact_td)
    steps, lane_shape = info["storage_shape"][0], tuple(info["storage_shape"][1:])
    end = compact_td.get((META, "end")).to(torch.bool)
    starts = _starts(end)
    expanded = {tuple(p.split("/")) for p in info["expanded"]}
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for k, v in _leaves(compact_td).items():
        if k[0] == META:
            continue
        if k in expanded:
            out[k] = v[starts]
            out[("next", *k)] = v[starts + 1]
        else:
            out[k] = v
    for entry in info["zero_root"]:
        out[tuple(entry["path"].split("/"))] = torch.zeros(
            (len(end), *entry["shape"]), dtype=torch_dtype_from_name(entry["dtype"]))
    return _ted(out, steps, lane_shape, info["shift"], info["is_full"], info.get("texts", ()))


def _ted(leaves: Mapping[tuple[str, ...], torch.Tensor], steps: int, lane_shape: tuple[int, ...],
         shift: int, is_full: bool, texts: Iterable[str] = ()) -> TensorDict:
    """Lane-major leaves -> a ``[T, *lanes]`` TensorDict in ring order; the text cells at
    ``texts`` back as strings."""
    td = TensorDict(batch_size=[steps, *lane_shape])
    for k, v in leaves.items():
        td.set(k, _time_major(v, steps, lane_shape))
    if is_full and steps and shift % steps:
        cut = steps - shift % steps
        td = torch.cat([td[cut:], td[:cut]], 0)
    for path in texts:
        key = tuple(path.split("/"))
        td.set(key, text.decode(td.get(key)))
    return td


def segments(compact_td: TensorDictBase) -> torch.Tensor:
    """Steps per segment (int64), from the segment-end mask."""
    end = compact_td.get((META, "end"))
    stops = torch.nonzero(end).reshape(-1) + 1
    return torch.diff(stops, prepend=torch.zeros(1, dtype=torch.int64))


def from_torchrl(flat: Mapping[tuple[str, ...], torch.Tensor], *, shift: int, is_full: bool,
                 storage_shape: list[int], done_key: Any = "done",
                 done_keys: Iterable[Any] = DEFAULT_DONE_KEYS,
                 reward_keys: Iterable[Any] = ("reward",)) -> TensorDict:
    """TorchRL's compact form (TED2Flat output: bare done/reward names, full capacity,
    ends forced at ``shift - 1`` or the last row) -> TED rows, as TorchRL's Flat2TED."""
    steps, lane_shape = int(storage_shape[0]), tuple(int(s) for s in storage_shape[1:])
    lanes = math.prod(lane_shape)
    n = steps * lanes
    done_key = (done_key,) if isinstance(done_key, str) else tuple(done_key)
    end = flat[done_key].reshape(lanes, steps, -1).any(-1).clone()
    if is_full:
        end[:, -1] = True
    else:
        end[:, shift - 1] = True
    end = end.reshape(n)
    starts = _starts(end)
    done_set, reward_set = _keyset(done_keys), _keyset(reward_keys)
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for k, v in flat.items():
        if len(v) != n:
            out[k] = v[starts]
            out[("next", *k)] = v[torch.clamp(starts + 1, max=len(v) - 1)]
        elif k in done_set | reward_set:
            out[("next", *k)] = v
        else:
            out[k] = v
    for k in done_set:
        if ("next", *k) in out and k not in out:
            out[k] = torch.zeros_like(out[("next", *k)])
    return _ted(out, steps, lane_shape, shift, is_full)


# -- TorchRL's hook names ---------------------------------------------------------------------
class _SaveHook:
    """A save hook: the checkpointer sets ``shift`` and ``is_full`` before calling it."""

    def __init__(self, done_key: Any = ("next", "done"), shift_key: str = "shift",
                 is_full_key: str = "is_full", done_keys: Iterable[Any] = DEFAULT_DONE_KEYS,
                 reward_keys: Iterable[Any] = ("reward",)):
        self.done_key, self.shift_key, self.is_full_key = done_key, shift_key, is_full_key
        self.done_keys, self.reward_keys = tuple(done_keys), tuple(reward_keys)
        self.shift: int | None = None
        self.is_full: bool | None = None

    def _compact(self, data: TensorDictBase) -> TensorDict:
        return compact(data, shift=self.shift or 0, is_full=bool(self.is_full),
                       done_key=self.done_key, done_keys=self.done_keys,
                       reward_keys=self.reward_keys)


class TED2Flat(_SaveHook):
    """Save hook: TED rows -> the lossless compact form (see the module docstring)."""

    def __call__(self, data: TensorDictBase, path: Any = None) -> TensorDict:
        return self._compact(data)


class TED2Nested(_SaveHook):
    """Save hook: as :class:`TED2Flat`, plus ``("_ted", "segments")``: steps per segment.

    Jagged keys are stored as their flat values plus this lengths table (a
    nested tensor's own representation), not as torch nested tensors.
    """

    def __call__(self, data: TensorDictBase, path: Any = None) -> TensorDict:
        out = self._compact(data)
        out.set((META, "segments"), segments(out))
        return out


class Flat2TED:
    """Load hook: the compact form -> TED rows (``out`` is accepted and not used)."""

    def __init__(self, done_key: Any = "done", shift_key: str = "shift",
                 is_full_key: str = "is_full", done_keys: Iterable[Any] = DEFAULT_DONE_KEYS,
                 reward_keys: Iterable[Any] = ("reward",)):
        self.done_key, self.done_keys, self.reward_keys = done_key, done_keys, reward_keys

    def __call__(self, data: TensorDictBase, out: Any = None) -> TensorDict:
        return expand(data)


class Nested2TED(Flat2TED):
    """Load hook: the nested compact form -> TED rows."""


class H5Split:
    """Save hook: the nested compact form -> ``{"traj_<i>": segment, "_ted": metadata}``.

    A segment holds its compacted keys with ``L + 1`` rows and the others with ``L``.
    """

    def __call__(self, data: TensorDictBase, path: Any = None) -> TensorDict:
        lengths = data.get((META, "segments")) if (META, "segments") in data.keys(True) \
            else segments(data)
        info = info_of(data)
        expanded = {tuple(p.split("/")) for p in info["expanded"]}
        width = max(1, math.ceil(math.log10(len(lengths)))) if len(lengths) > 1 else 1
        out = TensorDict(batch_size=[])
        leaves = {k: v for k, v in _leaves(data).items() if k[0] != META}
        stops = torch.cumsum(lengths, 0).tolist()
        start = 0
        for i, stop in enumerate(stops):
            seg = TensorDict(batch_size=[])
            for k, v in leaves.items():
                if k in expanded:
                    seg.set(k, v[start + i: stop + i + 1])
                else:
                    seg.set(k, v[start:stop])
            out.set(f"traj_{i:0{width}d}", seg)
            start = stop
        meta = TensorDict(batch_size=[])
        meta.set_non_tensor("info", info)
        out.set(META, meta)
        return out


class H5Combine:
    """Load hook: inverse of :class:`H5Split` (segments concatenated in key order)."""

    def __call__(self, data: TensorDictBase, out: Any = None) -> TensorDict:
        info = dict(data.get(META).get_non_tensor("info"))
        names = sorted(k for k in data.keys() if k.startswith("traj_"))  # noqa: SIM118
        expanded = {tuple(p.split("/")) for p in info["expanded"]}
        parts: dict[tuple[str, ...], list[torch.Tensor]] = {}
        ends = []
        for name in names:
            seg = data.get(name)
            seg_leaves = _leaves(seg)
            for k, v in seg_leaves.items():
                parts.setdefault(k, []).append(v)
            length = next((len(v) for k, v in seg_leaves.items() if k not in expanded), None)
            if length is None:
                length = next(len(v) - 1 for v in seg_leaves.values())
            mask = torch.zeros(length, dtype=torch.bool)
            mask[-1] = True
            ends.append(mask)
        result = TensorDict({k: torch.cat(v) for k, v in parts.items()}, batch_size=[])
        meta = TensorDict(end=torch.cat(ends) if ends else torch.zeros(0, dtype=torch.bool),
                          batch_size=[])
        meta.set_non_tensor("info", info)
        result.set(META, meta)
        return result
