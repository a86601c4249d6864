"""Memory planned against measured, category by category, for each pipeline stage.

Read by the job's REST answer (`predicted_vs_measured.memory_by_stage`, which `trident
describe` and `trident plan --compare` print) and by the job page's memory view. The plan
predicts the most loaded rank of each stage (`StoredPlan.memory_by_stage`); the measurement of
a stage is the largest value any of its ranks reported on the newest step rank 0 measured its
memory on (`monitor.memory_every`), newest attempt. The categories are those of
docs/planner-model.md; a category a rank cannot measure is `measured: None` with the reason
the rank gave (`MemoryReport.not_measured`), never folded into another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.planner.stored import StoredPlan
from service.store import Metric


@dataclass(frozen=True)
class Category:
    name: str
    """The plan's key (`MemoryBreakdown.to_json`)."""
    measured: tuple[str, ...]
    """The `MemoryReport` fields whose sum is the measured bytes (none: not measured by any
    rank)."""
    label: str
    offload: bool = False
    """Host memory of an offload: shown only where either side has some."""


CATEGORIES: tuple[Category, ...] = (
    Category("params", ("params_bytes",), "parameters"),
    Category("grads", ("grads_bytes",), "gradients"),
    Category("optimizer", ("optimizer_bytes",), "optimizer state"),
    Category("activations", ("activations_peak_bytes",), "activations"),
    Category("logits", (), "logits and loss"),
    Category("gathered", ("gathered_peak_bytes",), "ZeRO-3 gathered weights"),
    Category("buckets", ("buckets_bytes",), "communication buckets"),
    Category("framework", ("framework_bytes",), "framework"),
    Category("host_params", ("host_params_bytes",), "parameters in host memory", True),
    Category("host_grads", ("host_grads_bytes",), "gradients in host memory", True),
    Category("host_optimizer", ("host_optimizer_bytes",), "optimizer state in host memory",
             True),
    Category("offload_buffers", ("offload_buffers_bytes",), "offload staging buffers (host)",
             True),
    Category("total", ("process_peak_bytes",), "total (process peak)"),
)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _memory(metric: Metric) -> dict[str, Any]:
    """The step's memory report (`Metric.report`, the typed view), its fields by name: the
    categories name them."""
    return metric.report.memory.model_dump()


def measured_category(metric: Metric, cat: Category) -> float | None:
    """The bytes one rank's step reported for `cat` (None: not reported)."""
    if not cat.measured:
        return None
    mem = _memory(metric)
    values = [_number(mem.get(f)) for f in cat.measured]
    found = [v for v in values if v is not None]
    return sum(found) if found else None


def _reason(metrics: Sequence[Metric], cat: Category) -> str | None:
    """Why the ranks did not measure `cat`, as they said it (None: no reason given)."""
    if not cat.measured:
        return "no rank measures it apart: it is in the process peak"
    keys = {cat.name} | {f.removesuffix("_bytes").removesuffix("_peak") for f in cat.measured}
    for m in metrics:
        reasons = _memory(m).get("not_measured") or {}
        for k in keys:
            if k in reasons:
                return str(reasons[k])
    return None


def gap(planned: float | None, measured: float | None) -> tuple[float | None, float | None]:
    """(measured - planned, that over planned): None where either side is missing."""
    if planned is None or measured is None:
        return None, None
    return measured - planned, (measured - planned) / planned if planned else None


def _planned(plan: StoredPlan) -> dict[int, dict[str, float | None]]:
    """Each stage's planned bytes per category: the stored stage entries, and the most loaded
    stage's whole breakdown (a stage entry stored before a category was added lacks it). A
    job that is not planned has one stage and no planned bytes (None: measured only)."""
    if plan.memory is None:
        return {0: {c.name: None for c in CATEGORIES}}
    out: dict[int, dict[str, float | None]] = {}
    for s in plan.memory_by_stage:
        entry = s.model_dump()
        out[s.stage] = {c.name: _number(entry.get(c.name)) for c in CATEGORIES}
    whole = plan.memory.to_json()
    loaded = out.setdefault(int(plan.memory.stage), {})
    for c in CATEGORIES:
        if loaded.get(c.name) is None:
            loaded[c.name] = _number(whole.get(c.name))
    return out


def stage_rows(plan: StoredPlan, step_rows: Sequence[Metric]) -> list[dict[str, Any]]:
    """Per stage: its ranks that reported, the step, and per category planned, measured and
    the gap (absolute and as a share of planned). `step_rows` are every rank's rows of one
    step (`measured_rows`)."""
    stage_of = plan.stage_of()
    by_stage: dict[int, list[Metric]] = {}
    for m in step_rows:
        pp = m.report.pp_rank  # the rank's own word; else the plan's rank layout
        stage = pp if pp is not None else stage_of.get(m.rank, 0)
        by_stage.setdefault(stage, []).append(m)
    out = []
    for stage, planned in sorted(_planned(plan).items()):
        rows = by_stage.get(stage, [])
        cats = []
        for c in CATEGORIES:
            values = [v for m in rows if (v := measured_category(m, c)) is not None]
            measured = max(values) if values else None
            if c.offload and not planned.get(c.name) and not measured:
                continue  # no offload on either side
            diff, share = gap(planned.get(c.name), measured)
            cats.append({"name": c.name, "label": c.label, "planned": planned.get(c.name),
                         "measured": measured, "gap": diff, "gap_pct": share,
                         "not_measured": _reason(rows, c) if measured is None and rows
                         else None})
        out.append({"stage": stage, "ranks": sorted(m.rank for m in rows),
                    "step": rows[0].step if rows else None, "categories": cats})
    return out


def measured_step(rank0: Sequence[Metric]) -> Metric | None:
    """Rank 0's newest row (newest attempt) that measured any category besides the peak;
    else its newest row; None without rows."""
    if not rank0:
        return None
    attempt = max(m.attempt for m in rank0)
    rows = [m for m in rank0 if m.attempt == attempt]
    for m in reversed(rows):
        if any(measured_category(m, c) is not None for c in CATEGORIES[:-1]):
            return m
    return rows[-1]


ListMetrics = Callable[..., list[Metric]]
"""`Store.list_metrics`."""


def measured_rows(list_metrics: ListMetrics, job_id: int, world_size: int,
                  rank0: Sequence[Metric]) -> list[Metric]:
    """Every rank's row of the step `measured_step` picks (one query, `world_size` rows)."""
    m = measured_step(rank0)
    if m is None:
        return []
    return [r for r in list_metrics(job_id=job_id, rank=None, attempt=m.attempt,
                                    after_step=m.step - 1, limit=world_size)
            if r.step == m.step]


def memory_by_stage(plan: StoredPlan, list_metrics: ListMetrics, job_id: int,
                    rank0: Sequence[Metric]) -> list[dict[str, Any]]:
    """`stage_rows` of the job's newest measured step."""
    return stage_rows(plan, measured_rows(list_metrics, job_id, plan.world_size, rank0))
