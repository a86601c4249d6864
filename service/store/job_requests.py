"""What `trident stacks` and `trident profile` share: a table of requests about a running job
that the API makes and the controller takes and answers (`service.store.stack_requests`,
`service.store.profile_requests`).

A request is pending, then running (the controller took it for one attempt), then done or
failed. Bounded alike: at most `max_open` requests of a job wait at once (one more is
`TooManyOpen`), and making one deletes the job's oldest answered ones beyond `KEEP_PER_JOB`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from sqlalchemy import delete, func, select

from client.payloads import StackStatus
from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import JobRow, utcnow
from service.store.views import NotFound

KEEP_PER_JOB = 20
"""Requests kept per job: making one deletes the oldest answered ones beyond this."""
OPEN = (StackStatus.PENDING.value, StackStatus.RUNNING.value)
"""The states of a request not answered yet."""

Answer = TypeVar("Answer")
"""The request as the API shows it (`client.payloads.StackRequest`, `ProfileRequest`)."""


class TooManyOpen(Exception):
    """The job already has as many requests waiting as its table allows."""


class JobRequests(EngineTx, Generic[Answer]):
    """One table of requests about running jobs: `row` is its declarative class (with `id`,
    `job_id`, `attempt`, `status`, `requested_by`, `result`, `error`, `finished_at`),
    `answer_of` reads a row as the API shows it, `noun` names a request in messages."""

    def __init__(self, store: Store, *, row: Any, answer_of: Callable[[Any], Answer],
                 noun: str, max_open: int) -> None:
        super().__init__(store)
        self.row, self.answer_of, self.noun, self.max_open = row, answer_of, noun, max_open

    def _create(self, *, job_id: int, requested_by: str | None, waiting_hint: str,
                **fields: Any) -> Answer:
        """A pending request with `fields`; TooManyOpen when the job has `max_open` waiting
        already. The job's row is locked meanwhile, so concurrent requests count each other."""
        row = self.row
        with self._tx() as s:
            if s.execute(select(JobRow.id).where(JobRow.id == job_id)
                         .with_for_update()).scalar() is None:
                raise NotFound(f"job {job_id} not found")
            waiting = s.execute(select(func.count()).select_from(row).where(
                row.job_id == job_id, row.status.in_(OPEN))).scalar_one()
            if waiting >= self.max_open:
                raise TooManyOpen(f"job {job_id} has {waiting} {self.noun}s waiting (at most"
                                  f" {self.max_open}); {waiting_hint}")
            old = s.execute(select(row.id).where(row.job_id == job_id, row.status.not_in(OPEN))
                            .order_by(row.id.desc()).offset(KEEP_PER_JOB - 1)).scalars().all()
            if old:
                s.execute(delete(row).where(row.id.in_(old)))
            made = row(job_id=job_id, status=StackStatus.PENDING.value,
                       requested_by=requested_by, result={}, **fields)
            s.add(made)
            s.flush()
            return self.answer_of(made)

    def get(self, *, job_id: int, request_id: int) -> Answer:
        with self._tx() as s:
            found = s.get(self.row, request_id)
            if found is None or found.job_id != job_id:
                raise NotFound(f"{self.noun} {request_id} of job {job_id} not found")
            return self.answer_of(found)

    def of_job(self, job_id: int) -> list[Answer]:
        """The job's requests, newest first (at most `KEEP_PER_JOB` and those waiting)."""
        with self._tx() as s:
            rows = s.execute(select(self.row).where(self.row.job_id == job_id)
                             .order_by(self.row.id.desc())).scalars()
            return [self.answer_of(r) for r in rows]

    def open(self) -> list[Answer]:
        """Every request not answered yet, oldest first (few: `max_open` per job)."""
        with self._tx() as s:
            rows = s.execute(select(self.row).where(self.row.status.in_(OPEN))
                             .order_by(self.row.id)).scalars()
            return [self.answer_of(r) for r in rows]

    def take(self, *, request_id: int, attempt: int) -> None:
        """The controller is answering it from `attempt`'s ranks."""
        with self._tx() as s:
            found = s.get(self.row, request_id)
            if found is not None:
                found.status, found.attempt = StackStatus.RUNNING.value, attempt

    def _end(self, *, request_id: int, done: bool, result: dict[str, Any] | None,
             error: str | None) -> None:
        with self._tx() as s:
            found = s.get(self.row, request_id)
            if found is not None:
                found.status = (StackStatus.DONE if done else StackStatus.FAILED).value
                found.result, found.error, found.finished_at = result or {}, error, utcnow()
