"""A queued job's waiting reason for its project's quota, kept in step with the scheduler.

The rules (what a job claims, what a project holds, why a job waits) are `service.policy.quota`'s;
this writes their outcome: the reason on the job's row (`waiting`, what `trident status` and
the dashboard show) and, each time it changes, one `quota` event, so a job waiting through
many passes does not flood its events.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from service.contract.states import JobState
from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import EventRow, JobRow, utcnow


class QuotaNotes(EngineTx):
    """Keeps a queued job's waiting reason, and its event, in step with the scheduler."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def note(self, job_id: int, reason: str | None, *, kind: str = "quota",
             data: dict[str, Any] | None = None) -> bool:
        """Set (or with None clear) the job's waiting reason; a new reason is also an event
        (`kind`: `quota`, or `preempted` for a job requeued by a preemption, with `data`). A
        job that is no longer queued gets no new reason. Whether it changed."""
        with self._tx() as s:
            row = s.execute(select(JobRow).where(JobRow.id == job_id).with_for_update()).scalar()
            if row is None or row.waiting == reason or (
                    reason is not None and row.state != JobState.QUEUED.value):
                return False
            was = row.waiting
            row.waiting = reason
            row.updated_at = utcnow()
            if reason is not None:
                s.add(EventRow(job_id=job_id, kind=kind, message=reason,
                               data={"project": row.project, **(data or {})}))
            elif kind == "quota" and was is not None:  # the ledger's end of a quota wait
                s.add(EventRow(job_id=job_id, kind=kind, message="its project's quota no"
                               " longer holds it", data={"project": row.project,
                                                         "cleared": True}))
            return True
