"""Admission: which queued jobs start now. Pure functions; the controller calls `admit`.

A job is a gang: all its ranks start together or none do. Its ranks are claimed in bundles,
one per TP group (a TP group must sit on one node), so fitting a job means packing its
bundles onto the free capacity of the nodes. Queued jobs are taken by priority, then age;
admission stops at the first job that does not fit, so a large high-priority job is not
starved by smaller ones behind it. A job that could not fit even on the empty cluster is
reported as impossible instead of blocking the queue. A job whose project's quota
(`service.policy.quota`) it would pass waits, with the reason, and does not block the jobs of other
projects behind it: within quota, priority then age decide.

A RESTARTING job whose last group is still being stopped keeps its claim: admission takes it
in its place by priority and age and keeps its room free of the jobs behind it
(`Admission.reserved`), or stops at it when its room is not free yet, so a job of lower
priority admitted while the old group's resources come back never takes the room the
restart needs. The controller places it once the old group is gone (`Controller._restart`).

Preemption (`preemption_victims`): the job admission stopped at (`Admission.blocked`) may take
the room of running jobs of strictly lower priority that are preemptible, the fewest GPU-hours
lost first (GPUs held times the time since their newest checkpoint; then CPU-hours, then the
lower priority, then the younger job), as few as make it fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.cluster.data_plane import NodeCapacity
from service.planner.stored import StoredPlan
from service.policy.quota import Held, Quotas, over_quota, take
from service.store import Job

_EPS = 1e-9


@dataclass(frozen=True)
class Bundle:
    cpus: float
    gpus: float


class Claim(Protocol):
    """What a job claims: a stored `Job`, or one being submitted
    (`service.submission.intake.Prepared`)."""

    @property
    def plan(self) -> StoredPlan: ...
    @property
    def world_size(self) -> int: ...
    @property
    def cpus(self) -> float: ...
    @property
    def gpus(self) -> float: ...


def bundles(job: Claim) -> list[Bundle]:
    """One bundle per TP group: tp ranks' worth of CPUs and GPUs."""
    tp = job.plan.layout.tp
    groups = job.world_size // tp
    return [Bundle(cpus=job.cpus * tp, gpus=job.gpus * tp) for _ in range(groups)]


def pack(items: list[Bundle], nodes: list[NodeCapacity]) -> list[int] | None:
    """First-fit decreasing: the node index of every bundle (in input order), or None."""
    free = [[n.cpus, n.gpus] for n in nodes]
    order = sorted(range(len(items)), key=lambda i: (items[i].gpus, items[i].cpus), reverse=True)
    where = [0] * len(items)
    for i in order:
        b = items[i]
        for n, cap in enumerate(free):
            if cap[0] + _EPS >= b.cpus and cap[1] + _EPS >= b.gpus:
                cap[0] -= b.cpus
                cap[1] -= b.gpus
                where[i] = n
                break
        else:
            return None
    return where


def taken(free: list[NodeCapacity], items: list[Bundle],
          where: list[int]) -> list[NodeCapacity]:
    """The free room once `items` are placed on the nodes `where` says (`pack`'s answer)."""
    used = [[0.0, 0.0] for _ in free]
    for b, n in zip(items, where, strict=True):
        used[n][0] += b.cpus
        used[n][1] += b.gpus
    return [NodeCapacity(node.node_id, node.cpus - u[0], node.gpus - u[1])
            for node, u in zip(free, used, strict=True)]


@dataclass(frozen=True)
class Admission:
    admitted: list[Job]
    impossible: list[tuple[Job, str]]
    waiting: list[tuple[Job, str]] = field(default_factory=list)
    """Jobs over their project's quota, and why."""
    blocked: Job | None = None
    """The job admission stopped at: it fits the cluster and its quota, not the free room
    (a restarting job, when its old group's room is not free yet)."""
    reserved: list[Job] = field(default_factory=list)
    """Restarting jobs whose room admission kept free for them."""


def admit(queued: list[Job], free: list[NodeCapacity], total: list[NodeCapacity],
          quotas: Quotas | None = None, holding: Held | None = None,
          restarting: Sequence[Job] = ()) -> Admission:
    """Choose the queued jobs (already in priority order) that start now, within their
    projects' `quotas`, given what every project's active jobs hold (`holding`). The
    `restarting` jobs (their old groups still stopping; within their quota already, as
    active jobs) take their place by priority and age: their room is reserved, never
    admitted."""
    remaining = list(free)
    admitted: list[Job] = []
    reserved: list[Job] = []
    impossible: list[tuple[Job, str]] = []
    waiting: list[tuple[Job, str]] = []
    holding = {p: dict(h) for p, h in (holding or {}).items()}
    blocked: Job | None = None
    held = {j.id for j in restarting}
    for job in sorted([*queued, *restarting], key=lambda j: (-j.priority, j.id)):
        items = bundles(job)
        if pack(items, total) is None:
            if job.id not in held:  # a restart the cluster lost the room of: the controller's
                impossible.append((job, _why_impossible(job, items, total)))
            continue
        if job.id not in held and (why := over_quota(job, holding, quotas or {})) is not None:
            waiting.append((job, why))
            continue
        where = pack(items, remaining)
        if where is None:
            blocked = job
            break
        if job.id in held:
            reserved.append(job)
        else:
            admitted.append(job)
            take(holding, job)
        remaining = taken(remaining, items, where)
    return Admission(admitted=admitted, impossible=impossible, waiting=waiting,
                     blocked=blocked, reserved=reserved)


@dataclass(frozen=True)
class Running:
    """A running job as preemption sees it: what it holds on each node, and what stopping
    it now would lose."""

    job: Job
    holds: dict[str, tuple[float, float]]
    """node id -> (CPUs, GPUs) its ranks hold there."""
    lost_gpu_hours: float
    """GPUs it holds times the hours since its newest checkpoint (or its attempt's start)."""
    lost_cpu_hours: float


def preemption_victims(job: Job, free: list[NodeCapacity],
                       running: Sequence[Running]) -> list[Running] | None:
    """The running jobs to stop so that `job` fits, or None when stopping every candidate
    would not make it fit (then none is stopped). Candidates: preemptible, of strictly lower
    priority; taken the fewest GPU-hours lost first, and then dropped again, costliest first,
    where the others leave room enough."""
    candidates = sorted(
        (r for r in running if r.job.priority < job.priority and r.job.spec.preemptible),
        key=lambda r: (r.lost_gpu_hours, r.lost_cpu_hours, r.job.priority, -r.job.id))
    items = bundles(job)
    chosen: list[Running] = []
    for r in candidates:
        chosen.append(r)
        if pack(items, _freed(free, chosen)) is not None:
            break
    else:
        return None
    for r in reversed(chosen[:-1]):  # one taken early may be needless once later ones are
        rest = [c for c in chosen if c is not r]
        if pack(items, _freed(free, rest)) is not None:
            chosen = rest
    return chosen


def _freed(free: list[NodeCapacity], stopped: Sequence[Running]) -> list[NodeCapacity]:
    """The free room once the `stopped` jobs' ranks are gone."""
    out = []
    for n in free:
        cpus = n.cpus + sum(r.holds.get(n.node_id, (0.0, 0.0))[0] for r in stopped)
        gpus = n.gpus + sum(r.holds.get(n.node_id, (0.0, 0.0))[1] for r in stopped)
        out.append(NodeCapacity(n.node_id, cpus, gpus))
    return out


def unplaceable(job: Job, total: list[NodeCapacity]) -> str | None:
    """Why the job cannot be placed on the whole cluster even when idle, or None if it can."""
    items = bundles(job)
    return None if pack(items, total) is not None else _why_impossible(job, items, total)


def _why_impossible(job: Job, items: list[Bundle], total: list[NodeCapacity]) -> str:
    need_cpu = sum(b.cpus for b in items)
    need_gpu = sum(b.gpus for b in items)
    have_cpu = sum(n.cpus for n in total)
    have_gpu = sum(n.gpus for n in total)
    biggest = max(((n.cpus, n.gpus) for n in total), default=(0.0, 0.0))
    return (f"{job.world_size} ranks need {need_cpu:g} CPUs and {need_gpu:g} GPUs in"
            f" {len(items)} TP-group bundles of {items[0].cpus:g} CPUs / {items[0].gpus:g} GPUs"
            f" each; the cluster has {have_cpu:g} CPUs and {have_gpu:g} GPUs over {len(total)}"
            f" nodes, the largest node {biggest[0]:g} CPUs / {biggest[1]:g} GPUs")
