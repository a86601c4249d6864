"""Job views the dashboard draws (and any client may read): downsampled chart series, the
ranks grid, and hang diagnoses with the ranks' stacks grouped."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from api.deps import JobDep, StoreDep
from service.dashboard import MAX_POINTS, job_series, ranks_grid

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.get("/{job_id}/series")
def series(job: JobDep, store: StoreDep,
           max_points: Annotated[int, Query(ge=10, le=MAX_POINTS, description=(
               "The most points per series: longer series keep each bucket's minimum and"
               " maximum of every series."))] = MAX_POINTS) -> dict[str, Any]:
    """Rank 0's loss, step time, tokens/s and MFU per step, downsampled on the server, with
    the plan's predicted step time, tokens/s and MFU; `rows` is the number of steps stored."""
    return job_series(store, job, max_points)


@router.get("/{job_id}/ranks")
def ranks(job: JobDep, store: StoreDep) -> dict[str, Any]:
    """Every rank of the layout (newest attempt): tp/pp/dp coordinates, node and GPU, peak
    memory against the prediction for its stage, compute time against its stage peers,
    stragglers and the ranks a hang waits for."""
    return ranks_grid(store, job)


@router.get("/{job_id}/hangs")
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
            text = str(ev.data.get("stacks", ""))
            out[-1]["stacks"].setdefault(text, []).append(ev.data.get("rank"))
    for h in out:
        h["stacks"] = [{"ranks": sorted(r for r in rs if r is not None), "text": t}
                       for t, rs in sorted(h["stacks"].items(), key=lambda kv: -len(kv[1]))]
    return {"items": out[::-1]}
