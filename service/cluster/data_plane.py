"""What the control plane needs from a data plane: `Launcher` starts worker groups on a
cluster and says what it has free, `WorkerGroup` is one attempt's ranks, `PollResult` what a
poll brings back.

`workers.launch.launcher.RayLauncher` implements `Launcher`; tests implement it with fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from service.contract.reports import HeartbeatReport
from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointWriter
from service.planner.stored import StoredPlan

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
    heartbeats: dict[int, HeartbeatReport] = field(default_factory=dict)
    """Each answering rank's heartbeat."""
    acks: dict[int, int] = field(default_factory=dict)
    """Per rank, the sequence number of its last report in `reports`: given back to
    `WorkerGroup.acknowledge` once they are stored, so that the rank may forget them."""


class WorkerGroup(Protocol):
    """A thin handle on the ranks of one attempt."""

    def poll(self, timeout_s: float) -> PollResult: ...

    def cancel(self) -> None:
        """Ask every rank to stop at the next step boundary."""

    def preempt(self) -> None:
        """Ask every rank to save a checkpoint at the next step boundary and stop there (a
        job of higher priority needs the room)."""

    def shutdown(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to end, then kill them and free resources."""

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every rank's Python stacks, for hang reports."""
        ...

    def thread_stacks(self, timeout_s: float, max_bytes: int) -> dict[int, Any]:
        """`trident stacks`: per rank a list of `{"thread", "stack"}` (each stack at most
        `max_bytes`), or a string saying why that rank has none (it did not answer within
        `timeout_s`, or its actor is gone). May block up to `timeout_s`."""
        ...

    def profile(self, request_id: int, *, ranks: list[int], steps: int, memory: bool,
                max_bytes: int, timeout_s: float) -> dict[int, Any]:
        """`trident profile`: ranks `ranks` run torch.profiler over the same `steps` coming
        steps; per rank `{"rank", "steps", "files": {name: gzipped bytes}, "left_out",
        "error"}` (`workers.monitor.profiler`, each file at most `max_bytes`), or a string
        saying why there is none. Blocks until the steps ended, at most `timeout_s`."""
        ...

    def acknowledge(self, acks: dict[int, int]) -> None:
        """The reports of `PollResult.acks` are stored; until then ranks send them again."""


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    cpus: float
    gpus: float


class Launcher(Protocol):
    """Creates worker groups on a cluster and says what the cluster has free."""

    def free_capacity(self) -> list[NodeCapacity]:
        """What is free, on the nodes not cordoned (`cordon`)."""
        ...

    def total_capacity(self) -> list[NodeCapacity]:
        """Every live node's resources, cordoned ones included (a cordon is for a while: a
        job that needs the node waits for it instead of failing as impossible)."""
        ...

    def cordon(self, node_ids: frozenset[str]) -> None:
        """Keep new groups off these nodes (and only these) from now on: their room is not
        free, and no group started after this is placed there."""

    def start(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
              checkpoint_dir: str | None, writer: CheckpointWriter | None) -> WorkerGroup:
        """Claim resources and start the ranks; must not block on training. Each rank is
        sent the stored `spec` and its row of the stored `plan` (`StoredPlan.rank_plan`: its
        stage, layers and groups), which it builds from. `writer`: the job `checkpoint_dir`
        must belong to (rank 0 checks it before any rank resumes). What a start that raises
        claimed is released before it raises."""
        ...

    def start_cluster_probe(self, *, probe_id: int, ranks_per_node: int,
                            max_bytes: int) -> WorkerGroup:
        """Start `trident probe`'s group: `ranks_per_node` ranks on every node."""
        ...

    def inventory(self) -> list[dict[str, Any]]:
        """Every live node's inventory (`service.cluster.inventory.node_inventory` plus node_id)."""
        ...

    def attach(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
               checkpoint_dir: str | None,
               writer: CheckpointWriter | None) -> WorkerGroup | None:
        """The attempt's group, still there from before this controller started (training,
        or not launched yet: it goes on from its placement, to train from `checkpoint_dir`),
        or None (and whatever is left of it stopped)."""
        ...

    def sweep(self, keep: set[tuple[int, int]]) -> list[str]:
        """Stop the job groups on the cluster but those of the (job, attempt) pairs in `keep`;
        the names of those stopped."""
        ...
