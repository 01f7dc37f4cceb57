"""Paging advice (Linux ``madvise``; a no-op elsewhere): chunk files' maps, fresh host memory.

A fault on a file mapping makes the kernel read around the faulting page — by
default as far as the device's readahead (8 MiB on the disks measured here).
For a buffer sampled at random from disk that is the wrong guess: a sampled
row needs a few pages, not megabytes around it (256 random Atari rows from a
cold disk: 750 ms with read-around, 177 ms without). The maps of a read-only
buffer (an offline dataset, perhaps larger than RAM) are therefore advised
``MADV_RANDOM``; a long contiguous read of them (a checkpoint, an export) is a
:func:`scan`, advised ``MADV_SEQUENTIAL`` for its own pages while it runs.

Without read-around, a sample from a cold disk would fault its pages in one at a
time; while a read-only table's reads read from the disk (:func:`disk_reads`), it
first asks for the pages of every sampled row at once (:func:`prefetch_rows`,
``MADV_WILLNEED``), so the disk serves them concurrently (the same sample: 22 ms
instead of 187).

A writer's maps keep the read-around: filling fresh rows of a sparse chunk
file costs the same ~2.4 µs per page either way, and measured side by side,
single adds averaged 55-62 µs with it against 80 µs without.

Fresh host memory that zstore fills at once (a cache slab, a large read's result) is
advised ``MADV_HUGEPAGE`` (:func:`host_empty`): Linux then faults it in 2 MiB pages, not
4 KiB ones. glibc serves allocations of up to 32 MiB again from memory it already
faulted in, and larger ones from fresh mappings: gathering 4,000 Atari rows (108 MiB)
took 27 ms into a plain tensor, 7 ms into an advised one (:func:`gather_rows`).

Not in a virtual machine whose memory balloon reports free pages to its hypervisor
(:func:`free_pages_reported`): it hands back free 2 MiB blocks, the very blocks huge pages
are made of, and the hypervisor backs a block again 4 KiB at a time once it is faulted in.
There the same 108 MiB gather took 440 ms into advised memory and 31 ms into plain
memory. ``ZSTORE_HUGE_PAGES=1`` (or ``0``) overrides the choice (:data:`HUGE_PAGES`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .libc import LIBC

MADV_SEQUENTIAL = getattr(mmap, "MADV_SEQUENTIAL", 2)
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_RANDOM = getattr(mmap, "MADV_RANDOM", 1)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
#: Host tensors from this size are advised to use transparent huge pages.
HUGE_PAGE_BYTES = 2 << 20
#: Bytes of one column from which a contiguous read is a scan, read ahead as usual.
SCAN_BYTES = 1 << 20
#: Overrides whether fresh host memory is advised huge pages: ``1`` or ``0``.
HUGE_PAGES_ENV = "ZSTORE_HUGE_PAGES"
#: Where Linux lists virtio devices; the id of a memory balloon, and the feature bit of its
#: free page reporting.
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_VIRTIO_BALLOON, _BALLOON_F_REPORTING = "0x0005", 5


def free_pages_reported(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio memory balloon reports this machine's free pages to its hypervisor,
    which then takes the memory back (Linux's sysfs; ``False`` where it has none)."""
    try:
        found = list(devices.iterdir())
    except OSError:
        return False
    for device in found:
        try:
            if (device / "device").read_text().strip() != _VIRTIO_BALLOON:
                continue
            features = (device / "features").read_text().strip()
        except OSError:
            continue
        if features[_BALLOON_F_REPORTING:_BALLOON_F_REPORTING + 1] == "1":
            return True
    return False


def huge_pages_wanted(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether fresh host memory should be advised huge pages: :data:`HUGE_PAGES_ENV` when
    set, else unless free pages are reported (see the module docstring); never without
    ``MADV_HUGEPAGE``."""
    if MADV_HUGEPAGE is None:
        return False
    chosen = os.environ.get(HUGE_PAGES_ENV, "")
    if chosen in ("0", "1"):
        return chosen == "1"
    if chosen:
        warnings.warn(f"{HUGE_PAGES_ENV}={chosen!r} is neither 1 nor 0: ignored", stacklevel=2)
    return not free_pages_reported(devices)


#: Whether :func:`host_empty` advises huge pages (:func:`huge_pages_wanted`, at import).
HUGE_PAGES = huge_pages_wanted()


def advise_range(address: int, nbytes: int, advice: int) -> bool:
    """``madvise`` the pages covering ``nbytes`` from ``address``; ``False`` where the advice
    cannot be given. Only paging changes, never the data."""
    if LIBC is None or nbytes <= 0:
        return False
    page = address - address % mmap.PAGESIZE
    return LIBC.madvise(page, nbytes + (address - page), advice) == 0


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from :data:`HUGE_PAGE_BYTES` on, advised to fault in
    transparent huge pages where :data:`HUGE_PAGES` (paging only, never the data)."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if HUGE_PAGES and nbytes >= HUGE_PAGE_BYTES:
        advise_range(out.data_ptr(), nbytes, MADV_HUGEPAGE)
    return out


def gather_rows(source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``source.index_select(0, rows)``; on the CPU, into a :func:`host_empty` tensor
    (unless autograd tracks ``source``: ``out=`` gathers cannot be differentiated)."""
    if source.device.type != "cpu" or source.requires_grad:
        return source.index_select(0, rows)
    out = host_empty((len(rows), *source.shape[1:]), source.dtype)
    return torch.index_select(source, 0, rows, out=out)


def advise(mapped: torch.Tensor, advice: int) -> bool:
    """:func:`advise_range` over the memory of ``mapped`` (a contiguous tensor over a file
    mapping)."""
    return advise_range(mapped.data_ptr(), mapped.numel() * mapped.element_size(), advice)


def prefetch_rows(mapped: torch.Tensor, rows: np.ndarray) -> None:
    """Ask for the pages of ``mapped[rows]`` (rows along dim 0 of a contiguous tensor over a
    file mapping) all at once, in runs of adjacent pages, before a gather faults them in."""
    if LIBC is None or len(rows) == 0 or mapped.numel() == 0:
        return
    row_bytes = mapped.stride(0) * mapped.element_size()
    base = mapped.data_ptr()
    page = mmap.PAGESIZE
    offsets = np.unique(rows).astype(np.int64) * row_bytes + base % page  # sorted
    firsts, lasts = offsets // page, (offsets + row_bytes - 1) // page
    start, end = int(firsts[0]), int(lasts[0])
    origin = base - base % page
    for first, last in zip(firsts[1:].tolist(), lasts[1:].tolist()):
        if first > end + 1:
            advise_range(origin + start * page, (end - start + 1) * page, MADV_WILLNEED)
            start = first
        end = max(end, last)
    advise_range(origin + start * page, (end - start + 1) * page, MADV_WILLNEED)


def disk_reads() -> int:
    """Blocks this process has read from the disk plus its major page faults, so far.

    It grows during a read that needed the disk, whether its pages came in through
    faults or through :func:`prefetch_rows`' readahead. Major faults alone do not tell:
    a prefetched read takes none (its faults find the pages already being read), so a
    table judging by them stopped prefetching after every prefetched read, and every
    other sample of a disk-resident buffer waited for its pages one at a time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_inblock + usage.ru_majflt


@contextlib.contextmanager
def scan(window: torch.Tensor) -> Iterator[None]:
    """Read ahead for a contiguous access of ``window`` of at least :data:`SCAN_BYTES` while
    the block runs, then advise its pages random again."""
    if window.numel() * window.element_size() < SCAN_BYTES or not advise(window, MADV_SEQUENTIAL):
        yield
        return
    try:
        yield
    finally:
        advise(window, MADV_RANDOM)
