"""A stored step as named scalars: what a tracker, the comparison and a chart read.

Names are the store's own, so that a figure has one name everywhere (the metrics rows of
`GET /jobs/{id}/metrics`, MLflow, TensorBoard, `trident compare`):

- every number of rank 0's metrics row, by its field name: its columns (`loss`,
  `step_time_s`, `tokens_per_s`, and whatever per-step column is added later) and the numbers
  at the top of its `data` (`bubble_s`, `eval_loss`, `lr`, `grad_norm`, ... as the step
  report gains them), but the rank's coordinates (`IDENTITY`);
- `mfu`: the plan's MFU scaled by measured over predicted tokens/s;
- `comm_share/<dim>`: seconds in that dimension's collectives over the step time (timed
  steps only);
- `memory/stage<s>/<field>`: each pipeline stage's memory, from the first rank of the stage
  whose row is stored (rank 0 for stage 0);
- custom metrics (`StepReport.custom`) with number values, under their own names (they may not
  take a name of the report's fields, `service.contract.reports`).

A field that is None, not a number or not finite is left out of that step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from service.planner.stored import StoredPlan
from service.store.views import Metric

IDENTITY = frozenset({"attempt", "step", "rank", "tp_rank", "pp_rank", "dp_rank",
                      "resumed_from", "time"})
"""Numbers of a row that say which rank and step it is, not how the step went."""


@dataclass(frozen=True)
class StepScalars:
    """One step of one attempt, as named numbers."""

    attempt: int
    step: int
    time: datetime
    """When the step was stored (the trackers' timestamp)."""
    values: dict[str, float]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def first_rank_of_stages(plan: StoredPlan) -> dict[int, int]:
    """Each pipeline stage's lowest rank (stage -> rank)."""
    out: dict[int, int] = {}
    for r in plan.rank_layout:
        out[r.pp] = min(out.get(r.pp, r.rank), r.rank)
    return out


def mfu_per_token_s(plan: StoredPlan) -> float | None:
    """MFU per token/s: the plan's MFU over its tokens/s (None without a predicted MFU)."""
    mfu = _number(plan.mfu)
    if mfu is None or not plan.tokens_per_s:
        return None
    return mfu / float(plan.tokens_per_s)


def row_numbers(m: Metric) -> dict[str, float]:
    """The numbers of a metrics row by field name: its columns, then the top of `data`."""
    out: dict[str, float] = {}
    for f in fields(m):
        if f.name in IDENTITY or f.name == "data":
            continue
        if (v := _number(getattr(m, f.name))) is not None:
            out[f.name] = v
    for k, raw in m.report.figures.items():
        if k in IDENTITY or k in out:
            continue
        if (v := _number(raw)) is not None:
            out[k] = v
    return out


def comm_shares(m: Metric) -> dict[str, float]:
    """Seconds in each dimension's collectives over the step time (timed steps only)."""
    split = m.step_split()
    if split is None or m.step_time_s <= 0:
        return {}
    return {f"comm_share/{dim}": seconds / m.step_time_s
            for dim, seconds in split.comm_s.items()}


def memory(m: Metric, stage: int) -> dict[str, float]:
    return {f"memory/stage{stage}/{k}": v for k, raw in m.report.memory_figures().items()
            if (v := _number(raw)) is not None}


def custom(m: Metric) -> dict[str, float]:
    """A row's custom metrics that are numbers, under their names."""
    return {k: v for k, raw in m.report.custom.items() if (v := _number(raw)) is not None}


def step_scalars(rank0: Metric, plan: StoredPlan,
                 stages: Mapping[int, Metric] | None = None) -> StepScalars:
    """Rank 0's row of a step (and the first stored row of each later stage) as scalars."""
    values = row_numbers(rank0)
    per_token = mfu_per_token_s(plan)
    if per_token is not None and rank0.tokens_per_s is not None:
        values["mfu"] = rank0.tokens_per_s * per_token
    values.update(comm_shares(rank0))
    values.update(memory(rank0, 0))
    for stage, m in sorted((stages or {}).items()):
        if stage != 0:
            values.update(memory(m, stage))
    for k, v in custom(rank0).items():
        values.setdefault(k, v)
    return StepScalars(attempt=rank0.attempt, step=rank0.step, time=rank0.time, values=values)


def scalars_of(rows: Iterable[Metric], plan: StoredPlan) -> list[StepScalars]:
    """Steps from rows of several ranks (rank 0's and other stages' first ranks), in order."""
    leaders = first_rank_of_stages(plan)
    stage_of = {rank: stage for stage, rank in leaders.items()}
    by_step: dict[tuple[int, int], dict[int, Metric]] = {}
    for m in rows:
        if m.rank in stage_of:
            by_step.setdefault((m.attempt, m.step), {})[stage_of[m.rank]] = m
    out = []
    for key in sorted(by_step):
        stages = by_step[key]
        if 0 in stages:
            out.append(step_scalars(stages[0], plan, stages))
    return out
