"""What the dashboard, `GET /metrics` and `GET /api/v1/jobs` (`trident status`) read from the
store, in as few queries as possible.

The jobs list pages in SQL (filters, sort, offset) and reads each listed job's newest step by
an index seek, so a page costs the same with 10 or 10,000 jobs. A job's charts are read by
`service.store.charts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BindParameter, and_, bindparam, func, or_, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from client.payloads import one_line
from service.contract.states import JobState
from service.store.metrics import Newest, newest_in
from service.store.store import Job, Metric, Store, job_in, secret_names_in
from service.store.tables import EventRow, JobRow, MetricRow, StepMetricRow

SORTS = {"id": JobRow.id, "name": JobRow.name, "owner": JobRow.owner, "state": JobRow.state,
         "created": JobRow.created_at, "priority": JobRow.priority}
"""Columns the jobs list sorts by."""


def read_sessions(store: Store) -> sessionmaker[Session]:
    """Read-only transactions on the store (`service.store.engine.snapshot_reads`)."""
    return store._read_sessions


def snapshot(store: Store) -> Engine:
    """Read-only transactions of plain statements on a connection (`snapshot(store).begin()`,
    `service.store.engine.snapshot_reads`): what the jobs list and a job's detail read in,
    without an ORM session's bookkeeping."""
    return store._snapshot


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


def _latest(c: Connection, job_ids: Sequence[int]) -> dict[int, Metric]:
    """Rank 0's newest step of each job, in two queries (an index seek per job); one
    job's (its detail) in one."""
    if not job_ids:
        return {}
    if len(job_ids) == 1:
        row = c.execute(_NEWEST_OF_ONE, {"job_id": job_ids[0]}).first()
        return {} if row is None else {row.job_id: Metric.from_row(row)}  # type: ignore[arg-type]
    ids = [i for i in c.execute(_NEWEST_IDS, {"ids": list(job_ids)}).scalars()
           if i is not None]
    rows = c.execute(_ROWS_BY_ID, {"ids": ids})
    return {r.job_id: Metric.from_row(r) for r in rows}  # type: ignore[arg-type]


def _queue_positions(c: Connection, job_ids: Sequence[int]) -> dict[int, int]:
    """The queued jobs' positions (1-based) in admission order, priority then age, in one
    query that returns only theirs: one job's is a count of the queued jobs ahead of it
    (a submission's answer, a job's detail); a page's come from one numbering of the queue
    in the database."""
    if not job_ids:
        return {}
    if len(job_ids) == 1:
        ahead = c.execute(_AHEAD, {"job_id": job_ids[0]})
        return {job_ids[0]: int(ahead.scalar_one()) + 1}
    rows = c.execute(_POSITIONS, {"ids": list(job_ids)})
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
    with snapshot(store).begin() as c:
        total = c.execute(select(func.count()).select_from(JobRow).where(*conds)).scalar_one()
        # Plain rows, not ORM objects (nothing is written back): a page of 50 built 50
        # tracked instances for nothing.
        rows = c.execute(select(JobRow.__table__).where(*conds).order_by(*order)
                         .limit(limit).offset(offset)).all()
        return _summaries(c, rows), int(total)  # type: ignore[arg-type]  # JobRow's names


def _summaries(c: Connection, rows: Sequence[JobRow], *, steps: bool = True
               ) -> list[JobSummary]:
    """The summaries of `rows`: their newest steps in one query (unless `steps` is False: a
    job just queued has none), and queue positions (one more query, only when one of them
    is queued)."""
    return _summaries_of(c, [Job.from_row(r) for r in rows], steps=steps)


def _summaries_of(c: Connection, jobs: Sequence[Job], *, steps: bool = True
                  ) -> list[JobSummary]:
    positions = _queue_positions(c, [j.id for j in jobs if j.state == JobState.QUEUED])
    latest = _latest(c, [j.id for j in jobs]) if steps else {}
    evals = _latest_evals(c, [j.id for j in jobs if j.spec.data.eval_every]) if steps else {}
    return [JobSummary(job=j, latest=latest.get(j.id), total_steps=j.spec.train.steps,
                       queue_position=positions.get(j.id), eval_loss=evals.get(j.id))
            for j in jobs]


def _latest_evals(c: Connection, job_ids: Sequence[int]) -> dict[int, float]:
    """The newest validation loss of each job that evaluates, in one query (a walk back
    from each job's newest step to the newest that evaluated: `data.eval_every` rows)."""
    if not job_ids:
        return {}
    return {i: float(v) for i, v in c.execute(_EVALS, {"ids": list(job_ids)})
            if v is not None}


def summary_of(store: Store, job: Job, *, new: bool = False) -> JobSummary:
    """`job_summary` of a job just read or written (its row is not read again). A new job's
    is its queue position only: one statement, outside a transaction."""
    with (store._reads.connect() if new else snapshot(store).begin()) as c:
        return _summaries_of(c, [job], steps=not new)[0]


@dataclass(frozen=True)
class JobPage:
    """What a job's detail reads from the store, in one read-only transaction."""

    job: Job
    summary: JobSummary
    newest: Newest | None
    """Rank 0's newest row in its newest attempt (`service.store.metrics.newest_in`):
    whether the comparison with the plan worked out before still holds."""
    secrets: list[str]
    """Its secrets' names (`Store.secret_names`)."""


def job_page(store: Store, job_id: int) -> JobPage:
    """A job's detail (`GET /jobs/{id}`, which every viewer of its page polls): the job, its
    line of the jobs list, rank 0's newest row and its secrets' names on one connection in
    one snapshot, not a connection and a transaction each. NotFound if there is no such
    job."""
    with snapshot(store).begin() as c:
        job = job_in(c, job_id)
        return JobPage(job=job, summary=_summaries_of(c, [job])[0],
                       newest=newest_in(c, job_id),
                       secrets=secret_names_in(c, [job_id]).get(job_id, []))


def job_summary(store: Store, job_id: int, *, new: bool = False) -> JobSummary:
    """One job's line of the jobs list (`GET /jobs/{id}` carries it too); `new`: a job just
    queued (a submission's answer), which has no steps to look up."""
    with snapshot(store).begin() as c:
        return _summaries(c, c.execute(select(JobRow.__table__).where(JobRow.id == job_id))
                          .all(), steps=not new)[0]  # type: ignore[arg-type]


def queue(store: Store, limit: int = 200) -> tuple[list[JobSummary], int]:
    """The first `limit` queued jobs in admission order (priority, then age), with position
    and reason, and how many are queued."""
    with read_sessions(store).begin() as s:
        q = select(JobRow).where(JobRow.state == JobState.QUEUED.value)
        total = s.execute(select(func.count()).select_from(q.subquery())).scalar_one()
        rows = s.execute(q.order_by(JobRow.priority.desc(), JobRow.id).limit(limit)).scalars()
        jobs = [Job.from_row(r) for r in rows]
        return [JobSummary(job=j, latest=None, total_steps=j.spec.train.steps,
                           queue_position=i) for i, j in enumerate(jobs, 1)], int(total)


def count_by_state(store: Store) -> dict[JobState, int]:
    """Jobs per state, every state present (zero when none)."""
    with read_sessions(store).begin() as s:
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
        bubble = m.report.bubble_s
        if bubble is not None and m.step_time_s > 0:
            by_step.setdefault(m.step, []).append(min(1.0, bubble / m.step_time_s))
    if not by_step:
        return None
    shares = by_step[max(by_step)]
    return sum(shares) / len(shares)


def marked_ranks(store: Store, *, job_id: int,
                 attempt: int | None) -> tuple[set[int], set[int]]:
    """The attempt's stragglers and the ranks its hang diagnoses say never arrived."""
    stragglers: set[int] = set()
    waited_for: set[int] = set()
    with read_sessions(store).begin() as s:
        for ev in s.execute(select(EventRow).where(
                EventRow.job_id == job_id, EventRow.attempt == attempt,
                EventRow.kind.in_(["straggler", "hang"]))).scalars():
            if ev.kind == "straggler":
                stragglers.add(int((ev.data or {}).get("rank", -1)))
            else:
                waited_for |= set((ev.data or {}).get("never_arrived", []))
    return stragglers, waited_for
