"""Write the golden zstore H5 checkpoint of format 1 (``tests/golden/h5_v1.h5``; run once).

    python tests/golden/make_golden_h5_v1.py

Format 1 is what ``checkpoint.H5StorageCheckpointer`` wrote before its files
became loadable by TorchRL's own ``H5StorageCheckpointer`` (format 2). The
file holds a wrapped ``LazyTensorStorage(6)`` (8 steps written in two extends,
cursor at row 1) with a root ``done`` flag set, a ``("next", "obs")`` that
differs from the next step's ``obs``, a NaN, a next-only key and a nested key.
``tests/test_checkpoint_h5.py`` rebuilds the storage with :func:`golden_storage`
and checks that the file still loads exactly. Do not regenerate it to make a
failing test pass.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

FILE = Path(__file__).resolve().parent / "h5_v1.h5"
CAPACITY = 6
SIZES = (5, 3)


def golden_steps() -> TensorDict:
    """The 8 TED steps written, in order (deterministic, no random generator)."""
    n = sum(SIZES)
    obs = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) / 4
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[[2, 6]] = True
    nxt = torch.cat([obs[1:], obs[-1:] + 1])
    nxt[2] = -1.0                       # a reset after the done: next obs is not the next step's
    nxt[4, 1] = 7.5                     # a multi-step-like rewrite without a done
    nxt[5, 0] = float("nan")
    root_done = torch.zeros(n, 1, dtype=torch.bool)
    root_done[3] = True                 # a root-level done flag
    return TensorDict(
        obs=obs, action=torch.arange(n).reshape(n, 1) * 3, done=root_done,
        agent=TensorDict(pos=torch.arange(n * 3, dtype=torch.int32).reshape(n, 3), batch_size=[n]),
        next=TensorDict(obs=nxt, done=done, reward=torch.arange(n, dtype=torch.float64)[:, None],
                        info=torch.arange(n, dtype=torch.int16)[:, None], batch_size=[n]),
        batch_size=[n])


def golden_storage():
    """The storage the golden file was dumped from."""
    from zstore import LazyTensorStorage, RoundRobinWriter

    storage = LazyTensorStorage(CAPACITY)
    writer = RoundRobinWriter()
    writer.register_storage(storage)
    steps, start = golden_steps(), 0
    for size in SIZES:
        writer.extend(steps[start:start + size])
        start += size
    return storage


if __name__ == "__main__":
    import checkpoint

    source = golden_storage()
    source.checkpointer = checkpoint.H5StorageCheckpointer()
    source.dumps(FILE)
    print(FILE, FILE.stat().st_size, "bytes")
