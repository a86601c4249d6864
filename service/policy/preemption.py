"""Preemption by priority: which running jobs make room for a queued job of higher priority,
and what is said about it.

The controller asks after each admission pass (`Controller._admit`): the job admission stopped
at (`Admission.blocked`: it fits the cluster and its project's quota, not the free room) may
stop running jobs of strictly lower priority whose spec allows it (`preemptible`, true unless
an admin said otherwise). `service.policy.scheduler.preemption_victims` picks the fewest GPU-hours
lost first (GPUs held times the hours since the victim's newest checkpoint, or since its
attempt started), as few as make the job fit; none when all of them would not. Each victim is
asked to save a checkpoint now (`WorkerGroup.preempt`: the ranks' control path, which sets
`RankContext.save_now` with `stop`), moves RUNNING -> PREEMPTED, and once its ranks stopped
(or `grace_s` passed) PREEMPTED -> QUEUED: its attempt ends `preempted` and spends no retry
(`Job.preemptions`). Both jobs' events say who preempted whom and why; the victim's queue
reason says it until it runs again. One preemption is in flight at a time: none starts while
a victim is still stopping or its room not yet given back.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.cluster.data_plane import NodeCapacity
from service.contract.states import JobState
from service.policy.scheduler import Running, preemption_victims
from service.store import Job, Store
from service.store.checkpoints import CheckpointIndex
from service.store.views import aware


@dataclass
class Victim:
    """A job asked to checkpoint and stop, for job `by`, or to move off a drained `node`."""

    by: int | None
    asked: float
    """`time.monotonic()` when it was asked."""
    node: str | None = None
    """The drained node it moves off (`service.control.cordons`), as its events name it."""
    grace_s: float | None = None
    """How long it has to stop (None: the controller's preemption grace)."""


def holds(placement: Mapping[str, Any] | None, job: Job) -> dict[str, tuple[float, float]]:
    """node id -> (CPUs, GPUs) that `job`'s ranks hold there, from its attempt's placement
    (empty: not placed yet)."""
    out: dict[str, tuple[float, float]] = {}
    per = (job.spec.resources.cpus_per_worker, job.spec.resources.gpus_per_worker)
    for r in (placement or {}).get("ranks", []):
        node = str(r.get("node_id"))
        c, g = out.get(node, (0.0, 0.0))
        out[node] = (c + per[0], g + per[1])
    return out


def lost_hours(store: Store, job: Job, started_s: float, now_s: float) -> tuple[float, float]:
    """(GPU-hours, CPU-hours) the job would lose if stopped now without a save: what it holds
    times the hours since its newest checkpoint or, before one, since its attempt started."""
    since = now_s - started_s
    tags = CheckpointIndex(store).list(job_id=job.id)
    if tags:
        newest = aware(tags[-1].created_at)
        assert newest is not None
        since = min(since, max(0.0, time.time() - newest.timestamp()))
    hours = since / 3600
    return job.gpus * hours, job.cpus * hours


def choose(store: Store, blocked: Job, active: list[Job], free: list[NodeCapacity],
           running: Mapping[int, tuple[float, Mapping[str, Any] | None]]) -> list[Running] | None:
    """The running jobs to preempt for `blocked` (None: none, or not enough). `running`: job
    id -> (its attempt's start, `time.monotonic()`; its placement)."""
    now = time.monotonic()
    candidates = []
    for job in active:
        if job.state != JobState.RUNNING or job.id not in running or \
                job.priority >= blocked.priority or not job.spec.preemptible:
            continue
        started, placement = running[job.id]
        held = holds(placement, job)
        if not held:
            continue
        gpu_h, cpu_h = lost_hours(store, job, started, now)
        candidates.append(Running(job=job, holds=held, lost_gpu_hours=gpu_h,
                                  lost_cpu_hours=cpu_h))
    if not candidates:
        return None
    return preemption_victims(blocked, free, candidates)


def asked_message(victim: Running, by: Job) -> str:
    return (f"preempted by job {by.id} ({by.name}, priority {by.priority} > {victim.job.priority}),"
            f" which needs its room: asked to save a checkpoint now and stop; it is requeued"
            f" without spending a retry ({victim.lost_gpu_hours:.3g} GPU-hours since its"
            " newest checkpoint)")


def preempting_message(victims: list[Running], by: Job) -> str:
    names = ", ".join(f"job {v.job.id} (priority {v.job.priority})" for v in victims)
    return (f"preempting {names} to make room for this job (priority {by.priority}): fewest"
            " GPU-hours lost first")
