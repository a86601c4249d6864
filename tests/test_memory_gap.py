"""`service.views.memory_gap`: each memory category planned against measured, per pipeline
stage, from a real stored plan (the control plane's, tp x pp x dp CPU ranks) and step rows as
the store returns them. In-process, well under a second."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from service.store import Metric
from service.views.memory_gap import (
    CATEGORIES,
    gap,
    measured_rows,
    measured_step,
    memory_by_stage,
    stage_rows,
)
from tests.conftest import stored_plan


def row(step: int, rank: int, memory: dict[str, Any], *, attempt: int = 1,
        pp_rank: int | None = None) -> Metric:
    data: dict[str, Any] = {"memory": memory}
    if pp_rank is not None:
        data["pp_rank"] = pp_rank
    return Metric(attempt=attempt, step=step, rank=rank, loss=1.0, step_time_s=0.1,
                  tokens_per_s=10.0, data=data, time=datetime.now(UTC))


def mem(scale: float, *, peak: float = 5e8) -> dict[str, Any]:
    return {"params_bytes": int(1000 * scale), "grads_bytes": int(2000 * scale),
            "optimizer_bytes": int(3000 * scale), "activations_peak_bytes": int(4000 * scale),
            "process_peak_bytes": int(peak)}


def cat(stage: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in stage["categories"] if c["name"] == name)


def test_every_stage_every_category_planned_against_measured_with_the_gap() -> None:
    plan = stored_plan(pp=2, dp=2)
    stage_of = plan.stage_of()
    rows = [row(7, r, mem(2.0 if r % 2 else 1.0)) for r in sorted(stage_of)]
    out = stage_rows(plan, rows)
    assert [s["stage"] for s in out] == [0, 1]
    planned = {m.stage: m for m in plan.memory_by_stage}
    for s in out:
        ranks = sorted(r for r, st in stage_of.items() if st == s["stage"])
        assert s["ranks"] == ranks and s["step"] == 7
        # No offload on either side: its host categories are left out.
        assert [c["name"] for c in s["categories"]] == [c.name for c in CATEGORIES
                                                       if not c.offload]
        scale = max(2.0 if r % 2 else 1.0 for r in ranks)  # the stage's most loaded rank
        p = cat(s, "params")
        assert p["planned"] == pytest.approx(float(planned[s["stage"]].params))
        assert p["measured"] == 1000 * scale
        assert p["gap"] == pytest.approx(p["measured"] - p["planned"])
        assert p["gap_pct"] == pytest.approx(p["gap"] / p["planned"])
        assert cat(s, "activations")["measured"] == 4000 * scale
        assert cat(s, "total")["measured"] == 5e8
        assert cat(s, "total")["planned"] == pytest.approx(float(planned[s["stage"]].total))
        # Planned per stage, logits on the last stage only; no rank measures them apart.
        logits = cat(s, "logits")
        assert (logits["planned"] > 0) == (s["stage"] == 1)
        assert logits["measured"] is None and "process peak" in logits["not_measured"]
        # Not reported by these ranks: not measured, no gap, no reason invented.
        zb = cat(s, "gathered")
        assert zb["measured"] is None and zb["gap"] is None and zb["not_measured"] is None


def test_the_ranks_own_stage_and_reasons_are_used() -> None:
    plan = stored_plan(pp=2)
    # Rank 0 says it is stage 1 (its report's pp_rank), and why it measures no buckets.
    m = mem(1.0) | {"not_measured": {"buckets": "no reduction bucket on CPU"}}
    out = stage_rows(plan, [row(3, 0, m, pp_rank=1)])
    assert out[0]["ranks"] == [] and out[0]["step"] is None
    assert cat(out[0], "params")["measured"] is None
    assert cat(out[0], "params")["not_measured"] is None  # no rank of the stage reported
    assert out[1]["ranks"] == [0]
    assert cat(out[1], "buckets")["not_measured"] == "no reduction bucket on CPU"


def test_an_offload_shows_its_host_categories_planned_against_measured() -> None:
    from service.contract.spec import JobSpec
    from service.submission.intake import prepare
    from tests.conftest import tiny_spec

    plan = prepare(JobSpec.model_validate(tiny_spec(
        model={"layers": 2, "hidden": 64, "heads": 8, "vocab": 256, "seq_len": 32},
        train={"global_batch": 4, "micro_batch": 1, "precision": "fp32"},
        parallel={"dp": 2, "zero": 2, "offload": "optimizer"}))).plan
    assert plan.memory is not None
    planned = plan.memory.to_json()
    measured = {"host_grads_bytes": int(planned["host_grads"]),
                "host_optimizer_bytes": int(planned["host_optimizer"]) + 8,
                "host_params_bytes": 0, "offload_buffers_bytes": 1000}
    [stage] = stage_rows(plan, [row(4, r, mem(1.0) | measured) for r in (0, 1)])
    names = [c["name"] for c in stage["categories"]]
    # The optimizer's partition and its gradients are on the host; no parameter is.
    assert {"host_grads", "host_optimizer", "offload_buffers"} <= set(names)
    assert "host_params" not in names
    assert cat(stage, "host_grads")["gap"] == 0
    assert cat(stage, "host_optimizer")["gap"] == pytest.approx(8)
    buffers = cat(stage, "offload_buffers")
    assert planned["offload_buffers"] > 0
    assert buffers["planned"] == pytest.approx(planned["offload_buffers"])
    assert buffers["measured"] == 1000


def test_measured_step_is_rank_0s_newest_measured_row_of_the_newest_attempt() -> None:
    peak_only = {"process_peak_bytes": 1}
    rows = [row(1, 0, mem(1.0)), row(2, 0, mem(1.0)), row(3, 0, peak_only),
            row(1, 0, peak_only, attempt=2), row(2, 0, mem(1.0), attempt=2),
            row(3, 0, peak_only, attempt=2)]
    m = measured_step(rows)
    assert m is not None and (m.attempt, m.step) == (2, 2)
    only_peaks = [row(1, 0, peak_only), row(2, 0, peak_only)]
    m = measured_step(only_peaks)
    assert m is not None and m.step == 2
    assert measured_step([]) is None


def test_one_query_reads_every_rank_of_that_step() -> None:
    plan = stored_plan(dp=2)
    asked: list[dict[str, Any]] = []
    stored = [row(4, r, mem(1.0)) for r in (0, 1)] + [row(5, r, {}) for r in (0, 1)]

    def list_metrics(**kw: Any) -> list[Metric]:
        asked.append(kw)
        return [m for m in stored if m.step > kw["after_step"]][: kw["limit"]]

    rank0 = [m for m in stored if m.rank == 0]
    assert [m.rank for m in measured_rows(list_metrics, 9, 2, rank0)] == [0, 1]
    assert asked == [{"job_id": 9, "rank": None, "attempt": 1, "after_step": 3, "limit": 2}]
    out = memory_by_stage(plan, list_metrics, 9, rank0)
    assert len(out) == 1 and out[0]["ranks"] == [0, 1]
    assert memory_by_stage(plan, list_metrics, 9, []) == [
        {**out[0], "ranks": [], "step": None,
         "categories": [{**c, "measured": None, "gap": None, "gap_pct": None,
                         "not_measured": None} for c in out[0]["categories"]]}]


def test_gap() -> None:
    assert gap(100.0, 110.0) == (10.0, pytest.approx(0.1))
    assert gap(None, 1.0) == (None, None) and gap(1.0, None) == (None, None)
    assert gap(0.0, 5.0) == (5.0, None)
