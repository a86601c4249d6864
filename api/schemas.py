"""Request and response bodies of the REST API (separate from the database models)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from service.store import Attempt, Event, Job, Metric


class JobOut(Job):
    """A job as the API shows it: the stored `Job` without its per-rank claim."""

    cpus: float = Field(exclude=True)
    gpus: float = Field(exclude=True)
    predicted_vs_measured: dict[str, Any] | None = None
    """Step time, tokens/s and memory: the plan's prediction and the measurement (detail
    view only)."""

    @classmethod
    def of(cls, job: Job, predicted_vs_measured: dict[str, Any] | None = None) -> JobOut:
        return cls(**dict(job), predicted_vs_measured=predicted_vs_measured)


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
