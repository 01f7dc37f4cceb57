"""Contract suites: the behaviour every storage and every compare-and-swap backend shows.

Subclass them in a pytest module, once per storage class × store (as zarr-python's
``zarr.testing.StoreTests``)::

    class TestMyStorage(StorageTests):
        persistent = True

        @pytest.fixture
        def make(self, tmp_path):
            return lambda max_size: zstore.LazyMemmapStorage(max_size, scratch_dir=str(tmp_path / "rb"))

* :class:`StorageTests` needs a ``make`` fixture: a callable ``max_size -> storage``
  that creates a new, empty storage (at a new URL for persistent ones). It checks
  set / get / len / the last cursor against a plain list model through a ring that
  wraps, bad input leaving the storage as it was, pickling, a checkpoint round trip,
  and, with ``persistent = True``, ``flush()`` then a reopen by URL.
* :class:`ConditionalObjectsTests` needs an ``objects`` fixture: a fresh
  :class:`zstore.conditional.ConditionalObjects`. It checks create / read / replace
  / delete against tokens, and, for backends whose ``atomic`` is true, that of
  concurrent creates exactly one wins.

Rows are TensorDicts (``obs``: 3 floats, ``("next", "done")``), written by
:class:`zstore.ReplayBuffer`'s round-robin writer as a training loop would.
"""

from __future__ import annotations

import pickle
import random
import threading
from typing import Any, Callable, Iterator

import pytest
import torch
from tensordict import TensorDict

from ..api import open as open_storage
from ..replay_buffer import ReplayBuffer


def rows(start: int, n: int) -> TensorDict:
    """``n`` rows whose ``obs`` are ``start, start + 1, ...`` (each repeated 3 times)."""
    values = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict({"obs": values.unsqueeze(-1).expand(n, 3).clone(),
                       ("next", "done"): (values % 7 == 6).unsqueeze(-1)}, batch_size=[n])


def values_of(batch: Any) -> list[float]:
    """The ``obs`` value of each row a storage returned (a list of rows, or a batch)."""
    items = list(batch) if isinstance(batch, (list, tuple)) else [batch[i] for i in range(batch.shape[0])]
    out = []
    for item in items:
        obs, done = item["obs"], item["next", "done"]
        assert obs.shape == (3,) and bool((obs == obs[0]).all()), f"a row came back mangled: {obs}"
        assert bool(done.reshape(())) == (int(obs[0]) % 7 == 6), "a row's done flag is not its own"
        out.append(float(obs[0]))
    return out


class StorageTests:
    """Behaviour every storage shows; subclass with a ``make`` fixture (module docstring)."""

    #: Whether the storage lives at a URL that a new object reopens (``flush`` / ``open``).
    persistent = False
    #: Whether ``set`` records the last row written (``_last_cursor_index``): TorchRL's
    #: tensor storages do, its list storages do not.
    records_cursor = True
    #: Whether ``set`` refuses rows that do not match the stored ones (TorchRL's list
    #: storages keep any item).
    validates_rows = True
    #: Whether ``dumps`` / ``loads`` save it (TorchRL's ``ListStorage`` refuses).
    checkpointable = True
    capacity = 20

    @pytest.fixture
    def make(self) -> Callable[[int], Any]:  # pragma: no cover - every subclass overrides it
        """A callable ``max_size -> new empty storage``."""
        raise NotImplementedError("a StorageTests subclass defines the `make` fixture")

    @pytest.fixture
    def new(self, make) -> Iterator[Callable[[int], Any]]:
        """``make``, with every storage it made closed at the end of the test (committed
        while the test's servers still run)."""
        made: list[Any] = []

        def new_storage(max_size: int) -> Any:
            made.append(make(max_size))
            return made[-1]

        yield new_storage
        for storage in made:
            close = getattr(storage, "close", None)
            if close is not None and not getattr(storage, "read_only", False):
                close()

    def fill(self, storage: Any, sizes: list[int]) -> list[float]:
        """Extend ``storage`` by batches of ``sizes`` rows; the list model of what it holds."""
        model: list[float] = []
        buffer, written = ReplayBuffer(storage), 0
        for n in sizes:
            buffer.extend(rows(written, n))
            for value in range(written, written + n):
                slot = value % storage.max_size
                if slot == len(model):
                    model.append(float(value))
                else:
                    model[slot] = float(value)
            written += n
        return model

    def check(self, storage: Any, model: list[float]) -> None:
        """``storage`` holds exactly ``model``: its length, every row, and random gathers."""
        assert len(storage) == len(model)
        assert values_of(storage.get(torch.arange(len(model)))) == model
        rng = random.Random(len(model))
        picks = [rng.randrange(len(model)) for _ in range(16)]
        assert values_of(storage.get(torch.tensor(picks))) == [model[i] for i in picks]

    def test_set_get_len_and_cursor_follow_a_list_model(self, new):
        storage = new(self.capacity)
        assert len(storage) == 0
        model = self.fill(storage, [3, 5])
        self.check(storage, model)
        if self.records_cursor:
            assert storage._last_cursor_index == 7  # TorchRL's name: the last row written

    def test_a_ring_that_wraps_overwrites_the_oldest_rows(self, new):
        storage = new(self.capacity)
        model = self.fill(storage, [7, 9, 11, 6])  # 33 rows through a 20-row ring
        assert model[:13] == [float(v) for v in range(20, 33)]
        self.check(storage, model)
        if self.records_cursor:
            assert storage._last_cursor_index == 32 % self.capacity

    def test_bad_input_leaves_the_storage_as_it_was(self, new):
        if not self.validates_rows:
            pytest.skip("this storage keeps any item, as TorchRL's list storages do")
        storage = new(self.capacity)
        model = self.fill(storage, [6])
        buffer = ReplayBuffer(storage)
        wide = TensorDict({"obs": torch.zeros(4, 5), ("next", "done"): torch.zeros(4, 1, dtype=torch.bool)},
                          batch_size=[4])
        with pytest.raises((ValueError, RuntimeError)):
            buffer.extend(wide)
        self.check(storage, model)
        self.fill(storage, [2])  # and writing goes on where it was
        assert values_of(storage.get(torch.arange(6, 8))) == [0.0, 1.0]

    def test_pickle_gives_the_same_rows(self, new):
        storage = new(self.capacity)
        model = self.fill(storage, [5, 4])
        if self.persistent:
            storage.flush()
        self.check(pickle.loads(pickle.dumps(storage)), model)

    def test_checkpoint_round_trip(self, new, tmp_path):
        storage = new(self.capacity)
        model = self.fill(storage, [8, 15])
        if not self.checkpointable:
            with pytest.raises(NotImplementedError, match="dumps"):
                storage.dumps(str(tmp_path / "ckpt"))
            return
        storage.dumps(str(tmp_path / "ckpt"))
        fresh = new(self.capacity)
        fresh.loads(str(tmp_path / "ckpt"))
        self.check(fresh, model)

    def test_flush_then_reopen_by_url(self, new):
        if not self.persistent:
            pytest.skip("an in-RAM storage has no URL to reopen")
        storage = new(self.capacity)
        model = self.fill(storage, [9, 14])
        storage.flush()
        reopened = open_storage(storage.spec.url, storage_options=storage.spec.storage_options, mode="r")
        self.check(reopened, model)
        if self.records_cursor:
            assert reopened._last_cursor_index == storage._last_cursor_index


class ConditionalObjectsTests:
    """Compare-and-swap semantics; subclass with an ``objects`` fixture (module docstring)."""

    @pytest.fixture
    def objects(self) -> Any:  # pragma: no cover - every subclass overrides it
        """A fresh :class:`zstore.conditional.ConditionalObjects` on an empty location."""
        raise NotImplementedError("a ConditionalObjectsTests subclass defines the `objects` fixture")

    def test_create_is_exclusive(self, objects):
        assert objects.read("obj") is None
        token = objects.create("obj", b"first")
        assert token is not None
        assert objects.create("obj", b"second") is None
        assert objects.read("obj") == (b"first", token)

    def test_replace_needs_the_current_token(self, objects):
        first = objects.create("obj", b"1")
        second = objects.replace("obj", b"2", first)
        assert second is not None and objects.read("obj") == (b"2", second)
        assert objects.replace("obj", b"3", first) is None  # a stale token
        assert objects.read("obj") == (b"2", second)
        assert objects.replace("missing", b"x", second) is None
        assert objects.read("missing") is None

    def test_delete_needs_the_current_token(self, objects):
        first = objects.create("obj", b"1")
        second = objects.replace("obj", b"2", first)
        assert objects.delete("obj", first) is False
        assert objects.read("obj") == (b"2", second)
        assert objects.delete("obj", second) is True
        assert objects.read("obj") is None
        assert objects.delete("obj", second) is False
        assert objects.create("obj", b"again") is not None  # a deleted name can be created again

    def test_atomic_backends_let_one_of_concurrent_creates_win(self, objects):
        if not objects.atomic:
            pytest.skip("this backend makes no atomicity promise (plain reads and writes)")
        start, results = threading.Barrier(4), []

        def create(i: int) -> None:
            start.wait()
            results.append((i, objects.create("race", f"writer {i}".encode())))

        threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        winners = [(i, token) for i, token in results if token is not None]
        assert len(winners) == 1, f"{len(winners)} of 4 concurrent creates won"
        i, token = winners[0]
        assert objects.read("race") == (f"writer {i}".encode(), token)
