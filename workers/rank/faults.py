"""Fault injection for tests: hang, slow, fail or kill a chosen rank at a chosen step.

Only reaches a rank when the server allows it (`TRIDENT_ALLOW_FAULTS`); the actor arms it on
the rank's `CommTimer`. Hang and slow sleep right before the step's first collective, inside
the step (so the step's compute time grows and peers wait in that collective), which is how
a stuck or slow GPU looks from outside.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from workers.monitor.comm_timer import CommTimer


class FaultInjector:
    def __init__(self, rank: int, attempt: int, faults: Sequence[Any]) -> None:
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.rank = rank
        self._pending = 0.0
        self._lock = threading.Lock()

    def begin(self, step: int) -> None:
        """Called at the start of every step, on the training thread."""
        sleep = 0.0
        for f in self.faults:
            if f.kind == "fail" and step == f.step:
                raise RuntimeError(f"injected fault: rank {self.rank} fails at step {step}")
            if f.kind == "kill" and step == f.step:
                os._exit(17)
            if (f.kind == "hang" and step == f.step) or (f.kind == "slow" and step >= f.step):
                sleep += f.seconds
        with self._lock:
            self._pending = sleep

    def _before_collective(self) -> None:
        with self._lock:
            sleep, self._pending = self._pending, 0.0
        if sleep:
            time.sleep(sleep)

    def arm(self, timer: CommTimer) -> None:
        """Sleep before the step's first collective, through the timer's hook (outside its
        timing, so the sleep is compute); the timer's `uninstall` disarms it."""
        if any(f.kind in ("hang", "slow") for f in self.faults):
            timer.add_before_collective(self._before_collective)
