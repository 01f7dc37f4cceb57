"""Fuzzing the read path: mutated metadata and random chunk bytes opened read-only.

``zstore.open(url, mode="r")`` and a full read of the committed rows must end
in the data or in one of zstore's own errors (:class:`zstore.ZStoreError`
subclasses) — no other exception is acceptable, no hang (bounded sizes and
pytest-timeout), and never a write (every file is hashed before and after).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import zstore

FUZZ = settings(max_examples=int(os.environ.get("ZSTORE_FUZZ_EXAMPLES", "80")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from([0, 1, -1, 2**62, "float32", "../x", "zstd", ""]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
LAYOUTS = {"zstd-sharded": {"codec": "zstd", "chunks": 4, "shards": 8},
           "crc32c": {"codec": "zstd+crc32c", "chunks": 4},
           "raw-mmap": {"codec": None}}


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """One committed store per layout, copied afresh for every example."""
    out = {}
    for name, layout in LAYOUTS.items():
        url = str(tmp_path_factory.mktemp("fuzz") / name)
        storage = zstore.LazyMemmapStorage(16, scratch_dir=url, **layout)
        n = 10
        x = torch.arange(n)
        storage.set(torch.arange(n), TensorDict(obs=x.float().unsqueeze(-1).expand(n, 3).clone(),
                                                a=x, next=TensorDict(r=x.double(), batch_size=[n]),
                                                batch_size=[n]))
        storage.close()
        out[name] = url
    return out


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def open_and_read(url: str) -> None:
    """What a reader does; only ZStoreError may escape."""
    root = Path(url)
    before = digest(root)
    openers = [lambda: zstore.open(url, mode="r")]
    if hasattr(zstore, "open_dataset"):  # the datasets branch
        openers.append(lambda: zstore.open_dataset(url))
    for opener in openers:
        try:
            reader = opener()
            if len(reader):
                reader[:]
                reader.get(torch.tensor([0, len(reader) - 1]))
        except zstore.ZStoreError:
            pass
    assert digest(root) == before, "a read-only open changed the store"


def fresh(templates, layout: str, tmp_path: Path) -> Path:
    target = tmp_path / f"case-{os.urandom(4).hex()}"
    shutil.copytree(templates[layout], target)
    return target


def mutate(doc, path: list, action: str, value):
    """``doc`` with the node at ``path`` (indices into nested dicts/lists) replaced or removed."""
    node = doc
    for step in path[:-1]:
        if isinstance(node, dict) and node:
            node = node[sorted(node)[step % len(node)]]
        elif isinstance(node, list) and node:
            node = node[step % len(node)]
        else:
            return doc
    if isinstance(node, dict) and node:
        key = sorted(node)[path[-1] % len(node)]
        if action == "delete":
            del node[key]
        else:
            node[key] = value
    elif isinstance(node, list) and node:
        node[path[-1] % len(node)] = value
    return doc


METADATA_FILES = ["zarr.json", "obs/zarr.json", "a/zarr.json", "next/zarr.json", "next/r/zarr.json"]


@pytest.mark.timeout(300)
@FUZZ
@given(layout=st.sampled_from(sorted(LAYOUTS)), file=st.sampled_from(METADATA_FILES),
       path=st.lists(st.integers(0, 50), min_size=1, max_size=6),
       action=st.sampled_from(["replace", "delete"]), value=JSON)
def test_mutated_metadata_json(templates, tmp_path, layout, file, path, action, value):
    root = fresh(templates, layout, tmp_path)
    doc = json.loads((root / file).read_text())
    (root / file).write_text(json.dumps(mutate(doc, path, action, value)))
    open_and_read(str(root))


@pytest.mark.timeout(300)
@FUZZ
@given(layout=st.sampled_from(sorted(LAYOUTS)), file=st.sampled_from(METADATA_FILES),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 10**6))
def test_mutated_metadata_bytes(templates, tmp_path, layout, file, edits, cut):
    root = fresh(templates, layout, tmp_path)
    data = bytearray((root / file).read_bytes())
    for at, byte in edits:
        data[at % len(data)] = byte
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    (root / file).write_bytes(bytes(data))
    open_and_read(str(root))


@pytest.mark.timeout(300)
@FUZZ
@given(layout=st.sampled_from(sorted(LAYOUTS)), which=st.integers(0, 100),
       payload=st.binary(max_size=600) | st.none(),
       edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       cut=st.none() | st.integers(0, 10**6))
def test_random_and_mutated_chunk_bytes(templates, tmp_path, layout, which, payload, edits, cut):
    root = fresh(templates, layout, tmp_path)
    chunks = sorted(p for p in root.rglob("*") if p.is_file() and "/c/" in str(p))
    chunk = chunks[which % len(chunks)]
    data = bytearray(chunk.read_bytes() if payload is None else payload)
    for at, byte in edits:
        if data:
            data[at % len(data)] = byte
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    chunk.write_bytes(bytes(data))
    open_and_read(str(root))


def test_the_templates_read_back(templates):
    for url in templates.values():
        assert zstore.open(url, mode="r")[:]["a"].tolist() == list(range(10))
