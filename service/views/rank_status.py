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
from typing import Any

from client.payloads import RankCell
from service.planner.stored import PlannedLayout
from service.store import Job, Metric, Store
from service.store.dashboard import marked_ranks
from service.store.heartbeats import HeartbeatLog, ages
from service.store.tables import utcnow

WINDOW = 20
"""Steps of the newest attempt a status reads (medians, peaks, the newest report)."""


def _ratio(measured: float | None, against: float | None) -> float | None:
    if measured is None or not against:
        return None
    return measured / against


@dataclass(frozen=True)
class RanksStatus:
    """Every rank of a job's layout in its newest attempt."""

    layout: PlannedLayout
    world_size: int
    attempt: int | None
    ranks: list[RankCell]

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout.model_dump(), "world_size": self.world_size,
                "attempt": self.attempt, "cells": [r.model_dump() for r in self.ranks]}


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
        peak = max(peaks) if peaks else None
        predicted = by_stage.get(row.pp, float(plan.memory.total)) if plan.memory else None
        stage_s = statistics.median(peers[row.pp]) if peers.get(row.pp) else None
        out.append(RankCell(
            rank=row.rank, tp=row.tp, pp=row.pp, dp=row.dp, node=place.get("hostname"),
            gpu=",".join(place.get("gpu_ids") or []) or None,
            memory_peak_bytes=peak, memory_predicted_bytes=predicted,
            memory_ratio=_ratio(peak, predicted),
            compute_s=compute.get(row.rank), stage_compute_s=stage_s,
            compute_ratio=_ratio(compute.get(row.rank), stage_s),
            step=newest.step if newest else None,
            step_time_s=newest.step_time_s if newest else None,
            tp_s=tp_s, pp_s=pp_s, dp_s=dp_s, reported_at=newest.time if newest else None,
            heartbeat_age_s=beats.get(row.rank), straggler=row.rank in stragglers,
            hang_waits_for=row.rank in waited_for))
    return RanksStatus(layout=plan.layout, world_size=plan.world_size, attempt=number,
                       ranks=out)
