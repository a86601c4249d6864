"""`trident profile`: requests to profile a running job's ranks, and the traces stored.

On the base it shares with `service.store.stack_requests` (`service.store.job_requests`):
the API stores a request (pending), the controller's pass (`service.control.profile_collect`)
has the named ranks profile their next steps and stores the traces as files
(`service.files.profiles`), listed in the request's `result`. At most `PROFILE_MAX_OPEN`
requests of a job wait at once; a job keeps its newest `KEEP_PER_JOB` requests, and its files
within `PROFILE_MAX_JOB_BYTES` (the collector drops the oldest).
The `profile_requests` table is migration 0022.
"""

from __future__ import annotations

from typing import Any

from client.payloads import (
    PROFILE_MAX_JOB_BYTES,
    PROFILE_MAX_OPEN,
    PROFILE_MAX_TRACE_BYTES,
    ProfileFile,
    ProfileRequest,
    StackStatus,
)
from service.store.job_requests import KEEP_PER_JOB, JobRequests, TooManyOpen
from service.store.store import Store
from service.store.tables import ProfileRequestRow
from service.store.views import aware

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


class ProfileRequests(JobRequests[ProfileRequest]):
    """The `profile_requests` table: made by the API, taken and answered by the controller.
    The files of the requests that making one deletes go with the collector's next store
    (`ProfileFiles.prune`)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, row=ProfileRequestRow, answer_of=request_of,
                         noun="profile request", max_open=PROFILE_MAX_OPEN)

    def create(self, *, job_id: int, requested_by: str | None, steps: int, ranks: list[int],
               memory: bool) -> ProfileRequest:
        """A pending request (`JobRequests`: at most `PROFILE_MAX_OPEN` wait)."""
        return self._create(job_id=job_id, requested_by=requested_by,
                            waiting_hint="wait for their traces", steps=steps, ranks=ranks,
                            memory=memory)

    def finish(self, *, request_id: int, result: dict[str, Any] | None = None,
               error: str | None = None) -> None:
        """Answered: done when it stored a file, else failed with `error`."""
        self._end(request_id=request_id, done=bool((result or {}).get("files")), result=result,
                  error=error)

    def drop(self, *, request_id: int, why: str) -> None:
        """The request's files were removed (`why`): it lists none any more."""
        with self._tx() as s:
            row = s.get(ProfileRequestRow, request_id)
            if row is not None:
                row.result = {**(row.result or {}), "files": [], "dropped": why}
