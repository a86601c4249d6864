"""Test helper: a small filesystem of the test's own (a tmpfs, mounted for the test and
unmounted after), and a filler that keeps it full until it is freed: what the full-disk tests
(rank logs, checkpoints, a live stack) write on."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_fs(where: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of `size_mb` MiB mounted at `where` (made if missing) for the block's length."""
    if os.geteuid() != 0:
        pytest.fail("the full-disk tests mount a tmpfs of their own, which needs root (run"
                    " them as root, or in a container or `unshare -rm` namespace that is)")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs",
                    str(where)], check=True, capture_output=True, text=True)
    try:
        yield where
    finally:
        # Lazily: a process still holding a file there (a rank killed late) must not keep the
        # mount, nor the test's failure be hidden by an unmount error.
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Filler:
    """Fills the filesystem of `path` and keeps it full (whatever others free meanwhile is
    taken again, every few milliseconds) until `free`, which removes what it wrote."""

    def __init__(self, path: Path | str, leave_bytes: int = 0) -> None:
        self.path = Path(path)
        self.leave_bytes = leave_bytes
        self._stop = threading.Event()
        self._full = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="filler", daemon=True)

    def start(self, timeout_s: float = 60) -> Filler:
        """Start filling; returns once the filesystem was full the first time."""
        self._thread.start()
        self._full.wait(timeout_s)
        if self._error is not None:
            raise self._error
        assert self._full.is_set(), f"{self.path} not filled in {timeout_s} s"
        return self

    def _run(self) -> None:
        try:
            self._fill()
        except BaseException as exc:
            self._error = exc
            self._full.set()

    def _fill(self) -> None:
        block = b"\0" * (64 << 10)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while not self._stop.is_set():
                room = free_bytes(self.path.parent) - self.leave_bytes
                try:
                    if room <= 0:
                        raise OSError(errno.ENOSPC, "full")
                    os.write(fd, block[:min(len(block), room)])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    self._full.set()
                    self._stop.wait(0.005)
        finally:
            os.close(fd)

    def free(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.path.unlink(missing_ok=True)


def fill_last_page(path: Path) -> int:
    """Append newlines to the file `path` until its filesystem refuses them; the bytes
    appended. A full tmpfs still takes writes into the page a file has already begun, which a
    `Filler` cannot take: this takes that room, so that the next line written there is
    refused whatever its length."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    wrote = 0
    try:
        while True:
            try:
                wrote += os.write(fd, b"\n")
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return wrote
    finally:
        os.close(fd)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file below `folder`: its size and modification time."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), folder)] = (st.st_size,
                                                                        st.st_mtime_ns)
    return out
