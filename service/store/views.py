"""What the store hands out: immutable views of its rows, never ORM objects.

`service.store.jobs` and its neighbours build them; the API, the controller, the scheduler and
the CLI read them.
`Job` is a pydantic model so that the API's `JobOut` can extend it instead of repeating its
fields; the others are frozen dataclasses (FastAPI serialises them as JSON objects). A job's
spec and plan are validated once, here, when its row is read: `Job.spec` is the `JobSpec`
that runs, `Job.plan` the typed `StoredPlan`. A spec is read as stored (the limits added after
it could have been written are not enforced, `service.spec_limits`), wherever a `Job` is
validated: from its row, as an API answer, in a client.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from sqlalchemy import Row

from service.hardware import HardwareProfile
from service.planner.stored import StoredPlan
from service.spec import JobSpec
from service.spec_limits import STORED
from service.states import JobState
from service.store.steps import StepSplit, StoredStep
from service.store.tables import (
    AttemptRow,
    EventRow,
    JobRow,
    MetricRow,
    NodeRow,
    ProbeRow,
    ProfileRow,
)


class NotFound(LookupError):
    """No such job, probe or request (a 404 at the API)."""


def aware(t: datetime | None) -> datetime | None:
    # SQLite drops the zone on the way back; every time we store is UTC.
    if t is not None and t.tzinfo is None:
        return t.replace(tzinfo=UTC)
    return t


def _utc(t: datetime) -> datetime:
    out = aware(t)
    assert out is not None
    return out


class Job(BaseModel):
    """A job as stored: its spec (with the layout it runs), plan, claim and state."""

    model_config = ConfigDict(frozen=True)

    id: int
    name: str
    owner: str
    project: str | None = None
    """The project it was submitted under (None: submitted before projects existed)."""
    state: JobState
    priority: int
    spec: JobSpec
    """The spec as stored at submission, with the layout it runs (`parallel` resolved)."""
    plan: StoredPlan
    world_size: int
    cpus: float
    gpus: float
    cancel_requested: bool
    attempts: int
    error: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    waiting: str | None = None
    """Why it is still queued although it would fit (its project's quota), if it is."""
    preemptions: int = 0
    """Attempts stopped for a job of higher priority; they spend no retry."""
    elastic: dict[str, Any] | None = None
    """An elastic job re-planned (`service.elastic.ElasticState` reads it): the layout it
    was submitted with, and how many of its attempts ended in a move up (no retry spent)."""

    @property
    def moves_up(self) -> int:
        """Attempts stopped to move to a larger layout (elastic `scale_up`): no retry spent."""
        return int((self.elastic or {}).get("moves_up", 0))

    @field_validator("spec", mode="wrap")
    @classmethod
    def _read_as_stored(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                        info: ValidationInfo) -> Any:
        """A spec stored before a limit it fails was added still reads (the controller
        refuses to start it, `service.spec_limits.recheck`). A `JobSpec` is taken as it is:
        it was validated when made (its model checks ran then; an answer's `JobOut` is built
        from a job's validated spec, and ran them again for each job of a page)."""
        if isinstance(value, JobSpec):
            return value
        return handler(JobSpec.model_validate(value,
                                              context={**(info.context or {}), STORED: True}))

    @classmethod
    def from_row(cls, row: JobRow) -> Job:
        """The job of a row: an ORM `JobRow`, or a plain row of the jobs table (`Row`), whose
        job a process keeps while the row stays equal, every column (a job page polled by
        many viewers reads the same rows again; a Job is frozen, and no code changes what it
        holds)."""
        if not isinstance(row, Row):
            return cls._of_row(row)
        key = tuple(row)
        found = _JOBS.get(row.id)
        if found is not None and found[0] == key:
            return found[1]
        job = cls._of_row(row)  # type: ignore[arg-type]  # a row with JobRow's names
        if len(_JOBS) >= PARSED_MAX:
            _JOBS.clear()
        _JOBS[row.id] = (key, job)
        return job

    @classmethod
    def _of_row(cls, row: JobRow) -> Job:
        spec, plan = _parsed(row)
        return cls.model_construct(
            id=row.id, name=row.name, owner=row.owner, project=row.project,
            state=JobState(row.state), waiting=row.waiting,
            priority=row.priority, spec=spec, plan=plan,
            world_size=row.world_size, cpus=row.cpus, gpus=row.gpus,
            cancel_requested=row.cancel_requested, attempts=row.attempts, error=row.error,
            preemptions=row.preemptions or 0,
            elastic=row.elastic,
            created_at=_utc(row.created_at), updated_at=_utc(row.updated_at),
            started_at=aware(row.started_at), finished_at=aware(row.finished_at))


_JOBS: dict[int, tuple[tuple[Any, ...], Job]] = {}
"""Each job's plain row (every column) and its Job (`Job.from_row`), at most `PARSED_MAX`."""
_PARSED: dict[int, tuple[dict[str, Any], dict[str, Any], JobSpec, StoredPlan]] = {}
PARSED_MAX = 4096
"""Jobs whose validated spec and plan a process keeps (`_parsed`)."""


def _parsed(row: JobRow) -> tuple[JobSpec, StoredPlan]:
    """The row's spec and plan, validated once per process: a job's spec and plan never
    change once stored, and validating them was most of a jobs page's CPU. A hit needs the
    stored JSON to be equal to what was validated (not only the id: another database, or a
    row rewritten by hand, is validated afresh); the models are frozen in use (no code
    assigns to them). The cache is emptied when it holds `PARSED_MAX` jobs."""
    found = _PARSED.get(row.id)
    if found is not None and (found[0] is row.spec or found[0] == row.spec) and (
            found[1] is row.plan or found[1] == row.plan):
        return found[2], found[3]
    spec = JobSpec.model_validate(row.spec, context={STORED: True})
    plan = StoredPlan.from_json(row.plan)
    if len(_PARSED) >= PARSED_MAX:
        _PARSED.clear()
    _PARSED[row.id] = (row.spec, row.plan, spec, plan)
    return spec, plan


@dataclass(frozen=True)
class Event:
    id: int
    job_id: int
    attempt: int | None
    time: datetime
    kind: str
    message: str
    data: dict[str, Any]

    @classmethod
    def from_row(cls, row: EventRow) -> Event:
        return cls(id=row.id, job_id=row.job_id, attempt=row.attempt, time=_utc(row.time),
                   kind=row.kind, message=row.message, data=row.data or {})

    def rank_stacks(self) -> tuple[int | None, str]:
        """A `stacks` event's rank and its Python stacks at a hang
        (`service.monitor.attempt.record_stacks`)."""
        return self.data.get("rank"), str(self.data.get("stacks", ""))


@dataclass(frozen=True)
class Metric:
    """One rank's stored step: the columns of a metrics row, and its `data` (the rest of the
    step report) typed as `report`."""

    attempt: int
    step: int
    rank: int
    loss: float | None
    step_time_s: float
    tokens_per_s: float
    data: dict[str, Any]
    time: datetime
    lr: float | None = None
    grad_norm: float | None = None

    @classmethod
    def from_row(cls, r: MetricRow) -> Metric:
        return cls(attempt=r.attempt, step=r.step, rank=r.rank, loss=r.loss,
                   step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s, lr=r.lr,
                   grad_norm=r.grad_norm, data=r.data or {}, time=_utc(r.time))

    @cached_property
    def report(self) -> StoredStep:
        """The step's `data`, typed (`service.store.steps`): read once, on first use."""
        return StoredStep.of(self.data)

    def step_split(self) -> StepSplit | None:
        """Seconds in each dimension's collectives and in compute (None: not timed)."""
        return self.report.split(self.step_time_s)


class AttemptStatus(StrEnum):
    """How an attempt of a job ended (or that it has not)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"
    """The controller restarted and the attempt's worker group was gone."""
    PREEMPTED = "preempted"
    """Stopped (after a checkpoint) for a job of higher priority: no retry spent."""
    MOVED = "moved"
    """Stopped (after a checkpoint) to resume on a larger layout (elastic `scale_up`): no
    retry spent."""


@dataclass(frozen=True)
class Attempt:
    number: int
    status: AttemptStatus
    placement: dict[str, Any]
    """The node (and GPUs) of every rank, as the worker group reported it."""
    error: str | None
    started_at: datetime
    ended_at: datetime | None

    @classmethod
    def from_row(cls, r: AttemptRow) -> Attempt:
        return cls(number=r.number, status=AttemptStatus(r.status), placement=r.placement,
                   error=r.error, started_at=_utc(r.started_at), ended_at=aware(r.ended_at))


class ProbeStatus(StrEnum):
    PENDING = "pending"
    """Requested (`trident probe`); the controller has not started it."""
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Probe:
    """A bandwidth / matmul probe: of one job attempt's groups, or of the whole cluster."""

    id: int
    scope: str
    job_id: int | None
    attempt: int | None
    status: ProbeStatus
    request: dict[str, Any]
    results: list[Any]
    summary: dict[str, Any]
    error: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, r: ProbeRow) -> Probe:
        return cls(id=r.id, scope=r.scope, job_id=r.job_id, attempt=r.attempt,
                   status=ProbeStatus(r.status), request=r.request, results=r.results,
                   summary=r.summary, error=r.error, created_at=_utc(r.created_at),
                   finished_at=aware(r.finished_at))


@dataclass(frozen=True)
class Node:
    """One node of the live cluster, as the controller last saw it."""

    node_id: str
    hostname: str
    alive: bool
    updated_at: datetime
    info: dict[str, Any]
    """`service.inventory.node_inventory`: accelerator, GPUs and their link matrix, CPUs."""

    @classmethod
    def from_row(cls, r: NodeRow) -> Node:
        return cls(node_id=r.node_id, hostname=r.hostname, alive=r.alive,
                   updated_at=_utc(r.updated_at), info=r.info)


@dataclass(frozen=True)
class CalibratedProfile:
    """A hardware profile that a cluster probe calibrated on this cluster."""

    profile: HardwareProfile
    probe_id: int | None
    calibrated_at: datetime

    @classmethod
    def from_row(cls, r: ProfileRow) -> CalibratedProfile:
        # Keys that are no longer profile fields (an older calibration) are dropped.
        names = {f.name for f in fields(HardwareProfile)}
        profile = HardwareProfile.from_json({k: v for k, v in r.profile.items() if k in names})
        return cls(profile=profile, probe_id=r.probe_id, calibrated_at=_utc(r.created_at))

    def to_json(self) -> dict[str, Any]:
        """The profile's fields with `probe_id` and `calibrated_at` (GET /cluster)."""
        return {**self.profile.to_json(), "probe_id": self.probe_id,
                "calibrated_at": self.calibrated_at}
