"""Exception types raised by zstore.

Every error names what was wrong (a key, a shape, a URL, an index) and, where
there is one, the fix. They subclass the builtin exception a TorchRL user would
expect (``KeyError``, ``ValueError``, ``RuntimeError`` ...), so code written
against TorchRL's storages keeps catching them.
"""

from __future__ import annotations


class ZStoreError(Exception):
    """Base class of every zstore-specific error."""


class BackendNotInstalledError(ZStoreError, ImportError):
    """The fsspec backend for a URL's protocol is not installed."""


class StoreNotFoundError(ZStoreError, FileNotFoundError):
    """The bucket, directory or path behind a URL does not exist."""


class InvalidURLError(ZStoreError, ValueError):
    """A URL, or its storage options, cannot name a store (empty, an empty path segment, an
    endpoint without a scheme, an unknown option or transport)."""


class NotAZStoreError(ZStoreError, ValueError):
    """The location holds no zstore buffer (no group, or no ``zstore`` block)."""


class FormatVersionError(ZStoreError, ValueError):
    """The store was written by a newer zstore format than this version reads."""


class ReadOnlyError(ZStoreError, PermissionError):
    """A write was attempted on a read-only store or dataset."""


class NoCredentialsError(ZStoreError, PermissionError):
    """No credentials for a bucket: none given, none in the environment or from the machine."""


class SchemaError(ZStoreError, ValueError, RuntimeError):
    """Data does not match the buffer's schema (dtype or shape of a key).

    Also a ``RuntimeError``: TorchRL's storages raise one for such a write.
    """


class MissingKeyError(ZStoreError, KeyError):
    """Data carries a key the buffer does not have, or lacks one it has (``lacking``: the
    paths of those it lacks, when that is the error)."""

    lacking: tuple[str, ...] = ()

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidKeyError(ZStoreError, ValueError):
    """A key cannot be mapped to a Zarr path (empty, ``..``, ``/``, absolute)."""


class CorruptChunkError(ZStoreError, IOError):
    """A chunk could not be read or decoded; names the key and the chunk."""


class StoreExistsError(ZStoreError, RuntimeError):
    """A buffer already exists where a new one was to be created."""


class LeaseError(ZStoreError, RuntimeError):
    """Another writer holds the store's write lease, or this writer lost it."""


class SourceFileError(ZStoreError, ValueError):
    """The file an import reads (a D4RL or Minari HDF5 file) is missing, a directory, or
    not HDF5."""


def sealed_dataset(action: str, where: str) -> ReadOnlyError:
    """The error for a write to the sealed dataset at ``where``: it names the way to a
    writable copy."""
    return ReadOnlyError(f"cannot {action}: {where} is a sealed, read-only dataset (copy it "
                         f"with `zstore convert {where} DST --no-seal` to get a writable buffer)")


def filled(record: dict) -> str:
    """``length/max_size`` of a zstore block or checkpoint record, ``?`` when it has none."""
    length, max_size = record.get("length"), record.get("max_size", 0)
    return f"{length:,}/{max_size:,}" if isinstance(length, int) and isinstance(max_size, int) \
        else "?"


def checkpoint_not_a(what: str, where: str, record: dict, then: str = "") -> NotAZStoreError:
    """The error for the checkpoint at ``where`` (its commit ``record``) opened as a ``what``
    (a buffer, a dataset): what it is, and the way to load it (``then``: a further way on)."""
    return NotAZStoreError(
        f"{where} holds a zstore checkpoint ({record.get('checkpointer', '?')}, length "
        f"{filled(record)}), not a "
        f"{what}: load it with storage.loads(url) into a storage of the kind that dumped it "
        f"(docs/checkpoints.md){then}")


#: The second way on that :func:`folder_not_writable` offers (a Python caller's).
OPEN_READ_ONLY = " or open the store read-only (mode='r')"


def folder_not_writable(folder: str, path: str) -> PermissionError:
    """The error for a local store whose folder (or ``path`` in it) refuses this process's
    writes: names both, and the two ways on."""
    return PermissionError(
        f"cannot write to the store {folder}: permission denied on {path}. Make the folder "
        f"writable (chmod -R u+w {folder}){OPEN_READ_ONLY}")
