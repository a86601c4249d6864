"""The training guards (`train.guard`, `docs/guards.md`): skip the update of a step whose loss
or gradient norm is not finite, judge loss spikes, roll back a run of bad steps.

How a step is skipped, on every engine alike: `StepGate` wraps the step of the innermost torch
optimizer (the one holding the Adam states, inside DeepSpeed's ZeRO and bf16 wrappers,
`workers.monitor.memory.innermost_optimizer`). A skipped inner step leaves the fp32 master
weights and the Adam states (moments, step count) as they were; DeepSpeed's wrappers then copy
the unchanged masters into the 16-bit parameters and clear the gradients as after any step, so
nothing the run keeps changes. The gate skips when the loop says so (`skip_next`: the loss was
not finite on some rank, or a spike under `on_spike: skip`) or when the global gradient norm
the engine measured before the inner step is not finite. That norm is reduced over every
rank, so every rank decides alike; where DeepSpeed itself refuses an invalid norm (its bf16
optimizer, ZeRO in fp32) the inner step is never called, which the gate sees the same way
(`stepped` stays False). DeepSpeed's clipping with an invalid norm scales gradients that are
cleared unused; our own clipping (`workers.trainer.recipe.clip_grads`) leaves them alone.

When the loss is known (`workers.trainer.train`):

- one stage (pp = 1): at the accumulation boundary, before the optimizer step, one all-reduce
  over the world of [loss sum, not finite] gives every rank the global-batch loss and whether
  any rank's loss was not finite: both the skip of a non-finite loss and a spike's skip happen
  before the update;
- a pipeline (pp > 1): DeepSpeed's pipeline engine (and the interleaved one) runs the update
  inside `train_batch`, and the loss is known only after it. A non-finite loss makes a
  non-finite gradient, which the gate's norm check skips; a spike is judged after the update:
  `on_spike: skip` then reports the spike and keeps the update, `rollback` and `stop` act
  after it.

`Guard` keeps the rest: the running median of the last `window` losses of applied steps, the
run of skipped steps in a row and the sample ranges of their global batches, and the ranges a
rollback skips from then on (`past_skipped`: the loader never reads them again). Every
decision is a function of values every rank holds alike, so no further collective is needed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from service.contract.reports import GUARD_STOP
from service.contract.spec import GuardSpec

MIN_HISTORY = 5
"""Losses the window must hold before spikes are judged (fewer when `window` is smaller)."""


class GuardStop(RuntimeError):
    """The guard stops the job: a spike under `on_spike: stop`, or a run of skipped steps
    with no checkpoint to roll back to. The message says why; the controller does not retry
    it (a restart would meet the same data)."""

    def __init__(self, why: str) -> None:
        super().__init__(GUARD_STOP + why)


class _Skip(Exception):
    """Raised by the gate's pre-step hook to leave the inner optimizer step undone."""


class StepGate:
    """Wraps `inner.step` (see module): skips it when `skip_next` is set or the norm read by
    `norm()` is not finite. Its pre-step hook is registered after any other (the recipe's
    clipping hook, which measures the norm where DeepSpeed keeps none), so it reads this
    step's norm."""

    def __init__(self, inner: torch.optim.Optimizer, norm: Callable[[], Any]) -> None:
        self.norm = norm
        self.skip_next = False
        self.stepped = False
        """Whether the inner step ran since `begin` (ZeRO calls it once per parameter
        group)."""
        original = inner.step

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except _Skip:
                return None

        inner.step = step  # type: ignore[method-assign]
        inner.register_step_pre_hook(self._before)

    def begin(self) -> None:
        self.skip_next = False
        self.stepped = False

    def _before(self, *_: Any) -> None:
        if self.skip_next:
            raise _Skip
        if not finite_norm(self.norm()):
            raise _Skip
        self.stepped = True


def finite_norm(norm: Any) -> bool:
    """Whether an engine's norm is a valid one: None (not measured) is; DeepSpeed's helpers
    mark an invalid norm as -1, inf or NaN."""
    if norm is None:
        return True
    value = float(norm)
    return math.isfinite(value) and value >= 0


def engine_norm(engine: Any, inner: torch.optim.Optimizer,
                interleaved: bool) -> Callable[[], Any]:
    """Where this step's norm is before the inner step: the interleaved engine's own (it
    measures it before stepping), DeepSpeed's optimizer wrapper's `_global_grad_norm` (set
    before it calls the inner step), or the inner optimizer's own (set by the recipe's
    clipping hook, `workers.trainer.recipe.clip_before_step`)."""
    if interleaved:
        return engine.get_global_grad_norm  # type: ignore[no-any-return]
    outer = engine.optimizer
    return lambda: getattr(outer, "_global_grad_norm", None) if outer is not inner \
        else getattr(inner, "_global_grad_norm", None)


@dataclass
class Outcome:
    """What the guard made of one step."""

    skipped: bool = False
    why: str | None = None
    """Why the update was skipped, or the spike judged after it."""
    rollback: str | None = None
    """Why to roll back now (None: no rollback)."""
    bad: list[tuple[int, int]] = field(default_factory=list)
    """With a rollback: the [first, end) samples of the global batches that caused it."""


@dataclass
class Guard:
    """The guard's state over one attempt (see module)."""

    spec: GuardSpec
    pipelined: bool
    """The loss is known only after the update (pp > 1)."""
    skipped_steps: int = 0
    rollbacks: int = 0
    skipping: list[tuple[int, int]] = field(default_factory=list)
    """Sample ranges the loader passes over from now on (`past_skipped`)."""
    _run: list[tuple[int, int]] = field(default_factory=list)
    _losses: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._losses = deque(maxlen=self.spec.window)

    def spike(self, loss: float) -> str | None:
        """Why `loss` is a spike (None: it is not, or too few losses to judge)."""
        if len(self._losses) < min(self.spec.window, MIN_HISTORY) or not math.isfinite(loss):
            return None
        median = statistics.median(self._losses)
        if median > 0 and loss > self.spec.spike_factor * median:
            return (f"loss spike: {loss:.4g} is above {self.spec.spike_factor:g} x the median"
                    f" {median:.4g} of the last {len(self._losses)} steps")
        return None

    def skip_before_update(self, loss: float, nonfinite: bool) -> str | None:
        """One stage: why the coming update is to be skipped (the loss agreed over every
        rank; `nonfinite`: some rank's loss was not finite), or None."""
        if nonfinite or not math.isfinite(loss):
            return "loss not finite"
        why = self.spike(loss)
        return why if why is not None and self.spec.on_spike == "skip" else None

    def after_step(self, loss: float, applied: bool, samples: tuple[int, int],
                   skipped_for: str | None) -> Outcome:
        """The step's outcome: `applied` whether the optimizer update ran, `samples` the
        [first, end) samples of its global batch, `skipped_for` why the loop skipped it
        (None: the gate found the norm not finite, when not applied). Raises GuardStop on a
        spike under `on_spike: stop`."""
        out = Outcome()
        if not applied:
            out.skipped = True
            out.why = skipped_for or "gradient norm not finite"
            self.skipped_steps += 1
            self._run.append(samples)
        else:
            spike = None if skipped_for else self.spike(loss)
            self._run.clear()
            if spike is None:
                self._losses.append(loss)
            elif self.spec.on_spike == "skip":  # a pipeline's: the update already ran
                out.why = f"{spike} (judged after the update: the pipeline's loss comes with it)"
            else:
                out.why = spike
                self._run.append(samples)
        if out.why is not None and out.why.startswith("loss spike") and \
                self.spec.on_spike == "stop":
            raise GuardStop(f"{out.why} at samples [{samples[0]}, {samples[1]})")
        if out.why is not None and out.why.startswith("loss spike") and applied and \
                self.spec.on_spike == "rollback":
            out.rollback = out.why
        elif len(self._run) > self.spec.max_skips:
            out.rollback = (f"{len(self._run)} skipped steps in a row (more than"
                            f" train.guard.max_skips = {self.spec.max_skips}), the last: {out.why}")
        if out.rollback is not None:
            self.rollbacks += 1
            out.bad = list(self._run)
            self.skipping += self._run
            self._run.clear()
        return out

    def past_skipped(self, consumed: int) -> int:
        """The data position after `consumed` samples once the skipped ranges are passed
        over (a range starts where a step started reading)."""
        moved = True
        while moved:
            moved = False
            for first, end in self.skipping:
                if first == consumed:
                    consumed, moved = end, True
        return consumed

    def skipped_ahead(self, consumed: int) -> int:
        """Samples of the skipped ranges at or after `consumed` (the loader covers them too)."""
        return sum(end - first for first, end in self.skipping if first >= consumed)
