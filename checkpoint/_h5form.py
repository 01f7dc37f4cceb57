"""zstore's H5 form: TorchRL's own H5 layout, plus a ``zstore`` group for what it loses.

TorchRL's ``H5StorageCheckpointer.loads`` concatenates the ``traj_<i>`` groups key
by key, then rebuilds TED rows from the flat ``done`` column (its Flat2TED): lane
after lane, each lane ``T`` steps long; a compacted key holds each step's value at
``step + segment ends before it``, and after each segment end one extra row, the
end's ``("next", key)``. Segment ends are ``("next", "done")``, the cursor
(``shift - 1``, partial buffers) and the last row (full buffers, unrolled from
the oldest row). :func:`encode` lays the data out exactly so: ``("next", key)``
of done/reward keys at the bare key, keys present only under ``"next"`` (or
whose dtype/shape differ from the root key's) in a ``next`` sub-group, rows
never written as zero padding (each lane gets its ``T`` steps), so TorchRL loads
what it loads from its own file of the same storage. Group boundaries do not
matter to TorchRL: one group per segment, plus one padding group per lane. What
that layout cannot hold goes into the root group ``zstore``, which TorchRL's
loader passes over as metadata:

* ``zstore/segments`` (int64 ``[groups, 3]``): steps, extra row (0/1), written (0/1);
* ``zstore/root/<key>``: root done/reward keys, unless all false (then restored as zeros);
* ``zstore/next/<key>/index``, ``/value``: the steps whose ``("next", key)`` differs,
  bitwise, from what the layout implies (the next step's ``key`` inside a segment):
  multi-step transforms, resets without done, the last written step of a lane;
* ``zstore/text/<key>`` (``uint8 [steps, width]``, lane-major, written steps only): the
  string leaves as text cells (``zstore.text``: UTF-8, NUL-padded), one string per step.
  TorchRL's loader has no place for strings (its own checkpointer drops them), so they
  stay here, where it passes over them; its tensor keys load as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from zstore.dtypes import torch_dtype_from_name, torch_dtype_name

from ._ted import (
    DEFAULT_DONE_KEYS,
    _NO_INDEX_PUT,
    _bits,
    _keyset,
    _lane_major,
    _leaves,
    _path,
    _starts,
    _ted,
    with_text_cells,
)

#: The root group TorchRL's loader passes over.
GROUP = "zstore"


@dataclasses.dataclass
class H5Form:
    """A storage in zstore's H5 form, ready to be written group by group.

    ``columns``: path -> lane-major values over the written steps (compacted keys
    with their extra rows), split into groups by ``segments`` (steps, extra, written);
    groups with ``written == 0`` are zero padding. ``extras``: path below ``zstore/``
    -> values. ``info``: JSON for the reader. ``torchrl_shift``: TorchRL's ``shift``.
    """

    columns: dict[str, torch.Tensor]
    segments: torch.Tensor
    extras: dict[str, torch.Tensor]
    info: dict[str, Any]
    torchrl_shift: int


def _split(buf: torch.Tensor, pos: torch.Tensor, bounds: torch.Tensor,
           extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Root and next values of a compacted key as the layout implies them; zeros for the
    next value of a group's last step without an extra row (a lane's last written step
    that is no segment end)."""
    if not len(pos):
        return buf[:0], buf[:0].clone()
    nxt = buf[torch.clamp(pos + 1, max=len(buf) - 1)]
    nxt[bounds & ~extra] = 0
    return buf[pos], nxt


def encode(data: TensorDictBase, *, rows: int, shift: int, is_full: bool,
           done_key: Any = ("next", "done"), done_keys: Iterable[Any] = DEFAULT_DONE_KEYS,
           reward_keys: Iterable[Any] = ("reward",)) -> H5Form:
    """TED rows ``[steps, *lanes]`` (ring order; ``steps == rows`` when full, else the
    written rows) of a storage of ``rows`` rows whose newest row is ``shift - 1`` -> H5Form."""
    steps, lane_shape = data.batch_size[0], tuple(data.batch_size[1:])
    lanes = math.prod(lane_shape)
    turn = shift % steps if is_full and steps else 0
    data, texts = with_text_cells(data)
    if turn:
        data = torch.cat([data[turn:], data[:turn]], 0)
    leaves = {k: _lane_major(v, len(lane_shape)) for k, v in _leaves(data).items()}
    extras: dict[str, torch.Tensor] = {f"text/{path}": leaves.pop(tuple(path.split("/")))
                                       for path in texts}
    done_set, reward_set = _keyset(done_keys), _keyset(reward_keys)
    flags = done_set | reward_set
    nxt = {k[1:]: v for k, v in leaves.items() if k[0] == "next" and len(k) > 1}
    root = {k: v for k, v in leaves.items() if k[0] != "next"}
    expanded = [k for k, v in nxt.items()
                if k in root and k not in flags and root[k].dtype == v.dtype
                and root[k].shape == v.shape and v.dtype not in _NO_INDEX_PUT]
    n = steps * lanes
    t = torch.arange(n) % max(steps, 1)
    ends = torch.zeros(n, dtype=torch.bool)
    done_key = (done_key,) if isinstance(done_key, str) else tuple(done_key)
    if done_key in leaves and n:
        ends |= leaves[done_key].reshape(n, -1).any(-1)
    if is_full:
        ends |= t == steps - 1
    elif 0 < shift <= steps:
        ends |= t == shift - 1
    bounds = ends | (t == steps - 1)
    pos = _starts(ends)
    columns: dict[str, torch.Tensor] = {}
    for k in expanded:
        r, x = root[k], nxt[k]
        buf = torch.empty((n + int(ends.sum()), *r.shape[1:]), dtype=r.dtype, device=r.device)
        buf[pos] = r
        buf[pos[ends] + 1] = x[ends]
        columns[_path(k)] = buf
        if n:
            differs = (_bits(x) != _bits(_split(buf, pos, bounds, ends)[1])).any(-1)
            index = torch.nonzero(differs).reshape(-1)
            if len(index):
                extras[f"next/{_path(k)}/index"] = index
                extras[f"next/{_path(k)}/value"] = x[index]
    zero_root = []
    for k, v in root.items():
        if k in expanded:
            continue
        if k not in flags:
            columns[_path(k)] = v
        elif k in done_set and not bool(v.any()):
            zero_root.append({"path": _path(k), "dtype": torch_dtype_name(v.dtype),
                              "shape": list(v.shape[1:])})
        else:
            extras[f"root/{_path(k)}"] = v
    bare = []
    for k, v in nxt.items():
        if k in flags:
            bare.append(_path(k))
            columns[_path(k)] = v
        elif k not in expanded:
            columns[_path(("next", *k))] = v
    last = torch.nonzero(bounds).reshape(-1)
    table = torch.stack([torch.diff(last + 1, prepend=torch.zeros(1, dtype=torch.int64)),
                         ends[last].to(torch.int64), torch.ones_like(last)], 1)
    if steps < rows:  # zero padding after each lane's written steps
        pad = torch.tensor([[rows - steps, 0, 0]])
        cuts = (torch.nonzero(t[last] == steps - 1).reshape(-1) + 1).tolist() if steps else [0] * lanes
        parts, start = [], 0
        for cut in cuts:
            parts += [table[start:cut], pad]
            start = cut
        table = torch.cat(parts)
    info = {"shift": turn, "is_full": bool(is_full), "storage_shape": [steps, *lane_shape],
            "expanded": [_path(k) for k in expanded], "bare": bare, "zero_root": zero_root,
            "texts": texts}
    torchrl_shift = (turn or steps) if is_full else shift
    return H5Form(columns, table, extras, info, torchrl_shift)


def decode(columns: Mapping[str, torch.Tensor], segments: torch.Tensor,
           extras: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> TensorDictBase:
    """Inverse of :func:`encode`: ``columns`` hold the written groups only, concatenated."""
    written = segments[segments[:, 2] == 1]
    lengths = written[:, 0]
    n = int(lengths.sum())
    last = torch.cumsum(lengths, 0) - 1
    bounds = torch.zeros(n, dtype=torch.bool)
    bounds[last] = True
    extra = torch.zeros(n, dtype=torch.bool)
    extra[last[written[:, 1] == 1]] = True
    pos = _starts(extra)
    expanded, bare = set(info["expanded"]), set(info["bare"])
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for path, value in columns.items():
        key = tuple(path.split("/"))
        if path in expanded:
            out[key], nxt = _split(value, pos, bounds, extra)
            index = extras.get(f"next/{path}/index")
            if index is not None:
                nxt[index] = extras[f"next/{path}/value"]
            out[("next", *key)] = nxt
        elif path in bare:
            out[("next", *key)] = value
        else:
            out[key] = value
    for path, value in extras.items():
        kind, _, rest = path.partition("/")
        if kind in ("root", "text"):
            out[tuple(rest.split("/"))] = value
    for entry in info["zero_root"]:
        out[tuple(entry["path"].split("/"))] = torch.zeros(
            (n, *entry["shape"]), dtype=torch_dtype_from_name(entry["dtype"]))
    steps, lane_shape = info["storage_shape"][0], tuple(info["storage_shape"][1:])
    return _ted(out, steps, lane_shape, info["shift"], info["is_full"], info.get("texts", ()))
