"""Several jobs side by side: their curves, the spec fields that differ, and each one's
prediction against its measurement.

Read by `GET /api/v1/compare` (which `trident compare` and the comparison page use). The
curves are rank 0's steps as named scalars (`service.tracking.scalars`: the names a tracker
gets, custom metrics included), by step and by seconds since the job started; a step a later
attempt ran again shows the later attempt's value, as the job's page does. Long runs are
sampled to about `MAX_POINTS` steps. Each job's effective training time ratio (ETTR) is its
goodput ledger's (`service.store.goodput`, docs/goodput.md): training seconds over its wall
seconds so far. A spec's `env` values are shown only where the reader may
read them (`shows_env`); secrets are never in a spec.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.store import Job, Store
from service.store.dashboard import recent_metrics
from service.store.goodput import GoodputLedger
from service.store.metrics import MetricsIngest
from service.tracking.scalars import StepScalars, custom, mfu_per_token_s, step_scalars
from service.tracking.sinks import spec_json
from service.views.prediction import compare, steady_tokens_per_s

MAX_POINTS = 2000
"""Steps per curve at most (a longer run is sampled every k-th step)."""
MAX_JOBS = 8
"""Jobs one comparison takes."""
CHARTED = ("loss", "eval_loss", "step_time_s", "tokens_per_s")
"""The curves every comparison draws, in this order (custom metrics follow)."""
UNCHARTED = frozenset({"mfu"})
"""Per-step figures a comparison does not draw (MFU follows tokens/s)."""
HIDDEN_ENV = "(hidden)"
"""An `env` value the reader may not read."""


@dataclass(frozen=True)
class Curve:
    """One job's curves: per kept step its step, seconds since start and named values."""

    job_id: int
    step: list[int]
    elapsed_s: list[float]
    metrics: dict[str, list[float | None]]


@dataclass(frozen=True)
class Headline:
    """One job's figures for the table: newest values, and the plan against the measurement."""

    job: Job
    step: int | None
    loss: float | None
    loss_nonfinite: bool
    """The newest loss was NaN or infinite (`loss` is None)."""
    eval_loss: float | None
    mfu: float | None
    mfu_predicted: float | None
    custom: dict[str, float]
    predicted_vs_measured: dict[str, Any]
    ettr: float | None = None
    """Training seconds over wall seconds, from its goodput ledger."""


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A spec as dotted fields (`parallel.tp`), lists kept whole, empty sections left out."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def spec_for(job: Job, shows_env: bool) -> dict[str, Any]:
    """The job's spec as a reader sees it: `env` values hidden unless `shows_env`."""
    spec = spec_json(job)
    if not shows_env and spec.get("env"):
        spec = {**spec, "env": {k: HIDDEN_ENV for k in spec["env"]}}
    return spec


def differences(specs: Sequence[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The fields whose values are not the same in every spec (absent: None), in order."""
    flat = [flatten(s) for s in specs]
    fields: list[str] = []
    for f in flat:
        fields += [k for k in f if k not in fields]
    out = []
    for name in fields:
        values = [f.get(name) for f in flat]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            out.append((name, values))
    return out


def _kept(rows: list[StepScalars]) -> list[StepScalars]:
    """Per step the newest attempt's, in step order."""
    by_step: dict[int, StepScalars] = {}
    for s in rows:
        by_step[s.step] = s
    return [by_step[k] for k in sorted(by_step)]


def curve(store: Store, job: Job, max_points: int = MAX_POINTS) -> Curve:
    latest = store.latest_metric(job_id=job.id)
    every = max(1, -(-latest.step // max_points)) if latest is not None else 1
    rows = MetricsIngest(store).sampled(job_id=job.id, every=every)
    steps = _kept([step_scalars(m, job.plan) for m in rows])
    start = job.started_at or (steps[0].time if steps else None)
    names: list[str] = list(CHARTED)
    for s in steps:
        names += [k for k in s.values if k not in names and "/" not in k]  # not per stage/dim
    return Curve(job_id=job.id, step=[s.step for s in steps],
                 elapsed_s=[(s.time - start).total_seconds() if start else 0.0 for s in steps],
                 metrics={n: [s.values.get(n) for s in steps] for n in names})


def headline(store: Store, job: Job, series: Curve) -> Headline:
    recent = recent_metrics(store, job)
    latest = recent[-1] if recent else None
    evals = [v for v in series.metrics.get("eval_loss", []) if v is not None]
    per_token = mfu_per_token_s(job.plan)
    tokens = steady_tokens_per_s(recent)
    mfu = tokens * per_token if tokens is not None and per_token is not None else None
    return Headline(job=job, step=latest.step if latest else None,
                    loss=latest.loss if latest else None,
                    loss_nonfinite=bool(latest and latest.report.loss_nonfinite),
                    eval_loss=evals[-1] if evals else None, mfu=mfu,
                    mfu_predicted=per_token * float(job.plan.tokens_per_s)
                    if per_token is not None and job.plan.tokens_per_s is not None else None,
                    custom=custom(latest) if latest else {},
                    predicted_vs_measured=compare(job.plan, recent),
                    ettr=GoodputLedger(store).ledger(job.id).ettr)


def comparison(store: Store, jobs: Sequence[Job], shows_env: Callable[[Job], bool]
               ) -> tuple[list[Headline], list[tuple[str, list[Any]]], list[Curve], list[str]]:
    """Headlines, differing spec fields, curves and the names of the curves to chart."""
    curves = [curve(store, j) for j in jobs]
    charted: list[str] = list(CHARTED)
    for c in curves:  # then every other per-step figure (lr, grad_norm, custom metrics ...)
        charted += [n for n in c.metrics if n not in charted and n not in UNCHARTED]
    for c in curves:  # every curve has every charted figure (None where it has no value)
        for n in charted:
            c.metrics.setdefault(n, [None] * len(c.step))
    return ([headline(store, j, c) for j, c in zip(jobs, curves, strict=True)],
            differences([spec_for(j, shows_env(j)) for j in jobs]), curves, charted)
