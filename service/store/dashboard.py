"""What the dashboard, `GET /metrics` and `GET /api/v1/jobs` (`trident status`) read from the
store, in as few queries as possible.

The jobs list pages in SQL (filters, sort, offset) and reads each listed job's newest step by
an index seek, so a page costs the same with 10 or 10,000 jobs. A job's charts read four
columns of its rank-0 rows, bucketed in the database (min/max per bucket) when long, so a
100,000-step job sends at most `MAX_POINTS` points per series.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import BindParameter, and_, bindparam, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from service.states import JobState
from service.store.jobs import Job, Metric, Store
from service.store.tables import AttemptRow, EventRow, JobRow, MetricRow, StepMetricRow

MAX_POINTS = 2000
"""The most points of one chart series the server sends."""

SORTS = {"id": JobRow.id, "name": JobRow.name, "owner": JobRow.owner, "state": JobRow.state,
         "created": JobRow.created_at, "priority": JobRow.priority}
"""Columns the jobs list sorts by."""


class Sort(StrEnum):
    """The jobs list's sort keys (a query parameter of the page and of `GET /jobs`)."""

    id = "id"
    name = "name"
    owner = "owner"
    state = "state"
    created = "created"
    priority = "priority"


def _session(store: Store) -> sessionmaker[Session]:
    """Read-only transactions on the store (`service.store.tables.snapshot_reads`)."""
    return store._read_sessions


@dataclass(frozen=True)
class JobSummary:
    """One line of the jobs list: the job, its newest step, and why it waits if queued."""

    job: Job
    latest: Metric | None
    total_steps: int | None
    queue_position: int | None
    eval_loss: float | None = None
    """The validation loss of the job's newest step that evaluated (None: none did)."""

    @property
    def progress(self) -> float | None:
        if self.latest is None or not self.total_steps:
            return None
        return min(1.0, self.latest.step / self.total_steps)

    @property
    def restarts(self) -> int:
        return max(0, self.job.attempts - 1 - self.job.preemptions - self.job.moves_up)

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

    @property
    def reason(self) -> str | None:
        """Why it waits, restarts or failed, in one line (the jobs list's REASON column)."""
        j = self.job
        if j.state == JobState.QUEUED:
            return j.waiting or self.queue_reason
        if j.state == JobState.PREEMPTED:
            return "preempted by a job of higher priority: checkpointing and stopping"
        if j.state == JobState.RESTARTING:
            return f"attempt {j.attempts} failed; restarting from the last checkpoint"
        if j.state == JobState.FAILED and j.error:
            return one_line(j.error)
        if j.state == JobState.CANCELLED:
            return "cancelled"
        return None


def one_line(text: str, width: int = 200) -> str:
    """A message in one line: a traceback's exception line, else its first line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    line = lines[-1] if any(ln.startswith("Traceback") for ln in lines) else lines[0]
    return line if len(line) <= width else line[:width - 3] + "..."


# The statements every jobs page and job detail runs, built once per process (building and
# keying a statement cost as much CPU as running it); the ids are bound per call.
_IDS: BindParameter[list[int]] = bindparam("ids", expanding=True)
_NEWEST_ROW = (select(MetricRow.id).where(MetricRow.job_id == JobRow.id, MetricRow.rank == 0)
               .order_by(MetricRow.step.desc(), MetricRow.attempt.desc()).limit(1)
               .correlate(JobRow).scalar_subquery())
# First each job's newest row id (an index seek per job), then those rows: PostgreSQL plans
# the two steps as one `IN` over a correlated subquery poorly (a scan).
_NEWEST_IDS = select(_NEWEST_ROW).where(JobRow.id.in_(_IDS))
_ROWS_BY_ID = select(MetricRow).where(MetricRow.id.in_(_IDS))
_NEWEST_OF_ONE = (select(MetricRow).where(MetricRow.job_id == bindparam("job_id"),
                                          MetricRow.rank == 0)
                  .order_by(MetricRow.step.desc(), MetricRow.attempt.desc()).limit(1))
_QUEUED = JobRow.state == JobState.QUEUED.value
_ME = select(JobRow.priority, JobRow.id).where(JobRow.id == bindparam("job_id")).subquery()
_AHEAD = select(func.count()).select_from(JobRow).join(_ME, or_(
    JobRow.priority > _ME.c.priority,
    and_(JobRow.priority == _ME.c.priority, JobRow.id < _ME.c.id))).where(_QUEUED)
_LINE = select(JobRow.id, func.row_number().over(
    order_by=(JobRow.priority.desc(), JobRow.id)).label("position")).where(_QUEUED).subquery()
_POSITIONS = select(_LINE.c.id, _LINE.c.position).where(_LINE.c.id.in_(_IDS))
_NEWEST_EVAL = (select(StepMetricRow.eval_loss)
                .where(StepMetricRow.job_id == JobRow.id, StepMetricRow.eval_loss.is_not(None))
                .order_by(StepMetricRow.attempt.desc(), StepMetricRow.step.desc()).limit(1)
                .correlate(JobRow).scalar_subquery())
_EVALS = select(JobRow.id, _NEWEST_EVAL).where(JobRow.id.in_(_IDS))
_BY_STATE = select(JobRow.state, func.count()).group_by(JobRow.state)


def _latest(s: Session, job_ids: Sequence[int]) -> dict[int, Metric]:
    """Rank 0's newest step of each job, in two queries (an index seek per job); one
    job's (its detail) in one."""
    if not job_ids:
        return {}
    if len(job_ids) == 1:
        row = s.execute(_NEWEST_OF_ONE, {"job_id": job_ids[0]}).scalar()
        return {} if row is None else {row.job_id: Metric.from_row(row)}
    ids = [i for i in s.connection().execute(_NEWEST_IDS, {"ids": list(job_ids)}).scalars()
           if i is not None]
    rows = s.execute(_ROWS_BY_ID, {"ids": ids}).scalars()
    return {r.job_id: Metric.from_row(r) for r in rows}


def _queue_positions(s: Session, job_ids: Sequence[int]) -> dict[int, int]:
    """The queued jobs' positions (1-based) in admission order, priority then age, in one
    query that returns only theirs: one job's is a count of the queued jobs ahead of it
    (a submission's answer, a job's detail); a page's come from one numbering of the queue
    in the database."""
    if not job_ids:
        return {}
    if len(job_ids) == 1:
        ahead = s.connection().execute(_AHEAD, {"job_id": job_ids[0]})
        return {job_ids[0]: int(ahead.scalar_one()) + 1}
    rows = s.connection().execute(_POSITIONS, {"ids": list(job_ids)})
    return {job_id: int(n) for job_id, n in rows}


def jobs_page(store: Store, *, states: Sequence[JobState] = (), name: str = "",
              owner: str = "", project: str = "", sort: str = "id", desc: bool = True,
              limit: int = 50, offset: int = 0) -> tuple[list[JobSummary], int]:
    """One page of the jobs list and the number of jobs the filters select."""
    conds: list[Any] = []
    if states:
        conds.append(JobRow.state.in_([st.value for st in states]))
    if name:
        conds.append(JobRow.name.contains(name, autoescape=True))
    if owner:
        conds.append(JobRow.owner == owner)
    if project:
        conds.append(JobRow.project == project)
    col = SORTS[sort]
    order: list[Any] = [col.desc() if desc else col.asc()]
    if sort != "id":
        order.append(JobRow.id.desc())
    with _session(store).begin() as s:
        total = s.execute(select(func.count()).select_from(JobRow).where(*conds)).scalar_one()
        # Plain rows, not ORM objects (nothing is written back): a page of 50 built 50
        # tracked instances for nothing.
        rows = s.connection().execute(select(JobRow.__table__).where(*conds).order_by(*order)
                                      .limit(limit).offset(offset)).all()
        return _summaries(s, rows), int(total)  # type: ignore[arg-type]  # JobRow's names


def _summaries(s: Session, rows: Sequence[JobRow], *, steps: bool = True
               ) -> list[JobSummary]:
    """The summaries of `rows`: their newest steps in one query (unless `steps` is False: a
    job just queued has none), and queue positions (one more query, only when one of them
    is queued)."""
    return _summaries_of(s, [Job.from_row(r) for r in rows], steps=steps)


def _summaries_of(s: Session, jobs: Sequence[Job], *, steps: bool = True
                  ) -> list[JobSummary]:
    positions = _queue_positions(s, [j.id for j in jobs if j.state == JobState.QUEUED])
    latest = _latest(s, [j.id for j in jobs]) if steps else {}
    evals = _latest_evals(s, [j.id for j in jobs if j.spec.data.eval_every]) if steps else {}
    return [JobSummary(job=j, latest=latest.get(j.id), total_steps=j.spec.train.steps,
                       queue_position=positions.get(j.id), eval_loss=evals.get(j.id))
            for j in jobs]


def _latest_evals(s: Session, job_ids: Sequence[int]) -> dict[int, float]:
    """The newest validation loss of each job that evaluates, in one query (a walk back
    from each job's newest step to the newest that evaluated: `data.eval_every` rows)."""
    if not job_ids:
        return {}
    return {i: float(v) for i, v in s.connection().execute(_EVALS, {"ids": list(job_ids)})
            if v is not None}


def summary_of(store: Store, job: Job, *, new: bool = False) -> JobSummary:
    """`job_summary` of a job just read or written (its row is not read again)."""
    with _session(store).begin() as s:
        return _summaries_of(s, [job], steps=not new)[0]


def job_summary(store: Store, job_id: int, *, new: bool = False) -> JobSummary:
    """One job's line of the jobs list (`GET /jobs/{id}` carries it too); `new`: a job just
    queued (a submission's answer), which has no steps to look up."""
    with _session(store).begin() as s:
        return _summaries(s, s.execute(select(JobRow).where(JobRow.id == job_id))
                          .scalars().all(), steps=not new)[0]


def queue(store: Store, limit: int = 200) -> tuple[list[JobSummary], int]:
    """The first `limit` queued jobs in admission order (priority, then age), with position
    and reason, and how many are queued."""
    with _session(store).begin() as s:
        q = select(JobRow).where(JobRow.state == JobState.QUEUED.value)
        total = s.execute(select(func.count()).select_from(q.subquery())).scalar_one()
        rows = s.execute(q.order_by(JobRow.priority.desc(), JobRow.id).limit(limit)).scalars()
        jobs = [Job.from_row(r) for r in rows]
        return [JobSummary(job=j, latest=None, total_steps=j.spec.train.steps,
                           queue_position=i) for i, j in enumerate(jobs, 1)], int(total)


def count_by_state(store: Store) -> dict[JobState, int]:
    """Jobs per state, every state present (zero when none)."""
    with _session(store).begin() as s:
        got = dict(s.connection().execute(_BY_STATE).all())
    return {st: int(got.get(st.value, 0)) for st in JobState}


def recent_metrics(store: Store, job: Job, window: int = 1000) -> list[Metric]:
    """Rank 0's last `window` steps of the newest attempt: what the pages compare with the
    plan (steady-state medians), bounded however long the job ran."""
    latest = store.latest_metric(job_id=job.id)
    if latest is None:
        return []
    return store.list_metrics(job_id=job.id, attempt=latest.attempt,
                              after_step=max(0, latest.step - window), limit=window)


def measured_bubble_ratio(store: Store, job_id: int, attempt: int, step: int,
                          window: int = 20) -> float | None:
    """The pipeline bubble the ranks measured (`StepReport.bubble_s`) as a share of their step
    time: the mean over the ranks of the newest step within `window` steps of `step` that
    carries it (GPU ranks time it on sampled steps only); None when no step does."""
    by_step: dict[int, list[float]] = {}
    for m in store.list_metrics(job_id=job_id, rank=None, attempt=attempt,
                                after_step=max(0, step - window), limit=100000):
        bubble = m.data.get("bubble_s")
        if isinstance(bubble, int | float) and m.step_time_s > 0:
            by_step.setdefault(m.step, []).append(min(1.0, bubble / m.step_time_s))
    if not by_step:
        return None
    shares = by_step[max(by_step)]
    return sum(shares) / len(shares)


# --- charts ------------------------------------------------------------------------------------

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
                               "step_time_s": plan.time.step_s,
                               "tokens_per_s": plan.tokens_per_s, "mfu": mfu_pred}}
    m = MetricRow
    with _session(store).begin() as s:
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
    out["tokens_per_s"] = [float(p[3]) for p in points]
    out["mfu"] = [float(p[3]) * mfu_per_token for p in points]
    out["eval_step"], out["eval_loss"] = _eval_points(store, job.id, max_points)
    out["recipe_step"], out["lr"], out["grad_norm"] = _recipe_points(store, job.id, max_points)
    return out


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
    with _session(store).begin() as s:
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
    with _session(store).begin() as s:
        rows = s.execute(select(sm.step, sm.eval_loss)
                         .where(sm.job_id == job_id, sm.eval_loss.is_not(None))
                         .order_by(sm.step, sm.attempt)).all()
    by_step = {int(step): float(loss) for step, loss in rows  # the newest attempt last
               if loss is not None}
    steps = _thinned(sorted(by_step), max_points)
    return steps, [by_step[st] for st in steps]


def marked_ranks(store: Store, *, job_id: int,
                 attempt: int | None) -> tuple[set[int], set[int]]:
    """The attempt's stragglers and the ranks its hang diagnoses say never arrived."""
    stragglers: set[int] = set()
    waited_for: set[int] = set()
    with _session(store).begin() as s:
        for ev in s.execute(select(EventRow).where(
                EventRow.job_id == job_id, EventRow.attempt == attempt,
                EventRow.kind.in_(["straggler", "hang"]))).scalars():
            if ev.kind == "straggler":
                stragglers.add(int((ev.data or {}).get("rank", -1)))
            else:
                waited_for |= set((ev.data or {}).get("never_arrived", []))
    return stragglers, waited_for
