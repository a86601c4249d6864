"""What the dashboard and `GET /metrics` read from the store, in as few queries as possible.

The jobs list pages in SQL (filters, sort, offset) and reads each listed job's newest step by
an index seek, so a page costs the same with 10 or 10,000 jobs. A job's charts read four
columns of its rank-0 rows and downsample them here (min/max per bucket, `downsample`), so a
100,000-step job sends at most `MAX_POINTS` points per series.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from service.db import EventRow, JobRow, MetricRow
from service.states import JobState
from service.store import Job, Metric, Store

MAX_POINTS = 2000
"""The most points of one chart series the server sends."""

SORTS = {"id": JobRow.id, "name": JobRow.name, "owner": JobRow.owner, "state": JobRow.state,
         "created": JobRow.created_at, "priority": JobRow.priority}
"""Columns the jobs list sorts by."""


def _session(store: Store) -> sessionmaker[Session]:
    return sessionmaker(store.engine, expire_on_commit=False)


@dataclass(frozen=True)
class JobSummary:
    """One line of the jobs list: the job, its newest step, and why it waits if queued."""

    job: Job
    latest: Metric | None
    total_steps: int | None
    queue_position: int | None

    @property
    def progress(self) -> float | None:
        if self.latest is None or not self.total_steps:
            return None
        return min(1.0, self.latest.step / self.total_steps)

    @property
    def restarts(self) -> int:
        return max(0, self.job.attempts - 1)

    @property
    def queue_reason(self) -> str | None:
        if self.queue_position is None:
            return None
        need = f"{self.job.world_size} rank(s), {self.job.cpus:g} CPU"
        if self.job.gpus:
            need += f" and {self.job.gpus:g} GPU"
        if self.queue_position == 1:
            return f"first in line; waits until the cluster has {need} free"
        return (f"position {self.queue_position}: {self.queue_position - 1} job(s) before it"
                f" (needs {need})")


def _latest(s: Session, job_id: int, rank: int = 0) -> Metric | None:
    row = s.execute(select(MetricRow).where(MetricRow.job_id == job_id, MetricRow.rank == rank)
                    .order_by(MetricRow.step.desc(), MetricRow.attempt.desc())
                    .limit(1)).scalar()
    return Metric.from_row(row) if row is not None else None


def _position(s: Session, row: JobRow) -> int:
    ahead = s.execute(select(func.count()).select_from(JobRow).where(
        JobRow.state == JobState.QUEUED.value,
        or_(JobRow.priority > row.priority,
            and_(JobRow.priority == row.priority, JobRow.id < row.id)))).scalar_one()
    return int(ahead) + 1


def _steps(row: JobRow) -> int | None:
    steps = row.spec.get("train", {}).get("steps") if isinstance(row.spec, dict) else None
    return steps if isinstance(steps, int) else None


def summarize(s: Session, row: JobRow) -> JobSummary:
    queued = row.state == JobState.QUEUED.value
    return JobSummary(job=Job.from_row(row), latest=_latest(s, row.id), total_steps=_steps(row),
                      queue_position=_position(s, row) if queued else None)


def jobs_page(store: Store, *, states: Sequence[JobState] = (), name: str = "",
              owner: str = "", sort: str = "id", desc: bool = True, limit: int = 50,
              offset: int = 0) -> tuple[list[JobSummary], int]:
    """One page of the jobs list and the number of jobs the filters select."""
    conds: list[Any] = []
    if states:
        conds.append(JobRow.state.in_([st.value for st in states]))
    if name:
        conds.append(JobRow.name.contains(name, autoescape=True))
    if owner:
        conds.append(JobRow.owner == owner)
    col = SORTS[sort]
    order: list[Any] = [col.desc() if desc else col.asc()]
    if sort != "id":
        order.append(JobRow.id.desc())
    with _session(store).begin() as s:
        total = s.execute(select(func.count()).select_from(JobRow).where(*conds)).scalar_one()
        rows = s.execute(select(JobRow).where(*conds).order_by(*order)
                         .limit(limit).offset(offset)).scalars().all()
        return [summarize(s, r) for r in rows], int(total)


def queue(store: Store) -> list[JobSummary]:
    """Queued jobs in admission order (priority, then age), with position and reason."""
    with _session(store).begin() as s:
        rows = s.execute(select(JobRow).where(JobRow.state == JobState.QUEUED.value)
                         .order_by(JobRow.priority.desc(), JobRow.id)).scalars().all()
        return [JobSummary(job=Job.from_row(r), latest=None, total_steps=_steps(r),
                           queue_position=i) for i, r in enumerate(rows, 1)]


def count_by_state(store: Store) -> dict[JobState, int]:
    """Jobs per state, every state present (zero when none)."""
    with _session(store).begin() as s:
        got = dict(s.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all())
    return {st: int(got.get(st.value, 0)) for st in JobState}


# --- charts ------------------------------------------------------------------------------------

def downsample(columns: Sequence[np.ndarray], max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices (ascending) to keep so that every column keeps its minimum and maximum in each
    bucket of consecutive points, the first and last point, and at most `max_points` points.
    NaNs (a missing loss) are ignored."""
    n = len(columns[0]) if columns else 0
    if n <= max_points:
        return np.arange(n)
    per_bucket = 2 * max(1, len(columns))
    buckets = max(1, (max_points - 2) // per_bucket)
    size = -(-n // buckets)
    keep = [np.array([0, n - 1])]
    base = np.arange(buckets) * size
    for col in columns:
        padded = np.full(buckets * size, np.nan)
        padded[:n] = col
        grid = padded.reshape(buckets, size)
        lo = np.where(np.isnan(grid), np.inf, grid).argmin(axis=1)
        hi = np.where(np.isnan(grid), -np.inf, grid).argmax(axis=1)
        keep += [base + lo, base + hi]
    idx = np.unique(np.concatenate(keep))
    return idx[idx < n]


def job_series(store: Store, job: Job, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """Rank 0's loss, step time, tokens/s and MFU per step (a step a later attempt redid shows
    that attempt's values), downsampled, with the plan's predictions."""
    with _session(store).begin() as s:
        rows = s.execute(select(MetricRow.attempt, MetricRow.step, MetricRow.loss,
                                MetricRow.step_time_s, MetricRow.tokens_per_s)
                         .where(MetricRow.job_id == job.id, MetricRow.rank == 0)).all()
    plan = job.plan
    mfu_per_token = (plan.model_dump().get("mfu") or 0.0) / plan.tokens_per_s \
        if plan.tokens_per_s else 0.0
    pred = {"step_time_s": plan.time.step_s, "tokens_per_s": plan.tokens_per_s,
            "mfu": plan.model_dump().get("mfu")}
    if not rows:
        return {"rows": 0, "step": [], "loss": [], "step_time_s": [], "tokens_per_s": [],
                "mfu": [], "predicted": pred}
    a = np.array([(r[0], r[1], np.nan if r[2] is None else r[2], r[3], r[4]) for r in rows],
                 dtype=float)
    a = a[np.lexsort((a[:, 0], a[:, 1]))]  # by step, then attempt
    last = np.r_[a[1:, 1] != a[:-1, 1], True]  # the newest attempt of each step
    a = a[last]
    idx = downsample([a[:, 2], a[:, 3], a[:, 4]], max_points)
    pick = a[idx]

    def col(i: int) -> list[float | None]:
        return [None if np.isnan(v) else float(v) for v in pick[:, i]]

    return {"rows": int(len(a)), "step": [int(v) for v in pick[:, 1]], "loss": col(2),
            "step_time_s": col(3), "tokens_per_s": col(4),
            "mfu": [float(v) * mfu_per_token for v in pick[:, 4]], "predicted": pred}


# --- ranks grid --------------------------------------------------------------------------------

def _compute_s(m: Metric) -> float | None:
    comm = m.data.get("comm")
    if comm is None or not m.data.get("timed", True):
        return None
    return max(0.0, m.step_time_s - sum(o["time_s"] for ops in comm.values()
                                        for o in ops.values()))


def ranks_grid(store: Store, job: Job, window: int = 20) -> dict[str, Any]:
    """Every rank of the layout: coordinates, node, GPU, measured peak memory against the plan's
    prediction for its stage, compute time against its stage peers' median, and whether it is
    a straggler or the rank a hang waits for (the newest attempt's events)."""
    plan = job.plan
    by_stage = {int(m["stage"]): float(m["total"])
                for m in plan.model_dump().get("memory_by_stage") or []}
    attempts = store.list_attempts(job_id=job.id)
    placement = {r["rank"]: r for r in (attempts[-1].placement.get("ranks", [])
                                        if attempts else [])}
    latest = store.latest_metric(job_id=job.id)
    recent: dict[int, list[Metric]] = {}
    if latest is not None:
        for m in store.list_metrics(job_id=job.id, rank=None, attempt=latest.attempt,
                                    after_step=max(0, latest.step - window), limit=100000):
            recent.setdefault(m.rank, []).append(m)
    compute: dict[int, float] = {}
    for r, ms in recent.items():
        times = [x for m in ms if (x := _compute_s(m)) is not None]
        if times:
            compute[r] = statistics.median(times)
    stage_of = {row.rank: row.pp for row in plan.rank_layout}
    peers: dict[int, list[float]] = {}
    for r, t in compute.items():
        peers.setdefault(stage_of.get(r, 0), []).append(t)
    number = attempts[-1].number if attempts else None
    stragglers, waited_for = set(), set()
    with _session(store).begin() as s:
        for ev in s.execute(select(EventRow).where(
                EventRow.job_id == job.id, EventRow.attempt == number,
                EventRow.kind.in_(["straggler", "hang"]))).scalars():
            if ev.kind == "straggler":
                stragglers.add(int((ev.data or {}).get("rank", -1)))
            else:
                waited_for |= set((ev.data or {}).get("never_arrived", []))
    cells = []
    for row in plan.rank_layout:
        ms = recent.get(row.rank, [])
        peaks = [p for m in ms if isinstance(p := m.data.get("memory", {})
                                             .get("process_peak_bytes"), int | float)]
        pred = by_stage.get(row.pp, float(plan.memory.total))
        c = compute.get(row.rank)
        peer = statistics.median(peers[row.pp]) if peers.get(row.pp) else None
        place = placement.get(row.rank, {})
        cells.append({
            "rank": row.rank, "tp": row.tp, "pp": row.pp, "dp": row.dp,
            "node": place.get("hostname"), "gpu": ",".join(place.get("gpu_ids") or []) or None,
            "memory_peak_bytes": max(peaks) if peaks else None,
            "memory_predicted_bytes": pred,
            "memory_ratio": max(peaks) / pred if peaks and pred else None,
            "compute_s": c, "stage_compute_s": peer,
            "compute_ratio": c / peer if c is not None and peer else None,
            "step": ms[-1].step if ms else None,
            "straggler": row.rank in stragglers, "hang_waits_for": row.rank in waited_for})
    return {"layout": plan.layout.model_dump(), "world_size": plan.world_size,
            "attempt": number, "cells": cells}
