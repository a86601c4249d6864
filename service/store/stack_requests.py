"""`trident stacks`: requests for a running job's Python stacks, and their answers.

The API never calls Ray: `POST /jobs/{id}/stacks` stores a request here (pending), the
controller's pass (`service.control.stack_collect`) asks every rank of the job's live group for its
threads' stacks beside its loop, and stores the answer grouped (ranks with identical stacks
together); `GET /jobs/{id}/stacks/{request_id}` reads it back. Everything is bounded: at most
`MAX_OPEN` requests of a job wait at once, a job keeps its newest `KEEP_PER_JOB` requests,
and `service.control.stack_collect` bounds the answer's size. This module keeps the queries of the
`stack_requests` table (migration 0009, declared with every other table in
`service.store.tables`), on the base it shares with `trident profile`'s
(`service.store.job_requests`).
"""

from __future__ import annotations

from typing import Any

from client.payloads import StackRequest, StackStatus
from service.store.job_requests import KEEP_PER_JOB, OPEN, JobRequests, TooManyOpen
from service.store.store import Store
from service.store.tables import StackRequestRow
from service.store.views import aware

MAX_OPEN = 4
"""Requests of one job that may wait (pending or being collected) at once; one more is refused."""

__all__ = ["KEEP_PER_JOB", "MAX_OPEN", "OPEN", "StackRequest", "StackRequests", "StackStatus",
           "TooManyOpen", "request_of"]


def request_of(r: StackRequestRow) -> StackRequest:
    return StackRequest(id=r.id, job_id=r.job_id, attempt=r.attempt,
                        status=StackStatus(r.status), requested_by=r.requested_by,
                        result=r.result or {}, error=r.error,
                        created_at=aware(r.created_at) or r.created_at,
                        finished_at=aware(r.finished_at))


class StackRequests(JobRequests[StackRequest]):
    """The `stack_requests` table: made by the API, taken and answered by the controller."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, row=StackRequestRow, answer_of=request_of,
                         noun="stack request", max_open=MAX_OPEN)

    def create(self, *, job_id: int, requested_by: str | None) -> StackRequest:
        """A pending request (`JobRequests`: at most `MAX_OPEN` wait)."""
        return self._create(job_id=job_id, requested_by=requested_by,
                            waiting_hint="wait for them to be answered")

    def finish(self, *, request_id: int, result: dict[str, Any] | None = None,
               error: str | None = None) -> None:
        """Answered (`result`), or failed (`error`)."""
        self._end(request_id=request_id, done=not error, result=result, error=error)
