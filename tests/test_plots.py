"""zstore.plots: episode statistics against a plain-Python reference, and the figures' contents."""

from __future__ import annotations

import sys

import matplotlib
import numpy as np
import math

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import plots
from zstore.demo import PointMassEnv

matplotlib.use("Agg")


def reference_episodes(rows: list[dict]) -> list[tuple[float, int]]:
    """(return, length) of each finished trajectory, in trajectory id order."""
    acc: dict[int, list] = {}
    for row in rows:
        entry = acc.setdefault(row["traj"], [0.0, 0, False])
        entry[0] += row["reward"]
        entry[1] += 1
        entry[2] |= row["done"]
    return [(r, n) for _, (r, n, done) in sorted(acc.items()) if done]


def as_rows(td: TensorDict) -> list[dict]:
    return [{"traj": int(t), "reward": float(r), "done": bool(d)}
            for t, r, d in zip(td["collector", "traj_ids"], td["next", "reward"].reshape(-1),
                               td["next", "done"].reshape(-1))]


@pytest.fixture(scope="module")
def rollouts() -> TensorDict:
    """Six writes of 4 envs x 32 steps, env-major (as the demo writes them): 768 rows."""
    env = PointMassEnv(4, seed=1, max_steps=40)
    return torch.cat([env.rollout(32).reshape(-1) for _ in range(6)])


def test_episode_bounds():
    done = torch.tensor([False, True, False, False, True, False])
    start, stop = plots.episode_bounds(done)
    assert start.tolist() == [0, 2] and stop.tolist() == [2, 5]
    start, stop = plots.episode_bounds(done.unsqueeze(-1), partial=True)
    assert start.tolist() == [0, 2, 5] and stop.tolist() == [2, 5, 6]
    assert [t.tolist() for t in plots.episode_bounds(torch.zeros(3, dtype=torch.bool))] == [[], []]
    assert [t.tolist() for t in plots.episode_bounds(torch.zeros(3, dtype=torch.bool),
                                                     partial=True)] == [[0], [3]]
    assert [t.tolist() for t in plots.episode_bounds(torch.ones(2, 1, dtype=torch.bool))] == \
        [[0, 1], [1, 2]]


def test_episode_stats_by_trajectory_id(rollouts):
    stats = plots.episode_stats(rollouts)
    expected = reference_episodes(as_rows(rollouts))
    assert len(expected) > 10
    assert stats["length"].tolist() == [n for _, n in expected]
    assert torch.allclose(stats["return"], torch.tensor([r for r, _ in expected], dtype=torch.float64))


def test_episode_stats_from_done_flags_per_lane():
    reward = torch.arange(12.0).reshape(6, 2)          # [T, B]
    done = torch.zeros(6, 2, dtype=torch.bool)
    done[1, 0] = done[4, 0] = done[5, 1] = True
    td = TensorDict({("next", "reward"): reward.unsqueeze(-1), ("next", "done"): done.unsqueeze(-1)},
                    batch_size=[6, 2])
    stats = plots.episode_stats(td)
    # lane 0: rows 0-1 (0 + 2), rows 2-4 (4 + 6 + 8); lane 1: rows 0-5 (1 + 3 + ... + 11)
    assert stats["return"].tolist() == [2.0, 18.0, 36.0] and stats["length"].tolist() == [2, 3, 6]
    flat = td[:, 0]
    assert plots.episode_stats(flat)["length"].tolist() == [2, 3]


@pytest.mark.parametrize("odd", [float("nan"), float("inf"), 1e17])
def test_an_odd_reward_stays_in_its_episode(odd):
    """Regression: returns were differences of running sums, so a NaN, an inf or a huge
    reward in one episode changed the return of every later one (NaN, NaN; 0.0 for 3.0)."""
    reward = torch.tensor([1.0, odd, 1.0, 1.0, 1.0, 2.0, -1.0], dtype=torch.float64)
    done = torch.tensor([False, True, False, False, True, False, True])
    td = TensorDict({("next", "reward"): reward.unsqueeze(-1), ("next", "done"): done.unsqueeze(-1)},
                    batch_size=[7])
    got = plots.episode_stats(td)["return"].tolist()
    assert got[1:] == [3.0, 1.0] and (got[0] == odd + 1.0 or math.isnan(odd) and math.isnan(got[0]))


def test_traj_key_none_uses_contiguous_runs(rollouts):
    stats = plots.episode_stats(rollouts, traj_key=None)
    done = rollouts["next", "done"].reshape(-1)
    start, stop = plots.episode_bounds(done)
    reward = rollouts["next", "reward"].reshape(-1).double()
    assert stats["length"].tolist() == (stop - start).tolist()
    assert torch.allclose(stats["return"], torch.stack([reward[a:b].sum() for a, b in zip(start, stop)]))


def check_oldest_first(storage, rollouts) -> None:
    """Fill ``storage`` (capacity 500) with 768 rows in writes of 128; read it back in time order
    (a list storage by the item its writer wrote last: it was read in index order)."""
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    for i in range(0, len(rollouts), 128):
        writer.extend(rollouts[i:i + 128])
    kept = rollouts[len(rollouts) - 500:]  # the ring keeps the newest 500 rows
    ordered = plots.time_ordered(storage)
    assert ordered["observation"].equal(kept["observation"])
    stats = plots.episode_stats(storage)
    expected = reference_episodes(as_rows(kept))
    assert stats["length"].tolist() == [n for _, n in expected]


def test_memmap_storage_is_read_oldest_first(rollouts, location):
    check_oldest_first(zstore.LazyMemmapStorage(500, scratch_dir=location.new(),
                                                storage_options=location.options, codec="zstd"),
                       rollouts)


@pytest.mark.parametrize("cls", ["LazyTensorStorage", "ListStorage", "LazyStackStorage"])
def test_in_ram_storages_are_read_oldest_first(rollouts, cls):
    check_oldest_first(getattr(zstore, cls)(500), rollouts)


def test_return_and_length_histograms(rollouts):
    stats = plots.episode_stats(rollouts)
    fig = plots.episode_return_hist(rollouts, bins=12)
    (ax,) = fig.axes
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 12 and sum(heights) == len(stats)
    counts, _ = np.histogram(stats["return"].numpy(), bins=12)
    assert heights == counts.tolist()
    fig = plots.episode_length_hist(rollouts, bins=5)
    (ax,) = fig.axes
    assert len(ax.patches) == 5 and sum(p.get_height() for p in ax.patches) == len(stats)
    assert f"({len(stats)} episodes)" in ax.get_title()


def test_reward_done_timeline(rollouts):
    fig = plots.reward_done_timeline(rollouts, start=10, stop=138)
    (ax,) = fig.axes
    (line,) = ax.lines
    assert line.get_xdata().tolist() == list(range(10, 138))
    assert np.allclose(line.get_ydata(), rollouts["next", "reward"][10:138].reshape(-1).numpy())
    terminated, truncated = ax.collections
    part = rollouts[10:138]
    assert len(terminated.get_offsets()) == int(part["next", "terminated"].sum())
    assert len(truncated.get_offsets()) == int(part["next", "truncated"].sum())
    no_split = rollouts.exclude(("next", "terminated"))
    (done,) = plots.reward_done_timeline(no_split, stop=138).axes[0].collections
    assert len(done.get_offsets()) == int(rollouts["next", "done"][:138].sum())


def test_reward_done_timeline_takes_bounds_as_python_slices_do(rollouts):
    """``start=-50`` drew the last 50 steps at x = -50..-1, and an empty range raised a raw
    reshape error."""
    n = rollouts.shape[0]
    (line,) = plots.reward_done_timeline(rollouts, start=-50).axes[0].lines
    assert line.get_xdata().tolist() == list(range(n - 50, n))
    assert np.allclose(line.get_ydata(), rollouts["next", "reward"][-50:].reshape(-1).numpy())
    for start, stop in ((100, 10), (n + 5, None)):
        with pytest.raises(ValueError, match=f"start={start}, stop={stop} select no row of the "
                                             f"{n} rows"):
            plots.reward_done_timeline(rollouts, start=start, stop=stop)


@pytest.mark.parametrize("shape, axes, first_image", [
    ((5, 3, 12, 10), 5, lambda f: f[0].permute(1, 2, 0)),      # [N, C, H, W]
    ((5, 12, 10, 3), 5, lambda f: f[0]),                       # [N, H, W, C]
    ((6, 12, 10), 6, lambda f: f[0]),                          # [N, H, W]
    ((3, 4, 12, 10), 12, lambda f: f[0, 0]),                   # frame stacks [N, S, H, W]
    ((2, 4, 3, 12, 10), 8, lambda f: f[0, 0].permute(1, 2, 0)),  # colour stacks [N, S, C, H, W]
    ((20, 1, 8, 8), 16, lambda f: f[0, 0]),                    # at most max_frames
])
def test_frame_grid(shape, axes, first_image):
    frames = torch.randint(0, 256, shape, dtype=torch.uint8)
    fig = plots.frame_grid(frames)
    assert len(fig.axes) == axes
    assert all(len(ax.images) == 1 for ax in fig.axes)
    shown = np.asarray(fig.axes[0].images[0].get_array())
    assert np.array_equal(shown, first_image(frames).numpy())


def test_frame_grid_from_a_storage():
    storage = zstore.LazyTensorStorage(10)
    pixels = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8)
    storage.set(torch.arange(10), TensorDict(pixels=pixels, batch_size=[10]))
    fig = plots.frame_grid(storage, index=[7, 2], ncols=1)
    assert len(fig.axes) == 2
    assert np.array_equal(np.asarray(fig.axes[1].images[0].get_array()), pixels[2].permute(1, 2, 0).numpy())
    with pytest.raises(ValueError, match=r"\[10, 5\]"):
        plots.frame_grid(torch.zeros(10, 5))


def test_action_hist_discrete_one_hot_and_continuous(rollouts):
    actions = torch.tensor([0, 2, 2, 3, 3, 3])
    (ax,) = plots.action_hist(actions).axes
    assert [p.get_height() for p in ax.patches] == [1, 0, 2, 3]
    one_hot = torch.nn.functional.one_hot(actions, 4)
    (ax,) = plots.action_hist(TensorDict(action=one_hot, batch_size=[6])).axes
    assert [p.get_height() for p in ax.patches] == [1, 0, 2, 3]
    fig = plots.action_hist(rollouts, bins=7)  # continuous 2-D actions: one axes per dim
    assert len(fig.axes) == 2
    for d, ax in enumerate(fig.axes):
        counts, _ = np.histogram(rollouts["action"][:, d].double().numpy(), bins=7)
        assert [p.get_height() for p in ax.patches] == counts.tolist()


def test_integer_actions_of_many_values_are_a_histogram_not_a_bar_each():
    """Integer actions spanning many values (an id per step) got a bar per value: 100,000
    ids took 61-96 s and as much memory. Past MAX_ACTION_BARS they are binned."""
    actions = torch.arange(5000) * 7
    (ax,) = plots.action_hist(actions, bins=12).axes
    counts, _ = np.histogram(actions.double().numpy(), bins=12)
    assert [p.get_height() for p in ax.patches] == counts.tolist()
    few = torch.tensor([0, plots.MAX_ACTION_BARS - 1])  # still a bar per value below it
    assert len(plots.action_hist(few).axes[0].patches) == plots.MAX_ACTION_BARS


def test_missing_key_is_named(rollouts):
    with pytest.raises(zstore.MissingKeyError, match=r"'pixels'.*observation"):
        plots.frame_grid(rollouts)
    with pytest.raises(KeyError, match="reward"):
        plots.episode_stats(rollouts.exclude(("next", "reward")))
    with pytest.raises(TypeError, match="storage or a TensorDict"):
        plots.episode_stats([1, 2])
    texts = rollouts.clone()
    texts.set_non_tensor(("info", "name"), "left")  # a text key: there, but no numbers
    with pytest.raises(TypeError, match=r"key \('info', 'name'\) holds .* not numbers"):
        plots.action_hist(texts, key=("info", "name"))


@pytest.mark.parametrize("cls", ["LazyTensorStorage", "ListStorage", "CompressedListStorage"])
@pytest.mark.parametrize("plot", ["episode_stats", "episode_return_hist", "episode_length_hist",
                                  "reward_done_timeline", "action_hist", "frame_grid"])
def test_an_empty_storage_says_there_is_nothing_to_plot(cls, plot):
    """Every plot of a storage (frame_grid too) checks for rows before reading any: they
    raised the storage's "Cannot get elements out of a non-initialized storage"."""
    with pytest.raises(ValueError, match=f"nothing to plot: this {cls} holds no rows yet"):
        getattr(plots, plot)(getattr(zstore, cls)(10))


def test_figure_renders_to_png(rollouts, tmp_path):
    plots.episode_return_hist(rollouts).savefig(tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matplotlib_missing_says_how_to_install(monkeypatch, rollouts):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"zstore\[notebooks\]"):
        plots.episode_return_hist(rollouts)


def test_edge_data_says_nothing_to_plot_or_leaves_non_finite_values_out():
    """Regression: an empty TensorDict raised torch's "cannot reshape tensor of 0 elements",
    a frame grid of no frame ZeroDivisionError, and an infinite action matplotlib's "range
    ... is not finite". Each now says "nothing to plot", or plots the finite values and
    says how many it left out."""
    empty = TensorDict({("next", "reward"): torch.zeros(0, 1), ("next", "done"): torch.zeros(0, 1, dtype=torch.bool),
                        "action": torch.zeros(0, 2)}, batch_size=[0])
    for plot in (plots.episode_stats, plots.episode_return_hist, plots.action_hist):
        with pytest.raises(ValueError, match="nothing to plot"):
            plot(empty)
    with pytest.raises(ValueError, match="nothing to plot: no frames"):
        plots.frame_grid(torch.zeros(0, 8, 8, dtype=torch.uint8))
    actions = torch.tensor([[0.5], [float("inf")], [1.5]])
    fig = plots.action_hist(actions)
    assert "1 NaN or infinite left out" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="nothing to plot: no finite"):
        plots.action_hist(torch.full((3, 1), float("nan")))
    reward = torch.tensor([float("nan"), 1.0, 2.0, 3.0], dtype=torch.float64)
    done = torch.tensor([True, False, False, True])
    td = TensorDict({("next", "reward"): reward[:, None], ("next", "done"): done[:, None]},
                    batch_size=[4])
    assert "1 NaN or infinite left out" in plots.episode_return_hist(td).axes[0].get_title()


def test_action_hist_edges_and_frame_grid_of_one_stack():
    """An empty tensor drew an empty figure, complex actions were bars of their real parts'
    integers, one action read "1 steps", 200 continuous dims drew 200 axes (16 s, a figure
    130 inches high), an ensemble raised from inside ``get``, and ``frame_grid(index=3)`` of
    frame stacks showed row 3's stack as "4 frames"."""
    for empty in (torch.zeros(0, dtype=torch.long), torch.zeros(5, 0)):  # (ZeroDivisionError)
        with pytest.raises(ValueError, match="nothing to plot: no actions"):
            plots.action_hist(empty)
    flags = torch.tensor([[True], [True], [False]])  # all True read as one-hot: "action 0"
    assert [p.get_height() for p in plots.action_hist(flags).axes[0].patches] == [1, 2]
    assert [p.get_height() for p in plots.action_hist(flags[:2]).axes[0].patches] == [2]
    assert plots.action_hist(flags[:2]).axes[0].patches[0].get_x() == pytest.approx(0.6)
    with pytest.raises(TypeError, match=r"actions.real or actions.imag"):
        plots.action_hist(torch.randn(20, dtype=torch.complex64))
    assert plots.action_hist(torch.tensor([3])).axes[0].get_title() == "Actions (1 step)"
    wide = torch.randn(50, 200)
    fig = plots.action_hist(wide, bins=5)
    assert len(fig.axes) == plots.MAX_ACTION_DIMS
    assert fig._suptitle.get_text().startswith(f"the first {plots.MAX_ACTION_DIMS} of 200 action")
    counts, _ = np.histogram(wide[:, 15].double().numpy(), bins=5)
    assert [p.get_height() for p in fig.axes[15].patches] == counts.tolist()
    member = zstore.LazyTensorStorage(10)
    member.set(torch.arange(4), TensorDict(action=torch.zeros(4, dtype=torch.long), batch_size=[4]))
    with pytest.raises(TypeError, match=r"pass one of them \(ensemble\[0\]\)"):
        plots.action_hist(zstore.StorageEnsemble(member, zstore.LazyTensorStorage(10)))
    stacks = zstore.LazyTensorStorage(10)
    pixels = torch.randint(0, 256, (5, 4, 8, 8), dtype=torch.uint8)
    stacks.set(torch.arange(5), TensorDict(pixels=pixels, batch_size=[5]))
    for data in (stacks, pixels):
        for index in (3, torch.tensor(3)):
            fig = plots.frame_grid(data, index=index)
            assert fig._suptitle.get_text() == "1 frame (stacks of 4)"
            assert np.array_equal(np.asarray(fig.axes[2].images[0].get_array()), pixels[3, 2].numpy())
