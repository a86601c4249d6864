"""A job's charts as the dashboard draws them: rank 0's loss, step time, tokens/s and MFU per
step with the plan's predictions, the validation loss, and the recipe's learning rate and
gradient norm.

Four columns of the rank-0 rows are read, bucketed in the database (min/max per bucket) when
long, so a 100,000-step job sends at most `MAX_POINTS` points per series; a restarted job's
redone steps show their newest values.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from service.contract.reports import GUARD_EVENTS
from service.store.dashboard import read_sessions
from service.store.store import Job, Store
from service.store.tables import AttemptRow, EventRow, MetricRow, StepMetricRow

MAX_POINTS = 2000
"""The most points of one chart series the server sends."""


def _kept_steps(s: Session, job_id: int) -> tuple[Any, int, int, int]:
    """Which rank-0 rows a chart shows: each attempt's steps below the first step of any later
    attempt (a restarted job redoes the steps after its checkpoint: the newest values count).
    Returns the condition, the lowest and highest step, and the number of steps kept."""
    numbers = s.execute(select(AttemptRow.number).where(AttemptRow.job_id == job_id)
                        .order_by(AttemptRow.number.desc())).scalars().all()
    conds, bound, lo, hi, n = [], None, None, None, 0
    for attempt in numbers:
        # Two seeks of the (job, attempt, step, rank) unique index.
        q = select(MetricRow.step).where(MetricRow.job_id == job_id,
                                         MetricRow.attempt == attempt, MetricRow.rank == 0)
        first = s.execute(q.order_by(MetricRow.step).limit(1)).scalar()
        last = s.execute(q.order_by(MetricRow.step.desc()).limit(1)).scalar()
        if first is None or last is None:
            continue
        top = last if bound is None else min(last, bound - 1)
        if top >= first:
            conds.append(and_(MetricRow.attempt == attempt, MetricRow.step <= top))
            lo = first if lo is None else min(lo, first)
            hi = top if hi is None else max(hi, top)
            n += top - first + 1
        bound = first if bound is None else min(bound, first)
    return or_(*conds) if conds else None, lo or 0, hi or 0, n


def job_series(store: Store, job: Job, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """Rank 0's loss, step time, tokens/s and MFU per step, with the plan's predictions, the
    validation loss of the steps that evaluated (`eval_step`, `eval_loss`), and the recipe's
    learning rate and global gradient norm before clipping (`recipe_step`, `lr`, `grad_norm`:
    the steps that reported them, thinned as the validation loss is).

    Up to `max_points` steps come as they are. Longer series are bucketed in the database
    (`max_points / 2` buckets of consecutive steps): each bucket gives two points, its first
    step with every series' minimum and its last step with every series' maximum, so spikes
    and dips survive however long the job ran; a bucket is narrower than a pixel of a chart,
    so the order of minimum and maximum inside it is not drawn. `rows`: the steps shown."""
    plan = job.plan
    mfu_pred = plan.mfu
    mfu_per_token = (mfu_pred or 0.0) / plan.tokens_per_s if plan.tokens_per_s else 0.0
    out: dict[str, Any] = {"rows": 0, "step": [], "loss": [], "step_time_s": [],
                           "tokens_per_s": [], "mfu": [], "predicted": {
                               "step_time_s": plan.time.step_s if plan.time else None,
                               "tokens_per_s": plan.tokens_per_s, "mfu": mfu_pred}}
    m = MetricRow
    with read_sessions(store).begin() as s:
        kept, lo, hi, n = _kept_steps(s, job.id)
        if kept is None:
            return out
        where = (m.job_id == job.id, m.rank == 0, kept)
        if n <= max_points:
            exact = s.execute(select(m.step, m.loss, m.step_time_s, m.tokens_per_s)
                              .where(*where).order_by(m.step)).all()
            points = [(r[0], r[1], r[2], r[3]) for r in exact]
        else:
            width = -(-(hi - lo + 1) // (max_points // 2))
            bucket = ((m.step - lo) // width).label("bucket")
            rows = s.execute(select(bucket, func.min(m.step), func.max(m.step), func.min(m.loss),
                                    func.max(m.loss), func.min(m.step_time_s),
                                    func.max(m.step_time_s), func.min(m.tokens_per_s),
                                    func.max(m.tokens_per_s))
                             .where(*where).group_by(bucket).order_by(bucket)).all()
            points = []
            for _, first, last, lo_l, hi_l, lo_t, hi_t, lo_k, hi_k in rows:
                points.append((first, lo_l, lo_t, lo_k))
                if last != first:
                    points.append((last, hi_l, hi_t, hi_k))
    out["rows"] = n
    out["step"] = [int(p[0]) for p in points]
    out["loss"] = [None if p[1] is None else float(p[1]) for p in points]
    out["step_time_s"] = [float(p[2]) for p in points]
    out["tokens_per_s"] = [None if p[3] is None else float(p[3]) for p in points]
    # No predicted MFU (a job that is not planned): no MFU to scale the tokens/s into.
    out["mfu"] = [float(p[3]) * mfu_per_token if mfu_pred is not None and p[3] is not None
                  else None for p in points]
    out["eval_step"], out["eval_loss"] = _eval_points(store, job.id, max_points)
    out["recipe_step"], out["lr"], out["grad_norm"] = _recipe_points(store, job.id, max_points)
    out["guard"] = _guard_marks(store, job.id, max_points)
    return out


def _guard_marks(store: Store, job_id: int, max_points: int) -> list[dict[str, Any]]:
    """The newest `max_points` events of the training guard, oldest first, as marks at their
    steps (the loss chart draws them)."""
    e = EventRow
    with read_sessions(store).begin() as s:
        rows = s.execute(select(e.kind, e.message, e.data)
                         .where(e.job_id == job_id, e.kind.in_(GUARD_EVENTS))
                         .order_by(e.id.desc()).limit(max_points)).all()
    return [{"step": int((data or {}).get("step", 0)), "kind": kind, "message": message}
            for kind, message, data in reversed(rows)]


def _thinned(steps: list[int], max_points: int) -> list[int]:
    """At most `max_points` of `steps`, evenly spaced."""
    if len(steps) > max_points:
        steps = steps[::-(-len(steps) // max_points)]
    return steps


def _recipe_points(store: Store, job_id: int, max_points: int
                   ) -> tuple[list[int], list[float], list[float | None]]:
    """The steps that reported a learning rate, their rate and gradient norm (the newest
    attempt's where a step ran twice; the norm None where the trainer gave none)."""
    sm = StepMetricRow
    with read_sessions(store).begin() as s:
        rows = s.execute(select(sm.step, sm.lr, sm.grad_norm)
                         .where(sm.job_id == job_id, sm.lr.is_not(None))
                         .order_by(sm.step, sm.attempt)).all()
    by_step = {int(step): (float(lr), None if norm is None else float(norm))
               for step, lr, norm in rows if lr is not None}  # the newest attempt last
    steps = _thinned(sorted(by_step), max_points)
    return steps, [by_step[st][0] for st in steps], [by_step[st][1] for st in steps]


def _eval_points(store: Store, job_id: int, max_points: int) -> tuple[list[int], list[float]]:
    """The steps that evaluated and their validation loss (the newest attempt's where a step
    ran twice), at most `max_points` of them (evenly thinned)."""
    sm = StepMetricRow
    with read_sessions(store).begin() as s:
        rows = s.execute(select(sm.step, sm.eval_loss)
                         .where(sm.job_id == job_id, sm.eval_loss.is_not(None))
                         .order_by(sm.step, sm.attempt)).all()
    by_step = {int(step): float(loss) for step, loss in rows  # the newest attempt last
               if loss is not None}
    steps = _thinned(sorted(by_step), max_points)
    return steps, [by_step[st] for st in steps]
