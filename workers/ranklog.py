"""Rank logs: a rank's stdout and stderr (fds 1 and 2 of its actor process) go to a file.

The controller's launcher names the directory (`<data_dir>/logs/job-<id>/attempt-<n>/`, from
`Settings.log_root`); each rank writes `rank-<r>.log` there. Redirecting the file descriptors,
not `sys.stdout`, catches everything the process writes: the built-in trainer's and a custom
entrypoint's prints, tracebacks, and what C++ libraries (gloo, NCCL, DeepSpeed's ops) print.
Writes go straight to the file, so nothing is lost when the actor is killed.

Size cap: a rank keeps at most `max_bytes` (`TRIDENT_RANK_LOG_MAX_BYTES`) per attempt. When
`rank-<r>.log` grows past half of it, a watcher thread (every `CHECK_S`) moves it to
`rank-<r>.log.1` (replacing the older one) and starts a new file, so the newest output (the
traceback at the end) is always kept. `rank-<r>.log.base` holds the stream offset at which the
current file starts, so that readers (`service.ranklogs`) can follow across a rotation. A rank
writing faster than half the cap every `CHECK_S` overshoots by what it writes in that time.

Time index: the process writes straight to the file, so no line carries its time. Instead the
watcher appends `<unix time> <stream offset>` to `rank-<r>.log.times` whenever the stream grew
since its last look: every byte before that offset was written by that time (to within
`CHECK_S`). Readers turn it into a time per line (`trident logs --timestamps`) and a time into
an offset (`--since 10m`). The index rotates with the log (to `.times.1`) and its size counts
toward the cap.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from service.ranklogs import rank_log_path

CHECK_S = 0.5
"""How often the watcher compares the file's size with the cap."""


def write_base(path: Path, base: int) -> None:
    """Record the stream offset at which `path` starts (atomically: readers poll it)."""
    tmp = path.with_name(path.name + ".base.tmp")
    tmp.write_text(str(base))
    os.replace(tmp, path.with_name(path.name + ".base"))


class RankLog:
    """Sends fds 1 and 2 of this process to `path` and keeps the file under the cap."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.half = max(1, max_bytes // 2)
        self.base = 0
        self.indexed = 0
        """The stream offset the time index last recorded."""
        self.times = path.with_name(path.name + ".times")
        self._stop = threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_base(path, 0)
        self._fd = self._open_onto_stdio()
        self._index_fd = os.open(self.times, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._thread = threading.Thread(target=self._watch, name="ranklog", daemon=True)
        self._thread.start()

    def _open_onto_stdio(self) -> int:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        return fd

    def record_time(self) -> None:
        """Append `<now> <stream end>` to the time index if the stream grew."""
        end = self.base + os.fstat(self._fd).st_size
        if end > self.indexed:
            os.write(self._index_fd, f"{time.time():.3f} {end}\n".encode())
            self.indexed = end

    def rotate_if_full(self) -> bool:
        if os.fstat(self._fd).st_size + os.fstat(self._index_fd).st_size < self.half:
            return False
        self.record_time()  # the bytes of the file rotated out keep their times
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        os.replace(self.times, self.times.with_name(self.times.name + ".1"))
        old, old_index = self._fd, self._index_fd
        self._fd = self._open_onto_stdio()
        self._index_fd = os.open(self.times, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.base += os.fstat(old).st_size
        os.close(old)
        os.close(old_index)
        write_base(self.path, self.base)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self.record_time()
                self.rotate_if_full()
            except OSError:  # the directory was removed under us: keep the rank running
                return

    def close(self) -> None:
        self._stop.set()


def capture(log_dir: str | None, rank: int, max_bytes: int) -> RankLog | None:
    """Start capturing this process's output for `rank` (no-op without a directory), with
    line-buffered Python streams so that prints reach the file as they happen."""
    if not log_dir:
        return None
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    return RankLog(rank_log_path(log_dir, rank), max_bytes)
