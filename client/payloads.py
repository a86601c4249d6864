"""The REST API's bodies (`/api/v1`): the contract between `trident`'s server and its clients.

Every answer a route gives has its model here, and so has the part of the store's rows that
an answer carries (a `Job`, an `Event`, an `Attempt`, a `Probe`, a `User`, ...): the server
builds them (`api.schemas` adds its constructors from the store, `service.store.views` reads
its rows into them) and uses them as its routes' `response_model`; `client.TridentClient`
returns them. So a route and a client cannot disagree on a shape. Stored JSON that a client
reads (an attempt's placement, a node's inventory, a probe's summary) has a model here too,
read with its `of`.

This module imports nothing of the server: no SQLAlchemy, no FastAPI, nothing of
`service.store` or `api` (tests/test_imports.py runs `import client` and looks).
What it reads of `service` is the vocabulary both sides share and a user writes: the job
spec (`service.contract.spec`, with its limits), the job states (`service.contract.states`)
and the stored plan (`service.planner.stored`). A rank's log chunk (`Chunk`) is defined here
and read into by the server (`service.files.ranklogs`).

Compatibility, old clients and new servers: a server may add a field to an answer, never
remove, rename or retype one a released client reads; a client ignores a field it does not
know (every model here keeps pydantic's default `extra="ignore"`, or keeps the field with
`extra="allow"`), and a field added to a model here has a default, so that an older server's
answer, which lacks it, still reads. A request body follows the same rule the other way: a
server keeps reading the fields an older client sends. A change that cannot keep to this is
a new route (`/api/v2`), not a change here.

One module: it is the API's vocabulary, which a client reads top to bottom.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from service.contract.spec import JobSpec
from service.contract.spec_limits import STORED
from service.contract.states import JobState
from service.planner.stored import PlannedLayout, StoredPlan


@dataclass(frozen=True)
class Chunk:
    """A piece of one rank's log (`service.files.ranklogs.read_chunk`)."""

    rank: int
    text: str
    next: int
    """The offset to ask for next (`since`)."""
    skipped: int
    """Bytes between `since` and the first byte returned that the cap rotated away."""
    size: int
    """The stream's length so far (bytes written by the rank, including rotated ones)."""
    times: list[float] | None = None
    """With `with_times`: per line of `text` (the last one even if partial), the unix time by
    which it was written."""


# --- what an answer carries of the store's rows -------------------------------------------------

class Job(BaseModel):
    """A job as stored: its spec (with the layout it runs), plan, claim and state (the store
    reads its row into one, `service.store.views.Job`)."""

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
    """An elastic job re-planned (`service.policy.elastic_replan.ElasticState` reads it): the
    layout it
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
        refuses to start it, `service.contract.spec_limits.recheck`). A `JobSpec` is taken as it is:
        it was validated when made (its model checks ran then; an answer's `JobOut` is built
        from a job's validated spec, and ran them again for each job of a page)."""
        if isinstance(value, JobSpec):
            return value
        return handler(JobSpec.model_validate(value,
                                              context={**(info.context or {}), STORED: True}))


@dataclass(frozen=True)
class Event:
    id: int
    job_id: int
    attempt: int | None
    time: datetime
    kind: str
    message: str
    data: dict[str, Any]


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


@dataclass(frozen=True)
class Node:
    """One node of the live cluster, as the controller last saw it."""

    node_id: str
    hostname: str
    alive: bool
    updated_at: datetime
    info: dict[str, Any]
    """`service.cluster.inventory.node_inventory`: accelerator, GPUs and their link matrix, CPUs."""
    state: NodeState = "ready"
    """ready (new ranks may be placed here), cordoned (none are), draining (cordoned, and the
    jobs with ranks here are asked to save and move), drained (a drain found none left)."""
    cordon: NodeCordon | None = None
    """Who cordoned it, when and why, and a drain's deadline; None while it is ready."""
    events: list[NodeEvent] = field(default_factory=list)
    """Its newest events (cordon, drain, drained, uncordon, lemon, slow_link, link_ok), oldest
    first."""
    slow_link: NodeEvent | None = None
    """The `slow_link` event of the probe that last found this node's links slow (a job's
    bandwidth probe, `service.monitor.links`: what they measured, against what, which job);
    None when none did or a later probe found them healthy (a `link_ok` event)."""


NodeState = Literal["ready", "cordoned", "draining", "drained"]


@dataclass(frozen=True)
class NodeCordon:
    """Why no new rank is placed on a node (`trident node cordon|drain`, the lemon rule)."""

    by: str
    """A user's name, or `trident` (the lemon rule)."""
    at: datetime
    reason: str
    drain_deadline: datetime | None = None
    """A drain's: by when the jobs with ranks there are stopped, saved or not."""
    drained_at: datetime | None = None
    """When the controller saw no active job's ranks left there."""


@dataclass(frozen=True)
class NodeEvent:
    """Something that happened to a node: its cordon state, or a probe's verdict on its links."""

    time: datetime
    kind: str
    """cordon, drain, drained, uncordon, lemon, slow_link or link_ok."""
    by: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class User:
    id: int
    name: str
    role: str
    disabled: bool
    projects: list[str]
    """Its projects, the default (the first it joined) first."""
    created_at: datetime


@dataclass(frozen=True)
class Token:
    """A token as listed: never its secret, which is shown once, when it is created."""

    id: int
    user: str
    name: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True)
class Project:
    name: str
    gpu_quota: float | None
    """GPUs its running jobs may hold together (None: no limit)."""
    cpu_quota: float | None
    """CPUs its running CPU-only jobs may hold together (None: no limit)."""
    members: list[str]
    max_priority: int | None = None
    """The highest `priority` its members may give a job (None: no cap; admins are not
    capped)."""
    budget_gpu_hours: float | None = None
    """GPU-hours its jobs may spend from `budget_since` (None: no such budget); at 100 % its
    new jobs are refused (docs/goodput.md)."""
    budget_cpu_hours: float | None = None
    """CPU-hours its ranks without a GPU may spend from `budget_since` (None: none)."""
    budget_cost: float | None = None
    """Money its jobs may spend from `budget_since` at the server's prices (None: none)."""
    budget_since: datetime | None = None
    """Since when its budget is counted (None: it has no budget)."""
    budget_stop_running: bool = False
    """Whether its running jobs are cancelled once a budget is spent (False: they finish)."""


@dataclass(frozen=True)
class AuditEntry:
    id: int
    time: datetime
    actor: str | None
    client: str | None
    method: str
    path: str
    action: str | None
    status: int


class StackStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class StackRequest:
    id: int
    job_id: int
    attempt: int | None
    status: StackStatus
    requested_by: str | None
    result: dict[str, Any]
    error: str | None
    created_at: datetime
    finished_at: datetime | None


class RankCell(BaseModel):
    """One rank of the layout, as measured against the plan: a cell of the ranks grid
    (`GET /jobs/{id}/ranks`, newest attempt), a line of `trident top`, a rank's gauges on
    `/metrics`."""

    model_config = ConfigDict(frozen=True)

    rank: int
    tp: int
    pp: int
    dp: int
    node: str | None
    """Its host name, once placed."""
    gpu: str | None
    """Its GPU indices, comma-separated (None on CPU)."""
    memory_peak_bytes: int | float | None
    """The largest process peak it reported in the window."""
    memory_predicted_bytes: int | float | None
    """The plan's bytes per device for its pipeline stage (the most loaded rank's without
    a per-stage split; None: the job is not planned)."""
    memory_ratio: float | None
    """`memory_peak_bytes` over `memory_predicted_bytes`."""
    compute_s: float | None
    """Median seconds per step outside timed collectives (the step less its collectives)."""
    stage_compute_s: float | None
    """Median of its pipeline stage's ranks' `compute_s`."""
    compute_ratio: float | None
    """`compute_s` over `stage_compute_s`."""
    step: int | None
    step_time_s: float | None
    tp_s: float | None
    pp_s: float | None
    dp_s: float | None
    """Seconds of its newest step in TP, PP and DP collectives (None: not timed)."""
    reported_at: datetime | None
    heartbeat_age_s: float | None
    """Seconds since its last heartbeat as the controller saw it (None before the first)."""
    straggler: bool
    hang_waits_for: bool


# --- the jobs list's sort keys, and an answer's error text in one line -------------------------

class Sort(StrEnum):
    """The jobs list's sort keys (a query parameter of the page and of `GET /jobs`)."""

    id = "id"
    name = "name"
    owner = "owner"
    state = "state"
    created = "created"
    priority = "priority"


def one_line(text: str, width: int = 200) -> str:
    """A message in one line: a traceback's exception line, else its first line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    line = lines[-1] if any(ln.startswith("Traceback") for ln in lines) else lines[0]
    return line if len(line) <= width else line[:width - 3] + "..."


# --- the routes' answers ------------------------------------------------------------------------

Number = int | float
"""A JSON number kept as it was (an int stays an int)."""


class Refusal(BaseModel):
    """Why a request was refused: one sentence (`api.openapi_refusals`)."""

    detail: str


class JobOut(Job):
    """A job as the API shows it: the stored `Job` without its per-rank claim, with its line
    of the jobs list (newest step, loss, measured step time, restarts, why it waits)."""

    # The per-rank claim stays on the server: not in the answer, so None in a client's copy
    # (a JobOut read back from JSON), where `Job` always has it.
    cpus: float | None = Field(default=None, exclude=True)  # type: ignore[assignment]
    """Not in the API's answer: None in a client's copy."""
    gpus: float | None = Field(default=None, exclude=True)  # type: ignore[assignment]
    """Not in the API's answer: None in a client's copy."""
    elastic: dict[str, Any] | None = Field(default=None, exclude=True)
    """Not in the API's answer (the submitted plan it keeps is the size of `plan`): an elastic
    job's moves are its `elastic` events."""
    predicted_vs_measured: PredictedVsMeasured | None = None
    """Step time, tokens/s and memory: the plan's prediction and the measurement (detail
    view only)."""

    step: int | None = None
    """Rank 0's newest step (any attempt); None before the first report."""
    total_steps: int | None = None
    """`train.steps` of its spec."""
    loss: float | None = None
    """The loss at `step`."""
    loss_nonfinite: bool = False
    """True when the loss at `step` was NaN or infinite (`loss` is then null)."""
    lr: float | None = None
    """The learning rate `step` ran at (the schedule's)."""
    grad_norm: float | None = None
    """The global gradient norm of `step`, before clipping."""
    eval_loss: float | None = None
    """The validation loss of the newest step that evaluated (`data.eval_every`)."""
    tokens: int | None = None
    """Tokens trained on by `step` (rank 0's report)."""
    epoch: float | None = None
    """Passes over the first training corpus by `step` (kind `tokens`)."""
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
    secrets: list[str] = Field(default_factory=list)
    """The names of the job's secrets (`JobSpec.secrets`); their values are never shown."""
    env_hidden: list[str] = Field(default_factory=list)
    """The names of `spec.env`'s variables whose values you may not read (a job's `env` is
    its owner's and the admins' to read): `spec.env` leaves them out."""



class JobList(BaseModel):
    """`GET /jobs`: one page, and how many jobs the filters select."""

    items: list[JobOut]
    total: int
    limit: int
    offset: int


class EventList(BaseModel):
    items: list[Event]
    """The stored events as they are (`Event`), oldest first."""


class MetricOut(BaseModel):
    """One rank's report of one step."""

    attempt: int
    step: int
    rank: int
    loss: float | None
    loss_nonfinite: bool = False
    """True when the loss was NaN or infinite (`loss` is then null)."""
    step_time_s: float
    tokens_per_s: float | None
    """Global tokens per second (null: not known, a command job without a model whose
    script reports none)."""
    lr: float | None = None
    """The learning rate the step ran at (the schedule's, `train.lr` at its peak)."""
    grad_norm: float | None = None
    """The global gradient norm over every rank, before clipping (`train.grad_clip`)."""
    memory: dict[str, float | str | dict[str, str]]
    """The step's memory report (`MemoryReport`): bytes by category, the peak's source, and
    `not_measured`, the categories the rank cannot measure with the reason of each."""
    time: datetime
    eval_loss: float | None = None
    """Validation loss, on the steps that evaluated (`data.eval_every`; docs/data.md)."""
    tokens: int | None = None
    """Tokens the job had trained on after this step."""
    epoch: float | None = None
    """Passes over the first training corpus after this step (kind `tokens`)."""
    first_sample: int | None = None
    """The step read global samples [first_sample, first_sample + batch), as its loaders
    returned them."""
    batch: int | None = None
    """Global samples the step read (its global batch; the ramp's while it ramps)."""
    drawn: dict[str, int] | None = None
    """Samples drawn so far from each training corpus, by path (kind `tokens`)."""



class MetricList(BaseModel):
    items: list[MetricOut]


class AttemptList(BaseModel):
    items: list[Attempt]


class CheckpointOut(BaseModel):
    """One checkpoint tag of a job (`service.store.checkpoints`)."""

    step: int
    attempt: int
    bytes: int
    """Its size on disk, as the job's rank 0 counted it when the tag was complete."""
    layout: dict[str, Any]
    """The layout that wrote it (`tp`, `pp`, `dp`, `zero`, ..., `micro_batch`)."""
    created_at: datetime
    removed_at: datetime | None = None
    """When the retention policy deleted it (only with `removed=true`)."""


class CheckpointList(BaseModel):
    items: list[CheckpointOut]
    bytes_on_disk: int
    """The bytes of the job's tags not deleted."""
    keep_last: int | None
    """The job's retention policy (`checkpoint.keep_last`; None: every tag is kept)."""
    keep_every: int | None


# --- jobs: the plan against the measurement, attempts, logs ------------------------------------

class Measured(BaseModel):
    """One figure of `predicted_vs_measured`: the plan's prediction, the measurement (None
    before steady steps) and measured / predicted."""

    predicted: Number | None = None
    measured: Number | None = None
    ratio: float | None = None


class MeasuredMemory(BaseModel):
    predicted: Number | None = None
    """The plan's bytes per GPU (its most loaded stage; None: the job is not planned)."""
    measured_peak: Number | None = None
    """The highest process peak any step report of the newest attempt gave."""


class Reported(BaseModel):
    """What the step reports of the newest attempt carried of the monitor's figures
    (`service.store.reported`)."""

    source: Literal["trainer", "script"]
    """Who gave them: Trident's trainer measured them, or a command job's script reported
    them (`TRIDENT_REPORT`, docs/command.md)."""
    steps: int
    memory: dict[str, Number | None]
    """Each memory figure's newest value (None: no step carried it)."""
    comm_steps: int
    """Steps whose collectives were counted."""
    missing: str
    """What to say of a figure no step carried: "not measured" or "not reported"."""


class CategoryGap(BaseModel):
    """One memory category of one stage: planned, measured, the gap."""

    name: str
    """The plan's key: params, grads, optimizer, activations, logits, gathered, buckets,
    framework, total (docs/planner-model.md)."""
    label: str
    planned: Number | None = None
    measured: Number | None = None
    """The largest value the stage's ranks reported (None: not measured)."""
    gap: Number | None = None
    """measured - planned, bytes."""
    gap_pct: float | None = None
    """gap / planned."""
    not_measured: str | None = None
    """Why no rank measured it, as the ranks said."""


class StageMemoryGap(BaseModel):
    """`service.views.memory_gap.stage_rows`: one pipeline stage, planned against measured."""

    stage: int
    ranks: list[int]
    """The stage's ranks that reported on `step`."""
    step: int | None = None
    categories: list[CategoryGap]


class PredictedVsMeasured(BaseModel):
    """`service.views.prediction.compare`: rank 0's steady steps of the newest attempt against the
    plan
    (medians of the steps after the warm-up)."""

    planned: bool = True
    """False for a command job without model: no prediction (every `predicted` is None)."""
    steps_measured: int
    step_s: Measured
    tokens_per_s: Measured
    model_state_bytes: Measured
    """Parameters, gradients and optimizer states per GPU."""
    memory_bytes: MeasuredMemory
    reported: Reported | None = None
    memory_by_stage: list[StageMemoryGap] = []
    """Each memory category planned against measured, per pipeline stage (job detail)."""


class RankPlace(BaseModel):
    """Where one rank of an attempt ran (`Attempt.placement["ranks"]`)."""

    model_config = ConfigDict(extra="allow")

    rank: int
    node_id: str | None = None
    hostname: str | None = None
    gpu_ids: list[str | int] = Field(default_factory=list)


class Placement(BaseModel):
    """An attempt's `placement` as the worker group reported it: the node of every rank."""

    model_config = ConfigDict(extra="allow")

    ranks: list[RankPlace] = Field(default_factory=list)

    @classmethod
    def of(cls, attempt: Attempt) -> Placement:
        return cls.model_validate(attempt.placement or {})


class LogPage(BaseModel):
    """`GET /jobs/{id}/logs`: one attempt's rank output from the offsets asked for."""

    attempt: int | None
    """The attempt read (None: the job has not started)."""
    max_bytes_per_rank: int
    """How much of each rank's newest output the server keeps per attempt."""
    ranks: list[Chunk]


# --- the dashboard's job views -------------------------------------------------------------------

class SeriesPredicted(BaseModel):
    """The plan's figures (None: the job is not planned)."""

    step_time_s: Number | None
    tokens_per_s: Number | None
    mfu: Number | None


class GuardMark(BaseModel):
    """One event of the training guard (`docs/guards.md`) at a step."""

    step: int
    kind: str
    """guard_skip, guard_spike or guard_rollback."""
    message: str


class Series(BaseModel):
    """`GET /jobs/{id}/series`: rank 0's curves, downsampled on the server."""

    rows: int
    """Steps stored (the points may be fewer: `max_points`)."""
    step: list[int]
    loss: list[float | None]
    step_time_s: list[float]
    tokens_per_s: list[float | None]
    """None where a step's rate is not known (a command job without a model)."""
    mfu: list[float | None]
    """None where the plan predicts no MFU (a job that is not planned)."""
    predicted: SeriesPredicted
    eval_step: list[int] = Field(default_factory=list)
    """The steps that evaluated (`data.eval_every`), at most `max_points` of them."""
    eval_loss: list[float] = Field(default_factory=list)
    """The validation loss at each of `eval_step`."""
    recipe_step: list[int] = Field(default_factory=list)
    """The steps that reported the recipe's figures, at most `max_points` of them."""
    lr: list[float] = Field(default_factory=list)
    """The learning rate of each of `recipe_step`, as the schedule gave it."""
    grad_norm: list[float | None] = Field(default_factory=list)
    """The global gradient norm before clipping at each of `recipe_step` (None: not
    reported)."""
    guard: list[GuardMark] = Field(default_factory=list)
    """The training guard's events (skips, spikes, rollbacks), marked on the loss chart; the
    newest `max_points` of them."""


class RanksGrid(BaseModel):
    """`GET /jobs/{id}/ranks`: `service.views.rank_status.rank_status`, as the ranks grid, `trident
    top` and the per-rank gauges of `/metrics` read it."""

    layout: PlannedLayout
    world_size: int
    attempt: int | None
    cells: list[RankCell]


class TimeSplit(BaseModel):
    """Seconds of a step: compute and the time in TP, PP and DP collectives, the pipeline
    bubble (None: not measured), and the whole step."""

    compute: float
    tp: float
    pp: float
    dp: float
    bubble: float | None
    step: float


class StepSplit(BaseModel):
    step: int
    ranks: int
    """Ranks that reported the step with timed collectives."""
    step_s: float
    compute: float
    tp: float
    pp: float
    dp: float
    bubble: float | None


class CommSteps(BaseModel):
    """`GET /jobs/{id}/comm/steps`: the plan's split and each recent step's, rank means."""

    predicted: TimeSplit | None = None
    """None: the job is not planned."""
    steps: list[StepSplit]


class OpComm(BaseModel):
    time_s: float
    bytes: float
    calls: float


class RankDimComm(BaseModel):
    time_s: float
    fraction: float
    bytes: float
    busbw: float | None
    ops: dict[str, OpComm]


class RankComm(BaseModel):
    rank: int
    step_time_s: float
    steps: int
    dims: dict[str, RankDimComm]


class DimComm(BaseModel):
    time_s_per_step: float
    max_rank_time_s_per_step: float
    fraction: float
    bytes_per_step: float
    busbw: float | None
    predicted_time_s_per_step: Number | None
    predicted_fraction: float | None


class CommView(BaseModel):
    """`GET /jobs/{id}/comm` (`service.monitor.comm.summarize_comm`)."""

    step_time_s: float
    predicted_step_s: Number | None
    dims: dict[str, DimComm]
    ranks: list[RankComm]
    probe: list[dict[str, Any]]
    attempt: int | None
    probe_summary: dict[str, Any] | None
    reported: Reported | None = None


class StackGroup(BaseModel):
    ranks: list[int]
    text: str


class Hang(BaseModel):
    """A hang diagnosis and the stacks recorded with it, identical ones grouped."""

    id: int
    attempt: int | None
    time: datetime
    summary: str
    diagnosis: dict[str, Any]
    stacks: list[StackGroup]


class HangList(BaseModel):
    items: list[Hang]
    """Newest first."""


# --- tracking and comparison ---------------------------------------------------------------------

class TrackerExport(BaseModel):
    """How far a job's stored steps went to one tracker (`service.store.tracking_exports`)."""

    sink: str
    """`mlflow` or `tensorboard`."""
    target: str
    """The MLflow tracking URI, or `tensorboard`."""
    run_id: str | None = None
    run_url: str | None = None
    """The MLflow run's page."""
    directory: str | None = None
    """The job's TensorBoard directory on the server."""
    attempt: int
    step: int
    """The last (attempt, step) sent or dropped."""
    exported: int
    """Steps sent."""
    dropped: int
    """Steps the tracker refused for good (never sent again)."""
    state: str | None
    """The job state the tracker was last told."""
    done: bool
    error: str | None
    """The newest failure, until a send succeeds."""
    failing_since: datetime | None
    """Since when the tracker does not answer (None: it answers)."""
    updated_at: datetime


class JobTracking(BaseModel):
    """`GET /jobs/{id}/tracking`: the job's exports, one per tracker it goes to."""

    job_id: int
    exports: list[TrackerExport]


class TrackingInfo(BaseModel):
    """`GET /tracking`: the server's trackers."""

    mlflow_uri: str | None
    """Every job's MLflow server (`TRIDENT_MLFLOW_URI`), unless its spec says otherwise."""
    mlflow_uris: list[str]
    """The MLflow servers a spec's `tracking.mlflow` may name."""
    tensorboard_dir: str | None
    """Where jobs' TensorBoard event files are (`job-<id>/` each); None: none written."""


class ComparedRun(BaseModel):
    """One job of a comparison: its newest figures and the plan against the measurement."""

    id: int
    name: str
    owner: str
    state: str
    layout: str
    world_size: int
    step: int | None
    """Rank 0's newest step."""
    total_steps: int
    loss: float | None
    loss_nonfinite: bool = False
    """The newest loss was NaN or infinite (`loss` is then null)."""
    eval_loss: float | None
    """The newest stored validation loss (None: none stored)."""
    mfu: float | None
    """Measured (median of the steady steps)."""
    mfu_predicted: float | None
    custom: dict[str, float]
    """The newest step's custom metrics (numbers)."""
    predicted_vs_measured: PredictedVsMeasured
    ettr: float | None = None
    """The effective training time ratio so far: its goodput ledger's training seconds over
    its wall seconds (docs/goodput.md; None: no wall time yet)."""


class SpecDifference(BaseModel):
    field: str
    """A dotted spec field (`parallel.tp`)."""
    values: list[Any]
    """One per run, in the order of `runs` (None: not set)."""


class RunCurves(BaseModel):
    """One job's curves: per step (sampled beyond 2,000 steps), seconds since it started and
    every per-step figure by its stored name."""

    job_id: int
    step: list[int]
    elapsed_s: list[float]
    metrics: dict[str, list[float | None]]


class Comparison(BaseModel):
    """`GET /compare`: several jobs side by side."""

    runs: list[ComparedRun]
    differences: list[SpecDifference]
    """The spec fields whose values differ."""
    curves: list[RunCurves]
    charted: list[str]
    """The figures the comparison page draws, one chart each (loss, eval_loss, step_time_s,
    tokens_per_s, then the others the runs have: custom metrics ...)."""


# --- the planner ---------------------------------------------------------------------------------

class PlanOut(StoredPlan):
    """`POST /plan` for an explicit layout: the plan a job of this spec would store, whether
    it fits and why not."""

    fits: bool
    reasons: list[str] = Field(default_factory=list)
    cost: float | None = None
    """What its `train.steps` steps would cost: step time x steps x ranks at the profile's
    price per GPU-hour (CPU-hour on CPU ranks), `TRIDENT_PRICES` (None: not priced)."""


class LayoutSearch(BaseModel):
    """`POST /plan` for `parallel: auto`: the ranked layouts that fit, the rejected ones."""

    model_config = ConfigDict(extra="allow")

    world_size: int
    profile: str
    considered: int
    fitting: int
    best: PlanOut | None
    ranked: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    explanation: str


# --- the cluster ---------------------------------------------------------------------------------

class NodeJob(BaseModel):
    """An active job with ranks on a node (`GET /cluster`'s `jobs`)."""

    job_id: int
    name: str
    owner: str
    state: str
    attempt: int
    ranks: list[int]


class NodeInfo(BaseModel):
    """A node's inventory (`Node.info`, `service.cluster.inventory.node_inventory` and its
    labels)."""

    model_config = ConfigDict(extra="allow")

    hostname: str | None = None
    accelerator: str | None = None
    cpus: int | None = None
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    gpu_model: str | None = None
    gpu_link: str | None = None
    profile: str | None = None
    resources: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def of(cls, node: Node) -> NodeInfo:
        return cls.model_validate(node.info or {})


class NamedProfile(BaseModel):
    """A hardware profile as JSON (`HardwareProfile.to_json`): its name, the rest kept."""

    model_config = ConfigDict(extra="allow")

    name: str


class CalibratedProfileOut(NamedProfile):
    """A profile a cluster probe calibrated: the hardware profile's fields, and which probe."""

    probe_id: int | None
    calibrated_at: datetime


class ClusterView(BaseModel):
    """`GET /cluster`."""

    nodes: list[Node]
    jobs: dict[str, list[NodeJob]]
    """Node id -> the active jobs with ranks there."""
    probe: Probe | None
    """The newest cluster probe."""
    profiles: dict[str, CalibratedProfileOut]


class ProbeList(BaseModel):
    items: list[Probe]


class ProbeSummary(BaseModel):
    """A done cluster probe's `summary`: what it measured and the profile it calibrated (its
    `results` are `service.contract.reports.ProbeRowModel` rows, with their expectation)."""

    model_config = ConfigDict(extra="allow")

    ranks: int
    nodes: int
    matmul_flops: dict[str, float]
    links: dict[str, float | None]
    profile: NamedProfile
    """The profile it calibrated."""

    @classmethod
    def of(cls, probe: Probe) -> ProbeSummary:
        return cls.model_validate(probe.summary)


# --- identity ------------------------------------------------------------------------------------

class TokenRef(BaseModel):
    id: int
    name: str


class WhoAmI(BaseModel):
    """`GET /whoami`."""

    user: str
    role: str
    projects: list[str]
    """The default first."""
    token: TokenRef
    """The token this request carried."""


class NewToken(BaseModel):
    token: str
    """The secret: shown this once, stored only as a hash."""
    info: Token


class UserList(BaseModel):
    items: list[User]


class TokenList(BaseModel):
    items: list[Token]


class ProjectList(BaseModel):
    items: list[Project]


class AuditList(BaseModel):
    items: list[AuditEntry]
    """Oldest first."""


# --- system --------------------------------------------------------------------------------------

class ControllerLease(BaseModel):
    holder: str | None
    lease_age_s: float | None
    expires_in_s: float | None
    error: str | None = None
    """Why the controller is not healthy (absent when it is)."""


class DataDirUsage(BaseModel):
    """The filesystem of the server's data directory (`service.files.datadir.usage`)."""

    status: str
    """`ok`, `nearly full` (less than `min_free_fraction` of it free) or `unavailable: ...`."""
    min_free_fraction: float
    """`TRIDENT_DATA_DIR_MIN_FREE`."""
    total_bytes: int | None = None
    free_bytes: int | None = None
    free_fraction: float | None = None


class Health(BaseModel):
    """`GET /healthz`: 200 `ok`, or 503 `degraded` naming what is wrong."""

    status: Literal["ok", "degraded"]
    database: str
    controller: ControllerLease | None
    data_dir: DataDirUsage | None = None
    """Named when nearly full, without making the answer `degraded` by itself."""


# --- stacks --------------------------------------------------------------------------------------

class RanksStack(BaseModel):
    """Ranks whose stacks of one thread are identical, and that stack (None: left out, the
    answer's size limit was reached)."""

    ranks: list[int]
    stack: str | None


class ThreadStacks(BaseModel):
    thread: str
    groups: list[RanksStack]
    """Largest group first."""


class MissingRanks(BaseModel):
    reason: str
    ranks: list[int]


class StackAnswer(BaseModel):
    """A done stack request's `result` (`service.control.stack_collect.group_stacks`)."""

    ranks: int = 0
    """Ranks that answered."""
    threads: list[ThreadStacks] = Field(default_factory=list)
    """The rank's work thread (`train`) first."""
    missing: list[MissingRanks] = Field(default_factory=list)
    left_out: int = 0

    @classmethod
    def of(cls, request: StackRequest) -> StackAnswer:
        return cls.model_validate(request.result or {})


# --- profiles ------------------------------------------------------------------------------------

PROFILE_MAX_STEPS = 20
"""The most steps one `trident profile` request profiles."""
PROFILE_MAX_TRACE_BYTES = 64 << 20
"""The most bytes of one stored trace file (gzipped): a rank's file over it is left out, and a
rank whose trace is over it has none."""
PROFILE_MAX_JOB_BYTES = 512 << 20
"""The most bytes of trace files a job keeps: storing new ones drops the oldest requests'
files first (their requests say so), and files beyond it even then are left out."""
PROFILE_MAX_OPEN = 2
"""Requests of one job that may wait (pending or profiling) at once; one more is a 429."""


class ProfileFile(BaseModel):
    """One stored trace file of a request: `GET /jobs/{id}/profile/{request}/files/{name}`."""

    rank: int
    name: str
    bytes: int


class ProfileRequest(BaseModel):
    """A `trident profile` request and, once `done`, its stored files."""

    id: int
    job_id: int
    attempt: int | None = None
    """The attempt whose ranks were profiled."""
    status: StackStatus
    """pending, running (the ranks are profiling), done (files stored) or failed (`error`)."""
    requested_by: str | None = None
    steps: int
    ranks: list[int]
    memory: bool = False
    files: list[ProfileFile] = Field(default_factory=list)
    """Rank order; empty again once dropped to keep the job within `PROFILE_MAX_JOB_BYTES`."""
    profiled_steps: dict[str, list[int]] = Field(default_factory=dict)
    """Per rank (a string, JSON's keys), the first and last step profiled."""
    missing: list[dict[str, Any]] = Field(default_factory=list)
    """The ranks without a trace: `{"rank", "reason"}`."""
    left_out: list[dict[str, Any]] = Field(default_factory=list)
    """Files made but not stored: `{"rank", "name", "bytes", "why"}` (a size limit)."""
    dropped: str | None = None
    """Why the files are gone (a newer request's needed the room), when they are."""
    error: str | None = None
    created_at: datetime
    finished_at: datetime | None = None


class ProfileList(BaseModel):
    """A job's profile requests, newest first, and the bounds they are kept within."""

    items: list[ProfileRequest]
    stored_bytes: int
    """The job's trace files' bytes now."""
    max_trace_bytes: int = PROFILE_MAX_TRACE_BYTES
    max_job_bytes: int = PROFILE_MAX_JOB_BYTES
    max_steps: int = PROFILE_MAX_STEPS


class ExportState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class ExportRecord(BaseModel):
    """One `trident export` (`POST /jobs/{id}/exports`): a job's tag written as a Hugging
    Face folder by a task on the cluster, under an export root the server allows."""

    id: int
    job_id: int
    step: int
    """The tag's step."""
    state: ExportState
    """pending (waiting for the controller), running (its task writes the folder), done
    (`files`, `bytes`) or failed (`error`)."""
    destination: str
    """The folder on the cluster's storage that the export is (or will be) written to."""
    max_shard_bytes: int
    requested_by: str | None = None
    files: list[str] = Field(default_factory=list)
    """The folder's files once done: `config.json`, the safetensors shards, the index."""
    bytes: int | None = None
    """The folder's bytes once done."""
    error: str | None = None
    created_at: datetime
    finished_at: datetime | None = None


class ExportList(BaseModel):
    """A job's exports, newest first."""

    items: list[ExportRecord]


class ExportFile(BaseModel):
    """One file of a finished export: `GET /jobs/{id}/exports/{export_id}/files/{name}`."""

    name: str
    bytes: int


class ExportFiles(BaseModel):
    """The files of a finished export, as its folder holds them now."""

    export_id: int
    items: list[ExportFile]
