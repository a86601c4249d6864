"""The exporter's cursors: per job and tracker, how far its stored steps went.

A row (`service.store.tables.TrackingExportRow`) is made with its job (`Store.create_job`, from the
trackers `service.submission.intake.submit` chose) and moved on by the exporter
(`service.tracking.exporter`)
only: the MLflow run once it is made, the cursor after each batch sent or dropped, the newest
failure, the job state the tracker was told, and `done`. Every write is one transaction, and
conditional where two exporters could meet (a controller that lost its lease finishing a
send): a run id is stored only over none, a cursor only moves forward. The API reads the rows
(`GET /jobs/{id}/tracking`, `/metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import ColumnElement, and_, case, func, or_, select, update

from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import JobRow, TrackingExportRow, utcnow
from service.store.views import aware


class Sink(StrEnum):
    MLFLOW = "mlflow"
    TENSORBOARD = "tensorboard"


@dataclass(frozen=True)
class Export:
    """One job's export to one tracker, as stored."""

    job_id: int
    sink: Sink
    target: str
    """The MLflow tracking URI, or `tensorboard` (the job's files are in
    `<data_dir>/tensorboard/job-<id>/`)."""
    run_id: str | None
    experiment_id: str | None
    attempt: int
    step: int
    """The cursor: the last (attempt, step) sent or dropped."""
    exported: int
    dropped: int
    state: str | None
    done: bool
    error: str | None
    failing_since: datetime | None
    updated_at: datetime

    @classmethod
    def from_row(cls, r: TrackingExportRow) -> Export:
        return cls(job_id=r.job_id, sink=Sink(r.sink), target=r.target, run_id=r.run_id,
                   experiment_id=r.experiment_id, attempt=r.attempt, step=r.step,
                   exported=r.exported, dropped=r.dropped, state=r.state, done=r.done,
                   error=r.error, failing_since=aware(r.failing_since),
                   updated_at=aware(r.updated_at) or r.updated_at)


def _key(job_id: int, sink: Sink) -> ColumnElement[bool]:
    return and_(TrackingExportRow.job_id == job_id, TrackingExportRow.sink == sink.value)


class Exports(EngineTx):
    """The `tracking_exports` rows, on the store's database."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def pending(self, *, limit: int = 1000) -> list[Export]:
        """Exports not done, oldest job first."""
        with self._tx() as s:
            rows = s.execute(select(TrackingExportRow).where(TrackingExportRow.done.is_(False))
                             .order_by(TrackingExportRow.job_id, TrackingExportRow.sink)
                             .limit(limit)).scalars()
            return [Export.from_row(r) for r in rows]

    def job_states(self, *, job_ids: list[int]) -> dict[int, str]:
        """The state of each of `job_ids` (one query: a round skips a queued job's exports
        without reading the job)."""
        if not job_ids:
            return {}
        with self._tx() as s:
            rows = s.execute(select(JobRow.id, JobRow.state).where(JobRow.id.in_(job_ids)))
            return {int(i): str(st) for i, st in rows}

    def of_job(self, *, job_id: int) -> list[Export]:
        with self._tx() as s:
            rows = s.execute(select(TrackingExportRow)
                             .where(TrackingExportRow.job_id == job_id)
                             .order_by(TrackingExportRow.sink)).scalars()
            return [Export.from_row(r) for r in rows]

    def get(self, *, job_id: int, sink: Sink) -> Export | None:
        with self._tx() as s:
            row = s.get(TrackingExportRow, (job_id, sink.value))
            return None if row is None else Export.from_row(row)

    def opened(self, *, job_id: int, sink: Sink, run_id: str, experiment_id: str | None
               ) -> bool:
        """Store the job's run, unless one is stored already: whether this one was."""
        with self._tx() as s:
            res = s.execute(update(TrackingExportRow)
                            .where(_key(job_id, sink), TrackingExportRow.run_id.is_(None))
                            .values(run_id=run_id, experiment_id=experiment_id,
                                    updated_at=utcnow()))
            return bool(getattr(res, "rowcount", 0))

    def advance(self, *, job_id: int, sink: Sink, attempt: int, step: int, exported: int = 0,
                dropped: int = 0, error: str | None = None) -> bool:
        """Move the cursor to (attempt, step) past `exported` steps sent and `dropped` ones
        refused (`error`: why), and clear the failure; only forward (whether it moved)."""
        c = TrackingExportRow
        ahead = or_(c.attempt < attempt, and_(c.attempt == attempt, c.step < step))
        with self._tx() as s:
            res = s.execute(update(c).where(_key(job_id, sink), ahead).values(
                attempt=attempt, step=step, exported=c.exported + exported,
                dropped=c.dropped + dropped, error=error, failing_since=None,
                updated_at=utcnow()))
            return bool(getattr(res, "rowcount", 0))

    def told(self, *, job_id: int, sink: Sink, state: str, done: bool = False) -> None:
        """The tracker knows the job is `state` (with `done`: and it has everything). It
        answered: an outage's error goes (a refusal's stays until a batch goes)."""
        c = TrackingExportRow
        with self._tx() as s:
            s.execute(update(c).where(_key(job_id, sink)).values(
                state=state, done=done, failing_since=None, updated_at=utcnow(),
                error=case((c.failing_since.is_not(None), None), else_=c.error)))

    def failing(self, *, job_id: int, sink: Sink, error: str,
                since: datetime | None = None) -> None:
        """The tracker did not answer: keep the error, and since when it fails."""
        with self._tx() as s:
            row = s.get(TrackingExportRow, (job_id, sink.value))
            if row is None:
                return
            row.error = error[:4000]
            row.failing_since = row.failing_since or since or utcnow()
            row.updated_at = utcnow()

    def give_up(self, *, job_id: int, sink: Sink, error: str) -> None:
        """Nothing more can be sent (no run could be made, the job is gone): done, with why."""
        with self._tx() as s:
            s.execute(update(TrackingExportRow).where(_key(job_id, sink)).values(
                done=True, error=error[:4000], updated_at=utcnow()))

    def totals(self) -> dict[Sink, tuple[int, int, int]]:
        """Per tracker: steps sent, steps dropped, exports failing now (for `/metrics`)."""
        c = TrackingExportRow
        with self._tx() as s:
            rows = s.execute(select(c.sink, func.sum(c.exported), func.sum(c.dropped),
                                    func.count(c.failing_since)).group_by(c.sink))
            return {Sink(sink): (int(e or 0), int(d or 0), int(f or 0))
                    for sink, e, d, f in rows}
