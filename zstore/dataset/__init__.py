"""Offline datasets: sealed, read-only buffers with an episode index; importers and export.

* :func:`open_dataset` -> :class:`Dataset` (read-only; one metadata read to open);
* :func:`seal` / ``LazyMemmapStorage.seal()`` publish a written buffer;
* :func:`import_d4rl`, :func:`import_minari` turn HDF5 files into sealed TED datasets,
  :func:`export_h5` writes one back. See docs/datasets.md.
"""

from __future__ import annotations

from .._lazy import lazy_exports

#: Public name -> the submodule that defines it. Imported on first use, so that importing
#: one submodule (the CLI's ``convert`` imports :mod:`zstore.dataset.convert`) does not
#: import the others.
_SOURCES = {"Dataset": "open", "open_dataset": "open", "export_h5": "export",
            "import_d4rl": "importers", "import_minari": "importers", "seal": "sealing"}

__all__ = ["Dataset", "export_h5", "import_d4rl", "import_minari", "open_dataset", "seal"]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES, __all__, globals())
