"""`trident profile` over REST: a running job's ranks run torch.profiler; its traces listed, read.

The API only stores the request; the controller has the named ranks profile their next steps
(`service.control.profile_collect`) and stores the traces with the job
(`service.files.profiles`). Asking is like asking for stacks (rule `jobs:profile`: admins for any
job, members for their own), since it slows the profiled steps; reading the requests and
downloading their files is reading the job.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Who, check_owner, require
from api.deps import INT32_MAX, JobDep
from api.routes.job_requests import created, found, made_once, running
from api.schemas import Refusal
from client.payloads import (
    PROFILE_MAX_OPEN,
    PROFILE_MAX_STEPS,
    ProfileList,
    ProfileRequest,
)
from service.files.profiles import NAME, ProfileFiles, profile_root
from service.store.profile_requests import ProfileRequests, stored_bytes

router = APIRouter(prefix="/jobs", tags=["jobs"])


class ProfileAsk(BaseModel):
    """`POST /jobs/{id}/profile`: which ranks profile how many of their next steps. The
    traces are bounded (`client.payloads`): at most `PROFILE_MAX_TRACE_BYTES` (64 MiB) per
    file, gzipped, and `PROFILE_MAX_JOB_BYTES` (512 MiB) per job, the oldest requests' files
    dropped first."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    steps: int = Field(default=3, ge=1, le=PROFILE_MAX_STEPS)
    """How many of the next steps to profile (1 to 20): every named rank profiles the same
    steps, from the second to start after the request reaches them."""
    ranks: list[int] | None = Field(default=None, max_length=1024)
    """The ranks to profile, each within the job's world size (none: every rank)."""
    memory: bool = False
    """Also record memory: the profiler's allocations and memory timeline and, on CUDA, a
    `torch.cuda.memory._snapshot()`."""

ProfileRequestId = Annotated[int, Path(ge=1, le=INT32_MAX,
                                       description="A profile request's id.")]
FileName = Annotated[str, Path(max_length=80, pattern=NAME.pattern,
                               description="A trace file's name, as the request lists it.")]


Requests = Annotated[ProfileRequests,
                     Depends(made_once("profile_requests", ProfileRequests))]


@router.post("/{job_id}/profile", status_code=202,
             dependencies=[Depends(require("jobs:profile"))],
             responses={409: {"model": Refusal, "description": "The job is not running"},
                        429: {"model": Refusal, "description": f"The job has"
                              f" {PROFILE_MAX_OPEN} profile requests waiting"}})
def request_profile(job: JobDep, requests: Requests, who: Who,
                    body: ProfileAsk | None = None) -> ProfileRequest:
    """Have ranks of a RUNNING job (`ranks`, default all) run torch.profiler over their next
    `steps` steps (with `memory`, their memory too); poll `GET /jobs/{id}/profile/{request_id}`
    until `status` is `done` (or `failed`), then fetch its `files`. 409 when the job is not
    running; 429 when it has 2 requests waiting already; 422 for a rank outside the job."""
    check_owner(who, "jobs:profile", job.owner)
    ask = body or ProfileAsk()
    world = job.spec.world_size
    outside = sorted({r for r in ask.ranks or [] if not 0 <= r < world})
    if outside:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["body", "ranks"], "type": "value_error",
            "msg": f"rank(s) {outside[:8]} outside the job's world size {world} (0 to"
                   f" {world - 1})"}])
    running(job, "profile")
    ranks = sorted(set(ask.ranks)) if ask.ranks else list(range(world))
    return created(lambda: requests.create(job_id=job.id, requested_by=who.name,
                                           steps=ask.steps, ranks=ranks, memory=ask.memory))


@router.get("/{job_id}/profile", dependencies=[Depends(require("jobs:read"))])
def list_profiles(job: JobDep, requests: Requests) -> ProfileList:
    """The job's profile requests, newest first, with their files, and the size bounds."""
    items = requests.of_job(job.id)
    return ProfileList(items=items, stored_bytes=stored_bytes(items))


@router.get("/{job_id}/profile/{request_id}", dependencies=[Depends(require("jobs:read"))])
def get_profile(job: JobDep, requests: Requests,
                request_id: ProfileRequestId) -> ProfileRequest:
    """A profile request and, once `done`, its files (`files`) and steps."""
    return found(lambda: requests.get(job_id=job.id, request_id=request_id))


@router.get("/{job_id}/profile/{request_id}/files/{name}",
            dependencies=[Depends(require("jobs:read"))], response_class=FileResponse,
            responses={200: {"content": {"application/gzip": {}}}})
def get_profile_file(job: JobDep, requests: Requests, request: Request,
                     request_id: ProfileRequestId, name: FileName) -> FileResponse:
    """One trace file of a request, streamed as stored (gzip): Chrome trace JSON
    (`*.pt.trace.json.gz`: Perfetto, TensorBoard's profile plugin), the memory timeline, or
    the CUDA memory snapshot."""
    req = found(lambda: requests.get(job_id=job.id, request_id=request_id))
    files = ProfileFiles(profile_root(request.app.state.settings.data_dir))
    path = files.path(job.id, req.id, name) if name in {f.name for f in req.files} else None
    if path is None:
        raise HTTPException(status_code=404, detail=f"profile request {req.id} of job {job.id}"
                            f" has no file {name!r}" + (f" ({req.dropped})" if req.dropped
                                                        else ""))
    return FileResponse(path, media_type="application/gzip", filename=name)
