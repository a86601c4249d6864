"""An elastic job's moves in the store (`service.policy.elastic_replan` decides them,
`Rescaling.down` and
`Rescaling.up` in `service.control.rescaling` carry them out): the queued jobs that ran before,
which a re-plan looks at, and the change of a job's layout (its spec, plan and world size, with
`jobs.elastic`), said by an `elastic` event in the same transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from service.contract.spec import JobSpec
from service.contract.states import JobState, TransitionError
from service.planner.stored import StoredPlan
from service.store.engine import EngineTx
from service.store.store import Job, NotFound, Store
from service.store.tables import EventRow, JobRow, utcnow


class ElasticMoves(EngineTx):
    """The `jobs` rows of elastic moves, on the store's transactions (one per call)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def requeued(self, *, limit: int) -> list[Job]:
        """Queued jobs that ran before (a lost, moved or preempted attempt), in admission
        order."""
        with self._tx() as s:
            rows = s.execute(select(JobRow).where(JobRow.state == JobState.QUEUED.value,
                                                  JobRow.attempts > 0)
                             .order_by(JobRow.priority.desc(), JobRow.id)
                             .limit(limit)).scalars()
            return [Job.from_row(r) for r in rows]

    def relayout(self, *, job_id: int, expect: JobState, spec: JobSpec, plan: StoredPlan,
                 world_size: int, elastic: dict[str, Any], message: str,
                 data: dict[str, Any], attempt: int | None = None) -> Job:
        """The job's next attempts run `spec` (another layout) with `plan` on `world_size`
        ranks; `elastic` is its state after the move. An `elastic` event says so, in the same
        transaction. TransitionError when the job is no longer in `expect`, or a cancel was
        requested: nothing changes."""
        with self._tx() as s:
            row = s.execute(select(JobRow).where(JobRow.id == job_id)
                            .with_for_update()).scalar()
            if row is None:
                raise NotFound(f"job {job_id} not found")
            if row.state != expect.value or row.cancel_requested:
                raise TransitionError(f"job {job_id} is {row.state} (cancel requested:"
                                      f" {row.cancel_requested}), not {expect}: layout kept")
            row.spec = spec.model_dump(mode="json")
            row.plan = plan.to_json()
            row.world_size = world_size
            row.elastic = elastic
            row.updated_at = utcnow()
            s.add(EventRow(job_id=job_id, attempt=attempt, kind="elastic", message=message,
                           data=data))
            return Job.from_row(row)
