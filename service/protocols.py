"""What the control plane needs from a data plane, and what a worker may report.

`workers.group.RayLauncher` implements `Launcher`; tests implement it with fakes. Worker
reports cross a process boundary, so they are validated here before anything is stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.planner.stored import StoredPlan
from service.spec import JobSpec


class StepReport(BaseModel):
    """One rank's account of one optimizer step."""

    model_config = ConfigDict(extra="allow")

    kind: Literal["step"] = "step"
    rank: int = Field(ge=0, le=65535)
    step: int = Field(ge=1, le=10_000_000)
    loss: float | None = None
    step_time_s: float = Field(ge=0, le=86400)
    tokens_per_s: float = Field(ge=0)
    memory: dict[str, float | str] = Field(default_factory=dict)
    """Bytes by kind (params, grads, optimizer, activations, peak); string values label them."""

    @field_validator("loss")
    @classmethod
    def _finite_or_none(cls, v: float | None) -> float | None:
        # A diverged run reports nan/inf; JSON cannot carry them, so store None and say so.
        if v is not None and not math.isfinite(v):
            return None
        return v

    def row(self) -> dict[str, Any]:
        extra = dict(self.model_extra or {})
        return {"rank": self.rank, "step": self.step, "loss": self.loss,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "data": {"memory": self.memory, **extra}}


class ProbeRowModel(BaseModel):
    """One bandwidth measurement: one op at one size over one group (nccl-tests terms)."""

    model_config = ConfigDict(extra="allow")

    dim: str = Field(max_length=16)
    group: list[int] = Field(max_length=65536)
    op: str = Field(max_length=32)
    bytes: int = Field(ge=0)
    time_s: float = Field(ge=0)
    algbw: float = Field(ge=0)
    busbw: float = Field(ge=0)


class ProbeReport(BaseModel):
    """A rank's probe rows for the groups it reports (first rank of a group, sender of a pair)."""

    kind: Literal["probe"]
    rank: int = Field(ge=0, le=65535)
    rows: list[ProbeRowModel] = Field(max_length=10000)


class ClusterProbeReport(BaseModel):
    """A rank's part of `trident probe`: its matmul FLOP/s and the rows it reports."""

    kind: Literal["cluster_probe"]
    rank: int = Field(ge=0, le=65535)
    node_id: str = Field(max_length=128)
    matmul_flops: dict[str, float]
    rows: list[ProbeRowModel] = Field(max_length=10000)


GroupState = Literal["starting", "running", "succeeded", "failed", "stopped"]


@dataclass
class PollResult:
    """What a worker group says when polled; errors come back as data, never as raises."""

    state: GroupState
    reports: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    placement: dict[str, Any] | None = None
    heartbeats: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each answering rank's heartbeat: step, phase, collective, dim, group, time, age_s."""


class WorkerGroup(Protocol):
    """A thin handle on the ranks of one attempt."""

    def poll(self, timeout_s: float) -> PollResult: ...

    def cancel(self) -> None:
        """Ask every rank to stop at the next step boundary."""

    def shutdown(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to end, then kill them and free resources."""

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every rank's Python stacks, for hang reports."""
        ...


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    cpus: float
    gpus: float


class Launcher(Protocol):
    """Creates worker groups on a cluster and says what the cluster has free."""

    def free_capacity(self) -> list[NodeCapacity]: ...

    def total_capacity(self) -> list[NodeCapacity]: ...

    def start(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
              checkpoint_dir: str | None) -> WorkerGroup:
        """Claim resources and start the ranks; must not block on training."""
        ...

    def start_cluster_probe(self, *, probe_id: int, ranks_per_node: int,
                            max_bytes: int) -> WorkerGroup:
        """Start `trident probe`'s group: `ranks_per_node` ranks on every node."""
        ...

    def inventory(self) -> list[dict[str, Any]]:
        """Every live node's inventory (`workers.inventory.node_inventory` plus node_id)."""
        ...
