"""Tracking and comparison routes: where a job's steps went (MLflow, TensorBoard), the
server's trackers, and several jobs side by side (`GET /compare`, which `trident compare`
and the comparison page read). Any user may call them (`jobs:read`); a compared spec's `env`
values only where the caller may read them (`jobs:env`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request

from api.auth import Who, may, require
from api.deps import INT32_MAX, JobDep, StoreDep
from api.schemas import (
    ComparedRun,
    Comparison,
    JobTracking,
    PredictedVsMeasured,
    Refusal,
    RunCurves,
    SpecDifference,
    TrackerExport,
    TrackingInfo,
)
from service.store import Job, NotFound
from service.store.tracking_exports import Export, Exports, Sink
from service.tracking.tensorboard_sink import job_dir
from service.views.side_by_side import MAX_JOBS, comparison

router = APIRouter(tags=["tracking"], dependencies=[Depends(require("jobs:read"))])


def _export_out(e: Export, data_dir: Path) -> TrackerExport:
    run_url = directory = None
    if e.sink == Sink.MLFLOW and e.run_id and e.experiment_id:
        run_url = f"{e.target}/#/experiments/{e.experiment_id}/runs/{e.run_id}"
    if e.sink == Sink.TENSORBOARD:
        directory = str(job_dir(data_dir / e.target, e.job_id))
    return TrackerExport(sink=e.sink.value, target=e.target, run_id=e.run_id, run_url=run_url,
                         directory=directory, attempt=e.attempt, step=e.step,
                         exported=e.exported, dropped=e.dropped, state=e.state, done=e.done,
                         error=e.error, failing_since=e.failing_since, updated_at=e.updated_at)


@router.get("/jobs/{job_id}/tracking", response_model=JobTracking)
def job_tracking(job: JobDep, store: StoreDep, request: Request) -> JobTracking:
    """Where the job's steps went: per tracker its run (MLflow) or directory (TensorBoard),
    how far the exporter got, the steps sent and dropped, and the newest failure."""
    data_dir = request.app.state.settings.data_dir
    return JobTracking(job_id=job.id, exports=[_export_out(e, data_dir) for e in
                                               Exports(store).of_job(job_id=job.id)])


@router.get("/tracking", response_model=TrackingInfo)
def tracking_info(request: Request) -> TrackingInfo:
    """The server's trackers: the MLflow server every job goes to, the others a spec may
    name, and where TensorBoard files are written (`trident tensorboard`)."""
    cfg = request.app.state.tracking
    return TrackingInfo(mlflow_uri=cfg.mlflow_uri, mlflow_uris=sorted(cfg.mlflow_allowed),
                        tensorboard_dir=str(cfg.tensorboard_root)
                        if cfg.tensorboard_root is not None else None)


JobIds = Annotated[list[Annotated[int, Query(ge=1, le=INT32_MAX)]], Query(
    min_length=2, max_length=MAX_JOBS,
    description=f"The jobs to compare: 2 to {MAX_JOBS} ids, `jobs=3&jobs=7`.")]


@router.get("/compare", response_model=Comparison,
            responses={404: {"model": Refusal, "description": "A job named does not exist"}})
def compare_jobs(jobs: JobIds, store: StoreDep, who: Who) -> Comparison:
    """Jobs side by side: each one's newest figures and its plan against its measurement,
    the spec fields whose values differ, and every per-step figure (loss, eval_loss,
    step_time_s, tokens_per_s, custom metrics ...) by step and by seconds since it started."""
    if len(set(jobs)) != len(jobs):
        raise HTTPException(status_code=422, detail=[
            {"loc": ["query", "jobs"], "type": "value_error",
             "msg": "a job is named twice; compare distinct jobs"}])
    found: list[Job] = []
    for job_id in jobs:
        try:
            found.append(store.get_job(job_id=job_id))
        except NotFound as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
    heads, diffs, curves, charted = comparison(
        store, found, lambda j: may(who, "jobs:env", j.owner))
    return Comparison(
        runs=[ComparedRun(
            id=h.job.id, name=h.job.name, owner=h.job.owner, state=h.job.state.value,
            layout=h.job.plan.layout.label, world_size=h.job.world_size, step=h.step,
            total_steps=h.job.spec.train.steps, loss=h.loss, loss_nonfinite=h.loss_nonfinite,
            eval_loss=h.eval_loss, mfu=h.mfu, mfu_predicted=h.mfu_predicted, custom=h.custom,
            predicted_vs_measured=PredictedVsMeasured.model_validate(h.predicted_vs_measured),
            ettr=h.ettr)
            for h in heads],
        differences=[SpecDifference(field=f, values=v) for f, v in diffs],
        curves=[RunCurves(job_id=c.job_id, step=c.step, elapsed_s=c.elapsed_s,
                          metrics=c.metrics) for c in curves],
        charted=charted)
