"""Torch dtype <-> Zarr data type, for an allow-list of dtypes (bfloat16 and float8 as bit views).

Every dtype a user can put in a TensorDict is stored as a standard Zarr v3 data
type. Types NumPy (and so Zarr) lacks — ``bfloat16`` and the float8 family — are
stored as unsigned integers of the same width, and the torch dtype is recorded
in the array's ``zstore`` attributes so it is restored bit for bit. Only dtypes
in this allow-list are ever read back.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .errors import SchemaError

# torch dtype -> (numpy dtype used on the store, is the torch dtype a bit view of it)
_NATIVE: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_VIEWED: dict[torch.dtype, str] = {torch.bfloat16: "uint16"}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _VIEWED[getattr(torch, _name)] = "uint8"

_BY_NAME: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt for dt in list(_NATIVE) + list(_VIEWED)
}


def require_storable(dtype: torch.dtype, key: str) -> None:
    """Refuse the dtype of ``key`` when zstore cannot store it, naming the key, the dtypes
    it stores and the way out."""
    if dtype not in _NATIVE and dtype not in _VIEWED:
        wider = {torch.complex32: "torch.complex64"}.get(dtype, "torch.float32")
        raise SchemaError(
            f"key {key!r}: dtype {dtype} cannot be stored by zstore (it stores "
            f"{', '.join(sorted(_BY_NAME))}); convert the key first, e.g. .to({wider})")


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The name recorded in metadata for ``dtype`` (``"bfloat16"``, ``"float32"`` ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_NAME:
        raise SchemaError(f"dtype {dtype} cannot be stored by zstore")
    return name


def torch_dtype_from_name(name: str) -> torch.dtype:
    """Resolve a recorded dtype name through the allow-list (never ``getattr`` blindly)."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise SchemaError(
            f"dtype {name!r} recorded in the store is not one zstore reads; "
            f"allowed: {sorted(_BY_NAME)}"
        ) from None


def storage_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of the Zarr array that holds a torch ``dtype``."""
    if dtype in _NATIVE:
        return np.dtype(_NATIVE[dtype])
    if dtype in _VIEWED:
        return np.dtype(_VIEWED[dtype])
    raise SchemaError(f"dtype {dtype} cannot be stored by zstore")


# Dtypes whose indexing kernels torch lacks are handled as signed ints of the same width.
_COMPUTE: dict[torch.dtype, torch.dtype] = {
    torch.uint16: torch.int16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
    torch.bfloat16: torch.int16,
}
for _dt, _np in _VIEWED.items():
    if _np == "uint8":
        _COMPUTE[_dt] = torch.uint8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype caches and maps use for ``dtype`` (same width, full indexing support)."""
    return _COMPUTE.get(dtype, dtype)


def to_storage(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` with its :func:`compute_dtype` (bit-exact, no copy), detached: a
    stored row is a value, and no autograd graph outlives the write (gradients would
    otherwise reach a writer's graph through cached rows only, and keep it alive)."""
    tensor = tensor.detach()
    target = _COMPUTE.get(tensor.dtype)
    return tensor.view(target) if target is not None else tensor


def from_storage(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a cached / mapped tensor as the user's torch ``dtype``."""
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


def to_numpy(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A CPU tensor in compute dtype as the NumPy array of the Zarr array's dtype."""
    return tensor.numpy().view(storage_numpy_dtype(dtype))


def _spend_the_read_only_warning() -> None:
    """torch warns, once per process, that a tensor over a read-only array must not be
    written; :func:`from_numpy`'s are only ever copied from. Spent here, at import, so no
    decode thread swaps the process's warning state around each call
    (``warnings.catch_warnings`` is not per thread: it clobbered a caller's
    ``catch_warnings(record=True)``, which lost its warnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


_spend_the_read_only_warning()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A NumPy chunk read from Zarr as a tensor in :func:`compute_dtype`."""
    target = compute_dtype(dtype)
    width = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
    if target in (torch.int16, torch.int32, torch.int64) and dtype != target:
        array = array.view(width[array.dtype.itemsize])
    if not array.flags.writeable:  # decoded straight from a bytes object; only ever copied from
        return torch.from_numpy(array)  # (torch's warning about it: spent at import)
    return torch.from_numpy(np.ascontiguousarray(array))
