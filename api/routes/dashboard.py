"""Job views the dashboard draws (and any client may read): downsampled chart series, the
ranks grid, and hang diagnoses with the ranks' stacks grouped."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from starlette.concurrency import run_in_threadpool

from api.auth import require
from api.deps import JobDep, JobId, StoreDep, job_of
from api.schemas import CommSteps, HangList, RanksGrid, Series
from service.store import Metric
from service.store.charts import MAX_POINTS, job_series
from service.store.steps import StepSplit
from service.store.views import rank_stacks
from service.views.rank_status import rank_status

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(require("jobs:read"))])


@router.get("/{job_id}/series", response_model=Series)
async def series(job_id: JobId, store: StoreDep,
                 max_points: Annotated[int, Query(ge=10, le=MAX_POINTS, description=(
                     "The most points per series: longer series keep each bucket's minimum"
                     " and maximum of every series."))] = MAX_POINTS) -> dict[str, Any]:
    """Rank 0's loss, step time, tokens/s and MFU per step, downsampled on the server, with
    the plan's predicted step time, tokens/s and MFU; `rows` is the number of steps stored.
    Beside them the validation loss and the recipe's learning rate and gradient norm, on the
    steps that reported them."""
    return await run_in_threadpool(
        lambda: job_series(store, job_of(store, job_id), max_points))


@router.get("/{job_id}/ranks", response_model=RanksGrid)
def ranks(job: JobDep, store: StoreDep) -> dict[str, Any]:
    """Every rank of the layout (newest attempt): tp/pp/dp coordinates, node and GPU, peak
    memory against the prediction for its stage, compute time against its stage peers, the
    seconds since its last heartbeat as the controller saw it (`heartbeat_age_s`, None before
    the first), stragglers and the ranks a hang waits for."""
    return rank_status(store, job).to_json()


@router.get("/{job_id}/comm/steps", response_model=CommSteps)
def comm_steps(job: JobDep, store: StoreDep,
               last: Annotated[int, Query(ge=1, le=200)] = 20) -> dict[str, Any]:
    """Per step of the newest attempt's last `last` steps (timed steps only), the mean over
    ranks of the step time, of its time in TP, PP and DP collectives and of the pipeline
    bubble the ranks measured (`bubble`: the part of their PP time spent waiting for
    neighbouring stages, taken out of `pp`; None when no rank measured it), the rest being
    compute; next to the plan's split (`predicted`: None for a job that is not planned)."""
    t = job.plan.time
    out: dict[str, Any] = {"predicted": None if t is None else {
        "compute": t.compute_s + t.recompute_s + t.elementwise_s + t.optimizer_s
        + t.overhead_s + t.offload_s,
        "tp": t.tp_comm_s, "pp": t.pp_comm_s, "dp": t.dp_comm_s + t.zero3_gather_s,
        "bubble": t.bubble_s, "step": t.step_s}, "steps": []}
    latest = store.latest_metric(job_id=job.id)
    if latest is None:
        return out
    per_step: dict[int, list[tuple[Metric, StepSplit]]] = {}
    for m in store.list_metrics(job_id=job.id, rank=None, attempt=latest.attempt,
                                after_step=max(0, latest.step - last), limit=200 * 4096):
        if (split := m.step_split()) is not None:
            per_step.setdefault(m.step, []).append((m, split))
    for step, ms in sorted(per_step.items()):
        dims = {d: sum(split.dim_s(d) for _, split in ms) / len(ms) for d in ("tp", "pp", "dp")}
        step_s = sum(split.step_time_s for _, split in ms) / len(ms)
        measured = [float(b) for m, _ in ms if (b := m.report.bubble_s) is not None]
        bubble = sum(measured) / len(ms) if measured else None
        # The wait is in the PP collectives' time; a bubble the timer did not see as PP time
        # (a rank without it) comes out of compute instead.
        waits = max(dims["pp"], bubble or 0.0)
        if bubble is not None:
            dims["pp"] = max(0.0, dims["pp"] - bubble)
        out["steps"].append({"step": step, "ranks": len(ms), "step_s": step_s,
                             "compute": max(0.0, step_s - dims["tp"] - dims["dp"] - waits),
                             **dims, "bubble": bubble})
    return out


@router.get("/{job_id}/hangs", response_model=HangList)
def hangs(job: JobDep, store: StoreDep) -> dict[str, Any]:
    """Every hang diagnosis of the job (newest first), each with the ranks' Python stacks
    recorded with it, ranks with identical stacks grouped."""
    events = store.list_events(job_id=job.id, limit=1000)
    out: list[dict[str, Any]] = []
    for ev in events:
        if ev.kind == "hang":
            out.append({"id": ev.id, "attempt": ev.attempt, "time": ev.time,
                        "summary": ev.message, "diagnosis": ev.data, "stacks": {}})
        elif ev.kind == "stacks" and out:
            rank, text = rank_stacks(ev)
            out[-1]["stacks"].setdefault(text, []).append(rank)
    for h in out:
        h["stacks"] = [{"ranks": sorted(r for r in rs if r is not None), "text": t}
                       for t, rs in sorted(h["stacks"].items(), key=lambda kv: -len(kv[1]))]
    return {"items": out[::-1]}
