"""Optional dependencies, imported where they are used, their refusal naming the extra."""

from __future__ import annotations

from types import ModuleType


def import_h5py() -> ModuleType:
    """``h5py`` (D4RL files, HDF5 exports and checkpoints), or an ``ImportError`` naming the
    extra that installs it."""
    try:
        import h5py
    except ImportError as exc:
        raise ImportError(f"reading or writing HDF5 needs h5py: pip install 'zstore[h5]' "
                          f"({exc})") from exc
    return h5py
