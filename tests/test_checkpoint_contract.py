"""The checkpoint <-> storage boundary, and checkpoints of tensor / pytree storages as TorchRL's.

* ``checkpoint/`` uses nothing private of ``zstore`` but the names in :data:`ALLOWED`
  (each with its reason): the storages' side is ``zstore.storages.checkpoint_contract``.
* Save hooks on a tensor or pytree storage run and their output is saved, as TorchRL's
  ``TensorStorageCheckpointer`` does (issue #20); loads restore the same rows.
* TorchRL's own Tensor / Flat / Nested checkpointers cannot read zstore's dumps: what
  they raise, and that zstore's checkpointer reads the same dump (docs/torchrl.md).
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import checkpoint
import zstore.torchrl as zt
from checkpoint import CheckpointError

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Private attributes ``checkpoint/`` may still use on other objects, each with its reason.
ALLOWED = {
    "_storage": "TorchRL's container of a TensorStorage, public by convention (its "
                "checkpointers read and replace it); an in-RAM load maps chunk files into it",
    "_storages": "TorchRL's member list of a StorageEnsemble (its checkpointer reads it too)",
    "_empty": "TorchRL's way to empty a storage (its StorageEnsembleCheckpointer calls it)",
    "_async_array": "zarr's async array behind a zarr.Array: every chunk read / write of a "
                    "generation in flight at once (zarr has no public handle for it)",
    "_cp_file": "fsspec's async copy coroutine: many server-side copies on one event loop",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _defined(paths) -> set[str]:
    """Private names defined in ``paths``: functions, classes and ``self._x`` attributes."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {name for name in names if _private(name)}


def private_uses(sources: dict[str, str], own: set[str]) -> list[str]:
    """``file:line: what`` for each private name of another package that ``sources`` use:
    ``x._name`` (``x`` not ``self`` / ``cls``), ``getattr(x, "_name")`` and the like, and
    imports of private ``zstore`` names or modules. ``own``: the package's own names."""
    found = []
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            name = None
            if isinstance(node, ast.Attribute) and _private(node.attr) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value):
                name = node.args[1].value
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zstore":
                module_private = any(_private(part) for part in node.module.split("."))
                for alias in node.names:
                    if module_private or _private(alias.name):
                        found.append((where, node.lineno, f"from {node.module} import {alias.name}"))
                continue
            if name is not None and name not in own and name not in ALLOWED:
                found.append((where, node.lineno, ast.unparse(node)))
    return [f"{where}:{line}: {what}" for where, line, what in sorted(found)]


@pytest.fixture(scope="module")
def checkpoint_sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text()
            for p in sorted((ROOT / "checkpoint").glob("*.py"))}


@pytest.fixture(scope="module")
def own_names() -> set[str]:
    """checkpoint's own private names: defined in checkpoint/ and nowhere in zstore/."""
    return _defined((ROOT / "checkpoint").glob("*.py")) - _defined((ROOT / "zstore").rglob("*.py"))


def test_checkpoint_uses_only_the_storage_contract(checkpoint_sources, own_names):
    """Nothing private of zstore (or of a library) outside ALLOWED: the storages' side is
    zstore.storages.checkpoint_contract."""
    assert private_uses(checkpoint_sources, own_names) == []


def test_every_allowed_private_name_is_still_used(checkpoint_sources):
    used = set()
    for text in checkpoint_sources.values():
        used |= {node.attr for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute)}
        used |= {node.value for node in ast.walk(ast.parse(text))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert sorted(set(ALLOWED) - used) == []  # a stale entry: delete it


def test_the_check_finds_what_it_must(own_names):
    source = ("import zstore\nfrom zstore.storages.compressed import _root_block\n"
              "from zstore._pages import LIBC\nfrom zstore.layout import Schema\n"
              "def f(storage, self):\n    storage._row_rev[0] = 1\n    self._x = 1\n"
              "    hasattr(storage, '_ckpt_marks')\n    storage._storage\n"
              "    ckpt._stage\n")  # checkpoint's own
    assert private_uses({"x.py": source}, own_names) == [
        "x.py:2: from zstore.storages.compressed import _root_block",
        "x.py:3: from zstore._pages import LIBC",
        "x.py:6: storage._row_rev",
        "x.py:8: hasattr(storage, '_ckpt_marks')"]


# -- save hooks on tensor and pytree storages (issue #20) ----------------------------------

def _double(data, path=None):
    """A save hook that works on any tensor, TensorDict or pytree: every value doubled."""
    return pytree.tree_map(lambda x: x * 2, data)


class _ShiftRecorder:
    """A save hook that records the ``shift`` / ``is_full`` the checkpointer gives it."""

    shift = None
    is_full = None

    def __call__(self, data, path=None):
        return data


def _data(kind: str, n: int):
    x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
    if kind == "tensor":
        return x
    return {"obs": x, "pair": (torch.arange(n), torch.ones(n, 3, dtype=torch.uint8))}


def _fill(storage, kind: str, n: int, capacity: int) -> None:
    """Write ``n`` rows of ``_data(kind, n)`` into a ring of ``capacity`` rows, as a writer
    would (each row once per ``set``)."""
    data = _data(kind, n)
    for lo in range(0, n, capacity):
        hi = min(lo + capacity, n)
        storage.set(torch.arange(hi - lo), pytree.tree_map(lambda x: x[lo:hi], data))


def _assert_same(a, b) -> None:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert pytree.tree_structure(a) == pytree.tree_structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _torchrl_reference(tmp_path, kind: str, n: int, capacity: int):
    """TorchRL's storage + TensorStorageCheckpointer with the same hook: the loaded rows."""
    import torchrl.data as trl
    from torchrl.data.replay_buffers.checkpointers import TensorStorageCheckpointer

    source = trl.LazyTensorStorage(capacity)
    _fill(source, kind, n, capacity)
    source.checkpointer = TensorStorageCheckpointer()
    source.register_save_hook(_double)
    source.dumps(tmp_path / "torchrl")
    target = trl.LazyTensorStorage(capacity)
    target.set(0, pytree.tree_map(lambda x: x[0], _data(kind, 1)))  # TorchRL: initialised first
    target.checkpointer = TensorStorageCheckpointer()
    target.loads(tmp_path / "torchrl")
    return target


@pytest.mark.parametrize("storage_class", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("kind", ["tensor", "pytree"])
@pytest.mark.parametrize("n", [5, 11])  # partly filled; a ring that wrapped
def test_save_hooks_on_tensor_and_pytree_storages_as_torchrl(tmp_path, location, storage_class,
                                                             kind, n):
    capacity = 8
    theirs = _torchrl_reference(tmp_path, kind, n, capacity)
    ours = getattr(zt, storage_class)(capacity)
    _fill(ours, kind, n, capacity)
    ours.checkpointer = zt.TensorStorageCheckpointer(storage_options=location.options)
    ours.register_save_hook(_double)
    url = location.new("ckpt")
    ours.dumps(url)
    again = getattr(zt, storage_class)(capacity)  # not initialised: zstore fills it anyway
    again.checkpointer = zt.TensorStorageCheckpointer(storage_options=location.options)
    again.loads(url)
    rows = torch.arange(len(theirs))
    assert len(again) == len(theirs) == min(n, capacity)
    _assert_same(again.get(rows), theirs.get(rows))
    _assert_same(again.get(rows), _double(ours.get(rows)))  # the hook ran before saving


def test_save_hooks_on_a_pytree_get_shift_and_is_full(tmp_path):
    storage = zt.LazyTensorStorage(4)
    _fill(storage, "pytree", 6, 4)  # wrapped: the next row is 2
    hook = _ShiftRecorder()
    storage.register_save_hook(hook)
    storage.dumps(tmp_path / "ck")
    assert (hook.shift, hook.is_full) == (2, True)


def test_load_hooks_on_a_saved_pytree_are_refused_as_torchrl(tmp_path):
    theirs = _torchrl_reference(tmp_path, "pytree", 3, 4)
    theirs.checkpointer.register_load_hook(lambda data, out=None: data)
    with pytest.raises(RuntimeError, match="not compatible with PyTree"):
        theirs.loads(tmp_path / "torchrl")
    ours = zt.LazyTensorStorage(4)
    ours.set(torch.arange(3), _data("pytree", 3))
    ours.register_save_hook(_double)
    ours.dumps(tmp_path / "zstore")
    target = zt.LazyTensorStorage(4)
    target.register_load_hook(lambda data, out=None: data)
    with pytest.raises(CheckpointError, match="not compatible with PyTree") as err:
        target.loads(tmp_path / "zstore")
    assert str(tmp_path / "zstore") in str(err.value)
    assert not target.initialized  # refused before anything was written


# -- TorchRL's checkpointers on zstore's dumps (issue #20) ---------------------------------

def _ted(n: int):
    from tensordict import TensorDict

    done = torch.zeros(n, 1, dtype=torch.bool)
    done[n // 2] = True
    return TensorDict(obs=torch.arange(n, dtype=torch.float32)[:, None],
                      done=torch.zeros(n, 1, dtype=torch.bool),
                      terminated=torch.zeros(n, 1, dtype=torch.bool),
                      truncated=torch.zeros(n, 1, dtype=torch.bool),
                      next=TensorDict(obs=torch.arange(1, n + 1, dtype=torch.float32)[:, None],
                                      done=done, terminated=done.clone(),
                                      truncated=torch.zeros(n, 1, dtype=torch.bool),
                                      reward=torch.ones(n, 1), batch_size=[n]),
                      batch_size=[n])


@pytest.mark.parametrize("name", ["TensorStorageCheckpointer", "FlatStorageCheckpointer",
                                  "NestedStorageCheckpointer"])
def test_torchrl_cannot_read_zstore_dumps_and_zstore_can(tmp_path, name):
    """What docs/torchrl.md says: TorchRL's loads stops at the missing storage_metadata.json,
    before touching its storage; zstore's checkpointer of the same name reads the dump."""
    import torchrl.data as trl
    from torchrl.data.replay_buffers import checkpointers

    ours = zt.LazyMemmapStorage(8)
    ours.checkpointer = getattr(checkpoint, name)()
    ours.set(torch.arange(6), _ted(6))
    ours.dumps(tmp_path / "ck")
    theirs = trl.LazyMemmapStorage(8)
    theirs.checkpointer = getattr(checkpointers, name)()
    with pytest.raises(FileNotFoundError, match="storage_metadata.json"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.loads(tmp_path / "ck")
    assert not theirs.initialized and len(theirs) == 0
    again = zt.LazyMemmapStorage(8)
    again.checkpointer = getattr(checkpoint, name)()
    again.loads(tmp_path / "ck")
    assert len(again) == 6
    assert (again.get(torch.arange(6)) == ours.get(torch.arange(6))).all()
