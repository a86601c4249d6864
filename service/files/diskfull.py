"""Writing logs to a disk that may be full: what the long-running processes do when a write
of theirs is refused (ENOSPC, a quota, an I/O error), so that a full data directory costs
them the lines they could not write and nothing more.

`Refused` counts the writes a disk refused and says so once: the first write that goes
through again is preceded by one line naming how much was lost and why. `TolerantStream`
wraps a text stream (`sys.stdout`, `sys.stderr`) so that a refused write is counted instead
of raised: a `print` or a log line can then never end the thread that wrote it. Used by the
supervisor (`service.cluster.supervisor`, its lines in `controller.log`), the controller daemon
(`service.control.daemon`, whose output is `controller.log`) and each rank
(`workers.runtime.ranklog`,
whose
output is its rank log).
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any, TextIO


class Refused:
    """Writes a disk refused since that was last said: how much, and the first error."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        """What `count` counts ("line", "character", ...)."""
        self.count = 0
        self.error: str | None = None
        """The first refusal's reason; None while nothing was refused."""
        self._lock = threading.Lock()

    def add(self, n: int, exc: OSError) -> None:
        """`n` units were refused (0: a flush, which loses an unknown part of what was
        buffered)."""
        with self._lock:
            self.count += n
            if self.error is None:
                self.error = exc.strerror or type(exc).__name__

    def notice(self) -> tuple[str, int] | None:
        """The line that says what is missing, and the count it covers; None while nothing
        was refused. Write it, then call `said` with the count."""
        with self._lock:
            if self.error is None:
                return None
            what = (f"{self.count} {self.unit}{'' if self.count == 1 else 's'}" if self.count
                    else "some output")
            return (f"[trident] the disk refused writes here ({self.error}): {what} before"
                    " this line could not be written\n", self.count)

    def said(self, count: int) -> None:
        """The notice covering `count` was written; what was refused since stays to say."""
        with self._lock:
            self.count -= count
            if self.count <= 0:
                self.count, self.error = 0, None


class TolerantStream:
    """A text stream over a file descriptor whose writes the disk may refuse. Each `write`
    goes straight to the descriptor (unbuffered, so that nothing refused lingers in a buffer
    to come out later); the bytes the disk refused are counted in `refused`, not raised, and
    the first write that goes through afterwards is preceded by `refused`'s notice.
    Everything else (`fileno`, `encoding`, `buffer`, ...) is the wrapped stream's."""

    def __init__(self, stream: TextIO, refused: Refused | None = None) -> None:
        self._stream = stream
        self._fd = stream.fileno()
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self.refused = refused or Refused("byte")
        self._cut = False
        """Whether the last write stopped inside its text (the disk filled during it)."""

    def _write_all(self, data: bytes) -> tuple[int, OSError | None]:
        """How many bytes of `data` were written, and why not the rest."""
        done = 0
        while done < len(data):
            try:
                n = os.write(self._fd, data[done:])
            except OSError as exc:
                return done, exc
            if n == 0:
                return done, OSError(errno.EIO, "nothing written")
            done += n
        return done, None

    def write(self, text: str) -> int:
        self.flush()  # what was written to the wrapped stream before comes first
        notice = self.refused.notice()
        head = b"" if notice is None else ("\n" if self._cut else "").encode() + \
            notice[0].encode()  # on a line of its own
        data = text.encode(self._encoding, "backslashreplace")
        done, exc = self._write_all(head + data)  # one write: the notice never stands alone
        if notice is not None and done >= len(head):
            self.refused.said(notice[1])
            self._cut = False
        if exc is not None:
            self.refused.add(len(head) + len(data) - max(done, len(head)), exc)
            self._cut = self._cut or done > 0
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:  # written through `buffer`, and refused
            self.refused.add(0, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tolerate_full_disk(stream: TextIO) -> TextIO:
    """`stream` wrapped in a `TolerantStream` (once; a stream without a file descriptor is
    left as it is); assign it back to `sys.stdout` or `sys.stderr`."""
    if isinstance(stream, TolerantStream):
        return stream  # type: ignore[return-value]
    try:
        return TolerantStream(stream)  # type: ignore[return-value]
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both
        return stream
