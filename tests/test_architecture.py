"""The module layering of docs/architecture.md holds, and the doc's generated §1-§2 match the code.

``tools/import_graph.py`` reads every module of ``zstore/`` and ``checkpoint/`` with
``ast``; these tests check what it finds: no import cycle but the one allowed edge
(a storage's default checkpointer, looked up lazily), the command line and the demo
on top, and ``import zstore`` without ``checkpoint``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def graph_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def modules(graph_tool):
    return graph_tool.read_graph()


def test_doc_matches_the_code():
    """docs/architecture.md §1-§2 are what tools/import_graph.py prints (else: run --write)."""
    proc = subprocess.run([sys.executable, "tools/import_graph.py", "--check", str(DOC)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_import_cycle_but_the_checkpointer_lookup(graph_tool, modules):
    assert graph_tool.cycles(modules, allowed=False) == []
    source, target = graph_tool.ALLOWED_EDGE
    assert modules[source].imports[target] is True  # imported inside make_checkpointer only


def test_cli_and_demo_are_imported_by_no_library_module(modules):
    top = {"zstore.cli", "zstore.__main__"}
    for name, module in modules.items():
        if name in top:
            continue
        assert "zstore.cli" not in module.imports, name
        assert "zstore.demo" not in module.imports, name
    assert "zstore.cli" not in modules["zstore.cli_commands"].imports
    assert "zstore.cli" not in modules["zstore.demo"].imports


def test_the_tool_counts_lazy_relative_and_importlib_imports(graph_tool, tmp_path):
    """Guards the tool itself, on a small tree: function-level, relative, ``importlib`` and
    ``_SOURCES`` imports count, ``TYPE_CHECKING`` ones do not, a package's ``__init__``
    counts when one of its modules is imported from outside it, and so do cycles."""
    files = {
        "zstore/__init__.py": '"""Top. More."""\n_SOURCES = {"Thing": "b", **dict.fromkeys(["X"], "c")}\n',
        "zstore/a.py": ('"""A, e.g. this."""\nfrom typing import TYPE_CHECKING\nimport zstore\n'
                        'from . import b\nif TYPE_CHECKING:\n    from .c import X\n'
                        'def f():\n    from .c import X\n    return zstore.Thing\n'),
        "zstore/b.py": '"""B."""\nimport importlib\n'
                       'def g():\n    return importlib.import_module("checkpoint")\n',
        "zstore/c.py": '"""C: the ``c`` module with :func:`~zstore.b.g`."""\n',
        "zstore/sub/__init__.py": '"""Sub."""\nfrom .d import D\n',
        "zstore/sub/d.py": ('"""D."""\nfrom ..c import _hidden\nD = 1\n'
                            'def h():\n    from .. import b\n'),
        "checkpoint/__init__.py": '"""Ck."""\nfrom zstore.sub.d import D\nfrom zstore.c import _p\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = graph_tool.read_graph(tmp_path)
    assert found["zstore.a"].imports == {"zstore": False, "zstore.b": False, "zstore.c": True}
    assert found["zstore.b"].imports == {"checkpoint": True}
    assert found["zstore.sub.d"].imports == {"zstore.c": False, "zstore.b": True}
    assert found["checkpoint"].imports == {"zstore.sub.d": False, "zstore.sub": False,
                                           "zstore.c": False}
    assert found["zstore.a"].job == "A, e.g. this"
    assert found["zstore.c"].job == "C: the `c` module with `g`"
    # checkpoint -> zstore.sub (its __init__ runs) -> zstore.sub.d -> zstore.b -> checkpoint
    assert graph_tool.cycles(found) == [["checkpoint", "zstore.b", "zstore.sub", "zstore.sub.d"]]
    assert graph_tool.private_imports(found) == [("checkpoint", "zstore.c", "_p")]


def test_import_zstore_does_not_import_checkpoint():
    code = ("import sys, zstore; zstore.LazyMemmapStorage; zstore.open; zstore.Dataset; "
            "print(sorted(m for m in sys.modules if m == 'checkpoint' or m.startswith('checkpoint.')"
            " or m in ('zstore.cli', 'zstore.demo')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


#: Calls that write (or open for writing) a Zarr group's ``zarr.json``, or silence zarr's
#: metadata warnings around an open: zstore/group.py's job alone.
_GROUP_WRITES = {"create_group", "open_group", "consolidate_metadata", "put"}


def test_only_group_py_writes_a_groups_zarr_json():
    """Ensemble indexes, checkpoint trees, sealing, episode indexes and compressed roots
    create, reopen and update their groups through zstore/group.py."""
    import ast

    found = []
    for path in sorted([*(ROOT / "zstore").rglob("*.py"), *(ROOT / "checkpoint").rglob("*.py")]):
        if path == ROOT / "zstore" / "group.py":
            continue
        source = path.read_text()
        if "import zarr" not in source and "from zarr" not in source:
            continue  # h5py's File.create_group and the like
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, owner = node.func.attr, node.func.value
            if name == "put" and not (isinstance(owner, ast.Attribute) and owner.attr == "attrs"):
                continue  # only ``<group>.attrs.put``
            if name in _GROUP_WRITES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    assert found == [], "\n".join(found)


def test_the_leases_conditional_commit_is_called_from_group_py_alone():
    """A commit's fenced write of ``zarr.json`` (``Lease.write_metadata``) starts in
    zstore/group.py (``put_attrs``) only: no storage or checkpointer commits around it."""
    import ast

    callers = []
    for path in sorted([*(ROOT / "zstore").rglob("*.py"), *(ROOT / "checkpoint").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "write_metadata":
                callers.append(str(path.relative_to(ROOT)))
    assert callers == ["zstore/group.py"], callers


def test_every_public_name_has_a_docstring(graph_tool, modules):
    """Every module, public function and class, and public method or property (its own, or
    the one it overrides; one it inherits from a private class of zstore/ or checkpoint/ too)
    of zstore/ and checkpoint/ says what it does."""
    import importlib
    import inspect

    missing = []
    for name in sorted(modules):
        if name.endswith("__main__"):
            continue  # running it parses the command line
        module = importlib.import_module(name)
        if not (module.__doc__ or "").strip():
            missing.append(f"{name} (module)")
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and not inspect.getdoc(obj):
                missing.append(f"{name}.{attr}")
            if not inspect.isclass(obj):
                continue
            ours = [klass for klass in obj.__mro__
                    if klass is obj or klass.__name__.startswith("_")
                    and klass.__module__.split(".")[0] in ("zstore", "checkpoint")]
            for method, member in [item for klass in ours for item in vars(klass).items()]:
                if method.startswith(("_", "test_")):  # a contract suite's tests name themselves
                    continue
                function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(function) and not inspect.getdoc(
                        member if isinstance(member, property) else getattr(obj, method)):
                    missing.append(f"{name}.{attr}.{method}")
    assert missing == [], "no docstring:\n" + "\n".join(missing)
