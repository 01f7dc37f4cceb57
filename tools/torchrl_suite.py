"""Run TorchRL's own replay-buffer tests with TorchRL's classes, then with zstore's (issue #20).

    python tools/torchrl_suite.py RL_TEST_DIR [--out DIR] [--workers 2] [-k EXPR]

``RL_TEST_DIR`` is the ``test/`` directory of a pytorch/rl checkout (``test_rb.py`` with
its helpers ``_utils_internal.py`` and ``mocking_classes.py``); nothing of it is vendored
here. The directory is copied to ``DIR``, where ``test_rb_zstore.py`` is ``test_rb.py``
with one statement added after its imports: every storage-layer name it imported from
TorchRL (storages, checkpointers, ``ImmutableDatasetWriter``) imported again from
``zstore.torchrl``. TorchRL's writers, samplers and buffers stay TorchRL's, and no TorchRL
module is patched. Both files run under pytest with a JUnit report each; the script then
prints, for the tests that pass with TorchRL's classes, how many pass with zstore's, and
the others grouped by their first error line.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import zstore.torchrl

#: The names ``zstore.torchrl`` gives twins of: TorchRL's "Storage Backends" page.
TWINS = {"Storage", "ListStorage", "LazyStackStorage", "TensorStorage", "LazyTensorStorage",
         "LazyMemmapStorage", "CompressedListStorage", "StorageEnsemble",
         "ImmutableDatasetWriter", *zstore.torchrl.CHECKPOINTERS}

#: Imported by conftest.py: torchrl 0.14 renamed ``SyncDataCollector`` to ``Collector``,
#: and newer test files import the old name (only gym tests, skipped without gym, use it).
CONFTEST = """import torchrl.collectors as _collectors

if not hasattr(_collectors, "SyncDataCollector"):
    _collectors.SyncDataCollector = _collectors.Collector
"""


def with_zstore_twins(source: str) -> str:
    """``source`` with ``from zstore.torchrl import <twins it imported from torchrl>`` added
    before its first statement that is not an import (or a block of imports)."""
    tree = ast.parse(source)
    names = sorted({alias.asname or alias.name for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchrl")
                    for alias in node.names if alias.name in TWINS})

    def imports_only(node: ast.stmt) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return True
        if isinstance(node, ast.If):
            return all(imports_only(n) for n in node.body + node.orelse)
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)  # docstring

    first = next(node for node in tree.body if not imports_only(node))
    lines = source.splitlines(keepends=True)
    added = f"from zstore.torchrl import {', '.join(names)}  # noqa: E402 (tools/torchrl_suite.py)\n"
    return "".join(lines[:first.lineno - 1]) + added + "".join(lines[first.lineno - 1:])


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first error line)}`` of a JUnit report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        cls = re.sub(r"^test_rb(_zstore)?\.?", "", case.get("classname", ""))
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (found.get("message") or found.text or "").strip().split("\n")[0]
                break
        out[f"{cls}::{case.get('name')}" if cls else case.get("name")] = (outcome, message)
    return out


def run(directory: Path, module: str, workers: int, expr: str | None) -> dict:
    """Run ``module`` under pytest in ``directory``; its outcomes."""
    report = directory / f"{module}.xml"
    command = [sys.executable, "-m", "pytest", f"{module}.py", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", *(["-n", str(workers)] if workers > 1 else []),
               *(["-k", expr] if expr else [])]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=directory, stdout=subprocess.DEVNULL, check=False)
    return outcomes(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", type=Path, help="the test/ directory of a pytorch/rl checkout")
    parser.add_argument("--out", type=Path, default=None, help="where to copy and run it")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("-k", dest="expr", default=None, help="pytest -k of both runs")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="torchrl-suite-"))
    shutil.copytree(args.tests, out, dirs_exist_ok=True)
    (out / "conftest.py").write_text(CONFTEST)
    (out / "test_rb_zstore.py").write_text(with_zstore_twins((out / "test_rb.py").read_text()))
    theirs = run(out, "test_rb", args.workers, args.expr)
    ours = run(out, "test_rb_zstore", args.workers, args.expr)
    passing = [test for test, (outcome, _) in theirs.items() if outcome == "passed"]
    print(f"TorchRL's classes: {dict(collections.Counter(o for o, _ in theirs.values()))}")
    print(f"zstore's classes:  {dict(collections.Counter(o for o, _ in ours.values()))}")
    with_ours = collections.Counter(ours.get(test, ("missing", ""))[0] for test in passing)
    print(f"of the {len(passing)} that pass with TorchRL's classes, with zstore's: "
          f"{dict(with_ours)}")
    groups = collections.defaultdict(list)
    for test in passing:
        outcome, message = ours.get(test, ("missing", ""))
        if outcome != "passed":
            groups[re.sub(r"0x[0-9a-f]+|/tmp/\S+", "…", message)[:160]].append(test)
    for message, tests in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"\n{len(tests)}: {message}")
        for test in tests[:4]:
            print(f"    {test}")
    print(f"\nreports: {out}")


if __name__ == "__main__":
    main()
