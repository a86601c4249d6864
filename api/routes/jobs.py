"""Job routes under /api/v1/jobs: submit, list, inspect, cancel, events, metrics (a
resubmission: `api.routes.resubmit`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.auth import Who, check_owner, identity_of, may, require
from api.deps import (
    AfterStep,
    Attempt,
    EventAfter,
    IdempotencyKey,
    JobDep,
    JobId,
    Offset,
    Rank,
    StoreDep,
    job_of,
    read_hf_configs,
)
from api.schemas import (
    AttemptList,
    CommView,
    EventList,
    JobList,
    JobOut,
    MetricList,
    Refusal,
    job_out_of,
    metric_out_of,
)
from client.payloads import Sort
from service.contract.spec import JobSpec, SpecError
from service.contract.states import JobState, TransitionError
from service.files.data_check import CHECK_SLOTS, ChecksBusy, CheckSlots
from service.monitor.comm import comm_view
from service.planner.search import cpu_bound
from service.store import Job, NotFound, Store
from service.store.budgets import Budgets
from service.store.dashboard import job_page, jobs_page, summary_of
from service.store.identity import Principal
from service.store.metrics import MetricsIngest, Newest
from service.store.reported import by_script
from service.store.tables import NAME_MAX
from service.submission.confine import Confinement
from service.submission.intake import KeyReused, Submitter, submit_once
from service.submission.intake import submit as submit_job
from service.views.memory_gap import memory_by_stage
from service.views.prediction import compare

router = APIRouter(prefix="/jobs", tags=["jobs"])

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""User and project names: letters, digits, '.', '_', '-'."""
ProjectName = Annotated[str | None, Query(
    min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN,
    description="The project to submit under (default: your first project); members only"
    " under their own projects.")]


def submitter(request: Request, who: Principal, project: str | None) -> Submitter:
    """The job's owner and project, and the limits its spec must keep. A member submits only
    under a project of theirs (`who.projects`, read with the token); an admin under any."""
    identity = identity_of(request)
    mine = list(who.projects)
    if project is None:
        if not mine and who.role != "admin":
            raise HTTPException(status_code=403, detail=f"jobs:submit: {who.name} belongs to"
                                " no project; an admin adds them to one")
        project = mine[0] if mine else None
    else:
        try:
            identity.get_project(name=project)
        except NotFound as exc:
            raise HTTPException(status_code=422, detail=[
                {"loc": ["query", "project"], "msg": str(exc), "type": "value_error"}]) from None
        if who.role != "admin" and project not in mine:
            raise HTTPException(status_code=403, detail=(
                f"jobs:submit: members submit only under their own projects; {who.name}"
                f" belongs to {', '.join(mine) or 'none'}, not {project}"))
    settings = request.app.state.settings
    return Submitter(owner=who.name, project=project, confinement=Confinement(
        checkpoint_roots=settings.checkpoint_root_dirs, data_dir=settings.data_dir,
        entrypoint_modules=settings.entrypoint_prefixes, data_roots=settings.data_root_dirs,
        env_allow=settings.env_allowed, order_cache_user_bytes=settings.order_cache_user_bytes,
        admin=who.role == "admin", mlflow_uris=request.app.state.tracking.mlflow_allowed,
        code_roots=settings.code_root_dirs, member_commands=settings.allow_member_commands),
        tracking=request.app.state.tracking,
        box=request.app.state.box, checks=CheckSlots(
            folder=settings.data_dir / CHECK_SLOTS, total=settings.data_checks,
            per_user=settings.data_checks_per_user, wait_s=settings.data_check_wait_s),
        data_dir=settings.data_dir)


def job_out(store: Store, job: Job, who: Principal, *, secrets: list[str] | None = None,
            **kw: Any) -> JobOut:
    """`job` as `who` may read it: `env` values for its owner and admins only
    (`jobs:env`), its secrets by name (`secrets`: the names, known already; read
    otherwise)."""
    names = (secrets if secrets is not None
             else store.secret_names(job_ids=[job.id]).get(job.id, []))
    return job_out_of(job, shows_env=may(who, "jobs:env", job.owner), secrets=names, **kw)


CHECKS_BUSY: dict[int | str, dict[str, Any]] = {
    429: {"model": Refusal, "description": "Every corpus check of the caller's was under way"
          " (TRIDENT_DATA_CHECKS_PER_USER) for TRIDENT_DATA_CHECK_WAIT_S; Retry-After"},
    503: {"model": Refusal, "description": "The database is unavailable or damaged (as on"
          " every route), or every corpus check of the server's was under way"
          " (TRIDENT_DATA_CHECKS) for TRIDENT_DATA_CHECK_WAIT_S; Retry-After"}}
"""A submission's answers when it waited for a corpus check slot in vain
(`service.files.data_check.CheckSlots`)."""

RECENT_STEPS = 1000
"""A job's page compares the plan with rank 0's newest this-many steps (newest attempt)."""


@router.post("", status_code=201, response_model=JobOut,
             dependencies=[Depends(require("jobs:submit")), Depends(read_hf_configs)],
             responses={200: {"model": JobOut, "description": "A retried submission (same"
                              " Idempotency-Key and spec): the job it created"},
                        409: {"description": "The Idempotency-Key was used with another spec"},
                        **CHECKS_BUSY})
async def submit(spec: JobSpec, store: StoreDep, request: Request, response: Response,
                 who: Who, idempotency_key: IdempotencyKey = None,
                 project: ProjectName = None) -> JobOut:
    """Validate and plan a job, then queue it, owned by the caller, under `project`. For
    `parallel: auto` the stored spec carries the layout the search chose (the plan says
    `chosen_by: search`). With an `Idempotency-Key` a retry is safe: it returns the first
    submission's job. `checkpoint.dir` must be a folder of the job's own inside the server's
    checkpoint roots (not a root itself, not in the data directory but under its
    `checkpoints/`, not another job's folder), `entrypoint` under its allowed modules,
    `command` only where the server has code roots (and, for members, allows their
    commands), its `workdir` inside them,
    `env` and `secrets` may not set loader variables (`LD_*`, `PYTHON*`, `PATH`, ...) unless
    an admin submits, and `tracking.mlflow` must be an MLflow server this server allows.
    `secrets` are write-only: stored apart from the spec, sealed, never in an answer (their
    names are, in `secrets`)."""
    return await run_in_threadpool(_submitted, spec, store, request, response, who,
                                   idempotency_key, project)


def _submitted(spec: JobSpec, store: Store, request: Request, response: Response, who: Principal,
               idempotency_key: str | None, project: str | None) -> JobOut:
    job, created = queue_job(store, spec, request, submitter(request, who, project),
                             idempotency_key)
    if not created:
        response.status_code = 200
    # The job in hand (not read again): a new one has no steps, only its queue position,
    # and the secrets this request carried.
    return job_out(store, job, who, summary=summary_of(store, job, new=created),
                   secrets=sorted(spec.secrets) if created else None)


def queue_job(store: Store, spec: JobSpec, request: Request, by: Submitter,
              idempotency_key: str | None = None, *, resume_ok: bool = False
              ) -> tuple[Job, bool]:
    """Submit `spec` as `by`: the job, and whether this call created it; the refusals as
    4xx naming the field. `resume_ok`: the resubmission route checked the spec's
    `checkpoint.resume_from` (the caller may read that job, the tag is there)."""
    if spec.checkpoint.resume_from is not None and not resume_ok:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "checkpoint", "resume_from"], "type": "value_error",
             "msg": "set by POST /api/v1/jobs/{id}/resubmit with from_checkpoint only"
             " (trident resubmit JOB --from-checkpoint)"}])
    _check_priority(spec, request, by)
    _check_budget(store, request, by, idempotency_key)
    if spec.faults and not request.app.state.settings.allow_faults:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "faults"], "type": "value_error",
             "msg": "fault injection is disabled on this server (TRIDENT_ALLOW_FAULTS)"}])
    if spec.program == "light" and not request.app.state.settings.light_ranks:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "program"], "type": "value_error",
             "msg": "the light rank program is disabled on this server (TRIDENT_LIGHT_RANKS)"}])
    try:
        with cpu_bound():  # `parallel: auto` searches: at most API_SEARCH_CPU_S of CPU
            if idempotency_key is None:
                return submit_job(store, spec, by=by), True
            return submit_once(store, spec, idempotency_key, by)
    except ChecksBusy as exc:
        raise HTTPException(status_code=exc.status, detail=exc.message,
                            headers={"Retry-After": "5"}) from None
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


def _check_priority(spec: JobSpec, request: Request, by: Submitter) -> None:
    """A member's job keeps under its project's priority cap and is preemptible (403s
    naming the field and the cap); an admin's is not capped."""
    if by.confinement is not None and by.confinement.admin:
        return
    if not spec.preemptible:
        raise HTTPException(status_code=403, detail="preemptible: only an admin may submit a"
                            " job that is never preempted (preemptible: false)")
    if by.project is None:
        return
    try:
        cap = identity_of(request).get_project(name=by.project).max_priority
    except NotFound:
        return
    if cap is not None and spec.priority > cap:
        raise HTTPException(status_code=403, detail=(
            f"priority: {spec.priority} is above project {by.project}'s cap (max_priority"
            f" {cap}); an admin sets it with trident project quota {by.project}"
            " --max-priority N"))


def _check_budget(store: Store, request: Request, by: Submitter,
                  idempotency_key: str | None) -> None:
    """A project that spent a budget of its gets no new job (a 422 naming the budget and what
    was spent, `service.store.budgets`); a retry of a submission that created its job gets
    that job as ever."""
    if by.project is None or (idempotency_key is not None and store.job_by_idempotency_key(
            owner=by.owner, key=idempotency_key) is not None):
        return
    refusal = Budgets(store, request.app.state.settings.prices).refusal(by.project)
    if refusal is not None:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["query", "project"], "msg": refusal, "type": "value_error"}])


_READ = [Depends(require("jobs:read"))]


@router.get("", response_model=JobList, dependencies=_READ)
async def list_jobs(
        store: StoreDep, who: Who,
        state: Annotated[list[JobState] | None, Query()] = None,
        owner: Annotated[str | None, Query(min_length=1, max_length=NAME_MAX,
                                           description="Only this user's jobs.")] = None,
        project: Annotated[str | None, Query(min_length=1, max_length=NAME_MAX,
                                             description="Only this project's jobs.")] = None,
        name: Annotated[str | None, Query(min_length=1, max_length=NAME_MAX,
                                          description="Jobs whose name contains this.")] = None,
        sort: Annotated[Sort, Query(description="The column to sort by.")] = Sort.id,
        desc: Annotated[bool, Query(description="Descending (default).")] = True,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        offset: Offset = 0) -> JobList:
    """Jobs, newest first unless `sort`/`desc` say otherwise; `state` may repeat to select
    several states. Each carries its newest step, loss, measured step time, restarts and
    the reason it waits or failed (one query for the page's steps, none per job); `env`
    values only where the caller may read them (its own jobs; an admin's: all)."""
    return await run_in_threadpool(_page, store, who, state or (), owner or "",
                                   project or "", name or "", sort, desc, limit, offset)


def _page(store: Store, who: Principal, states: Sequence[JobState], owner: str, project: str,
          name: str, sort: Sort, desc: bool, limit: int, offset: int) -> JobList:
    items, total = jobs_page(store, states=states, owner=owner, project=project, name=name,
                             sort=sort.value, desc=desc, limit=limit, offset=offset)
    names = store.secret_names(job_ids=[it.job.id for it in items])
    return JobList(items=[job_out_of(it.job, summary=it, secrets=names.get(it.job.id),
                                    shows_env=may(who, "jobs:env", it.job.owner))
                          for it in items], total=total, limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobOut, dependencies=_READ)
async def get_job(job_id: JobId, store: StoreDep, who: Who) -> JobOut:
    """A job with its plan, the plan's predictions next to what was measured, and its line
    of the jobs list (newest step, reason). Its `env` values only for its owner and admins
    (others get the names in `env_hidden`); its secrets by name only, to anyone."""
    return await run_in_threadpool(_detail, store, job_id, who)


def _detail(store: Store, job_id: int, who: Principal) -> JobOut:
    try:
        page = job_page(store, job_id)
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    # The newest steps only: a job's page costs the same after a day of training as after a
    # minute (`service.store.metrics.MetricsIngest.recent_metrics`).
    return job_out(store, page.job, who, secrets=page.secrets, summary=page.summary,
                   predicted_vs_measured=compared(store, page.job, page.newest))


_COMPARED: dict[int, tuple[tuple[Any, ...], Any, dict[str, Any]]] = {}


def compared(store: Store, job: Job, newest: Newest | None) -> dict[str, Any]:
    """`compare(plan, newest steps)`, worked out again only when the job has a newer step
    (`newest`, rank 0's newest row, which the page read with the job, says whether it has):
    a job page polled by a hundred viewers every two seconds reads its 1,000 newest rows
    once per new step and process, not once per request. Keyed by the newest row (its id
    and time) and the plan."""
    ingest = MetricsIngest(store)
    key = (newest, id(job.plan))
    found = _COMPARED.get(job.id)
    if found is not None and found[0] == key and found[1] is job.plan:
        return found[2]
    recent = [] if newest is None else ingest.recent_metrics(job_id=job.id,
                                                             limit=RECENT_STEPS)
    out = compare(job.plan, recent, script=by_script(job))
    out["memory_by_stage"] = memory_by_stage(job.plan, store.list_metrics, job.id, recent)
    if len(_COMPARED) >= 1024:
        _COMPARED.clear()
    _COMPARED[job.id] = (key, job.plan, out)
    return out


@router.post("/{job_id}/cancel", response_model=JobOut, status_code=202,
             dependencies=[Depends(require("jobs:cancel"))],
             responses={409: {"model": Refusal,
                              "description": "The job has ended: nothing to cancel"}})
def cancel(job: JobDep, store: StoreDep, who: Who) -> JobOut:
    """Ask for cancellation; the controller stops the workers within seconds. Members cancel
    only their own jobs."""
    check_owner(who, "jobs:cancel", job.owner)
    try:
        moved = store.request_cancel(job_id=job.id)
    except TransitionError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    return job_out(store, moved, who, summary=summary_of(store, moved))


@router.get("/{job_id}/events", response_model=EventList, dependencies=_READ)
async def events(job_id: JobId, store: StoreDep,
                 after: EventAfter = 0,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> EventList:
    """A job's events after event id `after`, oldest first."""
    def read() -> EventList:
        job = job_of(store, job_id)
        return EventList(items=store.list_events(job_id=job.id, after_id=after, limit=limit))

    return await run_in_threadpool(read)


@router.get("/{job_id}/metrics", response_model=MetricList, dependencies=_READ)
def metrics(job: JobDep, store: StoreDep,
            rank: Rank = 0,
            attempt: Attempt = None,
            after_step: AfterStep = 0,
            limit: Annotated[int, Query(ge=1, le=100000)] = 10000) -> MetricList:
    """Per-step metrics of one rank (rank 0 by default), oldest first."""
    rows = store.list_metrics(job_id=job.id, rank=rank, attempt=attempt, after_step=after_step,
                              limit=limit)
    return MetricList(items=[metric_out_of(m) for m in rows])


@router.get("/{job_id}/attempts", response_model=AttemptList, dependencies=_READ)
def attempts(job: JobDep, store: StoreDep) -> AttemptList:
    """Every attempt of a job: status, placement (node of every rank), error."""
    return AttemptList(items=store.list_attempts(job_id=job.id))


@router.get("/{job_id}/comm", response_model=CommView, dependencies=_READ)
def comm(job: JobDep, store: StoreDep,
         last: Annotated[int, Query(ge=1, le=10000)] = 100) -> dict[str, Any]:
    """Communication per dimension over the last `last` steps of the newest attempt: time per
    step, fraction of step, bytes, achieved busbw, the plan's predicted share, per-rank
    breakdown, and the bandwidth probe."""
    return comm_view(store, job, last)
