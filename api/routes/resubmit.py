"""`POST /api/v1/jobs/{id}/resubmit`: a new job from a stored one, its spec changed by `set`,
or started from its checkpoint on another layout (`from_checkpoint`); checked as a new
submission is (`api.routes.jobs`). Starting from a checkpoint hands the new job's owner the
source's weights: it needs the rights an export needs (`api.auth.check_weights`). The new job
carries what of the source its caller may read: its `env` values (`jobs:env`), its secrets
(its owner only)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.auth import Who, check_owner, check_weights, may, require
from api.deps import JobDep, StoreDep
from api.routes.jobs import CHECKS_BUSY, job_out, queue_job, submitter
from api.schemas import JobOut
from service.contract.spec import JobSpec
from service.contract.spec_limits import recheck
from service.contract.specfile import set_field
from service.store import Job, NotFound, Store
from service.store.checkpoints import CheckpointIndex
from service.store.dashboard import summary_of
from service.store.identity import Principal

router = APIRouter(prefix="/jobs", tags=["jobs"])


class ResubmitIn(BaseModel):
    """What a resubmission changes (no body: the stored spec as it is)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    from_checkpoint: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    """Start from this job's checkpoint: 0 its newest tag, N its tag of step N (one that
    `GET /jobs/{id}/checkpoints` lists). Whoever may export the job's weights may (admins
    any job's, members their own jobs'); its folder is only read, the new job writes into a
    folder of its own. None: start afresh."""
    set: Annotated[dict[Annotated[str, Field(min_length=1, max_length=200,
                                             pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")],
                        Any], Field(max_length=64)] = Field(default_factory=dict)
    """Fields changed from the stored spec, by dotted name, as `--set` gives them:
    `{"parallel.dp": 1, "train.steps": 200}` (64 at most)."""


@router.post("/{job_id}/resubmit", response_model=JobOut, status_code=201,
             dependencies=[Depends(require("jobs:resubmit"))], responses=CHECKS_BUSY)
def resubmit(job: JobDep, store: StoreDep, request: Request, who: Who,
             body: ResubmitIn | None = None) -> JobOut:
    """Queue a new job with this job's stored spec (with the body's `set` applied), under
    its project (or the caller's default), owned by the caller; checked as a new submission.
    Members resubmit only their own jobs. `from_checkpoint`: a new job from this job's
    checkpoint, on any layout or cluster size `set` gives it, for whoever may export the
    job's weights (admins, its owner: a 403 naming `jobs:export` otherwise); its
    `checkpoint.dir` is not carried over, the new job writes into its own folder. A stored
    `checkpoint.resume_from` that names another job is held to the same rule. The job's
    `env` values go with it when the caller may read them, its secrets when its owner
    resubmits (an admin resubmitting another user's job gets a job without them: they stay
    their owner's)."""
    body = body or ResubmitIn()
    if body.from_checkpoint is None:
        check_owner(who, "jobs:resubmit", job.owner)
    else:
        check_weights(who, job.owner, FROM_CHECKPOINT)
    try:  # stored before a limit it fails was added: refused as a new submission would be
        spec = _readable(job, recheck(job.spec), who)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    if body.set or body.from_checkpoint is not None:
        spec = _changed(store, job, spec, body)
    if (rf := spec.checkpoint.resume_from) is not None and rf.job != job.id:
        source = _source(store, rf.job, "checkpoint.resume_from")  # carried over: still there
        check_weights(who, source.owner, FROM_CHECKPOINT)
    if who.name == job.owner and (sealed := store.job_secrets(job_id=job.id)):
        spec = spec.with_secrets(request.app.state.box.open_all(sealed))
    new, _ = queue_job(store, spec, request, submitter(request, who, job.project),
                       resume_ok=True)
    return job_out(store, new, who, summary=summary_of(store, new, new=True))


FROM_CHECKPOINT = ("starting a job from its checkpoint hands you its weights, as an export"
                   " does")
"""Why a resubmission from another owner's checkpoint is held to `jobs:export`."""


def _readable(job: Job, spec: JobSpec, who: Principal) -> JobSpec:
    """`job`'s `spec` without the `env` values the caller may not read (`jobs:env`, as the
    job's answer hides them): the new job is the caller's, and its answer shows its own."""
    if spec.env and not may(who, "jobs:env", job.owner):
        return spec.model_copy(update={"env": {}})
    return spec


def _source(store: Store, job_id: int, field: str) -> Job:
    try:
        return store.get_job(job_id=job_id)
    except NotFound as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", *field.split(".")], "msg": str(exc), "type": "value_error"}],
        ) from None


def _changed(store: Store, job: Job, spec: JobSpec, body: ResubmitIn) -> JobSpec:
    """`spec` with the body's `set` applied and, with `from_checkpoint`, the tag it starts
    from; 422s naming the field."""
    raw = spec.model_dump(mode="json", exclude_unset=False)
    if body.from_checkpoint is not None:
        tags = [c.step for c in CheckpointIndex(store).list(job_id=job.id)]
        step = body.from_checkpoint or (tags[-1] if tags else 0)
        if step not in tags:
            have = ", ".join(map(str, tags)) or "none"
            raise HTTPException(status_code=422, detail=[
                {"loc": ["body", "from_checkpoint"], "type": "value_error",
                 "msg": f"job {job.id} has no checkpoint" + (f" of step {step}" if step else "")
                 + f" (its tags: {have})"}])
        raw["checkpoint"]["dir"] = None  # the source's folder: read, never written
        raw["checkpoint"]["resume_from"] = {"job": job.id, "step": step}
    for name, value in body.set.items():
        set_field(raw, name, value)
    try:
        return recheck(JobSpec.model_validate(raw))
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": _set_loc(e["loc"], body.set)}
                                      for e in exc.errors()]) from None


def _set_loc(loc: tuple[Any, ...], sets: dict[str, Any]) -> tuple[Any, ...]:
    """Where an error of the changed spec is: `body.set.<field>` when a `set` made it."""
    dotted = ".".join(str(p) for p in loc)
    for name in sets:
        if dotted == name or dotted.startswith(name + ".") or name.startswith(dotted + "."):
            return ("body", "set", name)
    return ("body", *loc)
