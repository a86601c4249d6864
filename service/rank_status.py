"""Each rank's status in a job's newest attempt, computed once for every reader.

`rank_status(store, job)` is what the dashboard's ranks grid and `trident top` show (through
`GET /api/v1/jobs/{id}/ranks`, `RanksStatus.to_json`) and what `GET /metrics` exports per rank
(`api.prometheus`): where each rank sits and runs (coordinates, node, GPU), its measured peak
memory against the plan's prediction for its pipeline stage, its compute time against its
stage peers' median, its newest step (step time, seconds in TP/PP/DP collectives, when it was
reported), the age of its last heartbeat as the controller saw it, and whether it is a
straggler or a rank a hang waits for (the newest attempt's events).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from service.planner.stored import PlannedLayout
from service.store import Job, Metric, Store
from service.store.dashboard import marked_ranks
from service.store.heartbeats import HeartbeatLog, ages
from service.store.tables import utcnow

WINDOW = 20
"""Steps of the newest attempt a status reads (medians, peaks, the newest report)."""


@dataclass(frozen=True)
class RankStatus:
    """One rank of the layout, as measured against the plan."""

    rank: int
    tp: int
    pp: int
    dp: int
    node: str | None
    """Its host name, once placed."""
    gpu: str | None
    """Its GPU indices, comma-separated (None on CPU)."""
    memory_peak_bytes: float | None
    """The largest process peak it reported in the window."""
    memory_predicted_bytes: float
    """The plan's bytes per device for its pipeline stage (the most loaded rank's without
    a per-stage split)."""
    compute_s: float | None
    """Median seconds per step outside timed collectives."""
    stage_compute_s: float | None
    """Median of its pipeline stage's ranks' `compute_s`."""
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

    @property
    def memory_ratio(self) -> float | None:
        if self.memory_peak_bytes is None or not self.memory_predicted_bytes:
            return None
        return self.memory_peak_bytes / self.memory_predicted_bytes

    @property
    def compute_ratio(self) -> float | None:
        if self.compute_s is None or not self.stage_compute_s:
            return None
        return self.compute_s / self.stage_compute_s

    def to_json(self) -> dict[str, Any]:
        """A cell of the ranks grid (`GET /jobs/{id}/ranks`)."""
        return {
            "rank": self.rank, "tp": self.tp, "pp": self.pp, "dp": self.dp,
            "node": self.node, "gpu": self.gpu,
            "memory_peak_bytes": self.memory_peak_bytes,
            "memory_predicted_bytes": self.memory_predicted_bytes,
            "memory_ratio": self.memory_ratio,
            "compute_s": self.compute_s, "stage_compute_s": self.stage_compute_s,
            "compute_ratio": self.compute_ratio,
            "step": self.step, "step_time_s": self.step_time_s,
            "tp_s": self.tp_s, "pp_s": self.pp_s, "dp_s": self.dp_s,
            "reported_at": self.reported_at, "heartbeat_age_s": self.heartbeat_age_s,
            "straggler": self.straggler, "hang_waits_for": self.hang_waits_for}


@dataclass(frozen=True)
class RanksStatus:
    """Every rank of a job's layout in its newest attempt."""

    layout: PlannedLayout
    world_size: int
    attempt: int | None
    ranks: list[RankStatus]

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.model_dump(), "world_size": self.world_size,
                "attempt": self.attempt, "cells": [r.to_json() for r in self.ranks]}


def _comm_s(m: Metric | None) -> tuple[float | None, float | None, float | None]:
    """Seconds of one step report in TP, PP and DP collectives (None: not timed)."""
    split = m.step_split() if m is not None else None
    if split is None:
        return None, None, None
    return split.dim_s("tp"), split.dim_s("pp"), split.dim_s("dp")


def rank_status(store: Store, job: Job, window: int = WINDOW) -> RanksStatus:
    """Every rank of `job`'s layout in its newest attempt, from the last `window` steps."""
    plan = job.plan
    by_stage = plan.stage_bytes()
    attempts = store.list_attempts(job_id=job.id)
    placement = {r["rank"]: r for r in (attempts[-1].placement.get("ranks", [])
                                        if attempts else [])}
    latest = store.latest_metric(job_id=job.id)
    recent: dict[int, list[Metric]] = {}
    if latest is not None:
        for m in store.list_metrics(job_id=job.id, rank=None, attempt=latest.attempt,
                                    after_step=max(0, latest.step - window), limit=100000):
            recent.setdefault(m.rank, []).append(m)
    compute: dict[int, float] = {}
    for r, ms in recent.items():
        times = [x.compute_s for m in ms if (x := m.step_split()) is not None]
        if times:
            compute[r] = statistics.median(times)
    stage_of = plan.stage_of()
    peers: dict[int, list[float]] = {}
    for r, t in compute.items():
        peers.setdefault(stage_of.get(r, 0), []).append(t)
    number = attempts[-1].number if attempts else None
    beats = ages(HeartbeatLog(store).last_seen(job_id=job.id, attempt=number),
                 utcnow()) if number is not None else {}
    stragglers, waited_for = marked_ranks(store, job_id=job.id, attempt=number)
    out = []
    for row in plan.rank_layout:
        ms = recent.get(row.rank, [])
        peaks = [p for m in ms
                 if isinstance(p := m.report.memory.process_peak_bytes, int | float)]
        place = placement.get(row.rank, {})
        newest = ms[-1] if ms else None
        tp_s, pp_s, dp_s = _comm_s(newest)
        out.append(RankStatus(
            rank=row.rank, tp=row.tp, pp=row.pp, dp=row.dp, node=place.get("hostname"),
            gpu=",".join(place.get("gpu_ids") or []) or None,
            memory_peak_bytes=max(peaks) if peaks else None,
            memory_predicted_bytes=by_stage.get(row.pp, float(plan.memory.total)),
            compute_s=compute.get(row.rank),
            stage_compute_s=statistics.median(peers[row.pp]) if peers.get(row.pp) else None,
            step=newest.step if newest else None,
            step_time_s=newest.step_time_s if newest else None,
            tp_s=tp_s, pp_s=pp_s, dp_s=dp_s, reported_at=newest.time if newest else None,
            heartbeat_age_s=beats.get(row.rank), straggler=row.rank in stragglers,
            hang_waits_for=row.rank in waited_for))
    return RanksStatus(layout=plan.layout, world_size=plan.world_size, attempt=number,
                       ranks=out)
