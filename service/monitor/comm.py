"""The `/comm` view: communication per parallel dimension over the stored step reports.

`GET /api/v1/jobs/{id}/comm` calls `comm_view`, which reads the newest attempt's stored steps
and the job's bandwidth probe from the store and hands them to `summarize_comm` (pure, tested
on its own). A step's seconds per dimension are its `Metric.step_split()`, as everywhere a
stored step is read; its bytes, calls and each op's seconds are its typed collectives
(`Metric.report.comm`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.contract.parallel import Dim, ParallelDims
from service.monitor.bandwidth import busbw_factor
from service.store import Job, Metric, Store
from service.store.reported import by_script, reported


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclass
class _OpTotals:
    """One op of one dimension, summed over one rank's reports."""

    time_s: float = 0.0
    """Seconds on timed steps only."""
    bytes: float = 0.0
    calls: float = 0.0


@dataclass
class _DimTotals:
    """One dimension over every rank: each rank's per-step means, and the bus bytes and
    seconds of timed steps summed over the ranks (their quotient is the achieved busbw)."""

    time_s: list[float] = field(default_factory=list)
    """Per rank: seconds per timed step."""
    bytes: list[float] = field(default_factory=list)
    """Per rank: bytes per step."""
    bus_bytes: float = 0.0
    timed_s: float = 0.0


def _bus_bytes(op: str, n: int, o: _OpTotals, timed: int, total: int) -> float:
    """Bytes of `op` on timed steps, times its busbw factor (unknown ops count as factor 1)."""
    try:
        factor = busbw_factor(op, n)
    except ValueError:
        factor = 1.0
    return o.bytes * (timed / total if total else 0.0) * factor


def summarize_comm(rank_reports: Mapping[int, Sequence[Metric]],
                   group_size: Mapping[str, int] | ParallelDims,
                   predicted: Mapping[str, Any] | None = None,
                   probe: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Per dimension time per step, fraction of step, bytes, achieved busbw and the plan's
    predicted share, plus the per-rank breakdown and the probe rows.

    `predicted` is the plan's step-time split (`StoredPlan.time`: `step_s`, `tp_comm_s`, ...).

    `rank_reports[rank]` is that rank's stored steps whose collectives were counted
    (`Metric.report.comm`: `{dim: {op: {"time_s", "bytes", "calls"}}}`). Steps whose
    collectives were not timed (GPU steps between CUDA-event samples: `report.timed` False,
    so no `step_split()`) count toward bytes but not toward time.
    """
    sizes = ({d.value: getattr(group_size, d.value) for d in Dim}
             if isinstance(group_size, ParallelDims) else dict(group_size))
    plan_time = predicted or {}
    per_rank = []
    totals: dict[str, _DimTotals] = {}
    step_times = []
    for rank, reports in sorted(rank_reports.items()):
        if not reports:
            continue
        splits = [split for m in reports if (split := m.step_split()) is not None]
        timed = len(splits)
        rank_step_s = _mean([m.step_time_s for m in reports])
        step_times.append(rank_step_s)
        row: dict[str, Any] = {"rank": rank, "step_time_s": rank_step_s,
                               "steps": len(reports), "dims": {}}
        for dim in sorted({d for m in reports for d in m.report.comm or {}}):
            ops: dict[str, _OpTotals] = {}
            for m in reports:
                for op, s in (m.report.comm or {}).get(dim, {}).items():
                    o = ops.setdefault(op, _OpTotals())
                    o.bytes += s["bytes"]
                    o.calls += s["calls"]
                    if m.report.timed:
                        o.time_s += s["time_s"]
            n = sizes.get(dim, 2)
            t_total = sum(x.dim_s(dim) for x in splits)
            t_step = t_total / max(timed, 1)
            b_step = sum(o.bytes for o in ops.values()) / len(reports)
            bus_bytes = sum(_bus_bytes(op, n, o, timed, len(reports)) for op, o in ops.items())
            row["dims"][dim] = {
                "time_s": t_step, "fraction": t_step / rank_step_s if rank_step_s else 0.0,
                "bytes": b_step, "busbw": bus_bytes / t_total if t_total else None,
                "ops": {op: {"time_s": o.time_s / max(timed, 1),
                             "bytes": o.bytes / len(reports),
                             "calls": o.calls / len(reports)} for op, o in ops.items()},
            }
            acc = totals.setdefault(dim, _DimTotals())
            acc.time_s.append(t_step)
            acc.bytes.append(b_step)
            acc.bus_bytes += bus_bytes
            acc.timed_s += t_total
        per_rank.append(row)
    step_time_s = _mean(step_times)
    pred_step = plan_time.get("step_s")
    dims_out = {}
    for dim in [d.value for d in Dim] + sorted(set(totals) - {d.value for d in Dim}):
        tot = totals.get(dim)
        pred = plan_time.get(f"{dim}_comm_s")
        if tot is None and pred is None:
            continue
        t = _mean(tot.time_s) if tot else 0.0
        dims_out[dim] = {
            "time_s_per_step": t,
            "max_rank_time_s_per_step": max(tot.time_s) if tot else 0.0,
            "fraction": t / step_time_s if step_time_s else 0.0,
            "bytes_per_step": _mean(tot.bytes) if tot else 0.0,
            "busbw": tot.bus_bytes / tot.timed_s if tot and tot.timed_s else None,
            "predicted_time_s_per_step": pred,
            "predicted_fraction": pred / pred_step if pred is not None and pred_step else None,
        }
    return {"step_time_s": step_time_s, "predicted_step_s": pred_step, "dims": dims_out,
            "ranks": per_rank, "probe": list(probe or [])}


def comm_view(store: Store, job: Job, last: int) -> dict[str, Any]:
    """`GET /api/v1/jobs/{id}/comm`: `summarize_comm` over the last `last` steps of the newest
    attempt, with the job's newest bandwidth probe (rows and summary), and what those steps
    carried (`reported`: a command job's collectives are only those its script reports)."""
    latest = store.latest_metric(job_id=job.id)
    rank_reports: dict[int, list[Metric]] = {}
    window: list[Metric] = []
    if latest is not None:
        window = store.list_metrics(job_id=job.id, rank=None, attempt=latest.attempt,
                                    after_step=max(0, latest.step - last))
        for m in window:
            if m.report.comm is not None:
                rank_reports.setdefault(m.rank, []).append(m)
    probes = store.list_probes(job_id=job.id, limit=1)
    predicted = job.plan.time.to_json() if job.plan.time is not None else None
    out = summarize_comm(rank_reports, job.plan.layout.dims, predicted,
                         probes[0].results if probes else [])
    out["attempt"] = latest.attempt if latest else None
    out["probe_summary"] = probes[0].summary if probes else None
    out["reported"] = reported(window, script=by_script(job))
    return out
