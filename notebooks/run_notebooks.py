"""Run the notebooks top to bottom on a fresh kernel, store their outputs, write their figures.

    python notebooks/run_notebooks.py              # every notebooks/*.ipynb, saved in place
    python notebooks/run_notebooks.py 01_quickstart.ipynb --no-save

The kernel is this interpreter (a kernelspec written to a temporary directory,
so no installed "python3" kernel of another environment is picked up) and
imports zstore from this checkout. A cell tagged ``figure:NAME.png`` has its
first PNG output written to ``docs/img/NAME.png``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIGURES = ROOT / "docs" / "img"
KERNEL = "python3"


def _kernelspec(where: Path) -> KernelSpecManager:
    """A kernelspec manager that resolves ``python3`` to this interpreter, with the checkout importable."""
    spec_dir = where / "kernels" / KERNEL
    spec_dir.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "zstore (this interpreter)", "language": "python",
        "env": {"PYTHONPATH": path, "MPLBACKEND": "module://matplotlib_inline.backend_inline"},
    }))
    return KernelSpecManager(kernel_dirs=[str(where / "kernels")], ensure_native_kernel=False)


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` on a fresh kernel; raises ``CellExecutionError`` on any error."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="zstore-kernel-") as tmp:
        km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=_kernelspec(Path(tmp)))
        client = NotebookClient(nb, km=km, timeout=timeout, kernel_name=KERNEL,
                                resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    return nb


def write_figures(nb: nbformat.NotebookNode, out: Path = FIGURES) -> list[Path]:
    """Write the PNG output of every cell tagged ``figure:NAME.png`` to ``out/NAME.png``."""
    written = []
    for cell in nb.cells:
        names = [t.split(":", 1)[1] for t in cell.get("metadata", {}).get("tags", [])
                 if t.startswith("figure:")]
        pngs = [o["data"]["image/png"] for o in cell.get("outputs", [])
                if "image/png" in o.get("data", {})]
        for name in names:
            if not pngs:
                raise RuntimeError(f"cell tagged figure:{name} has no PNG output")
            out.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(base64.b64decode(pngs[0]))
            written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="names in notebooks/ (default: all)")
    parser.add_argument("--no-save", action="store_true", help="run only; keep the stored outputs")
    args = parser.parse_args(argv)
    paths = [HERE / n for n in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        nb = execute(path)
        if not args.no_save:
            nbformat.write(nb, path)
            for figure in write_figures(nb):
                print(f"wrote {figure.relative_to(ROOT)}")
        print(f"ran {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
