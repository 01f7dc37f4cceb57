"""What the distribution declares: every package the code imports is a declared requirement.

A package that arrives only as another's dependency can leave with that package's next
release: ``google_crc32c`` (zstore's chunk checksums) came only with zarr 3.1.4 and later,
so the floor ``zarr>=3.1`` installed a zstore that failed on import.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: imported but not declared, on purpose: name -> why
UNDECLARED = {
    "aiobotocore": "s3fs's own client (the s3 extra), whose session's option names S3 stores check",
    "botocore": "s3fs's credential chain (the s3 extra), which the obstore transport reuses",
    "ipywidgets": "tqdm's notebook bar where a kernel has it; the text bar otherwise",
}


def _imported_packages() -> set[str]:
    """The top-level names of the third-party packages imported anywhere in ``zstore/`` and
    ``checkpoint/``."""
    names = set()
    for package in ("zstore", "checkpoint"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {name for name in names
            if name not in sys.stdlib_module_names and name not in ("zstore", "checkpoint")}


def _declared() -> set[str]:
    """The normalized names of the distributions ``pyproject.toml`` requires, with any extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {_normalized(re.match(r"[A-Za-z0-9_.\-]+", r).group()) for r in requirements}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_a_declared_requirement():
    distributions = importlib.metadata.packages_distributions()
    declared = _declared()
    undeclared = {name: distributions.get(name) for name in _imported_packages() - set(UNDECLARED)
                  if not {_normalized(d) for d in distributions.get(name, [name])} & declared}
    assert not undeclared, f"imported, but no requirement declares them: {undeclared}"

