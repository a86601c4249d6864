"""The REST API's bodies as the server builds them: the models are the REST contract's
(`client.payloads`, which a client imports without the server), re-exported here for the
routes; what builds an answer from the store's own types (`job_out_of`, `metric_out_of`) is here,
on the server's side of the contract.
"""

from __future__ import annotations

from typing import Any

from client.payloads import (
    AttemptList,
    AuditList,
    CalibratedProfileOut,
    CheckpointList,
    CheckpointOut,
    ClusterView,
    CommSteps,
    CommView,
    ComparedRun,
    Comparison,
    EventList,
    Hang,
    HangList,
    Health,
    JobList,
    JobOut,
    JobTracking,
    LayoutSearch,
    LogPage,
    Measured,
    MeasuredMemory,
    MetricList,
    MetricOut,
    NewToken,
    NodeInfo,
    NodeJob,
    Number,
    Placement,
    PlanOut,
    PredictedVsMeasured,
    ProbeList,
    ProbeSummary,
    ProjectList,
    RankCell,
    RanksGrid,
    Refusal,
    RunCurves,
    Series,
    SpecDifference,
    StackAnswer,
    TimeSplit,
    TokenList,
    TrackerExport,
    TrackingInfo,
    UserList,
    WhoAmI,
)
from service.store import Job, Metric
from service.store.dashboard import JobSummary

__all__ = [
    "AttemptList",
    "AuditList",
    "CheckpointList",
    "CheckpointOut",
    "CalibratedProfileOut",
    "ClusterView",
    "CommSteps",
    "CommView",
    "ComparedRun",
    "Comparison",
    "EventList",
    "Hang",
    "HangList",
    "Health",
    "JobList",
    "JobOut",
    "JobTracking",
    "LayoutSearch",
    "LogPage",
    "Measured",
    "MeasuredMemory",
    "MetricList",
    "MetricOut",
    "NewToken",
    "NodeInfo",
    "NodeJob",
    "Number",
    "Placement",
    "PlanOut",
    "PredictedVsMeasured",
    "ProbeList",
    "ProbeSummary",
    "ProjectList",
    "RankCell",
    "RanksGrid",
    "Refusal",
    "RunCurves",
    "Series",
    "SpecDifference",
    "StackAnswer",
    "TimeSplit",
    "TokenList",
    "TrackerExport",
    "TrackingInfo",
    "UserList",
    "WhoAmI",
    "job_out_of",
    "metric_out_of",
]


def job_out_of(job: Job, predicted_vs_measured: dict[str, Any] | None = None,
               summary: JobSummary | None = None, *, shows_env: bool = True,
               secrets: list[str] | None = None) -> JobOut:
    """A job's answer for a reader: `shows_env` False for one who may not read its `env`."""
    hidden: list[str] = []
    if not shows_env and job.spec.env:
        hidden = sorted(job.spec.env)
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"env": {}})})
    extra: dict[str, Any] = {"secrets": secrets or [], "env_hidden": hidden}
    if summary is not None:
        extra.update(total_steps=summary.total_steps, restarts=summary.restarts,
                     queue_position=summary.queue_position, reason=summary.reason,
                     eval_loss=summary.eval_loss)
        if (m := summary.latest) is not None:
            extra.update(step=m.step, loss=m.loss, step_time_s=m.step_time_s,
                         loss_nonfinite=m.report.loss_nonfinite,
                         reported_at=m.time, lr=m.lr, grad_norm=m.grad_norm,
                         tokens=m.report.tokens, epoch=m.report.epoch)
    # The fields as they are (`dict(job)` walked pydantic's iterator, once per job).
    return JobOut(**job.__dict__, predicted_vs_measured=predicted_vs_measured, **extra)


def metric_out_of(m: Metric) -> MetricOut:
    """One rank's stored step as the API shows it."""
    d = m.data
    return MetricOut(attempt=m.attempt, step=m.step, rank=m.rank, loss=m.loss,
                     loss_nonfinite=bool(d.get("loss_nonfinite")), step_time_s=m.step_time_s,
                     tokens_per_s=m.tokens_per_s, lr=m.lr,
                     grad_norm=m.grad_norm, memory=d.get("memory", {}), time=m.time,
                     eval_loss=d.get("eval_loss"), tokens=d.get("tokens"), epoch=d.get("epoch"),
                     first_sample=d.get("first_sample"), batch=d.get("batch"),
                     drawn=d.get("drawn"))
