"""Prediction next to measurement: what a job's plan said against what its ranks reported.

Called by the API for job detail and the status page, and by `trident status`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from service.planner.stored import StoredPlan
from service.store import Metric
from service.store.reported import reported

WARMUP_STEPS = 3
"""Steps left out of the steady-state medians: the first steps build buffers, warm the
allocator and caches (and JIT-compile on GPUs)."""


def steady_tokens_per_s(metrics: Sequence[Metric]) -> float | None:
    """The median tokens/s of the steps past the warm-up that know theirs (of every step that
    knows it, when none past the warm-up does); None when no step knows it."""
    known = [(m.step, m.tokens_per_s) for m in metrics if m.tokens_per_s is not None]
    steady = [t for step, t in known if step > WARMUP_STEPS] or [t for _, t in known]
    return statistics.median(steady) if steady else None


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def compare(plan: StoredPlan, metrics: Sequence[Metric], *, script: bool = False) -> dict[str, Any]:
    """Step time, tokens/s and memory per GPU, predicted (None for a job that is not
    planned: `planned` false) and measured (newest attempt), and which memory figures its
    steps carried (`service.store.reported`; `script`: a command
    job's, whose script reports them itself)."""
    if metrics:
        attempt = max(m.attempt for m in metrics)
        metrics = [m for m in metrics if m.attempt == attempt]
    steady = [m for m in metrics if m.step > WARMUP_STEPS] or list(metrics)
    step_s = statistics.median(m.step_time_s for m in steady) if steady else None
    tokens = steady_tokens_per_s(metrics)
    state_bytes = None
    peak = None
    if metrics:
        # The newest step that measured them (the monitor samples its steps:
        # `monitor.memory_every`); none: not measured.
        for m in reversed(metrics):
            mem = m.report.memory
            parts = [mem.params_bytes, mem.grads_bytes, mem.optimizer_bytes]
            if all(isinstance(p, int | float) for p in parts):
                state_bytes = float(sum(parts))  # type: ignore[arg-type]
                break
        peaks = [m.report.memory.process_peak_bytes for m in metrics]
        peaks_num = [p for p in peaks if isinstance(p, int | float)]
        peak = max(peaks_num) if peaks_num else None
    # A job that is not planned predicts nothing: every `predicted` is None, no ratio.
    pred_states = (plan.memory.model_states or None) if plan.memory is not None else None
    pred_step = plan.time.step_s if plan.time is not None else None
    return {
        "planned": plan.planned,
        "steps_measured": len(steady),
        "step_s": {"predicted": pred_step, "measured": step_s,
                   "ratio": _ratio(step_s, pred_step)},
        "tokens_per_s": {"predicted": plan.tokens_per_s, "measured": tokens,
                         "ratio": _ratio(tokens, plan.tokens_per_s)},
        "model_state_bytes": {"predicted": pred_states, "measured": state_bytes,
                              "ratio": _ratio(state_bytes, pred_states)},
        "memory_bytes": {"predicted": plan.memory.total if plan.memory is not None else None,
                         "measured_peak": peak},
        "reported": reported(metrics, script=script),
    }
