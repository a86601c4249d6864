"""Admission: which queued jobs start now. Pure functions; the controller calls `admit`.

A job is a gang: all its ranks start together or none do. Its ranks are claimed in bundles,
one per TP group (a TP group must sit on one node), so fitting a job means packing its
bundles onto the free capacity of the nodes. Queued jobs are taken by priority, then age;
admission stops at the first job that does not fit, so a large high-priority job is not
starved by smaller ones behind it. A job that could not fit even on the empty cluster is
reported as impossible instead of blocking the queue. A job whose project's quota
(`service.quota`) it would pass waits, with the reason, and does not block the jobs of other
projects behind it: within quota, priority then age decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from service.planner.stored import StoredPlan
from service.protocols import NodeCapacity
from service.quota import Held, Quotas, over_quota, take
from service.store import Job

_EPS = 1e-9


@dataclass(frozen=True)
class Bundle:
    cpus: float
    gpus: float


class Claim(Protocol):
    """What a job claims: a stored `Job`, or one being submitted (`service.jobs.Prepared`)."""

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


@dataclass(frozen=True)
class Admission:
    admitted: list[Job]
    impossible: list[tuple[Job, str]]
    waiting: list[tuple[Job, str]] = field(default_factory=list)
    """Jobs over their project's quota, and why."""


def admit(queued: list[Job], free: list[NodeCapacity], total: list[NodeCapacity],
          quotas: Quotas | None = None, holding: Held | None = None) -> Admission:
    """Choose the queued jobs (already in priority order) that start now, within their
    projects' `quotas`, given what every project's active jobs hold (`holding`)."""
    remaining = list(free)
    admitted: list[Job] = []
    impossible: list[tuple[Job, str]] = []
    waiting: list[tuple[Job, str]] = []
    holding = {p: dict(h) for p, h in (holding or {}).items()}
    for job in queued:
        items = bundles(job)
        if pack(items, total) is None:
            impossible.append((job, _why_impossible(job, items, total)))
            continue
        if (why := over_quota(job, holding, quotas or {})) is not None:
            waiting.append((job, why))
            continue
        where = pack(items, remaining)
        if where is None:
            break
        admitted.append(job)
        take(holding, job)
        used: dict[int, list[float]] = {}
        for b, n in zip(items, where, strict=True):
            acc = used.setdefault(n, [0.0, 0.0])
            acc[0] += b.cpus
            acc[1] += b.gpus
        remaining = [NodeCapacity(node.node_id, node.cpus - used.get(i, [0, 0])[0],
                                  node.gpus - used.get(i, [0, 0])[1])
                     for i, node in enumerate(remaining)]
    return Admission(admitted=admitted, impossible=impossible, waiting=waiting)


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
