"""Matplotlib helpers for exploring TED replay data in notebooks.

Every plot takes a storage (read in time order: a full ring buffer starts at
the oldest row) or a TensorDict in TorchRL's TED layout, and returns a
:class:`matplotlib.figure.Figure` (built without pyplot, so nothing is kept in
global state; a notebook shows the returned figure once). Matplotlib is the
optional extra ``notebooks`` and is imported on first use.

Episodes come from the ``("next", "done")`` flags (or, without them,
``terminated | truncated``: :mod:`zstore.episodes`), grouped by trajectory id
where the data has one (``("collector", "traj_ids")`` or ``"episode"``, as
TorchRL's collectors and SliceSampler use), so that rows of several
environments interleaved in one buffer are attributed to the right episode.

>>> import torch
>>> episode_bounds(torch.tensor([False, True, False, False, True, False]))
(tensor([0, 2]), tensor([2, 5]))
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .episodes import DONE_KEY, REWARD_KEY, episode_bounds, flags_of, ring_order, segment_sums
from .errors import MissingKeyError
from .storages.base import Storage
from .storages.ensemble import StorageEnsemble

#: Keys holding a trajectory id in TorchRL data, tried in this order.
TRAJ_KEYS: tuple[Any, ...] = (("collector", "traj_ids"), "episode")


def _matplotlib():
    """The ``matplotlib.figure`` module, or an ImportError saying how to install it."""
    try:
        figure = importlib.import_module("matplotlib.figure")
    except ImportError as exc:
        raise ImportError("zstore.plots needs matplotlib: pip install 'zstore[notebooks]' "
                          "(or pip install matplotlib)") from exc
    return figure


def _figure(width: float = 6.4, height: float = 3.6):
    return _matplotlib().Figure(figsize=(width, height), layout="constrained")


# -- data -----------------------------------------------------------------------------------

def time_ordered(data: Storage | TensorDictBase) -> TensorDictBase:
    """The rows of a storage oldest first (a wrapped ring buffer is rotated), or ``data`` itself.

    List storages order by the item their writer wrote last in this process (they record no
    cursor for TorchRL, as TorchRL's do not); unknown there (a reopened one), in index order.

    The whole storage is read: for a large buffer, pass a TensorDict of the keys to plot.
    """
    if isinstance(data, TensorDictBase):
        if not data.batch_size.numel():
            raise ValueError("nothing to plot: this TensorDict holds no rows")
        return data
    _require_rows(data)
    lanes = math.prod(data.shape[1:]) if data.ndim > 1 and len(data) else 1  # [T, B] storages
    return _read(data, ring_order(len(data), data.max_size, data._newest_row(), lanes=lanes))


def _require_rows(storage: Storage) -> None:
    """Raise the "nothing to plot" ``ValueError`` when ``storage`` holds no rows; a
    ``TypeError`` for what is no storage, or an ensemble (whose rows are its members')."""
    if not isinstance(storage, Storage):
        raise TypeError(f"expected a zstore storage or a TensorDict, got {type(storage).__name__}")
    if isinstance(storage, StorageEnsemble):  # get() takes buffer ids and indices
        raise TypeError(f"plots read one storage; a {type(storage).__name__} holds several: "
                        "pass one of them (ensemble[0])")
    if not len(storage):
        raise ValueError(f"nothing to plot: this {type(storage).__name__} holds no rows yet "
                         "(write some first, or plot a TensorDict)")


def _read(storage: Storage, rows: torch.Tensor) -> TensorDictBase:
    """Rows of a storage as one TensorDict (list storages' items are stacked)."""
    out = storage.get(rows)
    if isinstance(out, list):
        out = torch.stack(out) if out else TensorDict(batch_size=[0])
    if not isinstance(out, TensorDictBase):
        raise TypeError(f"{type(storage).__name__} holds {type(out).__name__}, not TensorDicts")
    return out


def _has(td: TensorDictBase, key: Any) -> bool:
    return isinstance(td.get(key, None), torch.Tensor)


def _get(td: TensorDictBase, key: Any) -> torch.Tensor:
    if not _has(td, key):
        if td.get(key, None) is not None:  # there, but no tensor: strings (text), a node
            raise TypeError(f"key {key!r} holds {type(td.get(key)).__name__} values (strings or "
                            "a nested TensorDict), not numbers: plot a key of numbers")
        keys = sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))
        raise MissingKeyError(f"the data has no key {key!r} (keys: {keys})")
    return td.get(key).cpu()  # samples of a cache="cuda" storage live on the GPU


def _flag(td: TensorDictBase, key: Any) -> torch.Tensor:
    """A per-row boolean flag (trailing singleton dims dropped)."""
    value = _get(td, key)
    return value.reshape(*td.batch_size, -1).any(-1)


def _done(td: TensorDictBase, key: Any) -> torch.Tensor:
    """Per-row end flags: ``key``, or its ``terminated`` / ``truncated`` siblings
    (:func:`zstore.episodes.done_keys`)."""
    flags = flags_of(lambda k: td.get(k, None), key, lead=td.batch_dims)
    return _flag(td, key) if flags is None else flags.cpu()  # _flag names the missing key


def _per_row(td: TensorDictBase, key: Any) -> torch.Tensor:
    """A per-row scalar (summed over trailing dims) as float64."""
    value = _get(td, key).to(torch.float64)
    return value.reshape(*td.batch_size, -1).sum(-1)


def _traj_key(td: TensorDictBase, traj_key: Any) -> Any:
    if traj_key != "auto":
        return traj_key
    return next((k for k in TRAJ_KEYS if _has(td, k)), None)


def episode_stats(data: Storage | TensorDictBase, *, reward_key: Any = REWARD_KEY,
                  done_key: Any = DONE_KEY, traj_key: Any = "auto") -> TensorDict:
    """Return (sum of rewards) and length of every finished episode in ``data``.

    Rows are grouped by ``traj_key`` when the data has one (``"auto"``: the first of
    :data:`TRAJ_KEYS` present; ``None``: never); an episode is finished when one
    of its rows is done. Without trajectory ids, episodes are runs of rows ending
    at a done flag (:func:`episode_bounds`), per lane of ``[T, B]`` data. An
    episode whose first rows a ring buffer overwrote is counted from its oldest
    row still stored.

    Returns a TensorDict of batch size ``[episodes]`` with ``"return"`` (float64)
    and ``"length"`` (int64).
    """
    td = time_ordered(data)
    key = _traj_key(td, traj_key)
    reward, done = _per_row(td, reward_key), _done(td, done_key)
    if key is not None:
        ids = _get(td, key).reshape(-1)
        unique, inverse = torch.unique(ids, return_inverse=True)
        count = len(unique)
        returns = torch.zeros(count, dtype=torch.float64).index_add_(0, inverse, reward.reshape(-1))
        lengths = torch.bincount(inverse, minlength=count)
        finished = torch.zeros(count, dtype=torch.bool).index_fill_(
            0, inverse[done.reshape(-1)], True)
        return TensorDict({"return": returns[finished], "length": lengths[finished]},
                          batch_size=[int(finished.sum())])
    if done.ndim == 1:
        reward, done = reward.unsqueeze(-1), done.unsqueeze(-1)
    returns, lengths = [], []
    for lane in range(done.shape[1]):
        start, stop = episode_bounds(done[:, lane])
        returns.append(segment_sums(reward[:, lane], start, stop - start))
        lengths.append(stop - start)
    returns, lengths = torch.cat(returns), torch.cat(lengths)
    return TensorDict({"return": returns, "length": lengths}, batch_size=[len(lengths)])


# -- plots ----------------------------------------------------------------------------------

def _finite(values: torch.Tensor, what: str) -> tuple[torch.Tensor, str]:
    """The finite ``values`` (float64) and a note of how many NaN or infinite ones were left
    out of the plot ("" when none); "nothing to plot" when none is finite."""
    values = values.to(torch.float64)
    kept = values[torch.isfinite(values)]
    if not kept.numel():
        raise ValueError(f"nothing to plot: no finite {what} ({values.numel()} NaN or infinite)")
    dropped = values.numel() - kept.numel()
    return kept, f", {dropped} NaN or infinite left out" if dropped else ""


def _histogram(values: torch.Tensor, bins: int, title: str, xlabel: str):
    values, note = _finite(values, xlabel)
    fig = _figure()
    ax = fig.add_subplot()
    ax.hist(values.numpy(), bins=bins)
    ax.set(title=title.removesuffix(")") + note + ")" if note else title, xlabel=xlabel,
           ylabel="episodes")
    return fig


def episode_return_hist(data: Storage | TensorDictBase, *, bins: int = 30, **keys: Any):
    """Histogram of the returns of the finished episodes (keys as in :func:`episode_stats`)."""
    stats = episode_stats(data, **keys)
    return _histogram(stats["return"], bins, f"Episode return ({len(stats)} episodes)", "return")


def episode_length_hist(data: Storage | TensorDictBase, *, bins: int = 30, **keys: Any):
    """Histogram of the lengths of the finished episodes (keys as in :func:`episode_stats`)."""
    stats = episode_stats(data, **keys)
    return _histogram(stats["length"], bins, f"Episode length ({len(stats)} episodes)",
                      "steps")


def reward_done_timeline(data: Storage | TensorDictBase, *, start: int = 0, stop: int | None = None,
                         lane: int = 0, reward_key: Any = REWARD_KEY,
                         terminated_key: Any = ("next", "terminated"),
                         truncated_key: Any = ("next", "truncated"), done_key: Any = DONE_KEY):
    """Reward per row over ``[start, stop)``, with a marker at each episode end.

    Terminated and truncated ends get their own markers where the data has both
    keys; otherwise every done row is marked. ``lane`` picks the environment of
    ``[T, B]`` data.
    """
    td = time_ordered(data)
    if td.batch_dims > 1:
        td = td[:, lane]
    first, last, _ = slice(start, stop).indices(len(td))  # negative bounds as Python's
    if first >= last:
        raise ValueError(f"start={start}, stop={stop} select no row of the {len(td)} rows: "
                         "pass start < stop (negative values count from the end)")
    td = td[first:last]
    reward = _per_row(td, reward_key)
    steps = torch.arange(first, last)
    fig = _figure(8.0, 3.2)
    ax = fig.add_subplot()
    ax.plot(steps.numpy(), reward.numpy(), linewidth=0.8, label="reward")
    if _has(td, terminated_key) and _has(td, truncated_key):
        ends = [(terminated_key, "terminated", "v"), (truncated_key, "truncated", "x")]
    else:
        ends = [(done_key, "done", "v")]
    for key, label, marker in ends:
        rows = _done(td, key) if label == "done" else _flag(td, key)
        ax.scatter(steps[rows].numpy(), reward[rows].numpy(), marker=marker, zorder=3,
                   label=f"{label} ({int(rows.sum())})")
    ax.set(title="Reward and episode ends", xlabel="step (oldest row first)", ylabel="reward")
    ax.legend(loc="best", fontsize="small")
    return fig


def _as_images(frames: torch.Tensor) -> torch.Tensor:
    """Frames as ``[N, S, H, W, C]`` images (``S`` frames per stack, ``C`` in 1, 3, 4).

    Accepts ``[N, H, W]``, ``[N, C, H, W]`` (C in 1, 3), ``[N, H, W, C]`` (C in 1, 3, 4),
    stacks of grayscale frames ``[N, S, H, W]`` (so ``[N, 4, 84, 84]`` is a stack of
    four), and stacks of colour frames ``[N, S, C, H, W]`` / ``[N, S, H, W, C]``.
    """
    x = frames.detach().cpu()
    channels, first = (1, 3, 4), (1, 3)  # channels-first frames: grey or RGB (4 is a stack)
    if x.ndim == 3:
        x = x.unsqueeze(-1).unsqueeze(1)
    elif x.ndim == 4:
        if x.shape[-1] in channels and x.shape[1] not in first:
            x = x.unsqueeze(1)                                   # [N, H, W, C]
        elif x.shape[1] in first:
            x = x.permute(0, 2, 3, 1).unsqueeze(1)               # [N, C, H, W]
        else:
            x = x.unsqueeze(-1)                                  # [N, S, H, W] stack
    elif x.ndim == 5:
        if x.shape[2] in first and x.shape[-1] not in channels:
            x = x.permute(0, 1, 3, 4, 2)                         # [N, S, C, H, W]
    else:
        raise ValueError(f"frames of shape {list(frames.shape)} are not images: expected "
                         "[N, H, W], [N, C, H, W], [N, H, W, C] or a frame stack [N, S, ...]")
    if x.shape[-1] not in channels:
        raise ValueError(f"frames of shape {list(frames.shape)}: no channel dim of size 1, 3 or 4")
    if x.dtype == torch.bool:
        x = x.to(torch.uint8) * 255
    elif x.is_floating_point():
        x = x.float().clamp(0, 1)
    return x


def frame_grid(data: torch.Tensor | Storage | TensorDictBase, *, key: Any = "pixels",
               index: Any = None, max_frames: int = 16, ncols: int | None = None):
    """A grid of image frames (uint8, or float in ``[0, 1]``), one axes per frame.

    ``data`` is a tensor of frames or a storage / TensorDict holding them at ``key``;
    ``index`` picks rows (default: the first ``max_frames``). Frame stacks
    ``[N, S, ...]`` show one row per item with its ``S`` frames side by side;
    single frames fill ``ncols`` columns (default: up to 8).
    """
    if isinstance(index, int) or isinstance(index, torch.Tensor) and index.ndim == 0:
        index = [int(index)]  # one item: its frames (or stack), not the item as a batch
    if isinstance(data, Storage):
        _require_rows(data)
        rows = torch.arange(min(max_frames, len(data))) if index is None else torch.as_tensor(index)
        data, index = _read(data, rows), None
    if isinstance(data, TensorDictBase):
        data = _get(data, key)
    frames = data if index is None else data[index]
    if not len(frames):
        raise ValueError("nothing to plot: no frames were selected")
    images = _as_images(frames[:max_frames])
    n, stack = images.shape[:2]
    if stack > 1:
        nrows, ncols = n, stack
        cells = [images[i, s] for i in range(n) for s in range(stack)]
    else:
        ncols = ncols or min(n, 8)
        nrows = -(-n // ncols)
        cells = [images[i, 0] for i in range(n)]
    height, width = images.shape[2:4]
    side = 1.4 / max(height, width)  # inches per pixel: the longer side of a frame is 1.4"
    fig = _figure(ncols * width * side + 0.2, nrows * height * side + 0.4)
    for i, image in enumerate(cells):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        shown = image[..., 0] if image.shape[-1] == 1 else image
        ax.imshow(shown.numpy(), cmap="gray" if image.shape[-1] == 1 else None,
                  vmin=0, vmax=1 if image.is_floating_point() else 255, interpolation="nearest")
        ax.set_axis_off()
    fig.suptitle(f"{n} frame{'s' if n != 1 else ''}" + (f" (stacks of {stack})" if stack > 1 else ""))
    return fig


def _discrete(actions: torch.Tensor) -> torch.Tensor | None:
    """Action indices when ``actions`` are categorical (one integer per step, or one-hot),
    else None (continuous, or several integer dims: plotted per dimension)."""
    if actions.is_floating_point():
        return None
    per_step = actions.reshape(actions.shape[0], -1) if actions.ndim > 1 else actions.reshape(-1, 1)
    if per_step.shape[1] == 1:  # an index per step (a flag: 0 or 1)
        return per_step[:, 0].to(torch.int64)
    one_hot = ((per_step == 0) | (per_step == 1)).all() and (per_step.sum(-1) == 1).all()
    return per_step.to(torch.int64).argmax(-1) if bool(one_hot) else None


#: Integer actions spanning more values than this are drawn as a histogram of ``bins``
#: bins, not a bar each (100,000 distinct ids took 61-96 s as bars, and as much memory).
MAX_ACTION_BARS = 1024
#: Continuous actions of more dimensions than this have only their first ones drawn (a
#: histogram each: 200 took 16 s and a figure 130 inches high).
MAX_ACTION_DIMS = 16


def action_hist(data: Storage | TensorDictBase | torch.Tensor, *, key: Any = "action",
                bins: int = 30):
    """Action distribution: a bar per action for discrete actions (indices or one-hot,
    spanning fewer than :data:`MAX_ACTION_BARS` values), else one histogram per action
    dimension."""
    actions = data.cpu() if isinstance(data, torch.Tensor) else _get(time_ordered(data), key)
    if actions.ndim == 0 or not actions.numel():
        raise ValueError("nothing to plot: no actions (expected a value or vector per step)")
    if actions.is_complex():
        raise TypeError("action_hist plots real values; for complex actions pass "
                        "actions.real or actions.imag")
    index = _discrete(actions)
    if index is not None and int(index.max()) - int(index.min()) >= MAX_ACTION_BARS:
        actions, index = index, None  # too many for a bar each (an id): a histogram of them
    if index is not None:
        fig = _figure()
        ax = fig.add_subplot()
        low = int(index.min())
        counts = torch.bincount(index - low)
        ax.bar(torch.arange(low, low + len(counts)).numpy(), counts.numpy())
        steps = index.numel()
        ax.set(title=f"Actions ({steps} step{'s' if steps != 1 else ''})", xlabel="action",
               ylabel="count")
        return fig
    flat = actions.reshape(actions.shape[0], -1).to(torch.float64) if actions.ndim > 1 \
        else actions.reshape(-1, 1).to(torch.float64)
    total = flat.shape[1]
    dims = min(total, MAX_ACTION_DIMS)
    ncols = min(dims, 4)
    fig = _figure(3.2 * ncols, 2.6 * -(-dims // ncols))
    for d in range(dims):
        ax = fig.add_subplot(-(-dims // ncols), ncols, d + 1)
        values, note = _finite(flat[:, d], f"action[{d}] values")
        ax.hist(values.numpy(), bins=bins)
        ax.set(title=f"action[{d}]{note}", xlabel="value", ylabel="count" if d % ncols == 0 else None)
    if total > dims:
        fig.suptitle(f"the first {dims} of {total} action dimensions (slice the actions to "
                     "see others)")
    return fig
