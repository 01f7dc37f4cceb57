"""Offline datasets: sealed, read-only buffers with an episode index; importers and export.

* :func:`open_dataset` -> :class:`Dataset` (read-only; one metadata read to open);
* :func:`seal` / ``LazyMemmapStorage.seal()`` publish a written buffer;
* :func:`import_d4rl`, :func:`import_minari` turn HDF5 files into sealed TED datasets,
  :func:`export_h5` writes one back. See docs/datasets.md.
"""

from .export import export_h5
from .importers import import_d4rl, import_minari
from .open import Dataset, open_dataset
from .sealing import seal

__all__ = ["Dataset", "export_h5", "import_d4rl", "import_minari", "open_dataset", "seal"]
