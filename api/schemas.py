"""Request and response bodies of the REST API (separate from the database models)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.dashboard import JobSummary
from service.store import Attempt, Event, Job, Metric


class Refusal(BaseModel):
    """Why a request was refused: one sentence (`api.openapi_refusals`)."""

    detail: str


class JobOut(Job):
    """A job as the API shows it: the stored `Job` without its per-rank claim, with its line
    of the jobs list (newest step, loss, measured step time, restarts, why it waits)."""

    cpus: float = Field(exclude=True)
    gpus: float = Field(exclude=True)
    predicted_vs_measured: dict[str, Any] | None = None
    """Step time, tokens/s and memory: the plan's prediction and the measurement (detail
    view only)."""

    step: int | None = None
    """Rank 0's newest step (any attempt); None before the first report."""
    total_steps: int | None = None
    """`train.steps` of its spec."""
    loss: float | None = None
    """The loss at `step`."""
    step_time_s: float | None = None
    """The measured seconds of `step` (the plan's prediction: `plan.time.step_s`)."""
    reported_at: datetime | None = None
    """When `step` was reported."""
    restarts: int = 0
    """Attempts after the first."""
    queue_position: int | None = None
    """1-based place in the admission order, while queued."""
    reason: str | None = None
    """Why it waits, restarts or failed, in one line."""

    @classmethod
    def of(cls, job: Job, predicted_vs_measured: dict[str, Any] | None = None,
           summary: JobSummary | None = None) -> JobOut:
        extra: dict[str, Any] = {}
        if summary is not None:
            extra = {"total_steps": summary.total_steps, "restarts": summary.restarts,
                     "queue_position": summary.queue_position, "reason": summary.reason}
            if (m := summary.latest) is not None:
                extra.update(step=m.step, loss=m.loss, step_time_s=m.step_time_s,
                             reported_at=m.time)
        return cls(**dict(job), predicted_vs_measured=predicted_vs_measured, **extra)


class JobList(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class EventList(BaseModel):
    items: list[Event]
    """The stored events as they are (`service.views.Event`), oldest first."""


class MetricOut(BaseModel):
    attempt: int
    step: int
    rank: int
    loss: float | None
    step_time_s: float
    tokens_per_s: float
    memory: dict[str, float | str]
    time: datetime

    @classmethod
    def of(cls, m: Metric) -> MetricOut:
        return cls(attempt=m.attempt, step=m.step, rank=m.rank, loss=m.loss,
                   step_time_s=m.step_time_s, tokens_per_s=m.tokens_per_s,
                   memory=m.data.get("memory", {}), time=m.time)


class MetricList(BaseModel):
    items: list[MetricOut]


class AttemptList(BaseModel):
    items: list[Attempt]
