"""Write the golden format-v1 store in ``tests/golden/v1/`` (run once; the result is committed).

    python tests/golden/make_golden_v1.py

The store is a ``LazyMemmapStorage`` of capacity 64 with ``codec="zstd"`` and
16-row chunks, holding 40 committed rows (so chunks 0-2 exist, chunk 3 does
not), nested keys, and the dtypes float32, float16, bfloat16, int64, int32,
uint8, bool and complex64. Its values come from :func:`golden_data`, which
``tests/test_golden.py`` calls again to check them exactly. Only the
``created`` block (time, versions) differs between two runs.

Do not regenerate it to make a failing test pass: a failure means the current
zstore no longer reads what format v1 wrote.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
from tensordict import TensorDict

SEED = 20240601
CAPACITY = 64
CHUNK_ROWS = 16
LENGTH = 40
#: Rows are written in these ``storage.set`` calls (the last sets the cursor to 39).
WRITES = ((0, 25), (25, 40))
HERE = Path(__file__).resolve().parent
STORE = HERE / "v1"

#: key -> (torch dtype, per-row shape); the layout of the golden buffer.
LEAVES: dict[tuple[str, ...], tuple[torch.dtype, tuple[int, ...]]] = {
    ("obs",): (torch.float32, (3,)),
    ("action",): (torch.int64, (2,)),
    ("pixels",): (torch.uint8, (2, 2)),
    ("next", "obs"): (torch.float32, (3,)),
    ("next", "reward"): (torch.bfloat16, (1,)),
    ("next", "done"): (torch.bool, (1,)),
    ("next", "info", "success"): (torch.bool, ()),
    ("next", "info", "value"): (torch.float16, ()),
    ("collector", "traj_ids"): (torch.int32, ()),
    ("spectrum",): (torch.complex64, (2,)),
}


def golden_data(n: int = LENGTH) -> TensorDict:
    """The ``n`` rows written to the golden store (deterministic across Python/torch versions).

    Values come from ``random.Random(SEED).random()``, whose sequence Python
    guarantees stable, turned into tensors with exact conversions.
    """
    rng = random.Random(SEED)
    out = TensorDict(batch_size=[n])
    for key, (dtype, shape) in LEAVES.items():
        numel = n * max(1, int(torch.Size(shape).numel()))
        u = torch.tensor([rng.random() for _ in range(numel)], dtype=torch.float64)
        if dtype == torch.bool:
            value = u < 0.3
        elif dtype == torch.complex64:
            v = torch.tensor([rng.random() for _ in range(numel)], dtype=torch.float64)
            value = torch.complex(u * 2 - 1, v * 2 - 1).to(torch.complex64)
        elif dtype.is_floating_point:
            value = (u * 20 - 10).to(dtype)
        elif dtype == torch.uint8:
            value = (u * 256).floor().to(dtype)
        else:
            value = (u * 2_000_000 - 1_000_000).floor().to(dtype)
        out.set(key, value.reshape(n, *shape))
    return out


def main() -> None:
    import zstore

    if STORE.exists():
        shutil.rmtree(STORE)
    data = golden_data()
    storage = zstore.LazyMemmapStorage(CAPACITY, scratch_dir=STORE, codec="zstd",
                                       chunks=CHUNK_ROWS, auto_cleanup=False)
    for start, stop in WRITES:
        storage.set(torch.arange(start, stop), data[start:stop])
    storage.flush()
    storage.close()
    size = sum(p.stat().st_size for p in STORE.rglob("*") if p.is_file())
    print(f"wrote {STORE} ({size} bytes)")


if __name__ == "__main__":
    main()
