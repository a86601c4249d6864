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
current file starts, so that readers (`service.files.ranklogs`) can follow across a rotation. A rank
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
the disk refuses (`service.files.diskfull.TolerantStream`) instead of raising in the thread that
printed (which would end the rank); the first write that goes through afterwards says how
much was lost, and so does the watcher, for its own records, in the log itself.

Secrets: a job's secrets are variables of its ranks' environment (`workers.launch.group`), and a
library may print one (a connection error naming the address it could not reach, a
traceback's locals). The launcher names them in `SECRET_NAMES_ENV`; a rank that has any then
sends fds 1 and 2 into a pipe instead of the file, and a thread of its own (`_pump`) writes
what comes out of it to the file with every secret value replaced by `[secret NAME]`
(`service.redaction.redact`, as the controller redacts what it stores). A value cut across two
reads is held back until the rest comes (`StreamRedactor`); nothing waits for a newline. The
price: what a rank writes in the instant before a `kill -9` (still in the pipe) is lost, and
what it prints after its exit handlers ran is dropped (the pipe is closed to drain it then).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from service.files.diskfull import Refused, TolerantStream
from service.files.ranklogs import rank_log_path
from service.redaction import REDACT_MIN_CHARS, redact

CHECK_S = 0.5
"""How often the watcher compares the file's size with the cap."""
SECRET_NAMES_ENV = "TRIDENT_SECRET_NAMES"
"""The rank's variable that names (comma-separated) which of its variables are the job's
secrets, set by the launcher: their values are redacted from the rank's log."""
PIPE_BYTES = 1 << 20
"""The pipe's capacity asked of the kernel (Linux's unprivileged limit): a writer blocks only
when the pump is this far behind."""
DRAIN_S = 2.0
"""How long the exit handler waits for the pump to write what is left in the pipe."""


def secret_names_env(names: Iterable[str]) -> dict[str, str]:
    """The variable that names a job's secrets to its ranks' log writers (none without)."""
    names = sorted(names)
    return {SECRET_NAMES_ENV: ",".join(names)} if names else {}


def secrets_in(env: Mapping[str, str]) -> dict[str, str]:
    """The secrets among `env` (by `SECRET_NAMES_ENV`), by name: the values to redact."""
    names = [n for n in env.get(SECRET_NAMES_ENV, "").split(",") if n in env]
    return {n: env[n] for n in names if len(env[n]) >= REDACT_MIN_CHARS}


class StreamRedactor:
    """`redact` over a byte stream read in pieces: `feed` answers what may be written now,
    every whole secret value replaced; the end of the text that may begin one is held back
    until the next piece (or `flush`). Bytes are read as Latin-1 (one character each), so
    any output, UTF-8 or not, goes through as it came."""

    def __init__(self, secrets: Mapping[str, str]) -> None:
        self.secrets = {k: v.encode().decode("latin-1") for k, v in secrets.items() if v}
        self._values = sorted(set(self.secrets.values()))
        self._longest = max(map(len, self._values), default=0)
        self._held = ""

    def feed(self, data: bytes) -> bytes:
        text = redact(self._held + data.decode("latin-1"), self.secrets)
        keep = self._beginning(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep].encode("latin-1")

    def flush(self) -> bytes:
        out, self._held = self._held.encode("latin-1"), ""
        return out

    def _beginning(self, text: str) -> int:
        """The length of the longest end of `text` that a secret value begins with (only
        where the text holds a value's first character: the rest cannot)."""
        low = max(0, len(text) - self._longest + 1)
        starts: set[int] = set()
        for first in {v[0] for v in self._values}:
            at = text.find(first, low)
            while at != -1:
                starts.add(at)
                at = text.find(first, at + 1)
        for start in sorted(starts):
            tail = text[start:]
            if any(len(v) > len(tail) and v.startswith(tail) for v in self._values):
                return len(text) - start
        return 0


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
    """Sends fds 1 and 2 of this process to `path` and keeps the file under the cap; with
    `secrets` (name -> value), through a pipe whose pump redacts their values."""

    def __init__(self, path: Path, max_bytes: int,
                 secrets: Mapping[str, str] | None = None) -> None:
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
        self._outlets: tuple[int, ...] = (1, 2)
        """The descriptors that write into the current file (rotation moves them): the
        process's stdout and stderr, or with secrets the pump's own."""
        self._pump_thread: threading.Thread | None = None
        if secrets:
            self._outlets = (os.dup(self._fd),)
            self._start_pump(StreamRedactor(secrets))
        else:
            self._onto(self._fd)
        self._index_fd = _open_append(self.times)
        self._thread = threading.Thread(target=self._watch, name="ranklog", daemon=True)
        self._thread.start()

    def _onto(self, fd: int) -> None:
        _flush_stdio()
        for outlet in self._outlets:
            os.dup2(fd, outlet)

    def _start_pump(self, redactor: StreamRedactor) -> None:
        """Fds 1 and 2 into a pipe; a thread writes what comes out, redacted, to the file."""
        read, write = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # Linux's; else the default size
            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        _flush_stdio()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        # Latin-1: the redactor's bytes go out as they are; a full disk costs what it refuses.
        out = TolerantStream(os.fdopen(self._outlets[0], "w", encoding="latin-1",
                                       closefd=False))
        self._pump_thread = threading.Thread(target=self._pump, args=(read, redactor, out),
                                             name="ranklog-pump", daemon=True)
        self._pump_thread.start()
        atexit.register(self._drain)

    @staticmethod
    def _pump(read: int, redactor: StreamRedactor, out: TolerantStream) -> None:
        while chunk := os.read(read, 1 << 16):
            if done := redactor.feed(chunk):
                out.write(done.decode("latin-1"))
        if rest := redactor.flush():
            out.write(rest.decode("latin-1"))
        os.close(read)

    def _drain(self) -> None:
        """At exit: close this process's ends of the pipe (fds 1 and 2 go to /dev/null) and
        let the pump write what is still in it, for at most `DRAIN_S`."""
        _flush_stdio()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        if self._pump_thread is not None:
            self._pump_thread.join(DRAIN_S)

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
        self._onto(fd)
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


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # what the disk refused stays refused
            stream.flush()


def capture(log_dir: str | None, rank: int, max_bytes: int) -> RankLog | None:
    """Start capturing this process's output for `rank` (no-op without a directory), with
    line-buffered Python streams so that prints reach the file as they happen, and the
    values of the job's secrets (`SECRET_NAMES_ENV`) redacted."""
    if not log_dir:
        return None
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    log = RankLog(rank_log_path(log_dir, rank), max_bytes, secrets_in(os.environ))
    if not isinstance(sys.stdout, TolerantStream):
        sys.stdout = TolerantStream(sys.stdout)  # type: ignore[assignment]
        sys.stderr = TolerantStream(sys.stderr)  # type: ignore[assignment]
    return log
