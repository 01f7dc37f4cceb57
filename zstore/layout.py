"""TensorDict / pytree <-> Zarr group layout (format v1): key paths, ``Schema``, ``StoreMeta``; no I/O.

One Zarr array per leaf, at the path of its nested key (``("next", "obs")`` ->
``next/obs``); the group's attributes carry ``__tensordict__`` (read by
``TensorDict.from_zarr``) and the JSON ``zstore`` block (:class:`StoreMeta`).
This module owns the mapping from user data to columns and back; it never
pickles anything.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import sys
import unicodedata
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, is_non_tensor
from tensordict import is_tensor_collection, is_tensorclass

from .codecs import CodecSpec
from .dtypes import require_storable, torch_dtype_from_name, torch_dtype_name
from .errors import (
    CorruptChunkError,
    InvalidKeyError,
    MissingKeyError,
    NotAZStoreError,
    SchemaError,
)
from .format_version import FORMAT_VERSION, TAIL_FORMAT_VERSION, check_format_version, unknown_fields
from .row_objects import ALL_CHUNKS_STORED
from .tail import Segment, record_from_json, record_to_json
from .text import TEXT_BYTES, decode, encode, holds_value, is_text, non_tensor_leaves, width_for

#: Name of the array that holds a storage of plain tensors (TorchRL's file name).
SINGLE_TENSOR_KEY = "_-single-tensor-_"
#: Largest number of elements zstore accepts for one buffer leaf (guards absurd metadata).
MAX_ELEMENTS = 1 << 48
_RESERVED = {"zarr.json", ".zarray", ".zgroup", ".zattrs"}


#: Zarr ``dimension_names`` of a buffer's row dim and lane dims (``ndim > 1``).
ROW_DIM, LANE_DIM = "row", "env"


def dimension_names(path: str, ndim: int, lead: int = 0, prefix: str = "") -> list[str]:
    """The Zarr v3 ``dimension_names`` of the ``ndim``-D array at ``path``.

    Its first ``lead`` dims index rows then lanes: ``row``, then ``env`` (``env_0``,
    ``env_1`` ... for several lane dims), shared by every array aligned on them (xarray
    aligns on names); ``prefix`` sets apart rows that do not align (``episode_row``). Each
    other dim is the array's own, ``<path>_0``, ``<path>_1`` ... (``/`` written ``.``, and
    a ``.`` or ``%`` of a key written ``%2E`` / ``%25``), so feature dims of different
    arrays never share a name: ``a.b`` and ``("a", "b")`` get ``a%2Eb_0`` and ``a.b_0``.
    Nor a lane dim's: a key named as one (``env``, ``episode_env``) numbers its own dims
    after ``%5F`` (an escaped ``_``): ``env%5F0``, where ``env_0`` is the first lane dim.
    """
    lanes = max(0, lead - 1)
    shared = [ROW_DIM, *([LANE_DIM] if lanes == 1 else [f"{LANE_DIM}_{i}" for i in range(lanes)])]
    own = ".".join(part.replace("%", "%25").replace(".", "%2E") for part in path.split("/"))
    mark = "%5F" if own == LANE_DIM or own.endswith(f"_{LANE_DIM}") else "_"
    return [f"{prefix}{name}" for name in shared[:lead]] + [f"{own}{mark}{i}"
                                                            for i in range(ndim - lead)]


def key_to_path(key: str | tuple[str, ...]) -> str:
    """Map a (nested) key to its Zarr path, refusing keys that would escape the group."""
    parts = (key,) if isinstance(key, str) else tuple(key)
    if not parts:
        raise InvalidKeyError("an empty key cannot be stored")
    for part in parts:
        if not isinstance(part, str):
            raise InvalidKeyError(f"key {key!r}: every part must be a string, got {part!r}")
        if (not part or part in (".", "..") or "/" in part or "\\" in part
                or part in _RESERVED or part != part.strip() or "\x00" in part):
            raise InvalidKeyError(
                f"key {key!r} cannot be stored: part {part!r} is empty, '.', '..', reserved, "
                "padded with spaces or contains a path separator"
            )
    return "/".join(parts)


#: How the names of zstore's own objects beside the arrays begin (its lease, its tail log,
#: its conditional-write probes): a new buffer refuses top-level keys that begin so.
ZSTORE_OBJECT_PREFIX = "zstore-"
#: The sub-group where a sealed dataset keeps its episode index: no key of a buffer's.
EPISODE_INDEX_NAME = "__episodes__"


def refuse_zstore_names(paths: Iterable[str]) -> None:
    """Refuse key ``paths`` (Zarr paths) whose top-level part is named as zstore's own
    objects are."""
    for path in paths:
        top = path.split("/")[0]
        if top.startswith(ZSTORE_OBJECT_PREFIX):
            raise InvalidKeyError(
                f"key {top!r} cannot be stored: top-level names beginning "
                f"{ZSTORE_OBJECT_PREFIX!r} are zstore's own objects (its lease, tail log and "
                "probes); rename the key")


def refuse_keys_of_a_new_buffer(paths: Iterable[str], *, sealable: bool, remote: bool) -> None:
    """Refuse key ``paths`` (Zarr paths) that a new buffer cannot keep where it is: where it
    may be sealed, the top-level name of a dataset's episode index (sealing would replace
    that key); on a remote store, control characters (S3's clients fail on them). A buffer
    written before these rules still opens."""
    for path in paths:
        if sealable and path.split("/")[0] == EPISODE_INDEX_NAME:
            raise InvalidKeyError(f"key {EPISODE_INDEX_NAME!r} cannot be stored: it is where a "
                                  "sealed dataset keeps its episode index; rename the key")
        if remote and any(unicodedata.category(char) == "Cc" for char in path):
            raise InvalidKeyError(
                f"key {tuple(path.split('/'))!r} cannot be stored in a remote store: it holds a "
                "control character (a newline, a tab ...), which S3's clients cannot carry in "
                "an object's name; rename the key")


def _class_name(cls: type) -> str:
    """``"module.QualName"`` of a tensorclass (what :func:`loaded_tensorclass` finds)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def loaded_tensorclass(name: str | None) -> type | None:
    """The tensorclass ``name`` (``"module.QualName"``, a schema's ``class_name``) names
    when its module is already imported in this process, else ``None``: a name read from a
    store never imports or runs anything."""
    parts = (name or "").split(".")
    for cut in range(len(parts) - 1, 0, -1):
        found: Any = sys.modules.get(".".join(parts[:cut]))
        for attr in parts[cut:]:
            found = getattr(found, attr, None)
        if isinstance(found, type) and is_tensorclass(found):
            return found
    return None


def path_to_key(path: str) -> tuple[str, ...]:
    """Inverse of :func:`key_to_path` (validated)."""
    key = tuple(path.split("/"))
    key_to_path(key)
    return key


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One column: its key, torch dtype and per-row shape (lane dims + feature dims)."""

    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: str = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", "/".join(self.key))  # the column's Zarr path
        require_storable(self.dtype, self.path)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of this column."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def to_json(self) -> dict[str, Any]:
        """JSON form (inside the schema)."""
        return {"path": self.path, "dtype": torch_dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Leaf":
        """Inverse of :meth:`to_json`, with every field validated."""
        shape = data["shape"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise SchemaError(f"invalid shape {shape!r} for key {data.get('path')!r}")
        return cls(path_to_key(data["path"]), torch_dtype_from_name(data["dtype"]), tuple(shape))


@dataclasses.dataclass
class Schema:
    """What a buffer holds: its leaves, the kind of container, and how to rebuild it.

    ``lane_shape`` holds the batch dims after the first (``ndim > 1``); every
    leaf's ``shape`` starts with it. ``item_batch`` holds the batch dims an item of a
    tensor collection has beyond its lanes (a ``[N, 3]`` TensorDict in an ``ndim=1``
    buffer: ``(3,)``): they come back as batch dims, as TorchRL's storages keep them.
    ``texts`` holds the paths of string leaves, stored as text cells (``uint8`` leaves whose
    last dim is the cell width: :mod:`zstore.text`). ``stack`` is ``(dim, count)`` when an
    item is a lazy stack of ``count`` TensorDicts of different shapes along its item dim
    ``dim`` (an index of ``item_batch``): member ``i``'s leaves are under ``<i>/``, and
    reads are lazy stacks again, as TorchRL's storages keep them. ``empty`` holds the paths
    of nested TensorDicts that hold nothing (no array stores them): reads give them back.
    """

    leaves: tuple[Leaf, ...]
    kind: str  # "tensordict" | "tensorclass" | "tensor" | "pytree"
    lane_shape: tuple[int, ...] = ()
    group_batch: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    treespec: str | None = None
    class_name: str | None = None
    item_batch: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()
    stack: tuple[int, int] | None = None
    tensorclass: type | None = dataclasses.field(default=None, compare=False, repr=False)
    #: ``{node path: "module.QualName"}`` of the tensorclasses nested in an item: they come
    #: back as those classes where this process has imported them (as the root's class_name)
    classes: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    empty: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    #: the fields of the stored schema (:meth:`to_json`) this version reads
    FIELDS = frozenset({"kind", "lane_shape", "leaves", "group_batch", "treespec", "class_name",
                        "item_batch", "texts", "stack", "classes", "empty"})

    def __post_init__(self) -> None:
        self.by_path = {leaf.path: leaf for leaf in self.leaves}
        #: path -> (dtype, shape) of one item: the check of ``add()``'s hot path
        self._item_spec = {leaf.path: (leaf.dtype, torch.Size(leaf.shape)) for leaf in self.leaves}

    @property
    def row_bytes(self) -> int:
        """Bytes of one row over all columns."""
        return sum(leaf.row_bytes for leaf in self.leaves)

    @property
    def array_batch(self) -> tuple[int, ...]:
        """The item batch dims every array has after its lanes (``item_batch`` but the
        dim of a lazy stack's members)."""
        if self.stack is None:
            return self.item_batch
        dim = self.stack[0]
        return self.item_batch[:dim] + self.item_batch[dim + 1:]

    @property
    def group_paths(self) -> list[str]:
        """Paths of the sub-groups that hold nested keys, parents before children."""
        return sorted({"/".join(leaf.key[:depth]) for leaf in self.leaves
                       for depth in range(1, len(leaf.key))}, key=lambda p: (p.count("/"), p))

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_example(cls, example: Any, ndim: int = 1, text_bytes: int = TEXT_BYTES) -> "Schema":
        """Infer the schema from one example item (no leading buffer dim); its string
        leaves get text cells of ``text_bytes`` (or as many as its longest string needs)."""
        lanes = ndim - 1
        if is_tensor_collection(example):
            td = example._tensordict if is_tensorclass(example) else example
            if len(td.batch_size) < lanes:
                raise SchemaError(
                    f"ndim={ndim} needs items with at least {lanes} batch dims, "
                    f"got batch_size={tuple(td.batch_size)}"
                )
            lane_shape, item_batch = tuple(td.batch_size[:lanes]), tuple(td.batch_size[lanes:])
            if ragged_keys(td):
                return cls._stacked(td, ndim, text_bytes)
            leaves, groups = [], {}
            for key in td.keys(include_nested=True, leaves_only=True):
                key = (key,) if isinstance(key, str) else tuple(key)
                value = td.get(key)
                if not isinstance(value, torch.Tensor):
                    raise SchemaError(f"key {key!r}: only tensors can be stored, got {type(value).__name__}")
                key_to_path(key)
                leaves.append(Leaf(key, value.dtype, tuple(value.shape)))
            texts = []
            for key, value in non_tensor_leaves(td):
                key = (key,) if isinstance(key, str) else tuple(key)
                if not holds_value(value):
                    continue  # None everywhere: no value, as before
                if not is_text(value):
                    encode(value, 0, key)  # raises, naming the key and the value's type
                texts.append(key_to_path(key))
                leaves.append(Leaf(key, torch.uint8,
                                   (*td.batch_size, width_for(value, text_bytes))))
            classes, empty = {}, []
            for key in td.keys(include_nested=True):
                key = (key,) if isinstance(key, str) else tuple(key)
                sub = td.get(key)
                if is_tensor_collection(sub) and len(sub.batch_size) > len(td.batch_size):
                    groups[key_to_path(key)] = list(sub.batch_size)
                if is_tensorclass(sub) and not is_non_tensor(sub):  # strings are leaves
                    classes[key_to_path(key)] = _class_name(type(sub))
                if type(sub) is TensorDict and not sub.keys():  # (a tensorclass has fields)
                    empty.append(key_to_path(key))
            if not leaves:
                raise SchemaError("cannot store an item without any tensor")
            refuse_zstore_names([leaf.path for leaf in leaves] + empty)
            if is_tensorclass(example):
                return cls(tuple(leaves), "tensorclass", lane_shape, groups,
                           class_name=_class_name(type(example)), item_batch=item_batch,
                           texts=tuple(texts), tensorclass=type(example), classes=classes,
                           empty=tuple(empty))
            return cls(tuple(leaves), "tensordict", lane_shape, groups, item_batch=item_batch,
                       texts=tuple(texts), classes=classes, empty=tuple(empty))
        if isinstance(example, torch.Tensor):
            if example.ndim < lanes:
                raise SchemaError(f"ndim={ndim} needs tensors with at least {lanes} dims")
            return cls((Leaf((SINGLE_TENSOR_KEY,), example.dtype, tuple(example.shape)),),
                       "tensor", tuple(example.shape[:lanes]))
        flat, spec = pytree.tree_flatten_with_path(example)
        if not flat or not all(isinstance(v, torch.Tensor) for _, v in flat):
            raise SchemaError(
                f"cannot store {type(example).__name__}: expected a tensor, a TensorDict, "
                "a tensorclass or a pytree of tensors"
            )
        leaves = tuple(Leaf(_keypath(path), v.dtype, tuple(v.shape)) for path, v in flat)
        refuse_zstore_names([key_to_path(leaf.key) for leaf in leaves])
        paths = [leaf.path for leaf in leaves]
        if len(set(paths)) != len(paths):
            twice = sorted({p for p in paths if paths.count(p) > 1})
            raise InvalidKeyError(f"pytree keys {twice} name the same column twice (a string "
                                  "key spelled like a tagged one, e.g. '<int>3' beside 3)")
        return cls(leaves, "pytree", tuple(flat[0][1].shape[:lanes]),
                   treespec=pytree.treespec_dumps(spec))

    @classmethod
    def _stacked(cls, td: LazyStackedTensorDict, ndim: int, text_bytes: int) -> "Schema":
        """The schema of items that are lazy stacks of TensorDicts of different shapes: each
        member's leaves under ``<i>/``, stacked again at read."""
        lanes = ndim - 1
        dim = td.stack_dim - lanes
        if dim < 0:
            raise SchemaError(
                f"key(s) {ragged_keys(td)} differ in shape between the TensorDicts of a lazy "
                f"stack along a lane dim (dim {td.stack_dim} of ndim={ndim} items): only a "
                "stack along an item's own batch dims can be stored; pad the items to one shape, "
                "or use LazyTensorStorage (in RAM)")
        members = [cls.from_example(member, ndim, text_bytes) for member in td.tensordicts]
        if any(member.stack is not None or member.kind != "tensordict" for member in members):
            raise SchemaError("a lazy stack of lazy stacks (or of tensorclasses) of different "
                              "shapes cannot be stored; use LazyTensorStorage (in RAM)")
        leaves = tuple(Leaf((str(i), *leaf.key), leaf.dtype, leaf.shape)
                       for i, member in enumerate(members) for leaf in member.leaves)
        groups = {str(i): [*member.lane_shape, *member.item_batch]
                  for i, member in enumerate(members)}
        for i, member in enumerate(members):
            groups.update({f"{i}/{path}": batch for path, batch in member.group_batch.items()})
        texts = tuple(f"{i}/{path}" for i, member in enumerate(members) for path in member.texts)
        return cls(leaves, "tensordict", tuple(td.batch_size[:lanes]), groups,
                   item_batch=tuple(td.batch_size[lanes:]), texts=texts, stack=(dim, len(members)))

    def _stacked_leaves(self, data: Any, lead: int) -> dict[str, Any]:
        """``{path: leaf}`` of a lazy stack written to a buffer of stacked items."""
        dim, count = self.stack
        want = lead + len(self.lane_shape) + dim
        if not isinstance(data, LazyStackedTensorDict) or data.stack_dim != want \
                or len(data.tensordicts) != count:
            got = (f"a lazy stack of {len(data.tensordicts)} along dim {data.stack_dim}"
                   if isinstance(data, LazyStackedTensorDict) else type(data).__name__)
            raise SchemaError(f"this buffer stores lazy stacks of {count} TensorDicts along "
                              f"dim {want} of the data written, got {got}")
        return {f"{i}/{path}": value for i, member in enumerate(data.tensordicts)
                for path, value in _flat_leaves(member).items()}

    # -- data <-> columns -----------------------------------------------------------
    def columns(self, data: Any, lead: int) -> dict[str, torch.Tensor]:
        """Flatten ``data`` into ``{path: tensor}``, checking keys, dtypes and shapes.

        ``lead`` is the number of leading index dims the data has beyond a row
        (0 for one item, 1 for a batch).
        """
        if self.kind in ("tensordict", "tensorclass"):
            if not is_tensor_collection(data):
                raise SchemaError(f"this buffer stores TensorDicts, got {type(data).__name__}")
            td = data._tensordict if is_tensorclass(data) else data
            out = _flat_leaves(td) if self.stack is None else self._stacked_leaves(td, lead)
            if lead == 0 and self._is_item(out):  # add()'s hot path
                return out
            self._encode_texts(out)
            extra = [path for path in out if path not in self.by_path]
            if extra:
                raise MissingKeyError(
                    f"key {tuple(extra[0].split('/'))!r} is not in this "
                    f"buffer (keys: {sorted(self.by_path)}); a buffer's keys are fixed when it is "
                    "first written"
                )
            missing = set(self.by_path) - set(out)
            if missing:
                error = MissingKeyError(f"data lacks the buffer's key(s) {sorted(missing)}")
                error.lacking = tuple(sorted(missing))
                raise error
        elif self.kind == "tensor":
            if not isinstance(data, torch.Tensor):
                raise SchemaError(f"this buffer stores tensors, got {type(data).__name__}")
            out = {SINGLE_TENSOR_KEY: data}
        else:
            flat, spec = pytree.tree_flatten_with_path(data)
            if pytree.treespec_dumps(spec) != self.treespec:
                raise SchemaError("data does not have the buffer's pytree structure")
            out = {"/".join(_keypath(p)): v for p, v in flat}
        lead_shape = None
        for path, value in out.items():
            leaf = self.by_path[path]
            if not isinstance(value, torch.Tensor):
                raise SchemaError(f"key {leaf.key!r}: expected a tensor, got {type(value).__name__}")
            if value.dtype != leaf.dtype:
                raise SchemaError(
                    f"key {leaf.path!r}: dtype {value.dtype} does not match the buffer's "
                    f"{leaf.dtype} (a buffer's dtypes are fixed at its first write): cast the "
                    f"data first, e.g. data.to({leaf.dtype}); nothing was written")
            if not lead and value.shape == (1, *leaf.shape):  # one row as a batch of one: torch
                value = out[path] = value[0]                  # writes it into the row, as TorchRL
            if tuple(value.shape[lead:]) != leaf.shape or value.ndim != lead + len(leaf.shape):
                expected = ("N", *leaf.shape) if lead else leaf.shape
                raise SchemaError(
                    f"key {leaf.path!r}: shape {tuple(value.shape)} does not match the buffer's "
                    f"{tuple(expected)} (a buffer's shapes are fixed at its first write): "
                    "reshape the data, or write it to another buffer; nothing was written")
            if lead_shape is None:
                lead_shape = tuple(value.shape[:lead])
            elif tuple(value.shape[:lead]) != lead_shape:
                raise SchemaError(
                    f"key {leaf.key!r}: batch dims {tuple(value.shape[:lead])} differ from "
                    f"{lead_shape} of the other keys"
                )
        return out

    def _encode_texts(self, out: dict[str, Any]) -> None:
        """Replace the non-tensor leaves of ``out`` by text cells where the buffer stores
        them (``texts``); drop those that hold no value; the others stay, to be reported."""
        for path, value in list(out.items()):
            if not is_non_tensor(value):
                continue
            if path in self.texts:
                leaf = self.by_path[path]
                out[path] = encode(value, leaf.shape[-1], leaf.key)
            elif not holds_value(value):
                del out[path]  # None everywhere is no value (a tensorclass field left None)

    def _is_item(self, out: Mapping[str, Any]) -> bool:
        """Whether ``out`` holds exactly one valid item (the fast check; the full one says
        what is wrong)."""
        spec = self._item_spec
        for path, value in out.items():
            expected = spec.get(path)
            if (expected is None or not isinstance(value, torch.Tensor)
                    or value.dtype != expected[0] or value.shape != expected[1]):
                return False
        return len(out) == len(spec)

    def build(self, columns: Mapping[str, torch.Tensor], batch_shape: tuple[int, ...],
              device: torch.device | None = None) -> Any:
        """Rebuild user data from ``{path: tensor}`` whose leading dims are ``batch_shape``.

        The columns come from the buffer's own arrays, so shapes are trusted and
        the TensorDict is built without re-validation.
        """
        if self.kind == "tensor":
            return columns[SINGLE_TENSOR_KEY]
        if self.kind == "pytree":
            spec = pytree.treespec_loads(self.treespec)
            return pytree.tree_unflatten([columns[leaf.path] for leaf in self.leaves], spec)
        nested: dict[str, Any] = {}
        for leaf in self.leaves:
            node = nested
            for part in leaf.key[:-1]:
                node = node.setdefault(part, {})
            node[leaf.key[-1]] = (self._strings(leaf, columns[leaf.path]) if leaf.path in self.texts
                                  else columns[leaf.path])
        for path in self.empty:
            node = nested
            for part in path_to_key(path):
                node = node.setdefault(part, {})
        td = TensorDict._new_unsafe(nested, batch_size=torch.Size([*batch_shape, *self.array_batch]),
                                    device=device)
        for path in sorted(self.group_batch, key=lambda p: -p.count("/")):
            extra = self.group_batch[path][len(self.lane_shape):]
            td.get(path_to_key(path)).batch_size = torch.Size([*batch_shape, *extra])
        for path in sorted(self.classes, key=lambda p: -p.count("/")):  # innermost first
            found = loaded_tensorclass(self.classes[path])
            if found is not None:
                key = path_to_key(path)
                td.set(key, found.from_tensordict(td.get(key)))
        if self.stack is not None:
            dim, count = self.stack
            return LazyStackedTensorDict(*(td.get(str(i)) for i in range(count)),
                                         stack_dim=len(batch_shape) + dim)
        if self.kind == "tensorclass" and self.tensorclass is None:
            self.tensorclass = loaded_tensorclass(self.class_name)
        if self.kind == "tensorclass" and self.tensorclass is not None:
            return self.tensorclass.from_tensordict(td)
        return td

    @staticmethod
    def _strings(leaf: Leaf, cells: torch.Tensor) -> Any:
        """The strings of text cells read from key ``leaf``."""
        try:
            return decode(cells)
        except UnicodeDecodeError as exc:
            raise CorruptChunkError(f"key {leaf.key!r}: its text cells are not UTF-8 "
                                    f"({exc.reason} at byte {exc.start})") from None

    # -- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """JSON form stored in the ``zstore`` block (``item_batch`` only where an item has
        batch dims of its own, so every other store's metadata is as before)."""
        out = {
            "kind": self.kind,
            "lane_shape": list(self.lane_shape),
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "group_batch": dict(self.group_batch),
            "treespec": self.treespec,
            "class_name": self.class_name,
        }
        if self.item_batch:
            out["item_batch"] = list(self.item_batch)
        if self.texts:
            out["texts"] = list(self.texts)
        if self.stack is not None:
            out["stack"] = {"dim": self.stack[0], "count": self.stack[1]}
        if self.classes:
            out["classes"] = dict(self.classes)
        if self.empty:
            out["empty"] = list(self.empty)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Schema":
        """Inverse of :meth:`to_json`, validated."""
        if not isinstance(data, Mapping):
            raise SchemaError(f"the schema must be a JSON object, got {type(data).__name__}")
        kind = data.get("kind")
        if kind not in ("tensordict", "tensorclass", "tensor", "pytree"):
            raise SchemaError(f"unknown container kind {kind!r}")
        leaves = tuple(Leaf.from_json(leaf) for leaf in data["leaves"])
        if not leaves:
            raise SchemaError("a schema needs at least one leaf")
        paths = [leaf.path for leaf in leaves]
        if len(set(paths)) != len(paths):
            raise SchemaError(f"the leaves name {sorted({p for p in paths if paths.count(p) > 1})} "
                              "twice")
        if kind == "tensor" and paths != [SINGLE_TENSOR_KEY]:
            raise SchemaError(f"a tensor buffer has the one leaf {SINGLE_TENSOR_KEY!r}, not {paths}")
        if kind == "pytree":
            _check_treespec(data.get("treespec"), len(leaves))
        held = [leaf.key for leaf in leaves] + [path_to_key(p) for p in data.get("empty") or []
                                                 if isinstance(p, str)]
        nodes = {"/".join(key[:depth]) for key in held for depth in range(1, len(key) + 1)}
        strays = sorted(set(data.get("group_batch") or {}) - nodes)
        if strays:
            raise SchemaError(f"group_batch names {strays}, which hold no leaf")
        lanes = len(data.get("lane_shape", []))
        item_batch = data.get("item_batch", [])
        stack = _stack(data.get("stack"), item_batch, leaves, kind)
        return cls(leaves, kind, tuple(int(s) for s in data.get("lane_shape", [])),
                   {str(k): [int(x) for x in v] for k, v in (data.get("group_batch") or {}).items()},
                   data.get("treespec"), data.get("class_name"),
                   _item_batch(item_batch, leaves, lanes, None if stack is None else stack[0]),
                   _texts(data.get("texts", []), leaves, kind), stack,
                   classes=_classes(data.get("classes"), leaves),
                   empty=_empty(data.get("empty", []), leaves, kind))


def _stack(value: Any, item_batch: Any, leaves: tuple[Leaf, ...],
           kind: str) -> tuple[int, int] | None:
    """A stored ``stack``, validated: an item dim whose size is the number of members, and
    leaves each under a member's index."""
    if value is None:
        return None
    if kind != "tensordict" or not isinstance(value, Mapping) \
            or not all(isinstance(value.get(k), int) for k in ("dim", "count")) \
            or not isinstance(item_batch, list) or not 0 <= value["dim"] < len(item_batch) \
            or item_batch[value["dim"]] != value["count"] or value["count"] < 1:
        raise SchemaError(f"invalid stack {value!r}: expected {{'dim': an item dim, 'count': "
                          f"its size}} of a tensordict schema (item_batch {item_batch!r})")
    members = {str(i) for i in range(value["count"])}
    strays = sorted(leaf.path for leaf in leaves if leaf.key[0] not in members or len(leaf.key) < 2)
    if strays or {leaf.key[0] for leaf in leaves} != members:
        raise SchemaError(f"stack of {value['count']} members: leaves {strays} are under no "
                          "member, or a member has no leaf")
    return value["dim"], value["count"]


def _item_batch(value: Any, leaves: tuple[Leaf, ...], lanes: int,
                stack_dim: int | None = None) -> tuple[int, ...]:
    """A stored ``item_batch``, validated: sizes every leaf's shape has after its lanes (but
    the dim of a lazy stack's members, ``stack_dim``)."""
    if not isinstance(value, list) or not all(isinstance(s, int) and s >= 0 for s in value):
        raise SchemaError(f"invalid item_batch {value!r}: expected a list of sizes")
    dims = tuple(value)
    if stack_dim is not None:
        dims = dims[:stack_dim] + dims[stack_dim + 1:]
    for leaf in leaves:
        if leaf.shape[lanes:lanes + len(dims)] != dims:
            raise SchemaError(f"item_batch {list(dims)} does not lead the shape "
                              f"{list(leaf.shape)} of key {leaf.key!r} after its lanes")
    return tuple(value)


def _classes(value: Any, leaves: tuple[Leaf, ...]) -> dict[str, str]:
    """A stored ``classes``, validated: class names of nodes above some leaf."""
    if value is None:
        return {}
    nodes = {"/".join(leaf.key[:depth]) for leaf in leaves for depth in range(1, len(leaf.key))}
    if not isinstance(value, Mapping) or not all(
            path in nodes and isinstance(name, str) for path, name in value.items()):
        raise SchemaError(f"invalid 'classes' {value!r}: class names of nested nodes expected")
    return dict(value)


def _check_treespec(treespec: Any, leaves: int) -> None:
    """A pytree schema's ``treespec``: torch's JSON of a tree of ``leaves`` leaves."""
    try:
        found = pytree.treespec_loads(treespec).num_leaves
    except Exception as exc:  # (torch raises what its JSON parser meets)
        raise SchemaError(f"invalid treespec {treespec!r:.80} ({type(exc).__name__})") from None
    if found != leaves:
        raise SchemaError(f"the treespec has {found} leaves, the schema {leaves}")


def _empty(value: Any, leaves: tuple[Leaf, ...], kind: str) -> tuple[str, ...]:
    """A stored ``empty``, validated: paths of nodes of a tensor collection that hold no leaf."""
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise SchemaError(f"invalid 'empty' {value!r}: expected a list of key paths")
    for path in value:
        path_to_key(path)  # a valid key: raises naming it
        if kind not in ("tensordict", "tensorclass") or any(
                leaf.path == path or leaf.path.startswith(path + "/")
                or path.startswith(leaf.path + "/") for leaf in leaves):
            raise SchemaError(f"'empty' names {path!r}, which is a leaf or holds or lies "
                              f"under one in this {kind} buffer's schema")
    return tuple(value)


def _texts(value: Any, leaves: tuple[Leaf, ...], kind: str) -> tuple[str, ...]:
    """A stored ``texts``, validated: paths of ``uint8`` leaves of a tensor collection."""
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise SchemaError(f"invalid texts {value!r}: expected a list of key paths")
    by_path = {leaf.path: leaf for leaf in leaves}
    for path in value:
        leaf = by_path.get(path)
        if kind not in ("tensordict", "tensorclass") or leaf is None \
                or leaf.dtype != torch.uint8 or not leaf.shape:
            raise SchemaError(f"texts names {path!r}, which is no uint8 leaf of this "
                              f"{kind} buffer's schema")
    return tuple(value)


def ragged_keys(data: Any) -> list[str]:
    """Paths of a lazy stack's keys that cannot be one dense column: their shapes (or
    dtypes) differ between the stacked TensorDicts, or some of them lack the key (none for
    other data)."""
    if not isinstance(data, LazyStackedTensorDict):
        return []
    per_td = [{path: (value.dtype, tuple(value.shape)) for path, value in _flat_leaves(td).items()
               if isinstance(value, torch.Tensor)} for td in data.tensordicts]
    paths = sorted({path for part in per_td for path in part})
    return [path for path in paths if len({part.get(path) for part in per_td}) > 1]


def _tensor_or_text(cls: type) -> bool:
    """Whether a collection's entry of type ``cls`` is a leaf: a tensor, or a non-tensor
    (strings) entry, which a lazy stack's ``leaves_only`` walk would leave out."""
    return issubclass(cls, torch.Tensor) or bool(getattr(cls, "_is_non_tensor", False))


def _flat_leaves(td: TensorDictBase) -> dict[str, Any]:
    """``{path: leaf}`` of a tensor collection (fast walk over plain TensorDicts)."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, TensorDictBase]] = [("", td)]
    while stack:
        prefix, node = stack.pop()
        if type(node) is not TensorDict:
            for key in node.keys(include_nested=True, leaves_only=True, is_leaf=_tensor_or_text):
                key = (key,) if isinstance(key, str) else tuple(key)
                out[prefix + "/".join(key)] = node.get(key)
            continue
        for key, value in node._tensordict.items():
            if isinstance(value, torch.Tensor) or is_non_tensor(value):
                out[prefix + key] = value
            elif is_tensor_collection(value):
                stack.append((f"{prefix}{key}/", value))
            else:
                out[prefix + key] = value
    return out


#: Dict keys a pytree's JSON spec records exactly (a tuple key would come back a list).
_NON_STR_KEYS = (bool, int, float, type(None))


def _non_str_part(key: Any) -> str:
    """The path part of a pytree dict key that is not a string: ``<int>30``, ``<float>1.5``.

    The treespec stored with the schema gives back the key itself; the part only names
    the column, tagged with the type so that ``30`` and ``"30"`` get different columns.
    """
    if type(key) not in _NON_STR_KEYS:
        raise InvalidKeyError(
            f"pytree dict key {key!r} ({type(key).__name__}) cannot be stored: keys must be "
            "str, int, float, bool or None (what the stored JSON tree spec gives back "
            "exactly); use a TensorDict, or convert the key")
    return f"<{type(key).__name__}>{key!r}"


def _keypath(path: tuple) -> tuple[str, ...]:
    parts = []
    for entry in path:
        if isinstance(entry, pytree.MappingKey):
            parts.append(entry.key if isinstance(entry.key, str) else _non_str_part(entry.key))
        elif isinstance(entry, pytree.SequenceKey):
            parts.append(str(entry.idx))
        else:
            parts.append(str(getattr(entry, "name", entry)))
    return tuple(parts)


def json_int(value: Any, name: str) -> int:
    """``value``, a recorded JSON integer (``true`` or ``"12"`` is none)."""
    if type(value) is not int:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


#: the fields of a ``zstore`` block (:meth:`StoreMeta.to_json`) this version reads
BLOCK_FIELDS = frozenset({"format_version", "storage_class", "max_size", "ndim", "rows", "length",
                          "last_cursor", "high_water", "codec", "chunks", "schema", "read_only",
                          "sealed", "extra", "created", "codecs", "tail"})


@dataclasses.dataclass
class StoreMeta:
    """The ``zstore`` block of a buffer's group attributes: everything needed to reopen it.

    It is the *commit record*: written last, in one object, after the data.
    """

    storage_class: str
    max_size: int
    ndim: int
    rows: int
    schema: Schema
    codec: CodecSpec
    layout: dict[str, tuple[int, int | None]]  # path -> (rows per chunk, rows per shard or None)
    length: int = 0
    last_cursor: int = -1
    high_water: int = 0
    read_only: bool = False
    sealed: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    created: dict[str, Any] = dataclasses.field(default_factory=dict)
    key_codecs: dict[str, CodecSpec] = dataclasses.field(default_factory=dict)  # overrides of codec
    tail: dict[str, list[Segment]] = dataclasses.field(default_factory=dict)  # log segments
    #: fields of the stored block (``schema.`` before the schema's) this version does not
    #: know: a newer zstore's, which a write from this one would drop (not written back)
    unknown: list[str] = dataclasses.field(default_factory=list, compare=False)

    def codec_of(self, path: str) -> CodecSpec:
        """The codec preset of key ``path`` (its override, else the buffer's ``codec``)."""
        return self.key_codecs.get(path, self.codec)

    @property
    def all_chunks_stored(self) -> bool:
        """Whether this is a sealed dataset whose seal stored every chunk or shard object of
        its rows (:data:`ALL_CHUNKS_STORED` in ``extra``): a missing object is damage."""
        return self.sealed and bool(self.extra.get(ALL_CHUNKS_STORED))

    @property
    def all_raw(self) -> bool:
        """Whether every key is stored as plain bytes (a condition of the mmap path)."""
        return self.codec.is_raw and all(spec.is_raw for spec in self.key_codecs.values())

    def to_json(self) -> dict[str, Any]:
        """The JSON written to the group's attributes."""
        if not self.created:
            from . import __version__

            self.created = {
                "zstore_version": __version__,
                "torch_version": torch.__version__.split("+")[0],
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
        out = {
            "format_version": TAIL_FORMAT_VERSION if self.tail else FORMAT_VERSION,
            "storage_class": self.storage_class,
            "max_size": self.max_size,
            "ndim": self.ndim,
            "rows": self.rows,
            "length": self.length,
            "last_cursor": self.last_cursor,
            "high_water": self.high_water,
            "codec": self.codec.to_json(),
            "chunks": {path: list(chunks) for path, chunks in self.layout.items()},
            "schema": self.schema.to_json(),
            "read_only": self.read_only,
            "sealed": self.sealed,
            "extra": self.extra,
            "created": self.created,
        }
        if self.key_codecs:  # absent: every key uses "codec"
            out["codecs"] = {path: spec.to_json() for path, spec in self.key_codecs.items()}
        if self.tail:  # absent: every committed row is in its chunk or shard
            out["tail"] = record_to_json(self.tail)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> "StoreMeta":
        """Parse and validate a ``zstore`` block read from ``where`` (named in errors)."""
        if not isinstance(data, Mapping):
            raise NotAZStoreError(f"{where} is not a zstore buffer: no 'zstore' block in its attributes")
        check_format_version(data, where)
        try:
            ints = {name: json_int(data[name], name) for name in
                    ("max_size", "ndim", "rows", "length", "last_cursor", "high_water")}
            flags = {name: data.get(name, False) for name in ("read_only", "sealed")}
            if not all(isinstance(flag, bool) for flag in flags.values()):
                raise TypeError(f"read_only and sealed must be true or false, got {flags}")
            if not isinstance(data.get("extra", {}), (Mapping, type(None))):
                raise TypeError(f"extra must be an object, got {data['extra']!r}")
            meta = cls(
                storage_class=str(data["storage_class"]),
                schema=Schema.from_json(data["schema"]),
                codec=CodecSpec.parse(data["codec"]),
                layout={str(path): (int(chunk), None if shard is None else int(shard))
                        for path, (chunk, shard) in data["chunks"].items()},
                **flags,
                extra=dict(data.get("extra") or {}),
                created=dict(data.get("created") or {}),
                key_codecs={str(path): CodecSpec.parse(dict(spec))
                            for path, spec in (data.get("codecs") or {}).items()},
                tail=record_from_json(data.get("tail")),
                unknown=unknown_fields(data, BLOCK_FIELDS)
                + unknown_fields(data["schema"], Schema.FIELDS, "schema."),
                **ints,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # wrong JSON types too
            if isinstance(exc, (SchemaError, InvalidKeyError)):
                raise SchemaError(f"{where}: {exc}") from None
            raise NotAZStoreError(f"{where}: malformed 'zstore' block ({exc!r})") from None
        meta.validate(where)
        return meta

    def validate(self, where: str) -> None:
        """Reject inconsistent or absurd values (negative sizes, 2**62 capacities ...)."""
        problems = self.problems()
        if problems:
            raise NotAZStoreError(f"{where}: inconsistent 'zstore' block: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What :meth:`validate` rejects, each said in a few words."""
        problems = []
        if not 1 <= self.ndim <= 8:
            problems.append(f"ndim={self.ndim}")
        elif len(self.schema.lane_shape) != self.ndim - 1:
            problems.append(f"ndim={self.ndim} with lane_shape={list(self.schema.lane_shape)} "
                            f"(it has ndim - 1 sizes)")
        if not 0 < self.rows <= MAX_ELEMENTS or not 0 < self.max_size <= MAX_ELEMENTS:
            problems.append(f"rows={self.rows}, max_size={self.max_size}")
        if not 0 <= self.length <= self.max_size:
            problems.append(f"length={self.length} with max_size={self.max_size}")
        if not 0 <= self.high_water <= self.rows:
            problems.append(f"high_water={self.high_water} with rows={self.rows}")
        if not -1 <= self.last_cursor < self.rows:
            problems.append(f"last_cursor={self.last_cursor}")
        if set(self.layout) != set(self.schema.by_path):
            problems.append(f"chunks given for {sorted(self.layout)}, keys are {sorted(self.schema.by_path)}")
        if not set(self.key_codecs) <= set(self.schema.by_path):
            problems.append(f"codecs given for unknown keys {sorted(set(self.key_codecs) - set(self.schema.by_path))}")
        for path, (chunk, shard) in self.layout.items():
            if not 0 < chunk <= self.rows or (shard is not None and (shard <= 0 or shard % chunk)):
                problems.append(f"key {path!r}: chunk_rows={chunk}, shard_rows={shard}")
        for group, segments in self.tail.items():
            if any(seg.stop > self.high_water for seg in segments):
                problems.append(f"log segments of group {group} reach past high_water={self.high_water}")
        for leaf in self.schema.leaves:
            if self.rows * max(1, math.prod(leaf.shape)) > MAX_ELEMENTS:
                problems.append(f"key {leaf.path!r} would hold over {MAX_ELEMENTS} elements")
        return problems
