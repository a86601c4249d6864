"""The step report: one `StepReport` from the rank to the metrics row, each value stored once,
and the readers of stored rows (the /comm view, compare, the metrics API schema)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.schemas import metric_out_of
from service.contract.reports import METRIC_COLUMNS, MemoryReport, StepReport
from service.contract.spec import JobSpec
from service.monitor.comm import comm_view
from service.store import Store
from service.submission.intake import submit
from service.views.prediction import compare
from tests.conftest import migrated_sqlite, record_steps, tiny_spec

COMM = {"dp": {"all_reduce": {"time_s": 0.02, "bytes": 1e6, "calls": 2.0}}}


def rank_report(step: int = 1, rank: int = 0) -> StepReport:
    """What `workers.trainer.train` builds and the rank actor completes with its comm timer."""
    built = StepReport(rank=rank, step=step, loss=2.5, step_time_s=0.1, tokens_per_s=640.0,
                       lr=3e-4, grad_norm=1.5, tp_rank=0, pp_rank=0, dp_rank=rank, attempt=1,
                       resumed_from=0,
                       memory=MemoryReport(params_bytes=10, grads_bytes=10, optimizer_bytes=20,
                                           activations_peak_bytes=5, process_peak_bytes=99,
                                           process_peak_source="rss_peak"))
    return built.model_copy(update={"comm": COMM, "timed": True})


def test_a_report_crosses_as_a_dict_and_is_stored_once_per_value():
    sent = rank_report().model_dump()  # what the actor queues for Ray
    received = StepReport.model_validate(sent)  # what the controller validates
    row = received.row()
    assert {k: row[k] for k in METRIC_COLUMNS} == {
        "rank": 0, "step": 1, "loss": 2.5, "step_time_s": 0.1, "tokens_per_s": 640.0,
        "lr": 3e-4, "grad_norm": 1.5}
    data = row["data"]
    assert set(data) == {"memory", "tp_rank", "pp_rank", "dp_rank", "attempt", "resumed_from",
                         "comm", "timed"}  # no column repeated, no step_s, None left out
    assert data["comm"] == COMM and data["memory"]["process_peak_bytes"] == 99
    # an fp16 overflow's norm is infinite (DeepSpeed skips the step): stored as no norm
    assert StepReport.model_validate({**sent, "grad_norm": float("inf")}).grad_norm is None
    with pytest.raises(ValidationError, match="grad_norm"):
        StepReport.model_validate({**sent, "grad_norm": -1.0})


def test_custom_entrypoints_report_a_dict_with_their_own_values_under_custom():
    r = StepReport.model_validate({"rank": 1, "step": 3, "loss": 1.0, "step_time_s": 0.2,
                                   "tokens_per_s": 0.0, "custom": {"zero": 2, "tag": "a"}})
    assert r.memory == MemoryReport() and r.comm is None
    assert r.row()["data"] == {"memory": {}, "timed": True, "custom": {"zero": 2, "tag": "a"}}
    with pytest.raises(ValidationError, match="world_size"):
        StepReport.model_validate({"rank": 1, "step": 3, "step_time_s": 0.2,
                                   "tokens_per_s": 0.0, "world_size": 2})
    with pytest.raises(ValidationError, match="custom"):  # bounded, as every report field
        StepReport.model_validate({"rank": 1, "step": 3, "step_time_s": 0.2,
                                   "tokens_per_s": 0.0, "custom": {"note": "x" * 2000}})
    with pytest.raises(ValidationError, match="step_s"):  # the old second name is gone
        StepReport.model_validate({**rank_report().model_dump(), "step_s": 0.1})


def test_the_bubble_is_stored_with_the_step_and_bounded_by_it():
    sent = rank_report().model_copy(update={"bubble_s": 0.04}).model_dump()
    assert StepReport.model_validate(sent).row()["data"]["bubble_s"] == 0.04
    with pytest.raises(ValidationError, match="bubble_s"):
        StepReport.model_validate({**sent, "bubble_s": 0.2})  # more than the 0.1 s step
    with pytest.raises(ValidationError, match="bubble_s"):
        StepReport.model_validate({**sent, "bubble_s": -0.01})


@pytest.fixture
def job_store(tmp_path: Path):
    s = Store(migrated_sqlite(tmp_path / "r.db"))
    yield s
    s.close()


def test_readers_of_stored_rows_take_new_rows_and_old_ones_with_step_s(job_store: Store):
    job = submit(job_store, JobSpec.model_validate(tiny_spec()))
    old = {"rank": 1, "step": 1, "loss": 2.5, "step_time_s": 0.1, "tokens_per_s": 640.0,
           "data": {"memory": {"params_bytes": 10}, "comm": COMM, "timed": True,
                    "step_s": 0.1, "dp_rank": 1}}  # as stored before step_s went
    record_steps(job_store, job_id=job.id, attempt=1,
                 rows=[rank_report(1, 0).row(), rank_report(2, 0).row(), old])
    view = comm_view(job_store, job_store.get_job(job_id=job.id), last=100)
    assert [r["rank"] for r in view["ranks"]] == [0, 1]
    assert view["step_time_s"] == pytest.approx(0.1)
    assert view["dims"]["dp"]["time_s_per_step"] == pytest.approx(0.02)
    metrics = job_store.list_metrics(job_id=job.id, rank=None)
    assert [metric_out_of(m).memory.get("params_bytes") for m in metrics] == [10, 10, 10]
    assert compare(job.plan, metrics)["step_s"]["measured"] == pytest.approx(0.1)


def test_compare_reads_the_newest_step_that_measured_the_model_states(job_store: Store):
    """The monitor samples its steps (`monitor.memory_every`): the others carry the process
    peak only, and the prediction is compared with the newest measured step."""
    job = submit(job_store, JobSpec.model_validate(tiny_spec()))
    unmeasured = [rank_report(s).model_copy(update={"memory": MemoryReport(
        process_peak_bytes=99 + s, process_peak_source="rss_peak")}).row() for s in (2, 3)]
    record_steps(job_store, job_id=job.id, attempt=1, rows=unmeasured)
    out = compare(job.plan, job_store.list_metrics(job_id=job.id, rank=None))
    assert out["model_state_bytes"]["measured"] is None  # not measured: no 0
    assert out["memory_bytes"]["measured_peak"] == 102
    record_steps(job_store, job_id=job.id, attempt=1, rows=[rank_report(1).row()])
    out = compare(job.plan, job_store.list_metrics(job_id=job.id, rank=None))
    assert out["model_state_bytes"]["measured"] == 40  # step 1's, though steps 2-3 are newer
