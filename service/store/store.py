"""The job store: jobs, attempts and a job's sealed secrets; with a job's run records
(events, per-rank metrics: `service.store.records`) and the cluster's records (probes, nodes,
calibrated profiles: `service.store.cluster`), which `Store` inherits. `Store` owns the
engine of the package that alone reads or writes the database (`service.store`); its other
modules take a `Store`.

Every function is keyword-only and runs in one transaction. `transition` is the single writer
of job state: it checks the state machine and writes the event in the same transaction.
Callers (API, controller) get the immutable views of `service.store.views` back, never ORM rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, bindparam, func, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.contract.spec import JobSpec
from service.contract.states import JobState, TransitionError, check_transition
from service.planner.stored import StoredPlan
from service.store.cluster import ClusterRecords
from service.store.engine import EngineTx, make_engine
from service.store.records import RunRecords
from service.store.schema import upgrade
from service.store.tables import (
    AttemptRow,
    EventRow,
    JobRow,
    JobSecretRow,
    LeaseRow,
    TrackingExportRow,
    utcnow,
)
from service.store.views import (
    Attempt,
    AttemptStatus,
    CalibratedProfile,
    Event,
    Job,
    Metric,
    Node,
    NotFound,
    Probe,
    ProbeStatus,
    attempt_of,
    aware,
)

__all__ = ["Attempt", "AttemptStatus", "CalibratedProfile", "Event", "Fence", "Job", "KeyTaken",
           "Metric", "Node", "NotFound", "NotHolder", "Probe", "ProbeStatus", "Store"]


@dataclass(frozen=True)
class Fence:
    """A lease (`service.store.lease`) the caller must still hold for a write to happen: checked in
    the write's own transaction, so that a controller whose lease was taken while it was in
    the middle of a pass cannot start an attempt that the new leader also starts."""

    lease: str
    holder: str


class NotHolder(RuntimeError):
    """The caller no longer holds its fence's lease: nothing was written."""


class KeyTaken(Exception):
    """A job with this idempotency key exists already (`job`, and the hash it was sent with)."""

    def __init__(self, job: Job, request_hash: str | None) -> None:
        super().__init__(f"idempotency key taken by job {job.id}")
        self.job = job
        self.request_hash = request_hash

_SECRET_NAMES = (select(JobSecretRow.job_id, JobSecretRow.name)
                 .where(JobSecretRow.job_id.in_(bindparam("ids", expanding=True))))
_JOB = select(JobRow.__table__).where(JobRow.id == bindparam("job_id"))
"""Every job page and list reads them: built once per process."""
_INSERT_JOB = insert(JobRow).returning(JobRow.id)
_INSERT_EVENT = insert(EventRow)
_INSERT_SECRET = insert(JobSecretRow)
_INSERT_TRACKING = insert(TrackingExportRow)
"""A submission's statements (`Store.create_job`), built once per process."""


def job_in(c: Connection, job_id: int) -> Job:
    """Job `job_id` read on `c` (`Store.get_job`; a job's page reads it in the transaction
    of its other reads); NotFound if there is none."""
    row = c.execute(_JOB, {"job_id": job_id}).first()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    return Job.from_row(row)  # type: ignore[arg-type]  # a row with JobRow's names


def secret_names_in(c: Connection, job_ids: Sequence[int]) -> dict[int, list[str]]:
    """`Store.secret_names`, read on `c`: sorted here, in code point order (the database's
    collation need not agree), so the statement asks for no order."""
    out: dict[int, list[str]] = {}
    for job_id, name in c.execute(_SECRET_NAMES, {"ids": list(job_ids)}):
        out.setdefault(job_id, []).append(name)
    for names in out.values():
        names.sort()
    return out


class Store(EngineTx, ClusterRecords, RunRecords):
    """Owns an engine and its transactions (`EngineTx`); one instance per process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = make_engine(url)
        super().__init__(self.engine)

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision."""
        upgrade(self.url)

    def close(self) -> None:
        self.engine.dispose()

    def _check_fence(self, s: Session, fence: Fence) -> None:
        # FOR SHARE: a controller taking the lease over (FOR UPDATE) waits for this write.
        lease = s.execute(select(LeaseRow).where(LeaseRow.name == fence.lease)
                          .with_for_update(read=True)).scalar()
        expires = aware(lease.expires_at) if lease is not None else None
        if lease is None or lease.holder != fence.holder or expires is None or expires <= utcnow():
            holder = lease.holder if lease else "nobody"
            raise NotHolder(f"the {fence.lease} lease is held by {holder}, not {fence.holder}")

    def check_fence(self, fence: Fence) -> None:
        """Raise NotHolder unless `fence`'s holder holds its lease now: for work that is not
        a write of the store but must not happen under a lost lease (launching ranks)."""
        with self._tx() as s:
            self._check_fence(s, fence)

    def _lock_job(self, s: Session, job_id: int) -> JobRow:
        row = s.execute(select(JobRow).where(JobRow.id == job_id).with_for_update()).scalar()
        if row is None:
            raise NotFound(f"job {job_id} not found")
        return row

    # --- jobs -------------------------------------------------------------------------------

    def create_job(self, *, name: str, spec: JobSpec, plan: StoredPlan,
                   world_size: int, cpus: float, gpus: float, priority: int = 0,
                   owner: str = "local", project: str | None = None,
                   idempotency_key: str | None = None, request_hash: str | None = None,
                   secrets: Mapping[str, bytes] | None = None,
                   tracking: Mapping[str, str] | None = None) -> Job:
        """Queue a new job. With an `idempotency_key` that a job of the same `owner` holds
        already, nothing is created and KeyTaken carries that job (the unique index on owner
        and key decides between concurrent submissions, so exactly one of them creates it).
        `secrets`: the job's sealed secrets by name (`service.secrets`), stored apart
        from the spec in the same transaction; `tracking`: the trackers its steps go to (sink ->
        target, `service.store.tracking_exports`), each a cursor at the start."""
        now = utcnow()
        values: dict[str, Any] = dict(
            name=name, owner=owner, project=project, state=JobState.QUEUED.value,
            priority=priority, spec=spec.model_dump(mode="json"), plan=plan.to_json(),
            world_size=world_size, cpus=cpus, gpus=gpus, cancel_requested=False, attempts=0,
            preemptions=0, created_at=now, updated_at=now, idempotency_key=idempotency_key,
            request_hash=request_hash)
        # Core inserts, not ORM objects: a submission's unit of work (flush, identity map,
        # commit bookkeeping) cost more CPU than its statements. The JSON columns left NULL
        # are left out (given None, a JSON column would store JSON's null, not NULL).
        try:
            with self.engine.begin() as c:
                job_id = c.execute(_INSERT_JOB, values).scalar_one()
                c.execute(_INSERT_EVENT, {"job_id": job_id, "time": now, "kind": "state",
                                          "message": "job queued",
                                          "data": {"to": JobState.QUEUED.value}})
                if secrets:
                    c.execute(_INSERT_SECRET, [{"job_id": job_id, "name": k, "sealed": v}
                                               for k, v in secrets.items()])
                if tracking:
                    c.execute(_INSERT_TRACKING, [
                        {"job_id": job_id, "sink": sink, "target": target, "attempt": 0,
                         "step": 0, "exported": 0, "dropped": 0, "done": False}
                        for sink, target in tracking.items()])
            # The row as inserted, not read back: an ORM object that no session holds (the
            # columns left out read None).
            return Job.from_row(JobRow(id=job_id, **values))
        except IntegrityError:
            taken = (self.job_by_idempotency_key(owner=owner, key=idempotency_key)
                     if idempotency_key else None)
            if taken is None:
                raise
            raise KeyTaken(*taken) from None

    def job_secrets(self, *, job_id: int) -> dict[str, bytes]:
        """A job's sealed secrets by name: for the controller, which opens them for the
        ranks' environment, and the owner's resubmission. Never for an answer."""
        with self._tx() as s:
            rows = s.execute(select(JobSecretRow).where(JobSecretRow.job_id == job_id)
                             .order_by(JobSecretRow.name)).scalars()
            return {r.name: r.sealed for r in rows}

    def secret_names(self, *, job_ids: Sequence[int]) -> dict[int, list[str]]:
        """The names (only) of the secrets of each of `job_ids` that has any, each job's in
        code point order (as a submission's answer lists them, whatever the database's
        collation). One statement outside a transaction (`service.store.engine.reads`)."""
        if not job_ids:
            return {}
        with self._reads.connect() as c:
            return secret_names_in(c, job_ids)

    def job_by_idempotency_key(self, *, owner: str, key: str) -> tuple[Job, str | None] | None:
        """The job `owner` submitted with `key`, and the hash of the request that created
        it (other owners' jobs with that key are not found)."""
        with self._tx() as s:
            row = s.execute(select(JobRow).where(JobRow.owner == owner,
                                                 JobRow.idempotency_key == key)).scalar()
            return None if row is None else (Job.from_row(row), row.request_hash)

    def get_job(self, *, job_id: int) -> Job:
        """One job: one statement outside a transaction (every request on a job reads it)."""
        with self._reads.connect() as c:
            return job_in(c, job_id)

    def list_jobs(self, *, states: Sequence[JobState] | None = None, owner: str | None = None,
                  project: str | None = None, limit: int = 50,
                  offset: int = 0) -> tuple[list[Job], int]:
        where: list[ColumnElement[bool]] = []
        where += [JobRow.state.in_([st.value for st in states])] if states else []
        where += [JobRow.owner == owner] if owner is not None else []
        where += [JobRow.project == project] if project is not None else []
        # A read (`_rx`, one snapshot for the page and its count): no write lock; plain rows.
        with self._rx() as s:
            c = s.connection()
            q = (select(JobRow.__table__).where(*where).order_by(JobRow.id.desc())
                 .limit(limit).offset(offset))
            count = select(func.count()).select_from(JobRow).where(*where)
            return ([Job.from_row(r) for r in c.execute(q)],  # type: ignore[arg-type]
                    int(c.execute(count).scalar_one()))

    def queued_jobs(self, *, limit: int | None = None, offset: int = 0) -> list[Job]:
        """Queued jobs in admission order: priority first, then age (a page of them)."""
        with self._tx() as s:
            rows = s.execute(select(JobRow).where(JobRow.state == JobState.QUEUED.value)
                             .order_by(JobRow.priority.desc(), JobRow.id)
                             .limit(limit).offset(offset)).scalars()
            return [Job.from_row(r) for r in rows]

    def active_jobs(self) -> list[Job]:
        with self._tx() as s:
            active = [st.value for st in JobState if st.active]
            rows = s.execute(select(JobRow).where(JobRow.state.in_(active))
                             .order_by(JobRow.id)).scalars()
            return [Job.from_row(r) for r in rows]

    def transition(self, *, job_id: int, to: JobState, message: str,
                   expect: Sequence[JobState] | None = None, error: str | None = None,
                   data: dict[str, Any] | None = None, attempt: int | None = None,
                   unless_cancelled: bool = False) -> Job:
        """Move a job to `to`, check that the move is allowed, and record the event.

        `expect` guards against races: when the current state is not one of them, nothing
        changes and TransitionError is raised. So does `unless_cancelled` when a cancel has
        been requested (a job asked to stop never reports that it started).
        """
        with self._tx() as s:
            row = self._lock_job(s, job_id)
            current = JobState(row.state)
            if expect is not None and current not in expect:
                raise TransitionError(
                    f"job {job_id} is {current}, expected one of {', '.join(expect)}")
            if unless_cancelled and row.cancel_requested:
                raise TransitionError(f"job {job_id}: cancel requested; not moved to {to}")
            check_transition(current, to)
            now = utcnow()
            row.state = to.value
            row.updated_at = now
            if to == JobState.RUNNING and row.started_at is None:
                row.started_at = now
            if to.terminal:
                row.finished_at = now
            if current == JobState.PREEMPTED and to == JobState.QUEUED:
                row.preemptions = (row.preemptions or 0) + 1  # its attempt spent no retry
            if error is not None:
                row.error = error
            s.add(EventRow(job_id=job_id, attempt=attempt, kind="state", message=message,
                           data={"from": current.value, "to": to.value, **(data or {})}))
            return Job.from_row(row)

    def request_cancel(self, *, job_id: int) -> Job:
        """Flag a job for cancellation; a queued job is cancelled at once."""
        with self._tx() as s:
            row = self._lock_job(s, job_id)
            current = JobState(row.state)
            if current.terminal:
                raise TransitionError(f"job {job_id} is already {current}")
            if row.cancel_requested:
                return Job.from_row(row)
            row.cancel_requested = True
            row.updated_at = utcnow()
            s.add(EventRow(job_id=job_id, kind="cancel", message="cancel requested", data={}))
            if current == JobState.QUEUED:
                row.state = JobState.CANCELLED.value
                row.finished_at = row.updated_at
                s.add(EventRow(job_id=job_id, kind="state", message="cancelled while queued",
                               data={"from": current.value, "to": JobState.CANCELLED.value}))
            return Job.from_row(row)

    # --- attempts ---------------------------------------------------------------------------

    def start_attempt(self, *, job_id: int, fence: Fence | None = None) -> Job:
        """Open the next attempt of a job; the job back, `attempts` being the new attempt's
        number (1-based). With a `fence`, only while its holder holds that lease (NotHolder)."""
        with self._tx() as s:
            if fence is not None:
                self._check_fence(s, fence)
            row = self._lock_job(s, job_id)
            row.attempts += 1
            s.add(AttemptRow(job_id=job_id, number=row.attempts,
                             status=AttemptStatus.RUNNING.value))
            return Job.from_row(row)

    def end_attempt(self, *, job_id: int, number: int, status: AttemptStatus,
                    error: str | None = None) -> None:
        with self._tx() as s:
            s.execute(update(AttemptRow)
                      .where(AttemptRow.job_id == job_id, AttemptRow.number == number)
                      .values(status=status.value, error=error, ended_at=utcnow()))

    def set_placement(self, *, job_id: int, number: int, placement: dict[str, Any]) -> None:
        with self._tx() as s:
            s.execute(update(AttemptRow)
                      .where(AttemptRow.job_id == job_id, AttemptRow.number == number)
                      .values(placement=placement))

    def list_attempts(self, *, job_id: int) -> list[Attempt]:
        with self._tx() as s:
            rows = s.execute(select(AttemptRow).where(AttemptRow.job_id == job_id)
                             .order_by(AttemptRow.number)).scalars()
            return [attempt_of(r) for r in rows]
