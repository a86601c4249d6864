"""`trident stacks`: requests for a running job's Python stacks, and their answers.

The API never calls Ray: `POST /jobs/{id}/stacks` stores a request here (pending), the
controller's pass (`service.control.stack_collect`) asks every rank of the job's live group for its
threads' stacks beside its loop, and stores the answer grouped (ranks with identical stacks
together); `GET /jobs/{id}/stacks/{request_id}` reads it back. Everything is bounded: at most
`MAX_OPEN` requests of a job wait at once, a job keeps its newest `KEEP_PER_JOB` requests,
and `service.control.stack_collect` bounds the answer's size. This module keeps the queries of the
`stack_requests` table (migration 0009, declared with every other table in
`service.store.tables`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    delete,
    func,
    select,
)

from client.payloads import StackRequest, StackStatus
from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import JobRow, StackRequestRow, utcnow
from service.store.views import NotFound, aware

MAX_OPEN = 4
"""Requests of one job that may wait (pending or being collected) at once; one more is refused."""
KEEP_PER_JOB = 20
"""Requests kept per job: making one deletes the oldest answered ones beyond this."""


OPEN = (StackStatus.PENDING.value, StackStatus.RUNNING.value)


def request_of(r: StackRequestRow) -> StackRequest:
    return StackRequest(id=r.id, job_id=r.job_id, attempt=r.attempt,
                        status=StackStatus(r.status), requested_by=r.requested_by,
                        result=r.result or {}, error=r.error,
                        created_at=aware(r.created_at) or r.created_at,
                        finished_at=aware(r.finished_at))


class TooManyOpen(Exception):
    """The job already has `MAX_OPEN` requests waiting."""


class StackRequests(EngineTx):
    """The `stack_requests` table: made by the API, taken and answered by the controller."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def create(self, *, job_id: int, requested_by: str | None) -> StackRequest:
        """A pending request; TooManyOpen when the job has `MAX_OPEN` waiting already. The
        job's row is locked meanwhile, so two concurrent requests count each other."""
        with self._tx() as s:
            if s.execute(select(JobRow.id).where(JobRow.id == job_id)
                         .with_for_update()).scalar() is None:
                raise NotFound(f"job {job_id} not found")
            waiting = s.execute(select(func.count()).select_from(StackRequestRow).where(
                StackRequestRow.job_id == job_id, StackRequestRow.status.in_(OPEN))).scalar_one()
            if waiting >= MAX_OPEN:
                raise TooManyOpen(f"job {job_id} has {waiting} stack requests waiting (at most"
                                  f" {MAX_OPEN}); wait for them to be answered")
            old = s.execute(select(StackRequestRow.id).where(
                StackRequestRow.job_id == job_id, StackRequestRow.status.not_in(OPEN))
                .order_by(StackRequestRow.id.desc()).offset(KEEP_PER_JOB - 1)).scalars().all()
            if old:
                s.execute(delete(StackRequestRow).where(StackRequestRow.id.in_(old)))
            row = StackRequestRow(job_id=job_id, status=StackStatus.PENDING.value,
                                  requested_by=requested_by, result={})
            s.add(row)
            s.flush()
            return request_of(row)

    def get(self, *, job_id: int, request_id: int) -> StackRequest:
        with self._tx() as s:
            row = s.get(StackRequestRow, request_id)
            if row is None or row.job_id != job_id:
                raise NotFound(f"stack request {request_id} of job {job_id} not found")
            return request_of(row)

    def open(self) -> list[StackRequest]:
        """Every request not answered yet, oldest first (few: `MAX_OPEN` per job)."""
        with self._tx() as s:
            rows = s.execute(select(StackRequestRow).where(StackRequestRow.status.in_(OPEN))
                             .order_by(StackRequestRow.id)).scalars()
            return [request_of(r) for r in rows]

    def take(self, *, request_id: int, attempt: int) -> None:
        """The controller is collecting the answer from `attempt`'s ranks."""
        with self._tx() as s:
            row = s.get(StackRequestRow, request_id)
            if row is not None:
                row.status, row.attempt = StackStatus.RUNNING.value, attempt

    def finish(self, *, request_id: int, result: dict[str, Any] | None = None,
               error: str | None = None) -> None:
        """Answered (`result`), or failed (`error`)."""
        with self._tx() as s:
            row = s.get(StackRequestRow, request_id)
            if row is not None:
                row.status = (StackStatus.FAILED if error else StackStatus.DONE).value
                row.result, row.error, row.finished_at = result or {}, error, utcnow()
