"""The goodput ledger's bodies (`GET /api/v1/jobs/{id}/goodput`, `GET /api/v1/goodput`):
where every second of a job went, in categories that add up to its wall time, and what its
ranks held meanwhile. Kept beside `client.payloads` under its rules (fields are added, never
removed; every added field has a default); `service.store.goodput` builds them and
docs/goodput.md defines each category.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from service.contract.prices import ProfilePrice

CATEGORIES = ("queued", "placement", "start", "checkpoint_load", "training", "evaluation",
              "checkpoint_save", "lost", "recovery", "stall", "stopping", "finishing")
"""Every ledger category, in the order a job meets them (docs/goodput.md defines each)."""
Category = Literal["queued", "placement", "start", "checkpoint_load", "training", "evaluation",
                   "checkpoint_save", "lost", "recovery", "stall", "stopping", "finishing"]
QUEUE_REASONS = ("quota", "room", "preempted")
"""Why a queued job waited: its project's quota, no room in the cluster, or it was preempted
(a job of higher priority, a drain or an elastic move took its room) and waits to go on."""
QueueReason = Literal["quota", "room", "preempted"]


class Segment(BaseModel):
    """A stretch of a job's wall time: what it was mostly spent on (`category`), and, where
    several categories share it (a training loop's evaluations and saves), their seconds,
    which add up to `end - start`."""

    start: datetime
    end: datetime
    category: Category
    seconds: dict[Category, float]
    ranks: int = 0
    """Ranks the job held meanwhile (0: it held nothing, queued)."""
    attempt: int | None = None
    reason: QueueReason | None = None
    """Why it waited (queued segments only)."""


class CategoryTotal(BaseModel):
    """One category of a ledger: seconds of wall time, and what the ranks held meanwhile."""

    category: Category
    seconds: float = 0.0
    rank_seconds: float = 0.0
    """Seconds times the ranks held: a queued job holds none, a hung one its whole group."""
    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU-seconds held by ranks without a GPU (a GPU rank's CPUs are counted in its GPU's
    price)."""
    cost: float | None = None
    """The held seconds at the job's profile's prices (None: no price set)."""


class Ledger(BaseModel):
    """A job's goodput ledger: its wall time from submission to its end (or now), by
    category."""

    job_id: int
    name: str = ""
    project: str | None = None
    owner: str = ""
    state: str = ""
    profile: str = "cpu"
    start: datetime
    """When the job was submitted."""
    end: datetime
    """When it ended, or now for a job that has not."""
    ended: bool = False
    wall_s: float
    categories: list[CategoryTotal]
    """Every category of `CATEGORIES`, in that order; their seconds add up to `wall_s`."""
    queued_reasons: dict[QueueReason, float] = Field(default_factory=dict)
    """The queued seconds by reason."""
    ettr: float | None = None
    """The effective training time ratio: training seconds over wall seconds (None: no wall
    time yet)."""
    steps_counted: int = 0
    """Optimizer steps whose work the job kept."""
    steps_lost: int = 0
    """Steps computed and then redone (or never to be kept) after a failure."""
    tokens: int | None = 0
    """Tokens of the steps that count (None: not known, a command job without a model)."""
    goodput_tokens_per_s: float | None = None
    """`tokens` per wall second."""
    ranks: int = 0
    """Ranks of its newest attempt (or of its plan, before it ran)."""
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 0.0
    price: ProfilePrice | None = None
    """The profile's prices the costs were read at (None: not priced)."""
    cost: float | None = None
    """Everything it held, at `price` (None: not priced)."""
    cost_per_billion_tokens: float | None = None
    predicted_training_s: float | None = None
    """The plan's step time times the steps that count: what training should have taken."""
    planned_cost: float | None = None
    """What the plan's steps would cost at `price`: its step time times `train.steps`, on its
    ranks (None: not priced, or no step time planned)."""
    segments: list[Segment] = Field(default_factory=list)
    """The timeline, oldest first; the segments tile [start, end]."""

    def total(self, category: str) -> CategoryTotal:
        return next(c for c in self.categories if c.category == category)


class GroupTotals(BaseModel):
    """The ledgers of a group of jobs (a project, an owner, the cluster) over a window, each
    job's time clipped to it."""

    key: str
    jobs: int = 0
    wall_s: float = 0.0
    categories: list[CategoryTotal] = Field(default_factory=list)
    ettr: float | None = None
    """Training seconds over wall seconds, summed over the group's jobs."""
    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    tokens: int = 0
    """Tokens of the steps that count, of the jobs whose tokens are known."""
    jobs_tokens_unknown: int = 0
    """Jobs whose tokens nobody measured (a command job without a model whose script reports
    no rate): not in `tokens` nor in `cost_per_billion_tokens`."""
    cost: float | None = None
    """Everything the priced jobs held (None: none priced)."""
    cost_per_billion_tokens: float | None = None
    """The cost of the jobs both priced and of known tokens, per billion of their tokens."""


class LostJob(BaseModel):
    """A job among those that lost the most time in a window: its lost work, recovery and
    stalls."""

    job_id: int
    name: str
    project: str | None = None
    owner: str = ""
    lost_s: float
    """Lost work, recovery and stalls, in seconds."""
    ettr: float | None = None


class BudgetStatus(BaseModel):
    """A project's budget and what its jobs spent of it since the budget was set."""

    project: str
    since: datetime | None = None
    gpu_hours: float | None = None
    cpu_hours: float | None = None
    cost: float | None = None
    spent_gpu_hours: float = 0.0
    spent_cpu_hours: float = 0.0
    spent_cost: float | None = None
    used: float = 0.0
    """The largest share of a set budget spent (1.0: all of it)."""


class GoodputSummary(BaseModel):
    """`GET /api/v1/goodput`: the ledgers of the jobs a caller may see, over a window."""

    since: datetime | None = None
    until: datetime
    cluster: GroupTotals
    projects: list[GroupTotals] = Field(default_factory=list)
    owners: list[GroupTotals] = Field(default_factory=list)
    top_lost: list[LostJob] = Field(default_factory=list)
    budgets: list[BudgetStatus] = Field(default_factory=list)
