"""Every notebook in notebooks/ runs top to bottom on a fresh kernel (this interpreter, this checkout)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import zstore

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

#: What a notebook needs beyond the ``notebooks`` extra (skipped without it), and its marks.
NEEDS = {
    "02_offline_dataset.ipynb": (("h5py",), ()),
    "03_buckets.ipynb": (("s3fs", "moto.server"), (pytest.mark.s3,)),
}


def _runner():
    """notebooks/run_notebooks.py, the script that also refreshes the stored outputs."""
    spec = importlib.util.spec_from_file_location("run_notebooks", NOTEBOOKS / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tagged(nb) -> list[str]:
    return [t.split(":", 1)[1] for c in nb.cells for t in c.get("metadata", {}).get("tags", [])
            if t.startswith("figure:")]


def _params() -> list:
    params = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        modules, marks = NEEDS.get(path.name, ((), ()))
        params.append(pytest.param(path, modules, marks=marks, id=path.name))
    return params


@pytest.mark.parametrize(("path", "modules"), _params())
def test_notebook_runs(path, modules, tmp_path):
    for module in modules:
        pytest.importorskip(module)
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    # nbclient would skip these cells, or let them fail without failing the run
    assert not [c for c in code if {"skip-execution", "raises-exception"} & set(c.metadata.get("tags", []))]
    runner = _runner()
    nb = runner.execute(path, timeout=300)  # raises CellExecutionError on any failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    # every cell tagged figure:NAME.png produced the PNG that docs/img is made from
    assert runner.write_figures(nb, tmp_path) == [tmp_path / name for name in _tagged(nb)]
    assert _tagged(nb), "each notebook has a main figure tagged figure:NAME.png for docs/img"
    for name in _tagged(nb):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_kernel_is_this_interpreter_with_this_checkout(tmp_path):
    """The kernel runs sys.executable and imports zstore from this checkout, whatever its cwd."""
    from nbformat.v4 import new_code_cell, new_notebook

    path = tmp_path / "probe.ipynb"
    nbformat.write(new_notebook(
        cells=[new_code_cell("import sys, zstore; print(sys.executable); print(zstore.__file__)")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}),
        path)
    nb = _runner().execute(path, timeout=120)
    executable, module = nb.cells[0].outputs[0]["text"].split()
    assert Path(executable).resolve() == Path(sys.executable).resolve()
    assert Path(module).resolve() == Path(zstore.__file__).resolve()


def test_a_failing_cell_fails_the_run(tmp_path):
    """An exception in any cell (here the middle one) stops the run with CellExecutionError."""
    from nbclient.exceptions import CellExecutionError
    from nbformat.v4 import new_code_cell, new_notebook

    path = tmp_path / "failing.ipynb"
    nbformat.write(new_notebook(
        cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('cell two failed')"),
               new_code_cell("print('never reached')")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}),
        path)
    with pytest.raises(CellExecutionError, match="cell two failed"):
        _runner().execute(path, timeout=120)
