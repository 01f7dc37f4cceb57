"""Counters of storages and writers, in one process or shared with the processes they are handed to.

A tensor storage keeps its length, last cursor, mutation revision, write revision and
high-water mark in a :class:`Counters` object, a round-robin writer its cursor and write
count in a :class:`WriterCounters`. TorchRL shares a buffer with the processes that
``multiprocessing`` spawns (``mp.Process(target=..., args=(rb,))``, a collector's
workers): they all write it, and each sees the others' rows and length. When a storage or
writer is pickled for such a process (or a storage is made with ``shared_init=True``),
its counters move into shared memory (:class:`SharedCounters`) together with a
process-shared lock that every write holds (:class:`ProcessLock`, which the kernel
releases if its holder is killed), so every process writes rows of its own and the
length counts every write exactly once. The rows themselves are shared by where they
live: torch's shared memory for an in-RAM container, the chunk files for a memory-mapped
store.

A :class:`SharedCounters` also carries ``dirty_since``: when a process that does not
hold a persistent store's lease writes rows, it stamps them uncommitted here, and the
process that holds the lease commits them (``docs/torchrl.md`` §4).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import multiprocessing
import multiprocessing.reduction
import multiprocessing.sharedctypes
import os
import tempfile
import threading
import time
import weakref
from multiprocessing.context import get_spawning_popen
from operator import attrgetter
from typing import Any


class Ints:
    """Named ints of one process (a subclass names them in ``FIELDS``, with ``DEFAULTS``).

    ``lock``, which a write holds, is a thread lock here (cheaper to take than a no-op
    context manager written in Python); it is not pickled."""

    __slots__ = ("lock",)
    FIELDS: tuple[str, ...] = ()
    DEFAULTS: tuple[int, ...] = ()
    SHARED: type["SharedInts"]  # the shared twin, set by @shared_twin
    shared = False

    def __init__(self, *values: int):
        for name, value in zip(self.FIELDS, values or self.DEFAULTS):
            setattr(self, name, value)
        self.lock = threading.RLock()

    def __reduce__(self) -> tuple:
        return type(self), self.values()

    def values(self) -> tuple[int, ...]:
        """The ints in ``FIELDS`` order."""
        return tuple(getattr(self, name) for name in self.FIELDS)

    def to_shared(self) -> "SharedInts":
        """Shared copies of these ints (the caller replaces its own with them)."""
        return self.SHARED(self.values())


class ProcessLock:
    """A reentrant lock between the threads of every process holding this object, which the
    kernel releases when a process that holds it dies (``flock`` on a small file): a writer
    killed in the middle of a write never leaves the others waiting for ever.

    It pickles as the file's path (each process opens the file of its own, at once); the
    process that made it deletes the file when it is collected or exits."""

    def __init__(self, path: str | None = None):
        if path is None:
            handle, path = tempfile.mkstemp(prefix="zstore-group-", suffix=".lock")
            os.close(handle)
            weakref.finalize(self, _remove_file, path)
        self.path = path
        self._open()

    def _open(self) -> None:
        self._threads = threading.RLock()
        self._depth = 0
        self._pid = os.getpid()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._open()

    def acquire(self) -> bool:
        """Wait for the lock (a thread that holds it already takes it again)."""
        if self._pid != os.getpid():  # a forked child: a descriptor of its own, else it would
            self._open()              # share its parent's hold
        self._threads.acquire()
        if self._depth == 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._threads.release()
                raise
        self._depth += 1
        return True

    def release(self) -> None:
        """Release one hold of the calling thread."""
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _remove_file(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


class SharedInts:
    """Named ints in shared memory, with the process-shared lock that guards them.

    Pickled for a process that ``multiprocessing`` starts, the new process reads and writes
    the same memory; any other pickle (a copy of the storage) holds plain :class:`Ints` of
    the values at that moment.
    """

    FIELDS: tuple[str, ...] = ()
    PLAIN: type[Ints]  # the plain twin, set by @shared_twin
    shared = True

    def __init__(self, values: tuple[int, ...]):
        self._shared = _context().Array(ctypes.c_int64, list(values))  # pickles when spawning
        self._block = self._shared.get_obj()  # read and written without its lock: see .lock
        self.lock = ProcessLock()

    def __reduce__(self) -> tuple:
        if get_spawning_popen() is None:  # a copy, which shares nothing
            return self.PLAIN, self.values()
        return _shared_again, (type(self), self._shared, self.lock)

    def values(self) -> tuple[int, ...]:
        """The ints in ``FIELDS`` order."""
        return tuple(self._block)

    def to_shared(self) -> "SharedInts":
        """Itself: already shared."""
        return self


def _shared_again(kind: type[SharedInts], shared: Any, lock: ProcessLock) -> SharedInts:
    """A :class:`SharedInts` unpickled in a process that multiprocessing started."""
    ints = kind.__new__(kind)
    ints._shared, ints._block, ints.lock = shared, shared.get_obj(), lock
    return ints


def _in_block(index: int, name: str) -> property:
    def get(self: SharedInts) -> int:
        return self._block[index]

    def put(self: SharedInts, value: int) -> None:
        self._block[index] = value

    return property(get, put, doc=f"``{name}``, in shared memory")


def shared_twin(plain: type[Ints]):
    """Class decorator of a :class:`SharedInts` subclass: the shared twin of ``plain``.

    It also registers the block's ctypes type with multiprocessing's pickler now: ints
    become shared while a process is being pickled for its start (a ``__getstate__``),
    after that pickler copied its reducers, and multiprocessing registers the type only
    when it first makes one."""
    def make(shared: type[SharedInts]) -> type[SharedInts]:
        shared.FIELDS = plain.FIELDS
        for index, name in enumerate(plain.FIELDS):
            setattr(shared, name, _in_block(index, name))
        plain.SHARED, shared.PLAIN = shared, plain
        multiprocessing.reduction.ForkingPickler.register(
            ctypes.c_int64 * len(plain.FIELDS), multiprocessing.sharedctypes.reduce_ctype)
        return shared
    return make


class Counters(Ints):
    """A storage's counters: length, last cursor, mutation and write revisions, high-water
    mark, ``dirty_since`` (``time.monotonic_ns()`` of the group's oldest uncommitted
    write, 0 when clean), ``written``: the rows counted as TorchRL counts them, one per
    row written (:func:`count_rows`), and ``holder``: the pid of the process of the group
    holding a persistent store's lease (0: none does)."""

    FIELDS = ("length", "last_cursor", "revision", "write_rev", "high_water", "dirty_since",
              "written", "holder")
    DEFAULTS = (0, -1, 0, 0, 0, 0, 0, 0)
    __slots__ = FIELDS


@shared_twin(Counters)
class SharedCounters(SharedInts):
    """:class:`Counters` in shared memory."""


class WriterCounters(Ints):
    """A round-robin writer's cursor and write count."""

    FIELDS = ("cursor", "write_count")
    DEFAULTS = (0, 0)
    __slots__ = FIELDS


@shared_twin(WriterCounters)
class SharedWriterCounters(SharedInts):
    """:class:`WriterCounters` in shared memory."""


def counter(name: str, holder: str = "_counts", *, also: tuple[str, ...] = ()) -> property:
    """An attribute kept in the :class:`Ints` object ``holder`` (its field ``name``); setting
    it sets the fields named in ``also`` to the same value."""
    def put(self: Any, value: int) -> None:
        ints = getattr(self, holder)
        for field in (name, *also):
            setattr(ints, field, value)

    return property(attrgetter(f"{holder}.{name}"), put)


def count_rows(counts: Ints | SharedInts, rows: int, reached: int, max_size: int) -> None:
    """Count ``rows`` rows written, the last of them ending at row ``reached``: the length
    is TorchRL's count of the rows written, or ``reached`` where a writer moved past rows
    it never wrote (a refused batch), whichever is larger. The count is kept apart from the
    length, so a write into rows the length already covers (processes that took their rows
    in one order and wrote them in another) is not counted twice. The lock is held."""
    counts.written = written = min(counts.written + rows, max_size)
    counts.length = min(max(counts.length, written, reached), max_size)


def stamp_dirty(counts: Ints | SharedInts) -> None:
    """Record, once until the next commit, that rows were written and not committed."""
    if not counts.dirty_since:
        counts.dirty_since = time.monotonic_ns()


def dirty_at(counts: Ints | SharedInts) -> float | None:
    """``time.monotonic()`` of the oldest uncommitted write of the group (``None``: clean).
    The monotonic clock is the machine's, the same in every process."""
    stamp = counts.dirty_since
    return stamp / 1e9 if stamp else None


def _context() -> multiprocessing.context.BaseContext:
    """The context of the process being started, if one is (its locks must be of it), else
    the default one."""
    return multiprocessing.get_context(getattr(get_spawning_popen(), "method", None))


class InitRendezvous:
    """TorchRL's ``shared_init``: of the processes sharing an uninitialised storage, the
    first to write creates its rows; the others wait for that and open them."""

    def __init__(self) -> None:
        self._lock = ProcessLock()  # released if its holder dies: the next writer creates
        self._done = _context().Event()

    def coordinate(self) -> bool:
        """``True`` in the one process that creates the rows (it then calls :meth:`created`,
        or :meth:`failed`, which lets the next writer try); ``False`` once they exist."""
        if self._done.is_set():
            return False
        self._lock.acquire()  # the creator holds it until the rows exist, or its write failed
        if self._done.is_set():
            self._lock.release()
            return False
        return True

    def created(self) -> None:
        """The rows exist: the waiting processes open them."""
        self._done.set()
        self._lock.release()

    def failed(self) -> None:
        """The creating write was refused (nothing was created): the next writer tries."""
        self._lock.release()

    @property
    def ready(self) -> bool:
        """Whether the rows exist."""
        return self._done.is_set()
