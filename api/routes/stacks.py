"""`trident stacks` over REST: ask a running job's ranks for their Python stacks, read the answer.

The API only stores the request; the controller asks the ranks (`service.control.stack_collect`) and
stores their stacks grouped. Asking is like cancelling (admins: any job; members: their own
jobs), since it interrupts every rank for a moment; reading the answer is reading the job.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from api.auth import Who, check_owner, require
from api.deps import INT32_MAX, JobDep
from api.routes.job_requests import created, found, made_once, running
from api.schemas import Refusal
from service.store.stack_requests import StackRequest, StackRequests

router = APIRouter(prefix="/jobs", tags=["jobs"])

StackRequestId = Annotated[int, Path(ge=1, le=INT32_MAX, description="A stack request's id.")]
Requests = Annotated[StackRequests, Depends(made_once("stack_requests", StackRequests))]


@router.post("/{job_id}/stacks", status_code=202,
             dependencies=[Depends(require("jobs:stacks"))],
             responses={409: {"model": Refusal, "description": "The job is not running"},
                        429: {"model": Refusal,
                              "description": "The job has 4 stack requests waiting"}})
def request_stacks(job: JobDep, requests: Requests, who: Who) -> StackRequest:
    """Ask every rank of a RUNNING job for its Python stacks (all threads); poll
    `GET /jobs/{id}/stacks/{request_id}` until `status` is `done` (or `failed`). 409 when the
    job is not running; 429 when it has 4 requests waiting already."""
    check_owner(who, "jobs:stacks", job.owner)
    running(job, "ask for their stacks")
    return created(lambda: requests.create(job_id=job.id, requested_by=who.name))


@router.get("/{job_id}/stacks/{request_id}", dependencies=[Depends(require("jobs:read"))])
def get_stacks(job: JobDep, requests: Requests, request_id: StackRequestId) -> StackRequest:
    """A stack request and, once `done`, its answer: per thread (the rank's work thread,
    `train`, first) the ranks grouped by identical stack, and the ranks that did not answer."""
    return found(lambda: requests.get(job_id=job.id, request_id=request_id))
