"""`trident profile`: requests to profile a running job's ranks, and the traces stored.

Like `service.store.stack_requests`: the API stores a request (pending), the controller's pass
(`service.control.profile_collect`) has the named ranks profile their next steps and stores the
traces as files (`service.files.profiles`), listed in the request's `result`. At most
`PROFILE_MAX_OPEN` requests of a job wait at once; a job keeps its newest `KEEP_PER_JOB`
requests, and its files within `PROFILE_MAX_JOB_BYTES` (the collector drops the oldest).
The `profile_requests` table is migration 0022.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, select

from client.payloads import (
    PROFILE_MAX_JOB_BYTES,
    PROFILE_MAX_OPEN,
    PROFILE_MAX_TRACE_BYTES,
    ProfileFile,
    ProfileRequest,
    StackStatus,
)
from service.store.engine import EngineTx
from service.store.stack_requests import OPEN, TooManyOpen
from service.store.store import Store
from service.store.tables import JobRow, ProfileRequestRow, utcnow
from service.store.views import NotFound, aware

KEEP_PER_JOB = 20
"""Requests kept per job: making one deletes the oldest answered ones beyond this."""

__all__ = ["KEEP_PER_JOB", "PROFILE_MAX_JOB_BYTES", "PROFILE_MAX_TRACE_BYTES", "ProfileRequest",
           "ProfileRequests", "StackStatus", "TooManyOpen", "request_of", "stored_bytes"]


def request_of(r: ProfileRequestRow) -> ProfileRequest:
    res = r.result or {}
    return ProfileRequest(
        id=r.id, job_id=r.job_id, attempt=r.attempt, status=StackStatus(r.status),
        requested_by=r.requested_by, steps=r.steps, ranks=list(r.ranks), memory=r.memory,
        files=[ProfileFile.model_validate(f) for f in res.get("files", [])],
        profiled_steps=res.get("steps", {}), missing=res.get("missing", []),
        left_out=res.get("left_out", []), dropped=res.get("dropped"), error=r.error,
        created_at=aware(r.created_at) or r.created_at, finished_at=aware(r.finished_at))


def stored_bytes(requests: list[ProfileRequest]) -> int:
    return sum(f.bytes for r in requests for f in r.files)


class ProfileRequests(EngineTx):
    """The `profile_requests` table: made by the API, taken and answered by the controller."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    def create(self, *, job_id: int, requested_by: str | None, steps: int, ranks: list[int],
               memory: bool) -> ProfileRequest:
        """A pending request; TooManyOpen when the job has `PROFILE_MAX_OPEN` waiting already
        (the job's row locked meanwhile, so that concurrent requests count each other)."""
        with self._tx() as s:
            if s.execute(select(JobRow.id).where(JobRow.id == job_id)
                         .with_for_update()).scalar() is None:
                raise NotFound(f"job {job_id} not found")
            waiting = s.execute(select(func.count()).select_from(ProfileRequestRow).where(
                ProfileRequestRow.job_id == job_id, ProfileRequestRow.status.in_(OPEN))
            ).scalar_one()
            if waiting >= PROFILE_MAX_OPEN:
                raise TooManyOpen(f"job {job_id} has {waiting} profile requests waiting (at"
                                  f" most {PROFILE_MAX_OPEN}); wait for their traces")
            old = s.execute(select(ProfileRequestRow.id).where(
                ProfileRequestRow.job_id == job_id, ProfileRequestRow.status.not_in(OPEN))
                .order_by(ProfileRequestRow.id.desc()).offset(KEEP_PER_JOB - 1)).scalars().all()
            if old:  # their files go with the collector's next store (`ProfileFiles.prune`)
                s.execute(delete(ProfileRequestRow).where(ProfileRequestRow.id.in_(old)))
            row = ProfileRequestRow(job_id=job_id, status=StackStatus.PENDING.value,
                                    requested_by=requested_by, steps=steps, ranks=ranks,
                                    memory=memory, result={})
            s.add(row)
            s.flush()
            return request_of(row)

    def get(self, *, job_id: int, request_id: int) -> ProfileRequest:
        with self._tx() as s:
            row = s.get(ProfileRequestRow, request_id)
            if row is None or row.job_id != job_id:
                raise NotFound(f"profile request {request_id} of job {job_id} not found")
            return request_of(row)

    def of_job(self, job_id: int) -> list[ProfileRequest]:
        """The job's requests, newest first (at most `KEEP_PER_JOB` and those waiting)."""
        with self._tx() as s:
            rows = s.execute(select(ProfileRequestRow).where(
                ProfileRequestRow.job_id == job_id).order_by(ProfileRequestRow.id.desc())
            ).scalars()
            return [request_of(r) for r in rows]

    def open(self) -> list[ProfileRequest]:
        """Every request not answered yet, oldest first."""
        with self._tx() as s:
            rows = s.execute(select(ProfileRequestRow).where(
                ProfileRequestRow.status.in_(OPEN)).order_by(ProfileRequestRow.id)).scalars()
            return [request_of(r) for r in rows]

    def take(self, *, request_id: int, attempt: int) -> None:
        """The controller has the ranks of `attempt` profiling."""
        with self._tx() as s:
            row = s.get(ProfileRequestRow, request_id)
            if row is not None:
                row.status, row.attempt = StackStatus.RUNNING.value, attempt

    def finish(self, *, request_id: int, result: dict[str, Any] | None = None,
               error: str | None = None) -> None:
        """Answered: done when it stored a file, else failed with `error`."""
        with self._tx() as s:
            row = s.get(ProfileRequestRow, request_id)
            if row is not None:
                done = bool((result or {}).get("files"))
                row.status = (StackStatus.DONE if done else StackStatus.FAILED).value
                row.result, row.error, row.finished_at = result or {}, error, utcnow()

    def drop(self, *, request_id: int, why: str) -> None:
        """The request's files were removed (`why`): it lists none any more."""
        with self._tx() as s:
            row = s.get(ProfileRequestRow, request_id)
            if row is not None:
                row.result = {**(row.result or {}), "files": [], "dropped": why}
