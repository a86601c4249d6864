"""Project quotas: how much of the cluster a project's running jobs may hold together.

A project may cap the GPUs its jobs hold at once, and the CPUs its CPU-only jobs hold (a GPU
job's CPUs come with its GPUs). The scheduler (`service.policy.scheduler.admit`) admits a queued job
only when its project's holding plus the job's claim stays within the cap; a job that would
pass it waits, and the reason (`waiting for quota: project vision holds 24/24 GPUs, ...`) is
kept on the job and written as one event each time it changes
(`service.store.quota_waits.QuotaNotes`),
so a job waiting through many passes does not flood its events.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from service.store import Job

_EPS = 1e-9


@dataclass(frozen=True)
class Quota:
    gpus: float | None = None
    cpus: float | None = None

    def limit(self, kind: str) -> float | None:
        return self.gpus if kind == "GPUs" else self.cpus


Quotas = Mapping[str, Quota]
Held = dict[str, dict[str, float]]
"""project -> {"GPUs": held, "CPUs": held by CPU-only jobs}."""


def claim(job: Job) -> tuple[str, float]:
    """What a job counts against its project's quota: its GPUs, or, for a CPU-only job, its
    CPUs."""
    if job.gpus > 0:
        return "GPUs", job.gpus * job.world_size
    return "CPUs", job.cpus * job.world_size


def held(active: Iterable[Job]) -> Held:
    """What every project's active (placing, running, restarting) jobs hold."""
    out: Held = {}
    for job in active:
        if job.project is not None and job.state.active:
            kind, amount = claim(job)
            per = out.setdefault(job.project, {})
            per[kind] = per.get(kind, 0.0) + amount
    return out


def over_quota(job: Job, holding: Held, quotas: Quotas) -> str | None:
    """Why `job` must wait for its project's quota; None when it may start."""
    quota = quotas.get(job.project) if job.project is not None else None
    if quota is None:
        return None
    kind, need = claim(job)
    limit = quota.limit(kind)
    if limit is None:
        return None
    have = holding.get(job.project or "", {}).get(kind, 0.0)
    if have + need <= limit + _EPS:
        return None
    if need > limit + _EPS:
        return (f"waiting for quota: project {job.project} may hold {limit:g} {kind}, this job"
                f" needs {need:g} (an admin raises it with `trident project quota`)")
    return (f"waiting for quota: project {job.project} holds {have:g}/{limit:g} {kind}, this"
            f" job needs {need:g}")


def take(holding: Held, job: Job) -> None:
    """Count an admitted job in its project's holding."""
    if job.project is not None:
        kind, amount = claim(job)
        per = holding.setdefault(job.project, {})
        per[kind] = per.get(kind, 0.0) + amount
