"""TorchRL replay-buffer checkpoints at any fsspec URL: :func:`dumps` and :func:`loads`.

TorchRL's ``rb.dumps(path)`` / ``rb.loads(path)`` build a local ``pathlib.Path``, so a bucket
URL fails inside TorchRL. These two run TorchRL's own methods, with two changes: the
storage's checkpointer writes (reads) its checkpoint straight at ``url/storage``, whatever
local path TorchRL hands it, and the buffer's other state files (sampler, writer, RNG,
transforms, metadata: small) go through a temporary local directory to and from ``url``
by fsspec. The layout at ``url`` is the one ``rb.dumps`` writes; ``buffer_metadata.json``
is written last, so a save cut short is never loaded.

Nothing read from a store is ever unpickled: TorchRL pickles its prefetch queue
(``prefetch.pkl``, transient: a buffer reloaded without it prefetches afresh) and
``torch.save``-s a stateful transform's state (``transform.t``); tensordict pickles a
non-tensor field of a state it memory-maps (``other.pickle``, ``pickle.pkl``).
:func:`dumps` leaves the first behind and refuses the others; :func:`loads` refuses a save
holding any of them. A sampler's ``.pt`` state (``ConsumingSampler``'s,
``StreamingSliceSampler``'s) is read by ``torch.load``'s weights-only loader, which builds
tensors and plain containers only; where torch would unpickle it instead (torch before 2.6,
or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``), :func:`loads` refuses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any, Iterator

from . import storages as _z
from .credentials import request_error
from .errors import StoreExistsError
from .group import refuse_inside_a_dataset
from .store import StoreSpec

#: What TorchRL's ``rb.dumps`` writes last, and what :func:`loads` looks for first.
METADATA = "buffer_metadata.json"
STORAGE = "storage"
#: TorchRL's pickled state files: never stored (the prefetch queue) or refused (transforms).
PREFETCH, TRANSFORM = "prefetch.pkl", "transform.t"
#: The files in which tensordict's ``memmap`` pickles a non-tensor field (which its
#: ``load_memmap`` unpickles): refused wherever they are in a save.
TENSORDICT_PICKLES = ("other.pickle", "pickle.pkl")
#: ``{state file: bytes}`` of a save, written just before :data:`METADATA`: a save that lost
#: a file (a partial copy) is refused before anything is loaded.
MANIFEST = "zstore-files.json"
#: torch's switch that makes ``torch.load`` unpickle anything where its caller (TorchRL)
#: does not pass ``weights_only``.
_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class _At:
    """A storage checkpointer that saves and loads with ``inner`` at ``spec``, whatever
    path it is called with (TorchRL calls it with ``local_dir/storage``)."""

    def __init__(self, inner: Any, spec: StoreSpec | None):
        self.inner, self.spec = inner, spec

    def dumps(self, storage: Any, path: Any) -> Any:
        """Save at ``spec``; with no ``spec``, nothing (a dry run of the other state files)."""
        return None if self.spec is None else self.inner.dumps(storage, self.spec)

    def loads(self, storage: Any, path: Any) -> None:
        self.inner.loads(storage, self.spec)


@contextlib.contextmanager
def _storage_at(rb: Any, spec: StoreSpec | None) -> Iterator[None]:
    storage = rb.storage
    if not isinstance(storage, _z.Storage):
        raise TypeError(
            f"zstore.torchrl.dumps / loads save buffers over zstore storages, not TorchRL's "
            f"{type(storage).__name__}: use rb.dumps(local_path) for it, or build the buffer "
            "over a zstore.torchrl storage")
    inner = storage.checkpointer
    storage.checkpointer = _At(inner, spec)
    try:
        yield
    finally:
        storage.checkpointer = inner


def _spec(url: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> StoreSpec:
    return StoreSpec.parse(os.fspath(url).rstrip("/"), storage_options)


def dumps(rb: Any, url: str | os.PathLike,
          storage_options: Mapping[str, Any] | None = None) -> None:
    """Save TorchRL buffer ``rb`` (over a zstore storage) at ``url``, any fsspec URL.

    The storage's checkpoint goes to ``url/storage`` by its checkpointer; the rest of what
    ``rb.dumps`` writes is uploaded next to it, its manifest first and
    ``buffer_metadata.json`` last. A new save over an old one first removes the old
    metadata, so a save cut short is refused by :func:`loads` rather than loaded half old,
    and then the old save's files the new one does not write. ``url`` must be empty or hold
    a save: a Zarr store there (a zstore buffer or dataset), other files, or a folder inside
    a sealed dataset are refused, and nothing is written.

    >>> zstore.torchrl.dumps(rb, "s3://bucket/ckpt", {"endpoint_url": ...})  # doctest: +SKIP
    """
    spec = _spec(url, storage_options)
    spec.require_writable("save a replay buffer")
    refuse_inside_a_dataset(spec, "save a replay buffer")
    fs, root = spec.filesystem()
    previous = _previous_save(spec)
    with tempfile.TemporaryDirectory(prefix="zstore-rb-") as probe, _storage_at(rb, None):
        rb.dumps(probe)  # the state files alone: refused before anything at url changes
        _refuse_pickles(_files_under(probe), spec)
    if fs.exists(f"{root}/{METADATA}"):
        fs.rm_file(f"{root}/{METADATA}")
    with tempfile.TemporaryDirectory(prefix="zstore-rb-") as local, \
            _storage_at(rb, StoreSpec(f"{spec.url}/{STORAGE}", dict(spec.storage_options))):
        rb.dumps(local)
        files = [rel for rel in _files_under(local) if rel != PREFETCH]  # transient; a pickle
        _refuse_pickles(files, spec)  # (the state as saved now)
        with open(os.path.join(local, MANIFEST), "w") as file:
            json.dump({rel: os.path.getsize(os.path.join(local, rel)) for rel in files}, file)
        files.append(MANIFEST)
        for old in previous:
            if old not in files:
                fs.rm_file(f"{root}/{old}")  # of an earlier save (e.g. a transform since removed)
        # the manifest first: a save cut short is still known as one, and replaced by the next
        for rel in sorted(files, key=lambda f: (f != MANIFEST, f == METADATA)):
            if spec.is_local:
                fs.makedirs(os.path.dirname(f"{root}/{rel}"), exist_ok=True)
            with open(os.path.join(local, rel), "rb") as file:
                fs.pipe_file(f"{root}/{rel}", file.read())


def loads(rb: Any, url: str | os.PathLike,
          storage_options: Mapping[str, Any] | None = None) -> None:
    """Load TorchRL buffer ``rb`` (over a zstore storage) from a :func:`dumps` at ``url``.

    ``FileNotFoundError`` names the URL when it holds no complete save.
    """
    spec = _spec(url, storage_options)
    fs, root = spec.filesystem()
    if not fs.exists(f"{root}/{METADATA}"):
        if spec.objects():
            raise FileNotFoundError(
                f"no complete replay-buffer checkpoint at {spec.redacted()}: a save there was "
                f"interrupted ({METADATA}, which zstore.torchrl.dumps writes last, is missing). "
                "A save replaces the one before it as it begins: save again, and to keep a "
                "complete save while the next one runs, alternate between two URLs")
        raise FileNotFoundError(
            f"no replay-buffer checkpoint at {spec.redacted()}: {METADATA} is missing "
            "(zstore.torchrl.dumps writes it last; save there first)")
    found = _state_files(spec)
    if pickled := _pickles(found):
        raise ValueError(
            f"refusing to load the replay buffer at {spec.redacted()}: it holds {pickled}, "
            "pickles that TorchRL would unpickle (a pickle can run any code). "
            "zstore.torchrl.dumps never writes them; load a trusted save with "
            "rb.loads(local_copy) instead")
    if any(rel.endswith(".pt") for rel in found) and (why := _torch_load_unpickles()):
        raise ValueError(
            f"refusing to load the replay buffer at {spec.redacted()}: {why}, so TorchRL's "
            "torch.load of the sampler's .pt state would unpickle anything in it; load it "
            "where torch reads it with its weights-only loader")
    expected = json.loads(_read(fs, root, MANIFEST, spec)) if MANIFEST in found else {}
    missing = sorted(set(expected) - set(found))
    if missing:  # before anything is loaded: the buffer stays as it was
        raise FileNotFoundError(f"the replay-buffer checkpoint at {spec.redacted()} lacks "
                                f"{missing} (copied in part, or a file was deleted): load an "
                                "intact copy")
    with tempfile.TemporaryDirectory(prefix="zstore-rb-") as local, \
            _storage_at(rb, StoreSpec(f"{spec.url}/{STORAGE}", dict(spec.storage_options))):
        for rel in found:
            data = _read(fs, root, rel, spec)
            if rel in expected and len(data) != expected[rel]:
                raise ValueError(f"the replay-buffer checkpoint at {spec.redacted()}: {rel} "
                                 f"holds {len(data)} bytes, {expected[rel]} were saved (cut "
                                 "short): load an intact copy")
            os.makedirs(os.path.dirname(os.path.join(local, rel)), exist_ok=True)
            with open(os.path.join(local, rel), "wb") as file:
                file.write(data)
        rb.loads(local)


def _previous_save(spec: StoreSpec) -> list[str]:
    """The files of the save at ``spec`` (besides the storage's checkpoint) that a new save
    there may replace: none where it is empty. Refuses a location holding anything else (a
    Zarr store: a buffer or dataset; files no save wrote), which a save would overwrite."""
    found = _state_files(spec)
    if "zarr.json" in found:
        raise StoreExistsError(
            f"cannot save a replay buffer at {spec.redacted()}: it holds a Zarr store (a zstore "
            "buffer or dataset, left unchanged); choose an empty location or an earlier save's")
    if MANIFEST in found:  # a save by zstore.torchrl.dumps, complete or cut short
        fs, root = spec.filesystem()
        try:
            listed = set(json.loads(fs.cat_file(f"{root}/{MANIFEST}")))
        except ValueError:  # cut short as it was written (a Ctrl-C, a kill), as its save:
            listed = set()      # the new one is written over it, and nothing else deleted
        return sorted(set(found) & (listed | {METADATA, MANIFEST}))
    if METADATA in found or not found:  # a save without a manifest (TorchRL's rb.dumps), or none
        return found
    raise StoreExistsError(
        f"cannot save a replay buffer at {spec.redacted()}: it holds {len(found)} files that no "
        f"save wrote (e.g. {found[0]!r}), left unchanged; choose an empty location or an "
        "earlier save's")


def _read(fs: Any, root: str, rel: str, spec: StoreSpec) -> bytes:
    """The state file ``rel`` of the save at ``spec``; a request that failed after the
    client's retries (a server error, a body damaged in transfer) raises naming it."""
    try:
        return fs.cat_file(f"{root}/{rel}")
    except FileNotFoundError:
        raise
    except Exception as exc:  # (s3fs's and botocore's own errors name no save)
        error = request_error(exc, spec.redacted(), f"cannot read {rel} of the replay-buffer "
                              f"checkpoint at {spec.redacted()}", "nothing was loaded: load it "
                              "again once the server answers", remote=spec.is_remote)
        if error is None:
            raise
        raise error from exc


def _torch_load_unpickles() -> str:
    """Why a ``torch.load`` that passes no ``weights_only`` (TorchRL's) unpickles anything
    here, or ``""`` where it reads weights only."""
    import torch

    if os.environ.get(_NO_WEIGHTS_ONLY, "0").lower() in ("1", "y", "yes", "true"):
        return f"{_NO_WEIGHTS_ONLY} is set"
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 6):
        return f"torch {torch.__version__} predates 2.6, whose torch.load reads weights only"
    return ""


def _files_under(local: str) -> list[str]:
    """The files below the local folder ``local``, as sorted paths relative to it."""
    return sorted(os.path.relpath(os.path.join(folder, name), local)
                  for folder, _, names in os.walk(local) for name in names)


def _refuse_pickles(files: list[str], spec: StoreSpec) -> None:
    """Refuse saving at ``spec`` a buffer whose state files (``files``) hold a pickle that a
    load would unpickle (the prefetch queue aside: never stored)."""
    if TRANSFORM in files:
        raise ValueError(
            f"cannot save this buffer at {spec.redacted()}: its transforms have state, which "
            f"TorchRL saves with torch.save ({TRANSFORM}, a pickle), and zstore never stores "
            "what it would have to unpickle. Save the transforms' state_dict() yourself "
            "(e.g. as tensors), or use rb.dumps(local_path)")
    if pickled := [rel for rel in _pickles(files) if rel != PREFETCH]:
        raise ValueError(
            f"cannot save this buffer at {spec.redacted()}: its state holds objects that are "
            f"not tensors, which tensordict pickles ({pickled}), and zstore never stores what "
            "it would have to unpickle. Keep the sampler's and writer's state in tensors, or "
            "use rb.dumps(local_path)")


def _pickles(files: list[str]) -> list[str]:
    """The files among ``files`` (relative paths) that TorchRL or tensordict would unpickle
    on loading them."""
    return [rel for rel in files
            if rel in (PREFETCH, TRANSFORM) or rel.rsplit("/", 1)[-1] in TENSORDICT_PICKLES]


def _state_files(spec: StoreSpec) -> list[str]:
    """The files of a save at ``spec`` besides the storage's checkpoint, relative to it."""
    return sorted(rel for rel in spec.objects() if rel.split("/")[0] != STORAGE)
