"""Fault injection for tests: hang, slow, fail or kill a chosen rank at a chosen step, or make
its loss NaN or spike there (`loss_factor`, which the built-in trainer applies to the loss).

Only reaches a rank when the server allows it (`TRIDENT_ALLOW_FAULTS`); the rank actor makes
one injector per rank and calls `begin(step)` where each step starts. Hang and slow sleep
right before the step's first collective, inside the step (so the step's compute time grows
and peers wait in that collective), which is how a stuck or slow GPU looks from outside: for
the torch programs the injector is armed on the rank's `workers.monitor.comm_timer.CommTimer`
(`arm`), whose hook runs before every blocking collective; the light rank program
(`workers.rank.light`), which has no torch collectives, calls `stall_before_collective`
itself before its own. This module imports no torch, so that a light rank loads none.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class CollectiveHooks(Protocol):
    """What the injector arms on: `workers.monitor.comm_timer.CommTimer` has this."""

    def add_before_collective(self, fn: Callable[[], None]) -> None: ...


class FaultInjector:
    def __init__(self, rank: int, attempt: int, faults: Sequence[Any]) -> None:
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.rank = rank
        self._pending = 0.0
        self._fired: set[int] = set()
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

    def loss_factor(self, step: int) -> float:
        """What this rank's loss is multiplied by at `step`: NaN for a nan fault, `factor` for
        a spike, 1.0 otherwise. Each fires once, the first time the attempt reaches its step
        (as bad data would: after a rollback the step reads other samples)."""
        factor = 1.0
        for f in self.faults:
            if f.kind in ("nan", "spike") and step == f.step and id(f) not in self._fired:
                self._fired.add(id(f))
                factor *= float("nan") if f.kind == "nan" else f.factor
        return factor

    def stall_before_collective(self) -> None:
        """Sleep the step's hang or slow fault, once per step: called before each blocking
        collective, outside its timing (the first call of a step sleeps, the others not)."""
        with self._lock:
            sleep, self._pending = self._pending, 0.0
        if sleep:
            time.sleep(sleep)

    def arm(self, hooks: CollectiveHooks) -> None:
        """Sleep before the step's first collective, through the timer's hook (outside its
        timing, so the sleep is compute); the timer's `uninstall` disarms it."""
        if any(f.kind in ("hang", "slow") for f in self.faults):
            hooks.add_before_collective(self.stall_before_collective)
