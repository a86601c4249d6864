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

A full disk: the watcher never ends over a write the disk refuses (its time index, the base
file, the rotation): it counts the refusal and tries again at its next look, so the cap still
holds while writes fail and once they work again. The rank's Python streams drop the output
the disk refuses (`service.diskfull.TolerantStream`) instead of raising in the thread that
printed (which would end the rank); the first write that goes through afterwards says how
much was lost, and so does the watcher, for its own records, in the log itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import time
from pathlib import Path

from service.diskfull import Refused, TolerantStream
from service.ranklogs import rank_log_path

CHECK_S = 0.5
"""How often the watcher compares the file's size with the cap."""


def write_base(path: Path, base: int) -> None:
    """Record the stream offset at which `path` starts (atomically: readers poll it)."""
    tmp = path.with_name(path.name + ".base.tmp")
    tmp.write_text(str(base))
    os.replace(tmp, path.with_name(path.name + ".base"))


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _open_append(path: Path, truncate: bool = False) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    return os.open(path, flags, 0o644)


class RankLog:
    """Sends fds 1 and 2 of this process to `path` and keeps the file under the cap."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.half = max(1, max_bytes // 2)
        self.base = 0
        self.indexed = 0
        """The stream offset the time index last recorded."""
        self.times = path.with_name(path.name + ".times")
        self.refused = Refused("log index write")
        """The watcher's own writes the disk refused, not yet said in the log."""
        self._base_written = True
        self._stop = threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_base(path, 0)
        self._fd = _open_append(path)
        self._onto_stdio(self._fd)
        self._index_fd = _open_append(self.times)
        self._thread = threading.Thread(target=self._watch, name="ranklog", daemon=True)
        self._thread.start()

    @staticmethod
    def _onto_stdio(fd: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError):  # what the disk refused stays refused
                stream.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)

    def record_time(self) -> None:
        """Append `<now> <stream end>` to the time index if the stream grew."""
        end = self.base + os.fstat(self._fd).st_size
        if end > self.indexed:
            line = f"{time.time():.3f} {end}\n".encode()
            if os.write(self._index_fd, line) < len(line):  # the disk filled meanwhile
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.indexed = end

    def rotate_if_full(self) -> bool:
        if os.fstat(self._fd).st_size + os.fstat(self._index_fd).st_size < self.half:
            return False
        try:
            self.record_time()  # the bytes of the file rotated out keep their times
        except OSError as exc:  # they lose them; the cap matters more
            self.refused.add(1, exc)
        # The new files first: if the disk refuses them, nothing has moved yet and the next
        # look tries again; past them only renames are left.
        new, new_times = _sibling(self.path, ".new"), _sibling(self.times, ".new")
        fd = _open_append(new, truncate=True)
        try:
            index_fd = _open_append(new_times, truncate=True)
        except OSError:
            os.close(fd)
            raise
        os.replace(self.path, _sibling(self.path, ".1"))
        os.replace(new, self.path)
        os.replace(self.times, _sibling(self.times, ".1"))
        os.replace(new_times, self.times)
        old, old_index = self._fd, self._index_fd
        self._fd, self._index_fd = fd, index_fd
        self._onto_stdio(fd)
        self.base += os.fstat(old).st_size
        os.close(old)
        os.close(old_index)
        self._base_written = False
        self._write_base()
        return True

    def _write_base(self) -> None:
        """Record the current file's base (again, after a refusal: readers need it)."""
        if not self._base_written:
            write_base(self.path, self.base)
            self._base_written = True

    def _say_refused(self) -> None:
        """Say in the log what the watcher could not write, once the log takes it."""
        notice = self.refused.notice()
        if notice is None:
            return
        line = notice[0].encode()
        if os.write(self._fd, line) == len(line):
            self.refused.said(notice[1])

    def look(self) -> bool:
        """One look of the watcher: the base if it is owed, the time index, the cap, and
        what the disk refused. Each part on its own: a time index the disk refuses must not
        stop the rotation that keeps the cap. False when the log's directory is gone."""
        for part in (self._write_base, self.record_time, self.rotate_if_full,
                     self._say_refused):
            try:
                part()
            except OSError as exc:
                if not self.path.parent.is_dir():  # removed under us: the rank runs on
                    return False
                if part != self._say_refused:
                    self.refused.add(1, exc)  # the disk is full: again at the next look
        return True

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_S):
            if not self.look():
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
    log = RankLog(rank_log_path(log_dir, rank), max_bytes)
    if not isinstance(sys.stdout, TolerantStream):
        sys.stdout = TolerantStream(sys.stdout)  # type: ignore[assignment]
        sys.stderr = TolerantStream(sys.stderr)  # type: ignore[assignment]
    return log
