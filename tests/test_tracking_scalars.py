"""A stored step as named scalars (`service.tracking.scalars`), and the custom metrics a step
report may carry (`service.contract.reports.StepReport.custom`): pure, no database."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from service.contract.reports import CUSTOM_MAX, CUSTOM_NAME_MAX, StepReport
from service.store import Metric
from service.tracking.scalars import first_rank_of_stages, scalars_of, step_scalars
from tests.conftest import stored_plan

T = datetime(2026, 1, 1, tzinfo=UTC)


def row(rank: int = 0, step: int = 1, **data: object) -> Metric:
    return Metric(attempt=1, step=step, rank=rank, loss=2.5, step_time_s=0.5,
                  tokens_per_s=1000.0, data=dict(data), time=T)


def test_a_row_is_exported_by_its_stored_names_whatever_fields_it_has() -> None:
    """Every number of the row by its field name, new per-step fields included (eval_loss,
    lr and grad_norm as other parts of Trident add them): no list of names to keep up."""
    plan = stored_plan(dp=2)
    m = row(eval_loss=2.75, lr=3e-4, grad_norm=1.5, bubble_s=0.0, tp_rank=0, pp_rank=0,
            dp_rank=0, resumed_from=0, attempt=1, timed=True, checkpoint="/x",
            memory={"process_peak_bytes": 123, "params_bytes": 7, "process_peak_source": "rss"},
            comm={"dp": {"all_reduce": {"time_s": 0.1, "bytes": 8.0, "calls": 2.0},
                         "all_gather": {"time_s": 0.05, "bytes": 4.0, "calls": 1.0}}},
            custom={"accuracy": 0.75, "note": "text", "done": True})
    s = step_scalars(m, plan)
    assert (s.attempt, s.step, s.time) == (1, 1, T)
    per_token = plan.model_dump()["mfu"] / plan.tokens_per_s
    assert s.values == pytest.approx({
        "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 1000.0, "eval_loss": 2.75,
        "lr": 3e-4, "grad_norm": 1.5, "bubble_s": 0.0, "mfu": 1000.0 * per_token,
        "comm_share/dp": 0.15 / 0.5, "memory/stage0/process_peak_bytes": 123.0,
        "memory/stage0/params_bytes": 7.0, "accuracy": 0.75})


def test_a_guarded_steps_counts_go_to_the_trackers_and_its_words_do_not() -> None:
    """MLflow and TensorBoard get the training guard's counts with the step
    (docs/guards.md); the flag, the reason and the rollback's ranges stay in the store."""
    m = row(step=6, skipped=True, guard="loss not finite", skipped_steps=3, rollbacks=1,
            rollback={"to_step": 4, "samples": [[32, 40], [40, 48]], "reason": "x"})
    values = step_scalars(m, stored_plan(dp=2)).values
    assert values["skipped_steps"] == 3.0 and values["rollbacks"] == 1.0
    assert not {"skipped", "guard", "rollback"} & values.keys()


def test_untimed_steps_have_no_comm_share_and_nan_is_left_out() -> None:
    m = Metric(attempt=1, step=3, rank=0, loss=None, step_time_s=0.5, tokens_per_s=1.0,
               data={"timed": False, "comm": {"tp": {"x": {"time_s": 0.0, "bytes": 1.0,
                                                             "calls": 1.0}}},
                     "grad_norm": math.nan, "custom": {"inf": math.inf}}, time=T)
    values = step_scalars(m, stored_plan()).values
    assert "loss" not in values and "grad_norm" not in values and "inf" not in values
    assert not any(k.startswith("comm_share/") for k in values)


def test_memory_per_stage_comes_from_each_stages_first_stored_rank() -> None:
    plan = stored_plan(pp=2, dp=2)
    leaders = first_rank_of_stages(plan)
    assert leaders[0] == 0 and set(leaders) == {0, 1}
    rows = [row(rank=r, step=s, memory={"process_peak_bytes": 100 * (r + 1) + s})
            for s in (1, 2) for r in range(plan.world_size)]
    steps = scalars_of(rows, plan)
    assert [s.step for s in steps] == [1, 2]
    for s in steps:
        assert s.values["memory/stage0/process_peak_bytes"] == 100 + s.step
        assert s.values["memory/stage1/process_peak_bytes"] == 100 * (leaders[1] + 1) + s.step


def test_a_step_without_rank_0s_row_is_not_a_step_yet() -> None:
    plan = stored_plan(pp=2)
    assert scalars_of([row(rank=first_rank_of_stages(plan)[1])], plan) == []


def _report(**custom: object) -> StepReport:
    return StepReport(rank=0, step=1, step_time_s=1.0, tokens_per_s=1.0, custom=custom)


def test_custom_metrics_are_bounded_and_named_where_the_report_is_read() -> None:
    ok = _report(**{"accuracy": 0.9, "val.top-5": 0.99, "_x": 1, "n" * CUSTOM_NAME_MAX: 2})
    assert ok.row()["data"]["custom"]["accuracy"] == 0.9
    refused = {
        "count": {f"m{i}": i for i in range(CUSTOM_MAX + 1)},
        "length": {"n" * (CUSTOM_NAME_MAX + 1): 1},
        "charset": {"two words": 1},
        "slash": {"memory/stage0": 1},
        "a field": {"loss": 1.0},
        "derived": {"mfu": 0.5},
    }
    for why, custom in refused.items():
        with pytest.raises(ValidationError) as err:
            _report(**custom)
        assert "custom" in str(err.value), why
