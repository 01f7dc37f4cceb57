"""Which process of which machine wrote something, and whether it still runs.

A lease (:mod:`zstore.lease`) and a checkpoint's temporary file (:mod:`checkpoint._h5`)
record the process that made them: its host name, the machine's boot id, its pid and its pid
namespace. A later process of the same machine and namespace (same host name and boot id, so
a host name shared by two machines is not enough; same namespace, since two containers of one
host, ``--network host`` giving both its host name, number their processes apart) can then
tell that the maker is gone, and take over or clean up at once instead of waiting out a
timeout.
"""

from __future__ import annotations

import functools
import os
import socket


@functools.cache
def boot_id() -> str | None:
    """This machine's boot id (Linux; ``None`` elsewhere), read once per process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def pid_namespace() -> str | None:
    """The inode number of this process's pid namespace (Linux; ``None`` where it cannot be
    read): a pid names a process only within its namespace. Read on each call (one system
    call), as a process may move to another."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    return link.partition("[")[2].rstrip("]") or None


def here(host: object, boot: object, namespace: object) -> bool:
    """Whether ``host``, ``boot`` and ``namespace`` (a host name, boot id and
    :func:`pid_namespace`) name this machine and pid namespace: where a recorded pid means a
    process of ours. ``namespace`` ``None`` (a record of an earlier zstore, or of a system
    that did not tell) is not compared; a machine without a boot id is never here."""
    this_boot = boot_id()
    return (this_boot is not None and boot == this_boot and host == socket.gethostname()
            and namespace in (None, pid_namespace()))


def gone_here(host: object, boot: object, pid: object, namespace: object) -> bool:
    """Whether ``pid`` was a process of this machine and pid namespace (:func:`here`) that no
    longer runs; ``False`` when that cannot be told."""
    if not here(host, boot, namespace):
        return False
    try:
        pid = int(pid)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return pid != os.getpid() and not runs_here(pid)


def runs_here(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (``True`` when that cannot be
    told): one system call, or two for a process killed but not reaped yet (a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:  # killed but not reaped yet: a zombie runs no more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_tag() -> str:
    """``pid@host@boot id@pid namespace``: this process, in a form a file name can carry (a
    field that cannot be told is left empty)."""
    return "@".join(str(part or "") for part in
                    (os.getpid(), socket.gethostname(), boot_id(), pid_namespace()))


def tag_gone_here(tag: str) -> bool:
    """Whether the process of :func:`process_tag` ``tag`` ran on this machine and is gone."""
    parts = tag.split("@")  # three: a tag of an earlier zstore, without the namespace
    if len(parts) not in (3, 4):
        return False
    pid, host, boot, namespace = (parts + [""])[:4]
    return gone_here(host, boot or None, pid, namespace or None)
