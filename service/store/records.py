"""A job's run records: its events (state changes, placements, failures, hangs), as `Store`
writes and reads them, and the per-rank metrics its ranks report, as `Store` reads them.

`RunRecords` is a part of `Store` (`service.store.store`), which inherits its methods and gives
them its engine and transactions, as `ClusterRecords` (`service.store.cluster`) is: callers
keep calling `store.list_events(...)`. Writing the metrics (the controller's
`MetricsIngest.record`), a large job's sampling and the per-step rows are
`service.store.metrics`'s.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.store.tables import EventRow, MetricRow, StepMetricRow
from service.store.views import Event, Metric, event_of


class RunRecords:
    """Events and per-rank metrics; `Store` supplies `_tx` and `_rx`."""

    def _tx(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _rx(self) -> AbstractContextManager[Session]:
        """A read-only transaction (`service.store.engine.EngineTx._rx`)."""
        raise NotImplementedError

    # --- events -----------------------------------------------------------------------------

    def add_event(self, *, job_id: int, kind: str, message: str,
                  data: dict[str, Any] | None = None, attempt: int | None = None) -> None:
        with self._tx() as s:
            s.add(EventRow(job_id=job_id, attempt=attempt, kind=kind, message=message,
                           data=data or {}))

    def list_events(self, *, job_id: int, after_id: int = 0, limit: int = 200) -> list[Event]:
        # A read (`_rx`): a job page's poll must not queue behind a 4,096-rank step's write.
        with self._rx() as s:
            rows = s.execute(select(EventRow)
                             .where(EventRow.job_id == job_id, EventRow.id > after_id)
                             .order_by(EventRow.id).limit(limit)).scalars()
            return [event_of(r) for r in rows]

    def count_events(self, *, job_id: int, kinds: tuple[str, ...]) -> dict[str, int]:
        """How many events of each of `kinds` the job has (every attempt); 0 for none."""
        with self._rx() as s:
            rows = s.execute(select(EventRow.kind, func.count())
                             .where(EventRow.job_id == job_id, EventRow.kind.in_(kinds))
                             .group_by(EventRow.kind)).all()
        counts = dict.fromkeys(kinds, 0)
        counts.update({kind: int(n) for kind, n in rows})
        return counts

    # --- metrics ----------------------------------------------------------------------------

    def list_metrics(self, *, job_id: int, rank: int | None = 0, attempt: int | None = None,
                     after_step: int = 0, limit: int = 10000) -> list[Metric]:
        with self._tx() as s:
            q = select(MetricRow).where(MetricRow.job_id == job_id, MetricRow.step > after_step)
            if rank is not None:
                q = q.where(MetricRow.rank == rank)
            if attempt is not None:
                q = q.where(MetricRow.attempt == attempt)
            q = q.order_by(MetricRow.attempt, MetricRow.step, MetricRow.rank).limit(limit)
            return [Metric.from_row(r) for r in s.execute(q).scalars()]

    def latest_eval(self, *, job_id: int) -> float | None:
        """The validation loss of the job's newest step that evaluated (newest attempt first);
        None when none did."""
        with self._tx() as s:
            return s.execute(select(StepMetricRow.eval_loss)
                             .where(StepMetricRow.job_id == job_id,
                                    StepMetricRow.eval_loss.is_not(None))
                             .order_by(StepMetricRow.attempt.desc(), StepMetricRow.step.desc())
                             .limit(1)).scalar()

    def latest_metric(self, *, job_id: int, rank: int = 0) -> Metric | None:
        """The newest step of the newest attempt of one rank."""
        with self._tx() as s:
            row = s.execute(select(MetricRow)
                            .where(MetricRow.job_id == job_id, MetricRow.rank == rank)
                            .order_by(MetricRow.attempt.desc(), MetricRow.step.desc())
                            .limit(1)).scalar()
            return Metric.from_row(row) if row is not None else None
