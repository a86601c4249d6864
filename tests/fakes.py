"""Fakes of the controller's collaborators: a worker group and a launcher that play a script of
poll results, a tracker that records what the exporter sends, and the small job builders the
controller, scheduler and quota tests share.
The real ones run in the Ray end-to-end tests (tests/test_e2e_ray.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from service.cluster.data_plane import NodeCapacity, PollResult
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.control_pass import Change, LiveAttempt, StepResult
from service.control.controller import Controller
from service.control.teardown import Teardowns
from service.files.checkpoint_dirs import CheckpointWriter
from service.monitor.attempt import AttemptHealth
from service.planner import StoredPlan
from service.store import Job, Store
from service.store.tracking_exports import Export, Sink
from service.submission.intake import submit as submit_job
from service.tracking.scalars import StepScalars
from service.tracking.sinks import TrackerDown, TrackerRefused
from tests.conftest import stored_plan, tiny_spec

NOW = datetime.now(UTC)
SPEC = JobSpec.model_validate(tiny_spec())


@dataclass
class FakeGroup:
    script: list[PollResult]
    cancelled: bool = False
    shut: bool = False
    starts: dict[str, Any] = field(default_factory=dict)
    release: threading.Event | None = None
    """When set, `shutdown` blocks until it is (ranks slow to stop)."""
    on_poll: Callable[[], None] | None = None
    polls: int = 0
    acked: dict[int, int] = field(default_factory=dict)
    after_cancel: PollResult | None = None
    """What a poll after `cancel` returns (default: stopped, nothing reported)."""
    poll_threads: list[str] = field(default_factory=list)
    stack_threads: list[str] = field(default_factory=list)
    preempted: bool = False
    stopping: bool = False
    """`shutdown` was called (it may still be blocked on `release`)."""

    def poll(self, timeout_s: float) -> PollResult:
        self.polls += 1
        self.poll_threads.append(threading.current_thread().name)
        if self.on_poll is not None:
            self.on_poll()
        if self.cancelled:
            return self.after_cancel or PollResult(state="stopped")
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def cancel(self) -> None:
        self.cancelled = True

    def preempt(self) -> None:
        """Save and stop: polls from now on return `after_cancel`."""
        self.preempted = True
        self.cancelled = True

    def shutdown(self, grace_s: float) -> None:
        self.stopping = True
        if self.release is not None:
            assert self.release.wait(60), "shutdown never released"
        self.shut = True

    def stacks(self, timeout_s: float) -> dict[int, str]:
        self.stack_threads.append(threading.current_thread().name)
        return {0: "Thread rank0:\n  File train.py, in all_reduce", 1: "Thread rank1:\n  sleep"}

    def acknowledge(self, acks: dict[int, int]) -> None:
        self.acked.update(acks)


class FakeLauncher:
    def __init__(self, scripts: list[list[PollResult]], cpus: float = 4) -> None:
        self.scripts = scripts
        self.groups: list[FakeGroup] = []
        self.started: list[dict[str, Any]] = []
        self.cpus = cpus
        self.release: threading.Event | None = None
        self.live: dict[tuple[int, int], FakeGroup] = {}
        """Groups that outlive a controller, by (job, attempt): what `attach` finds."""
        self.swept: list[tuple[int, int]] = []
        self.cordoned: frozenset[str] = frozenset()

    def cordon(self, node_ids: frozenset[str]) -> None:
        self.cordoned = frozenset(node_ids)

    def attach(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
               checkpoint_dir: str | None, writer: CheckpointWriter | None) -> FakeGroup | None:
        g = self.live.get((job_id, attempt))
        return g if g is not None and not g.shut else None

    def sweep(self, keep: set[tuple[int, int]]) -> list[str]:
        gone = [k for k in self.live if k not in keep]
        for k in gone:
            self.live.pop(k).shut = True
            self.swept.append(k)
        return [f"job{j}-a{a}" for j, a in gone]

    def total_capacity(self) -> list[NodeCapacity]:
        return [NodeCapacity("n0", self.cpus, 0)]

    def free_capacity(self) -> list[NodeCapacity]:
        return [n for n in self.total_capacity() if n.node_id not in self.cordoned]

    def inventory(self) -> list[dict[str, Any]]:
        return [{"node_id": "n0", "hostname": "fake", "accelerator": "cpu"}]

    def start_cluster_probe(self, *, probe_id: int, ranks_per_node: int,
                            max_bytes: int) -> FakeGroup:
        g = FakeGroup(self.scripts.pop(0), starts={"probe": probe_id})
        self.groups.append(g)
        return g

    def start(self, *, job_id: int, attempt: int, spec: JobSpec, plan: StoredPlan,
              checkpoint_dir: str | None, writer: CheckpointWriter | None) -> FakeGroup:
        g = FakeGroup(self.scripts.pop(0), starts={"attempt": attempt, "ckpt": checkpoint_dir},
                      release=self.release)
        self.started.append({"spec": spec, "plan": plan, "writer": writer})
        self.groups.append(g)
        self.live[(job_id, attempt)] = g
        return g


class FakeRoomLauncher(FakeLauncher):
    """A one-node fake whose free room is what its live groups leave (preemption's tests).
    With `freed_early`, a group's room is free once its shutdown began, before the teardown
    ends (as Ray frees a placement group before the controller reaps its teardown)."""

    freed_early = False

    def free_capacity(self) -> list[NodeCapacity]:
        used = sum(s["spec"].resources.cpus_per_worker * s["spec"].world_size
                   for s, g in zip(self.started, self.groups, strict=True)
                   if not g.shut and not (self.freed_early and g.stopping))
        return [NodeCapacity("n0", self.cpus - used, 0)]


class FakeNodesLauncher(FakeLauncher):
    """Nodes of `cpus` each that come and go (`nodes`; the elastic tests): the free room is
    what the live groups' ranks leave, each rank placed first fit."""

    def __init__(self, scripts: list[list[PollResult]], nodes: dict[str, float]) -> None:
        super().__init__(scripts)
        self.nodes = dict(nodes)

    def total_capacity(self) -> list[NodeCapacity]:
        return [NodeCapacity(n, c, 0) for n, c in self.nodes.items()]

    def free_capacity(self) -> list[NodeCapacity]:
        free = dict(self.nodes)
        for s, g in zip(self.started, self.groups, strict=True):
            if g.shut:
                continue
            per = s["spec"].resources.cpus_per_worker
            for _ in range(s["spec"].world_size):
                node = next((n for n, c in free.items() if c + 1e-9 >= per), None)
                if node is not None:
                    free[node] -= per
        return [NodeCapacity(n, c, 0) for n, c in free.items()]


def step_report(rank: int, step: int, loss: float) -> dict[str, Any]:
    return {"kind": "step", "rank": rank, "step": step, "loss": loss, "step_time_s": 0.1,
            "tokens_per_s": 2560.0, "memory": {"params_bytes": 1000}}


def submit(store: Store, **over: Any) -> int:
    return submit_job(store, JobSpec.model_validate(tiny_spec(**over))).id


def make(store: Store, launcher: FakeLauncher, tmp_path: Path, **kw: Any) -> Controller:
    return Controller(store, launcher, checkpoint_root=tmp_path, **kw)


def stopped(c: Controller, group: FakeGroup) -> bool:
    """Whether `group` was shut down, once the teardowns (beside the loop) are done."""
    assert c.teardowns.wait(30), "teardowns still running"
    return group.shut


def job(job_id: int, *, world: int, tp: int = 1, cpus: float = 1, gpus: float = 0,
        priority: int = 0) -> Job:
    return Job(id=job_id, name=f"j{job_id}", owner="local", state=JobState.QUEUED,
               priority=priority, spec=SPEC, plan=stored_plan(tp=tp, dp=world // tp),
               world_size=world, cpus=cpus, gpus=gpus, cancel_requested=False, attempts=0,
               error=None, created_at=NOW, updated_at=NOW, started_at=None, finished_at=None)


class FakeLoop:
    """The controller's loop as its collaborators (`service.control.control_pass.Loop`) see it:
    moves go
    through the store, groups are stopped by real `Teardowns`, every other call is recorded."""

    def __init__(self, store: Store, teardowns: Teardowns) -> None:
        self.store = store
        self.teardowns = teardowns
        self.running: dict[int, LiveAttempt] = {}
        self.calls: list[tuple[str, int]] = []
        self.errors: dict[int, str] = {}
        """The error each failed attempt was failed with, by job."""

    def move(self, job: Job, to: JobState, message: str, result: StepResult, *,
             error: str | None = None, attempt: int | None = None,
             data: dict[str, Any] | None = None, unless_cancelled: bool = False) -> Job | None:
        moved = self.store.transition(job_id=job.id, to=to, message=message, error=error,
                                      attempt=attempt, data=data)
        result.changes.append(Change(job.id, to, message))
        return moved

    def record(self, job: Job, run: LiveAttempt, poll: PollResult) -> int:
        self.calls.append(("record", job.id))
        return len(poll.reports)

    def teardown(self, job_id: int, run: LiveAttempt) -> None:
        self.teardowns.start(("job", job_id), run.group, attempt=run.attempt)
        self.running.pop(job_id)

    def succeed(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        self.calls.append(("succeed", job.id))

    def fail_attempt(self, job: Job, attempt: int, error: str, result: StepResult) -> None:
        self.calls.append(("fail", job.id))
        self.errors[job.id] = error

    def fenced(self) -> None:
        self.calls.append(("fenced", 0))



def live(store: Store, loop: FakeLoop, group: FakeGroup, job_id: int,
         placement: dict[str, Any]) -> Job:
    """Queued job `job_id` RUNNING its first attempt in `group` on `placement`, as the loop
    keeps it."""
    store.transition(job_id=job_id, to=JobState.PLACING, message="admitted")
    job = store.start_attempt(job_id=job_id)
    job = store.transition(job_id=job_id, to=JobState.RUNNING, message="running", attempt=1)
    loop.running[job_id] = LiveAttempt(group=group, attempt=1, started=time.monotonic(),
                                       spec=job.spec, health=AttemptHealth(store, job, 1,
                                                                           job.spec),
                                       placement=placement)
    return job


class FakeTracker:
    """Records what it is sent; `down` makes it not answer, `refuse` steps it refuses."""

    kind = Sink.MLFLOW

    def __init__(self, target: str) -> None:
        self.target = target
        self.steps: list[tuple[int, int, dict[str, float]]] = []
        self.told: list[tuple[str, bool]] = []
        self.summaries: list[dict[str, float]] = []
        self.opened = 0
        self.down = False
        self.refuse: set[int] = set()
        self.block: threading.Event | None = None

    def open(self, job: Job) -> tuple[str | None, str | None]:
        self._answer()
        self.opened += 1
        return f"run-{job.id}", "1"

    def discard(self, run_id: str) -> None:
        raise AssertionError("no run is made twice here")

    def send(self, job: Job, export: Export, steps: Sequence[StepScalars]) -> None:
        self._answer()
        if self.refuse & {s.step for s in steps}:
            raise TrackerRefused("400 INVALID_PARAMETER_VALUE")
        self.steps += [(s.attempt, s.step, s.values) for s in steps]

    def tell(self, job: Job, export: Export, *, final: bool) -> None:
        self._answer()
        self.told.append((job.state.value, final))

    def summarize(self, job: Job, export: Export, values: dict[str, float]) -> None:
        self._answer()
        self.summaries.append(values)

    def close(self) -> None:
        pass

    def _answer(self) -> None:
        if self.block is not None:
            self.block.wait(60)
        if self.down:
            raise TrackerDown("ConnectionRefusedError: [Errno 111] Connection refused")
