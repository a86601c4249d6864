"""What the store hands out: immutable views of its rows, never ORM objects.

`service.store.store` and its neighbours build them; the API, the controller, the scheduler and
the CLI read them. The views an API answer carries (`Job`, `Event`, `Attempt`, `Probe`,
`Node`) are the REST contract's (`client.payloads`), read here from their rows (`Job.from_row`,
`event_of`, ...), so that the store and the wire share one shape and a client needs nothing
of the store; `Metric` and `CalibratedProfile` are the server's own. A job's spec and plan are
validated once, here, when its row is read: `Job.spec` is the `JobSpec` that runs, `Job.plan`
the typed `StoredPlan`. A spec is read as stored (the limits added after it could have been
written are not enforced, `service.contract.spec_limits`), wherever a `Job` is validated: from its
row, as an API answer, in a client.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from sqlalchemy import Row

from client import payloads
from client.payloads import Attempt, AttemptStatus, Event, Node, Probe, ProbeStatus
from service.contract.hardware import HardwareProfile
from service.contract.spec import JobSpec
from service.contract.spec_limits import STORED
from service.contract.states import JobState
from service.planner.stored import StoredPlan
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


class Job(payloads.Job):
    """A job as stored (`client.payloads.Job`), read from its row."""

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


def event_of(row: EventRow) -> Event:
    return Event(id=row.id, job_id=row.job_id, attempt=row.attempt, time=_utc(row.time),
                 kind=row.kind, message=row.message, data=row.data or {})


def rank_stacks(event: Event) -> tuple[int | None, str]:
    """A `stacks` event's rank and its Python stacks at a hang
    (`service.monitor.attempt.record_stacks`)."""
    return event.data.get("rank"), str(event.data.get("stacks", ""))


@dataclass(frozen=True)
class Metric:
    """One rank's stored step: the columns of a metrics row, and its `data` (the rest of the
    step report) typed as `report`."""

    attempt: int
    step: int
    rank: int
    loss: float | None
    step_time_s: float
    tokens_per_s: float | None
    """None: not known (a command job without a model whose script reports none)."""
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


def attempt_of(r: AttemptRow) -> Attempt:
    return Attempt(number=r.number, status=AttemptStatus(r.status), placement=r.placement,
                   error=r.error, started_at=_utc(r.started_at), ended_at=aware(r.ended_at))


def probe_of(r: ProbeRow) -> Probe:
    return Probe(id=r.id, scope=r.scope, job_id=r.job_id, attempt=r.attempt,
                 status=ProbeStatus(r.status), request=r.request, results=r.results,
                 summary=r.summary, error=r.error, created_at=_utc(r.created_at),
                 finished_at=aware(r.finished_at))


LINK_EVENTS = ("slow_link", "link_ok")
"""A node's events that say whether a probe last found its links slow (`slow_link`) or
healthy (`link_ok`): `service.monitor.links` judges, `Store.mark_slow_link` records."""


def slow_link_event(events: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The node's newest link event when it says slow, else None."""
    for e in reversed(events or []):
        if e.get("kind") in LINK_EVENTS:
            return e if e["kind"] == "slow_link" else None
    return None


def node_of(r: NodeRow) -> Node:
    cordon = None
    state: payloads.NodeState = "ready"
    if r.cordoned_at is not None:
        cordon = payloads.NodeCordon(by=r.cordoned_by or "", at=_utc(r.cordoned_at),
                                     reason=r.cordon_reason or "",
                                     drain_deadline=aware(r.drain_deadline),
                                     drained_at=aware(r.drained_at))
        state = ("cordoned" if r.drain_deadline is None else
                 "drained" if r.drained_at is not None else "draining")
    events = [payloads.NodeEvent(time=_utc(datetime.fromisoformat(e["time"])), kind=e["kind"],
                                 by=e.get("by", ""), message=e.get("message", ""),
                                 data=e.get("data") or {}) for e in r.events or []]
    slow = slow_link_event(r.events)
    slow_link = None if slow is None else events[(r.events or []).index(slow)]
    return Node(node_id=r.node_id, hostname=r.hostname, alive=r.alive,
                updated_at=_utc(r.updated_at), info=r.info, state=state, cordon=cordon,
                events=events, slow_link=slow_link)


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
