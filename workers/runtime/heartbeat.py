"""Per-rank heartbeat: the step, phase and collective a rank is in, readable from another thread.

The trainer loop owns the writes (`beat`, `entering`, `left`; or `in_collective` as a context
manager, which `workers.monitor.comm_timer.CommTimer` calls for every collective it times). The Ray
actor's poll thread calls `read()`, a `service.contract.reports.HeartbeatReport`, and ships it to
the controller, which feeds `service.monitor.hang.diagnose_hang`. When the controller declares a
hang it asks every rank for `dump_stacks()` and stores the text in the job's events.

A write is a few attribute stores under a lock, cheap enough for every collective.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from service.contract.reports import HeartbeatReport, Phase


class Heartbeat:
    """What one rank is doing now, and since when."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._step = -1
        self._phase: Phase = "setup"
        self._collective: str | None = None
        self._dim: str | None = None
        self._group: list[int] | None = None
        self._wall = time.time()
        self._mono = time.monotonic()

    def _touch(self) -> None:
        self._wall = time.time()
        self._mono = time.monotonic()

    def beat(self, step: int, phase: Phase) -> None:
        """The rank entered `phase` of `step` (also the progress mark of the hang detector)."""
        with self._lock:
            self._step, self._phase = step, phase
            self._touch()

    def entering(self, collective: str, dim: str | None, group_ranks: Sequence[int]) -> None:
        """The rank is about to block in `collective` over `group_ranks` (global ranks)."""
        with self._lock:
            self._collective, self._dim, self._group = collective, dim, list(group_ranks)
            self._touch()

    def left(self) -> None:
        with self._lock:
            self._collective = self._dim = self._group = None
            self._touch()

    @contextmanager
    def in_collective(self, collective: str, dim: str | None,
                      group_ranks: Sequence[int]) -> Iterator[None]:
        self.entering(collective, dim, group_ranks)
        try:
            yield
        finally:
            self.left()

    def read(self) -> HeartbeatReport:
        """A snapshot; `time` is the wall clock of the last change, `age_s` the monotonic
        seconds since then (immune to clock skew between nodes)."""
        with self._lock:
            return HeartbeatReport(
                rank=self.rank, step=self._step, phase=self._phase,
                collective=self._collective, dim=self._dim,
                group=list(self._group) if self._group is not None else None,
                time=self._wall, age_s=max(0.0, time.monotonic() - self._mono))


def thread_stacks(names: dict[int, str] | None = None,
                  max_bytes: int = 32 << 10) -> list[dict[str, str]]:
    """Python stacks of every thread of this process as `[{"thread", "stack"}]`, innermost
    frame last. `names` renames threads by ident (the rank actor calls its work thread
    `train` in every rank, so identical stacks of different ranks compare equal); a stack
    over `max_bytes` keeps its innermost frames, after a line that says how much was cut.
    `trident stacks` groups ranks by these."""
    known = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        text = "".join(traceback.format_stack(frame))
        if len(text) > max_bytes:
            cut = len(text) - max_bytes
            text = f"  ... ({cut} bytes of outer frames cut)\n" + text[cut:]
        out.append({"thread": (names or {}).get(ident) or known.get(ident, "?"),
                    "stack": text})
    return out


def dump_stacks() -> str:
    """Python stacks of every thread of this process, for the hang events."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
