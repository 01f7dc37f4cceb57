"""Sealed datasets: the episode index against a plain-Python model, sampling, opening cost."""

from __future__ import annotations

import functools
import json
import http.server
import math
import re
import threading
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import zstore
from zstore.dataset import open_dataset


def _transitions(n: int, seed: int = 0, lanes: tuple[int, ...] = ()) -> TensorDict:
    """TED steps whose ("collector", "traj_ids") and obs let a test check episode membership."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, *lanes)
    term = torch.rand(*shape, 1, generator=g) < 0.06
    trunc = (torch.rand(*shape, 1, generator=g) < 0.04) & ~term
    done = term | trunc
    # trajectory ids: a new id after every done step, per lane
    ids = torch.cumsum(torch.cat([torch.zeros(1, *lanes, 1, dtype=torch.long),
                                  done[:-1].long()]), 0).squeeze(-1)
    return TensorDict({
        "obs": torch.arange(n * max(1, int(torch.tensor(lanes).prod()) if lanes else 1),
                            dtype=torch.float32).reshape(*shape, 1),
        "action": torch.randn(*shape, 2, generator=g),
        ("collector", "traj_ids"): ids,
        ("next", "reward"): torch.randn(*shape, 1, generator=g),
        ("next", "done"): done, ("next", "terminated"): term, ("next", "truncated"): trunc,
    }, batch_size=list(shape))


def _model_episodes(td: TensorDict) -> list[dict]:
    """Reference index of a 1-D chronological TD: a plain loop over the done flags."""
    out, start = [], 0
    for t in range(td.shape[0]):
        if bool(td["next", "done"][t]) or t == td.shape[0] - 1:
            out.append({"start": start, "length": t - start + 1,
                        "return": float(td["next", "reward"][start:t + 1].double().sum()),
                        "terminated": bool(td["next", "terminated"][t]),
                        "truncated": bool(td["next", "truncated"][t])})
            start = t + 1
    return out


def _as_rows(index: TensorDict) -> list[dict]:
    return [{"start": int(e["start"]), "length": int(e["length"]),
             "return": pytest.approx(float(e["return"][0])),
             "terminated": bool(e["terminated"]), "truncated": bool(e["truncated"])}
            for e in index]


def _sealed(location, td: TensorDict, capacity: int | None = None, **kw) -> str:
    url = location.new("ds")
    storage = zstore.LazyMemmapStorage(capacity or td.shape[0], scratch_dir=url,
                                       storage_options=location.options, **kw)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(td)
    assert storage.seal() > 0
    storage.close()
    return url


@pytest.mark.parametrize("odd", [float("nan"), float("inf"), 1e17])
def test_an_odd_reward_stays_in_its_episodes_return(location, odd):
    """Regression: the index's returns were differences of running sums, so one NaN, inf or
    huge reward changed the return of every later episode (NaN, NaN; 0.0 for 3.0)."""
    td = _transitions(120, seed=5)
    td["next", "reward"][3] = odd
    model = _model_episodes(td)
    url = _sealed(location, td)
    got = open_dataset(url, location.options).episodes["return"][:, 0].tolist()
    assert len(model) > 5
    assert got[1:] == pytest.approx([e["return"] for e in model[1:]])
    assert got[0] == model[0]["return"] or math.isnan(odd) and math.isnan(got[0])


def test_episode_index_matches_a_python_model(location):
    td = _transitions(300)
    td["next", "done"][-1] = td["next", "terminated"][-1] = td["next", "truncated"][-1] = False
    ds = open_dataset(_sealed(location, td, codec="zstd", chunks=32), location.options)
    model = _model_episodes(td)
    assert ds.num_episodes == len(model) > 5
    assert _as_rows(ds.episodes) == model
    assert (ds.episodes["stop"] == ds.episodes["start"] + ds.episodes["length"]).all()
    assert not ds.episodes["terminated"][-1] and not ds.episodes["truncated"][-1]  # open
    for i in (0, 3, -1):
        entry = model[i]
        assert (ds.episode(i) == td[entry["start"]: entry["start"] + entry["length"]]).all()
    with pytest.raises(IndexError, match=f"episode {len(model)} is out of range.*{len(model)} episodes"):
        ds.episode(len(model))
    assert f"episodes={len(model)}" in repr(ds)
    ds.close()


def test_a_wrong_episode_number_or_row_names_the_dataset(location):
    """Before: ds.episode("a") raised Python's "'<=' not supported", True and 2.0 read as
    episodes 1 and 2, and an out-of-range row was torch's message without the dataset."""
    td = _transitions(120, seed=2)
    ds = open_dataset(_sealed(location, td), location.options)
    where = re.escape(ds.spec.redacted())
    assert ds.num_episodes > 2
    for wrong in ("a", True, 2.0, torch.tensor(1.0)):
        with pytest.raises(TypeError, match=f"an episode number is an int, got .*: {where} has "):
            ds.episode(wrong)
    for number in (np.int64(1), torch.tensor(1)):
        assert (ds.episode(number) == ds.episode(1)).all()
    for row in (120, -121, [3, 500], torch.tensor([0.0])):
        with pytest.raises(IndexError, match=f"\\(reading {where}\\)$"):
            ds[row]
    ds.close()


def test_wrapped_ring_is_indexed_in_chronological_order(tmp_path):
    td = _transitions(130, seed=3)
    for key in ("done", "terminated", "truncated"):
        td["next", key][92:108] = False  # one episode runs from row 9x over the end into row 0x
    url = str(tmp_path / "ring")
    storage = zstore.LazyMemmapStorage(100, scratch_dir=url, codec="zstd", chunks=16)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(td[:70])
    writer.extend(td[70:])  # transitions 100..129 overwrote rows 0..29: the oldest row is 30
    storage.seal()
    ds = open_dataset(url)
    kept = td[30:]
    model = _model_episodes(kept)
    got = _as_rows(ds.episodes)
    assert [g["length"] for g in got] == [m["length"] for m in model]
    assert [g["start"] for g in got] == [(m["start"] + 30) % 100 for m in model]
    assert [g["return"] for g in got] == [m["return"] for m in model]
    crossing = [i for i, g in enumerate(got) if g["start"] + g["length"] > 100]
    assert len(crossing) == 1
    assert int(ds.episodes["stop"][crossing[0]]) > 100
    for i, m in enumerate(model):
        assert (ds.episode(i) == kept[m["start"]: m["start"] + m["length"]]).all()
    windows = ds.sample_slices(200, 12, generator=torch.Generator().manual_seed(0))
    obs = windows["obs"][..., 0]
    assert torch.equal(obs[:, 1:], obs[:, :-1] + 1)  # consecutive transitions, across row 99 -> 0


def test_ndim2_episodes_per_lane(tmp_path):
    td = _transitions(60, seed=5, lanes=(3,))
    url = str(tmp_path / "lanes")
    storage = zstore.LazyMemmapStorage(180, scratch_dir=url, ndim=2, codec="zstd", chunks=8)
    storage.set(torch.arange(60), td)
    storage.seal()
    ds = open_dataset(url)
    index = ds.episodes
    expected = []
    for lane in range(3):
        expected += [{**m, "lane": lane} for m in _model_episodes(td[:, lane])]
    assert index["lane"].tolist() == [m["lane"] for m in expected]
    assert _as_rows(index) == [{k: v for k, v in m.items() if k != "lane"} for m in expected]
    for i in (0, len(expected) // 2, -1):
        m = expected[i]
        assert (ds.episode(i) == td[m["start"]: m["start"] + m["length"], m["lane"]]).all()
    sl = ds.sample_slices(16, 3, generator=torch.Generator().manual_seed(0))
    assert sl.batch_size == (16, 3)
    ids = sl["collector", "traj_ids"]
    assert (ids == ids[:, :1]).all()
    assert torch.equal(sl["obs"][:, 1:], sl["obs"][:, :-1] + 3)  # next step of the same lane
    assert ds.sample(10)["obs"].shape == (10, 1)


def test_sample_slices_stay_inside_episodes(location):
    td = _transitions(400, seed=1)
    ds = open_dataset(_sealed(location, td, codec="zstd", chunks=40), location.options,
                      cache_bytes=1 << 12)
    g = torch.Generator().manual_seed(7)
    sl = ds.sample_slices(64, 5, generator=g)
    assert sl.batch_size == (64, 5)
    ids = sl["collector", "traj_ids"]
    assert (ids == ids[:, :1]).all()  # one trajectory per window
    assert torch.equal(sl["obs"][:, 1:], sl["obs"][:, :-1] + 1)  # consecutive steps
    assert not sl["next", "done"][:, :-1].any()  # only the last step may end an episode
    for window in sl:
        row = int(window["obs"][0])
        assert (window == td[row: row + 5]).all()
    # every window that fits can be drawn: their starts cover them all after enough draws
    lengths = ds.episodes["length"]
    fits = int((lengths - 5 + 1).clamp(min=0).sum())
    starts = set(ds.sample_slices(4000, 5, generator=g)["obs"][:, 0, 0].long().tolist())
    assert len(starts) == fits
    assert ds.cache_stats.loads > 0  # read through the hot-chunk cache
    longest = int(lengths.max())
    with pytest.raises(ValueError, match=f"slice_len={longest + 1}.*longest has {longest}"):
        ds.sample_slices(2, longest + 1)
    batch = ds.sample(32, generator=torch.Generator().manual_seed(0))
    rows = batch["obs"][:, 0].long()
    assert (batch == td[rows]).all()
    assert ds.sample(0).batch_size == (0,)
    with pytest.raises(ValueError, match="batch_size must be >= 0, got -1"):
        ds.sample(-1)  # was torch's "negative dimension"
    ds.close()


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):  # one entry per request, instead of stderr
        self.server.requests.append((self.command, self.path))


@pytest.fixture
def http_root(tmp_path):
    """A directory served over HTTP on 127.0.0.1 by an in-process server that logs requests."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_CountingHandler, directory=str(tmp_path)))
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}", server.requests
    server.shutdown()
    thread.join()


def test_opening_over_http_is_one_request(http_root):
    root, base, requests = http_root
    td = _transitions(500, seed=2)
    storage = zstore.LazyMemmapStorage(500, scratch_dir=str(root / "ds"), codec="zstd", chunks=64)
    storage.set(torch.arange(500), td)
    storage.seal()
    requests.clear()
    ds = open_dataset(f"{base}/ds")
    assert requests == [("GET", "/ds/zarr.json")]
    assert (ds.sample_slices(8, 4)["collector", "traj_ids"].diff(dim=1) == 0).all()
    assert (ds[:] == td).all()
    ds.close()


@pytest.mark.s3
def test_opening_on_s3_is_one_request(s3_bucket, s3_options):
    """Counted at a proxy in front of the server: one request, whichever the transport."""
    from faultproxy import logged

    url = f"s3://{s3_bucket}/one-request"
    storage = zstore.LazyMemmapStorage(200, scratch_dir=url, storage_options=s3_options)
    storage.set(torch.arange(200), _transitions(200))
    storage.seal()
    with logged(s3_options, s3_bucket) as requests:
        ds = open_dataset(url, requests.options)
        assert requests.seen() == [("GET", "one-request/zarr.json")]
        assert len(ds.sample(16)) == 16
        ds.close()


def test_open_dataset_refuses_what_is_not_a_sealed_dataset(tmp_path):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(50, scratch_dir=url)
    td = _transitions(40)
    storage.set(torch.arange(40), td)
    storage.flush()
    with pytest.raises(zstore.NotAZStoreError,
                       match=f"{url} holds a LazyMemmapStorage that is not sealed; publish it "
                             "with zstore.seal"):
        open_dataset(url)
    with pytest.raises(zstore.StoreNotFoundError, match="nope"):
        open_dataset(str(tmp_path / "nope"))
    # each named for what it is, with the way on (not "a None that is not sealed", nor
    # advice to seal what cannot be sealed)
    import zarr

    from checkpoint import TensorStorageCheckpointer

    zarr.open_group(str(tmp_path / "plain"), mode="w").create_array("x", shape=(2,), dtype="f4")
    ram = zstore.LazyTensorStorage(50)
    ram.set(torch.arange(40), td)
    ram.checkpointer = TensorStorageCheckpointer()
    ram.dumps(str(tmp_path / "ckpt"))
    for where, what in ((f"{url}/obs", "is one array .* of a store, not a dataset: open the "
                                       "dataset's folder"),
                        (str(tmp_path / "plain"), "is a Zarr group but not a zstore buffer"),
                        (str(tmp_path / "ckpt"), "holds a zstore checkpoint .*, not a "
                                                 "dataset: load it with storage.loads")):
        with pytest.raises(zstore.NotAZStoreError, match=what):
            open_dataset(where)
    (tmp_path / "bad").mkdir()  # a malformed checkpoint record: still named
    (tmp_path / "bad" / "zarr.json").write_text(json.dumps(
        {"zarr_format": 3, "node_type": "group",
         "attributes": {"zstore_checkpoint": {"length": "3", "max_size": None}}}))
    with pytest.raises(zstore.NotAZStoreError, match=r"checkpoint \(\?, length \?\)"):
        open_dataset(str(tmp_path / "bad"))
    for attributes in ([1], "x"):  # malformed attributes: still named, not an AttributeError
        (tmp_path / "plain" / "zarr.json").write_text(json.dumps(
            {"zarr_format": 3, "node_type": "group", "attributes": attributes}))
        with pytest.raises(zstore.NotAZStoreError, match="not a zstore"):
            open_dataset(str(tmp_path / "plain"))
    assert zstore.seal(url) == len(_model_episodes(td))
    storage.close()
    ds = open_dataset(url)
    assert len(ds) == 40 and _as_rows(ds.episodes) == _model_episodes(td)
    with pytest.raises(zstore.NotAZStoreError, match="nothing was written"):
        zstore.LazyMemmapStorage(5, scratch_dir=str(tmp_path / "empty")).seal()


def test_a_sealed_local_dataset_stays_readable_by_plain_zarr_and_tensordict(tmp_path):
    url = str(tmp_path / "ds")
    td = _transitions(50)
    storage = zstore.LazyMemmapStorage(50, scratch_dir=url)
    storage.set(torch.arange(50), td)
    storage.seal()
    full = TensorDict.from_zarr(url)
    assert torch.equal(full["obs"][:50], td["obs"])
    assert full["__episodes__", "length"][: len(_model_episodes(td))].tolist() == \
        [m["length"] for m in _model_episodes(td)]
    reopened = zstore.open(url, mode="r+")  # the block says read-only: writes are refused
    with pytest.raises(zstore.ReadOnlyError):
        reopened.set(0, td[0])
    reopened.close()


def test_a_dataset_is_opened_not_created(tmp_path):
    with pytest.raises(TypeError, match="zstore.open_dataset"):
        zstore.Dataset(10, scratch_dir=str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_convert_keeps_ring_order_and_seals_the_copy(tmp_path):
    from zstore.dataset.convert import convert

    td = _transitions(150, seed=9)
    url = str(tmp_path / "ring")
    storage = zstore.LazyMemmapStorage(100, scratch_dir=url, codec="zstd", chunks=16)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    writer.extend(td[:80])
    writer.extend(td[80:])  # wraps: the oldest row is 50
    storage.flush()
    copy = convert(url, str(tmp_path / "copy"), codec="lz4", chunks=8, seal=True, progress=False)
    storage.seal()
    a, b = open_dataset(url), open_dataset(tmp_path / "copy")
    assert (len(a), a._last_cursor_index) == (len(b), b._last_cursor_index) == (100, 49)
    assert (a[:] == b[:]).all() and (a.episodes == b.episodes).all()
    assert _as_rows(b.episodes) == [{**m, "start": (m["start"] + 50) % 100}
                                    for m in _model_episodes(td[50:])]
    assert str(copy.codec) == "lz4:5+crc32c" and b._meta.layout["obs"] == (8, None)


@pytest.mark.parametrize("damage", ["a lost chunk", "a lost flag chunk", "a lost folder",
                                    "a flipped byte"])
def test_a_damaged_episode_index_is_refused_and_convert_rebuilds_it(location, damage):
    """Zarr reads a lost chunk of the index as zeros: a dataset copied without one chunk of
    ``start`` served episode 3 as rows 0-9, one copied without ``__episodes__`` served every
    episode empty, and a flipped byte raised zarr's bare ValueError naming nothing. A lost
    chunk of ``terminated`` (or ``truncated``, ``return``) served every episode as truncated,
    since the index is consistent without it: sealing stores every chunk of the index, so
    a missing one is refused. Each raises CorruptChunkError naming the dataset and the fix,
    which works: ``convert`` computes the index again from the rows."""
    from zstore.dataset.convert import convert
    from zstore.storages.episode_index import INDEX_PATH

    td = _transitions(60, seed=3)
    url = _sealed(location, td, codec="zstd+crc32c", chunks=16)
    fs, root = zstore.StoreSpec.parse(url, location.options).filesystem()
    if damage == "a lost chunk":
        fs.rm(f"{root}/{INDEX_PATH}/start/c/0")
    elif damage == "a lost flag chunk":
        fs.rm(f"{root}/{INDEX_PATH}/terminated/c/0")
    elif damage == "a lost folder":
        fs.rm(f"{root}/{INDEX_PATH}", recursive=True)
    else:
        chunk = f"{root}/{INDEX_PATH}/length/c/0"
        data = fs.cat_file(chunk)
        fs.pipe_file(chunk, data[:5] + bytes([data[5] ^ 0x40]) + data[6:])
    dataset = open_dataset(url, location.options)
    assert (dataset[:] == td).all()  # the rows are intact
    for use in (lambda: dataset.episodes, lambda: dataset.episode(3),
                lambda: dataset.sample_slices(4, 3)):
        with pytest.raises(zstore.CorruptChunkError, match="episode index") as err:
            use()
        assert url in str(err.value) and "zstore convert" in str(err.value)
    copy = location.new("copy")
    convert(url, copy, location.options, dst_options=location.options, seal=True, progress=False)
    assert _as_rows(open_dataset(copy, location.options).episodes) == _model_episodes(td)


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(1, 40), capacity=st.integers(1, 40), lanes=st.sampled_from([(), (2,)]),
       seed=st.integers(0, 2**16), with_flags=st.booleans())
def test_episode_index_property(steps, capacity, lanes, seed, with_flags):
    """Any done pattern, ring wrap and lane count: the index equals the per-lane model."""
    td = _transitions(steps, seed=seed, lanes=lanes)
    if not with_flags:  # only ("next", "done"): terminated = done, never truncated
        del td["next", "terminated"], td["next", "truncated"]
    url = f"memory://zstore-prop/{uuid.uuid4().hex}"
    rows = -(-capacity // 2) if lanes else capacity
    storage = zstore.LazyMemmapStorage(rows * (2 if lanes else 1), scratch_dir=url,
                                       ndim=2 if lanes else 1, codec="zstd", chunks=4)
    writer = zstore.RoundRobinWriter()
    writer.register_storage(storage)
    for start in range(0, steps, 7):
        writer.extend(td[start:start + 7])
    storage.seal()
    ds = open_dataset(url)
    kept = td[max(0, steps - rows):]  # what the ring still holds, oldest first
    first_row = (steps - len(kept)) % rows
    expected = []
    for lane in range(2 if lanes else 1):
        series = kept[:, lane] if lanes else kept
        if not with_flags:
            series = series.clone()
            series["next", "terminated"] = series["next", "done"]
            series["next", "truncated"] = torch.zeros_like(series["next", "done"])
        expected += [{**m, "start": (m["start"] + first_row) % rows}
                     for m in _model_episodes(series)]
    assert _as_rows(ds.episodes) == expected
    assert int(ds.episodes["length"].sum()) == len(kept) * (2 if lanes else 1)
    ds.close()
    storage.close()


def test_a_seal_interrupted_before_its_commit_leaves_a_writable_buffer(tmp_path, monkeypatch):
    from zstore.storages import sealing

    url = str(tmp_path / "rb")
    td = _transitions(60, seed=4)
    storage = zstore.LazyMemmapStorage(100, scratch_dir=url, codec="zstd", chunks=16)
    storage.set(torch.arange(40), td[:40])

    def crash(*args):
        raise KeyboardInterrupt("killed before the commit")

    monkeypatch.setattr(sealing, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        storage.seal()
    monkeypatch.undo()
    with pytest.raises(zstore.NotAZStoreError, match="not sealed"):
        open_dataset(url)
    again = zstore.open(url)  # still an ordinary buffer: keep writing, then seal for real
    assert len(again) == 40 and not again._meta.sealed
    again.set(torch.arange(40, 60), td[40:])
    again.seal()
    ds = open_dataset(url)
    assert len(ds) == 60 and _as_rows(ds.episodes) == _model_episodes(td)
    assert (ds[:] == td).all()


def test_sealing_a_buffer_of_no_rows_names_the_url_and_the_fix(tmp_path):
    """A buffer whose arrays exist but whose length is 0 (emptied, or left by an import killed
    before its first commit) is refused by the seal; it stays an unsealed, writable buffer."""
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(50, scratch_dir=url)
    storage.set(torch.arange(10), _transitions(10))
    storage.flush()
    storage._empty()  # what a replay buffer's empty() calls
    storage.flush()
    storage.close()
    with pytest.raises(zstore.NotAZStoreError,
                       match=rf"cannot seal {url}: it holds no rows.*run it again"):
        zstore.seal(url)
    again = zstore.open(url, mode="r")
    assert len(again) == 0 and not again._meta.sealed


@pytest.mark.parametrize("step", ["seal", "flush", "close"])
def test_a_conversion_interrupted_after_its_rows_leaves_nothing(location, monkeypatch, step):
    """Ctrl-C while a conversion stores its last chunks, seals or closes the copy: the copy
    was deleted only when the interrupt came during the row copy, so a late one left key
    folders (no root zarr.json: invisible to ``zstore ls``) or a whole buffer, and a rerun
    was refused ("not empty"). Now nothing is left and the rerun copies."""
    from zstore.dataset.convert import convert
    from zstore.storages.memmap import LazyMemmapStorage

    td = _transitions(80, seed=5)
    src = location.new("src")
    storage = zstore.LazyMemmapStorage(100, scratch_dir=src, storage_options=location.options,
                                       codec="zstd", chunks=16)
    storage.set(torch.arange(80), td)
    storage.close()
    dst = location.new("dst")
    real = getattr(LazyMemmapStorage, step)

    def interrupted(self, *args, **kwargs):
        real(self, *args, **kwargs)  # the step's work done, then the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(LazyMemmapStorage, step, interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, location.options, seal=step != "flush", progress=False)
    monkeypatch.undo()
    assert not zstore.StoreSpec.parse(dst, location.options).exists()
    copy = convert(src, dst, location.options, seal=True, progress=False)
    assert len(copy) == 80 and (open_dataset(dst, location.options)[:] == td).all()
