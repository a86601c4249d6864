"""Job routes under /api/v1/jobs: submit, list, inspect, cancel, events, metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response

from api.deps import (
    AfterStep,
    Attempt,
    EventAfter,
    IdempotencyKey,
    JobDep,
    Offset,
    Rank,
    StoreDep,
)
from api.schemas import (
    AttemptList,
    EventList,
    JobList,
    JobOut,
    MetricList,
    MetricOut,
)
from service.compare import compare
from service.jobs import KeyReused, submit_once
from service.jobs import submit as submit_job
from service.metrics_ingest import MetricsIngest
from service.monitor.comm import comm_view
from service.spec import JobSpec, SpecError
from service.states import JobState, TransitionError

router = APIRouter(prefix="/jobs", tags=["jobs"])

RECENT_STEPS = 1000
"""A job's page compares the plan with rank 0's newest this-many steps (newest attempt)."""


@router.post("", status_code=201, response_model=JobOut,
             responses={200: {"model": JobOut, "description": "A retried submission (same"
                              " Idempotency-Key and spec): the job it created"},
                        409: {"description": "The Idempotency-Key was used with another spec"}})
def submit(spec: JobSpec, store: StoreDep, request: Request, response: Response,
           idempotency_key: IdempotencyKey = None) -> JobOut:
    """Validate and plan a job, then queue it. For `parallel: auto` the stored spec carries
    the layout the search chose (the plan says `chosen_by: search`). With an
    `Idempotency-Key` a retry is safe: it returns the first submission's job."""
    if spec.faults and not request.app.state.settings.allow_faults:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "faults"], "type": "value_error",
             "msg": "fault injection is disabled on this server (TRIDENT_ALLOW_FAULTS)"}])
    try:
        if idempotency_key is None:
            job = submit_job(store, spec)
        else:
            job, created = submit_once(store, spec, idempotency_key)
            if not created:
                response.status_code = 200
    except KeyReused as exc:
        raise HTTPException(status_code=409, detail=[
            {"loc": ["header", "idempotency-key"], "msg": str(exc), "type": "value_error"}],
        ) from None
    except SpecError as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", *exc.field.split(".")], "msg": exc.message,
             "type": "value_error"}]) from None
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "parallel"], "msg": str(exc), "type": "value_error"}]) from None
    return JobOut.of(job)


@router.get("", response_model=JobList)
def list_jobs(store: StoreDep,
              state: Annotated[list[JobState] | None, Query()] = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50,
              offset: Offset = 0) -> JobList:
    """Jobs, newest first; `state` may repeat to select several states."""
    items, total = store.list_jobs(states=state, limit=limit, offset=offset)
    return JobList(items=[JobOut.of(j) for j in items], total=total, limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: JobDep, store: StoreDep) -> JobOut:
    """A job with its plan, and the plan's predictions next to what was measured."""
    # The newest steps only: a job's page costs the same after a day of training as after a
    # minute (`service.metrics_ingest.MetricsIngest.recent_metrics`).
    recent = MetricsIngest(store).recent_metrics(job_id=job.id, limit=RECENT_STEPS)
    return JobOut.of(job, predicted_vs_measured=compare(job.plan, recent))


@router.post("/{job_id}/cancel", response_model=JobOut, status_code=202)
def cancel(job: JobDep, store: StoreDep) -> JobOut:
    """Ask for cancellation; the controller stops the workers within seconds."""
    try:
        return JobOut.of(store.request_cancel(job_id=job.id))
    except TransitionError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None


@router.get("/{job_id}/events", response_model=EventList)
def events(job: JobDep, store: StoreDep,
           after: EventAfter = 0,
           limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> EventList:
    """A job's events after event id `after`, oldest first."""
    return EventList(items=store.list_events(job_id=job.id, after_id=after, limit=limit))


@router.get("/{job_id}/metrics", response_model=MetricList)
def metrics(job: JobDep, store: StoreDep,
            rank: Rank = 0,
            attempt: Attempt = None,
            after_step: AfterStep = 0,
            limit: Annotated[int, Query(ge=1, le=100000)] = 10000) -> MetricList:
    """Per-step metrics of one rank (rank 0 by default), oldest first."""
    rows = store.list_metrics(job_id=job.id, rank=rank, attempt=attempt, after_step=after_step,
                              limit=limit)
    return MetricList(items=[MetricOut.of(m) for m in rows])


@router.get("/{job_id}/attempts", response_model=AttemptList)
def attempts(job: JobDep, store: StoreDep) -> AttemptList:
    """Every attempt of a job: status, placement (node of every rank), error."""
    return AttemptList(items=store.list_attempts(job_id=job.id))


@router.get("/{job_id}/comm")
def comm(job: JobDep, store: StoreDep,
         last: Annotated[int, Query(ge=1, le=10000)] = 100) -> dict[str, Any]:
    """Communication per dimension over the last `last` steps of the newest attempt: time per
    step, fraction of step, bytes, achieved busbw, the plan's predicted share, per-rank
    breakdown, and the bandwidth probe."""
    return comm_view(store, job, last)
