"""The data directory as a whole: which `trident up` owns it, and how full its disk is.

A data directory belongs to one `trident up` at a time (its database, its Ray head's address
and token, its controller's log): `hold` takes an exclusive `flock` on `<data_dir>/up.lock`
for the life of the process, so a second `trident up` on the same directory is refused
(`InUse`, naming the pid that holds it) instead of adopting and then stopping the first one's
Ray head. The kernel drops the lock with the process, `kill -9` included, so the next
`trident up` takes it and adopts what the killed one left running (`service.cluster.rayhead`).

`usage` is what `GET /api/v1/healthz` says of the directory's filesystem: its free space,
and `nearly full` under `Settings.data_dir_min_free`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_NAME = "up.lock"


class InUse(Exception):
    """Another process holds the data directory."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        self.data_dir, self.pid = data_dir, pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"data dir {data_dir} is in use by another `trident up` ({who});"
                         " stop it, or give this one another --data-dir")


@dataclass
class Held:
    """The lock on a data directory, held while this object's file stays open."""

    path: Path
    fd: int

    def release(self) -> None:
        os.close(self.fd)


def hold(data_dir: Path) -> Held:
    """Lock `data_dir` for this process (until it ends or `release`), writing its pid in the
    lock file for whoever is refused; raises `InUse` when another process holds it."""
    path = data_dir / LOCK_NAME
    # Not truncated: the holder's pid must stay readable to the one refused. Not inherited by
    # children, so the Ray head that outlives `trident up` does not keep it.
    fd = try_lock(path, mode=0o644)
    if fd is None:
        raise InUse(data_dir, holder(data_dir))
    pid = f"{os.getpid()}\n".encode()
    with contextlib.suppress(OSError):  # a full disk: the lock holds, its pid is not known
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
    return Held(path, fd)


def try_lock(path: Path, mode: int = 0o600) -> int | None:
    """An exclusive `flock` on `path` (made if missing, with `mode`; the data directory's own
    lock, a slot of a bounded kind of work: exports, corpus checks): its descriptor, not
    inherited by children, or None when another holds it. The kernel drops it with its last
    descriptor, or its process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return None
    return fd


def holder(data_dir: Path) -> int | None:
    """The pid written in the data directory's lock file, if any."""
    try:
        return int((data_dir / LOCK_NAME).read_text().strip())
    except (OSError, ValueError):
        return None


def usage(data_dir: Path, min_free: float) -> dict[str, Any]:
    """The filesystem of `data_dir`: total and free bytes, the free fraction, the threshold,
    and `status`: `ok`, `nearly full` (free under `min_free` of the total), or
    `unavailable: <error>`. The path itself is left out: `/healthz` answers without a token,
    and where the server keeps its files is the operator's to know, not every caller's."""
    out: dict[str, Any] = {"min_free_fraction": min_free}
    try:
        st = os.statvfs(data_dir)
    except OSError as exc:
        return {**out, "status": f"unavailable: {exc.strerror or type(exc).__name__}"}
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    fraction = free / total if total else 0.0
    return {**out, "total_bytes": total, "free_bytes": free,
            "free_fraction": round(fraction, 4),
            "status": "nearly full" if fraction < min_free else "ok"}
