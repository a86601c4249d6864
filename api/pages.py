"""The web dashboard: server-rendered pages (Jinja2) over the store, plus small fragments the
pages poll to stay live (every 2 s, no full reload).

Pages: jobs (`/`), a job (`/jobs/{id}`, tabs), the what-if planner (`/plan`), the cluster
(`/cluster`) and the queue (`/queue`). Charts and grids load JSON from `/api/v1` (series,
ranks, comm, logs, hangs); the pages only lay them out. Every page needs a log-in (the session
cookie of `/login`, or a Bearer token), and the pages' scripts send the session's CSRF token
with every request that changes something.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlencode

import yaml
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from fastapi.templating import Jinja2Templates

from api.auth import may
from api.deps import INT32_MAX, JobDep, StoreDep
from api.session import page_principal, session_csrf
from client.payloads import Sort
from service.contract.ds_config import deepspeed_config
from service.contract.hardware import PROFILES
from service.contract.states import JobState
from service.files.ranklogs import attempt_log_dir, rank_log_path
from service.store import Job, NotFound
from service.store.budgets import WARN_AT, Budgets, spent_text, worst
from service.store.dashboard import count_by_state, jobs_page, queue, recent_metrics
from service.store.reported import by_script
from service.store.tracking_exports import Exports
from service.tracking.sinks import spec_json
from service.views.memory_gap import memory_by_stage
from service.views.prediction import compare
from service.views.side_by_side import HIDDEN_ENV, MAX_JOBS

# Every page needs a log-in (`api.session`): the session cookie, or a Bearer token.
router = APIRouter(include_in_schema=False, dependencies=[Depends(page_principal)])
templates = Jinja2Templates(directory=pathlib.Path(__file__).parent / "templates")
templates.env.globals["csrf_for"] = session_csrf  # the pages' scripts send it (app.js)

POLL_MS = 2000
"""How often pages poll their fragments (state changes and new steps show within 2 s)."""


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return "-"


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _ago(t: datetime | None) -> str:
    return "-" if t is None else _secs((datetime.now(UTC) - t).total_seconds())


def _duration(job: Any) -> str:
    if job.started_at is None:
        return "-"
    return _secs(((job.finished_at or datetime.now(UTC)) - job.started_at).total_seconds())


def _query_for(query: dict[str, Any], **over: Any) -> str:
    """A jobs-list query string: `query` with `over` replaced (lists repeat their key)."""
    pairs = []
    for k, v in {**query, **over}.items():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, bool):
                x = "true" if x else "false"
            if x not in ("", None):
                pairs.append((k, x))
    return urlencode(pairs)


templates.env.globals["query_for"] = _query_for
templates.env.filters.update(bytes=_bytes, secs=_secs, ago=_ago, duration=_duration,
                             tojson_pretty=lambda v: json.dumps(v, indent=2, default=str))


DEFAULT_SPEC: dict[str, Any] = {
    "name": "what-if", "model": {"preset": "gpt-tiny"},
    "train": {"steps": 30, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
    "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
    "resources": {"gpus_per_worker": 0, "cpus_per_worker": 1},
    "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}}
"""What the what-if page starts from without a job: the demo job."""


States = Annotated[list[JobState] | None, Query(description="Only jobs in these states.")]
Name = Annotated[str, Query(max_length=128, description="Jobs whose name contains this.")]
Owner = Annotated[str, Query(max_length=128, description="Only this owner's jobs.")]
Page = Annotated[int, Query(ge=1, le=INT32_MAX // 200)]
PerPage = Annotated[int, Query(ge=10, le=200)]


def _jobs_context(store: Any, state: list[JobState] | None, name: str, owner: str, sort: Sort,
                  desc: bool, page: int, per_page: int) -> dict[str, Any]:
    items, total = jobs_page(store, states=state or [], name=name, owner=owner, sort=sort.value,
                             desc=desc, limit=per_page, offset=(page - 1) * per_page)
    query = {"state": [s.value for s in state or []], "name": name, "owner": owner,
             "sort": sort.value, "desc": desc, "per_page": per_page}
    return {"items": items, "total": total, "page": page, "per_page": per_page,
            "pages": max(1, -(-total // per_page)), "query": query, "states": list(JobState),
            "selected": {s.value for s in state or []}, "name": name, "owner": owner,
            "sort": sort.value, "desc": desc, "poll_ms": POLL_MS}


@router.get("/", response_class=HTMLResponse)
def jobs(request: Request, store: StoreDep, state: States = None, name: Name = "",
         owner: Owner = "", sort: Sort = Sort.id, desc: bool = True, page: Page = 1,
         per_page: PerPage = 50) -> HTMLResponse:
    """The jobs list: filters, sort, paging, progress; live rows."""
    ctx = _jobs_context(store, state, name, owner, sort, desc, page, per_page)
    ctx["counts"] = count_by_state(store)
    ctx["budgets"] = budget_banner(store, request)
    return templates.TemplateResponse(request, "jobs.html", ctx)


def budget_banner(store: Any, request: Request) -> list[dict[str, Any]]:
    """The projects that spent `WARN_AT` (80 %) of a budget or more: the jobs page's banner,
    each with the budget it spent the most of and what was spent."""
    out = []
    for status in Budgets(store, request.app.state.settings.prices).statuses():
        top = worst(status)
        if top is not None and top[1] >= WARN_AT:
            out.append({"project": status.project, "used": top[1],
                        "text": spent_text(status, top[0], top[2], top[3])})
    return out


@router.get("/ui/jobs/rows", response_class=HTMLResponse)
def job_rows(request: Request, store: StoreDep, state: States = None, name: Name = "",
             owner: Owner = "", sort: Sort = Sort.id, desc: bool = True, page: Page = 1,
             per_page: PerPage = 50) -> HTMLResponse:
    """The rows of one page of the jobs list (what the page polls)."""
    ctx = _jobs_context(store, state, name, owner, sort, desc, page, per_page)
    return templates.TemplateResponse(request, "_job_rows.html", ctx)


def shown_spec(request: Request, job: Job, *, names: bool = True) -> dict[str, Any]:
    """The job's spec as the signed-in user may read it: `env` values for its owner and
    admins only (`jobs:env`; others see the names, or nothing with `names` False, where the
    spec is to be edited and submitted); secrets are in no spec."""
    spec = spec_json(job)
    if spec.get("env") and not may(request.state.principal, "jobs:env", job.owner):
        spec["env"] = {k: HIDDEN_ENV for k in spec["env"]} if names else {}
    return spec


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job: JobDep, store: StoreDep) -> HTMLResponse:
    """One job, in tabs: overview (its goodput ledger, drawn by goodput.js, its trackers and
    its secrets' names), metrics, ranks, communication, logs, hangs."""
    metrics = recent_metrics(store, job)
    return templates.TemplateResponse(request, "job.html", {
        "job": job, "spec_yaml": yaml.safe_dump(shown_spec(request, job), sort_keys=False),
        "plan": job.plan, "measured": compare(job.plan, metrics, script=by_script(job)),
        "memory_by_stage": memory_by_stage(job.plan, store.list_metrics, job.id, metrics),
        "attempts": store.list_attempts(job_id=job.id), "poll_ms": POLL_MS,
        "terminal": job.state.terminal, "exports": Exports(store).of_job(job_id=job.id),
        "secrets": store.secret_names(job_ids=[job.id]).get(job.id, []),
        "ds_config": json.dumps(deepspeed_config(job.spec,
                                                 cuda=job.spec.resources.gpus_per_worker > 0),
                                indent=2, sort_keys=True)})


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, store: StoreDep,
                 jobs: Annotated[list[Annotated[int, Query(ge=1, le=INT32_MAX)]],
                                 Query(min_length=2, max_length=MAX_JOBS)]) -> HTMLResponse:
    """Jobs side by side: their figures, the spec fields that differ, and one chart per
    figure with every job's curve (by step or wall time). Opened from the jobs list."""
    for job_id in jobs:
        try:
            store.get_job(job_id=job_id)
        except NotFound as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
    return templates.TemplateResponse(request, "compare.html", {"ids": jobs})


@router.get("/jobs/{job_id}/logs/rank-{rank}.log")
def download_log(request: Request, job: JobDep,
                 rank: Annotated[int, Path(ge=0, le=INT32_MAX)],
                 attempt: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None,
                 ) -> StreamingResponse:
    """One rank's whole log of one attempt (default the newest) as text."""
    number = attempt or job.attempts
    if rank >= job.world_size or not 1 <= number <= job.attempts:
        raise HTTPException(status_code=404, detail="no such rank or attempt")
    path = rank_log_path(attempt_log_dir(request.app.state.settings.log_root, job.id, number),
                         rank)

    def chunks() -> Iterator[bytes]:
        for p in (path.with_name(path.name + ".1"), path):
            if p.exists():
                with p.open("rb") as f:
                    while block := f.read(1 << 16):
                        yield block

    return StreamingResponse(chunks(), media_type="text/plain; charset=utf-8", headers={
        "Content-Disposition": f'attachment; filename="job-{job.id}-a{number}-rank-{rank}.log"'})


@router.get("/plan", response_class=HTMLResponse)
def plan_page(request: Request, store: StoreDep,
              job: Annotated[int | None, Query(ge=1, le=INT32_MAX)] = None) -> HTMLResponse:
    """The what-if planner: edit model, cluster and layout; see memory and step time split,
    the ranked layouts and the rejected ones; submit. From a job: its spec and measurement."""
    base, measured = None, None
    if job is not None:
        try:
            j = store.get_job(job_id=job)
        except NotFound as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        base = j
        measured = compare(j.plan, recent_metrics(store, j), script=by_script(j))
    return templates.TemplateResponse(request, "plan.html", {
        "job": base, "measured": measured, "profiles": sorted(PROFILES),
        "spec": shown_spec(request, base, names=False) if base else DEFAULT_SPEC})


@router.get("/cluster", response_class=HTMLResponse)
def cluster_page(request: Request, store: StoreDep) -> HTMLResponse:
    """Nodes with GPUs/CPUs and the jobs holding them, link matrices, the jobs' goodput
    totals over a window (`GET /api/v1/goodput`, drawn by goodput.js), the newest probe and
    the calibrated profiles."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for job in store.active_jobs():
        attempts = store.list_attempts(job_id=job.id)
        for r in (attempts[-1].placement.get("ranks", []) if attempts else []):
            holders.setdefault(r.get("node_id", ""), []).append((job.id, r["rank"]))
    probes = store.list_probes(scope="cluster", limit=1)
    profiles = {n: p.to_json() for n in PROFILES if (p := store.get_profile(name=n))}
    return templates.TemplateResponse(request, "cluster.html", {
        "nodes": store.list_nodes(), "holders": holders,
        "probe": probes[0] if probes else None, "profiles": profiles})


@router.get("/queue", response_class=HTMLResponse)
def queue_page(request: Request, store: StoreDep) -> HTMLResponse:
    """Queued jobs in admission order, with position and why each waits."""
    items, total = queue(store)
    return templates.TemplateResponse(request, "queue.html", {"items": items, "total": total,
                                                              "poll_ms": POLL_MS})
