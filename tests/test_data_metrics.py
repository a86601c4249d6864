"""A job's data figures on the way out (SQLite and PostgreSQL): eval_loss, tokens and epoch in
the step rows (migration 0014), in the rows of `GET /api/v1/jobs/{id}/metrics` (with rank 0's
memory report, its `not_measured` reasons included), the job page's series, and
`trident_job_eval_loss` on `/metrics`."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.charts import job_series
from service.store.metrics import MetricsIngest
from service.submission.intake import submit
from tests.conftest import authed_client, tiny_spec


def report(step: int, rank: int) -> dict[str, Any]:
    memory = {"params_bytes": 930304, "process_peak_bytes": 3.4e8,
              "process_peak_source": "rss_peak",
              "not_measured": {"buckets": "no reduction bucket on CPU"}} if rank == 0 else {}
    data: dict[str, Any] = {"memory": memory, "tokens": 256 * step, "epoch": step / 10,
                            "first_sample": 8 * (step - 1), "drawn": {"/c/a": 8 * step}}
    if step % 2 == 0:
        data["eval_loss"] = 6.0 - step / 10
    return {"step": step, "rank": rank, "loss": 7.0 - step / 10, "step_time_s": 0.2,
            "tokens_per_s": 1000.0, "data": data}


def test_eval_loss_tokens_and_epoch_go_out(store: Store, tmp_path) -> None:
    job = submit(store, JobSpec.model_validate(tiny_spec()))
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value)
    store.start_attempt(job_id=job.id)
    MetricsIngest(store).record(job_id=job.id, attempt=1, world_size=2, rows=[
        report(s, r) for s in (1, 2, 3) for r in (0, 1)])
    steps = MetricsIngest(store).list_steps(job_id=job.id)
    assert [s.eval_loss for s in steps] == [None, pytest.approx(5.8), None]
    assert [s.tokens for s in steps] == [256, 512, 768]
    assert [s.epoch for s in steps] == [pytest.approx(0.1), pytest.approx(0.2),
                                        pytest.approx(0.3)]
    assert store.latest_eval(job_id=job.id) == pytest.approx(5.8)

    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        rows = client.get(f"/api/v1/jobs/{job.id}/metrics").json()["items"]
        text = client.get("/metrics").text
    assert [r["eval_loss"] for r in rows] == [None, pytest.approx(5.8), None]
    assert [r["tokens"] for r in rows] == [256, 512, 768]
    assert [r["first_sample"] for r in rows] == [0, 8, 16]
    assert rows[-1]["drawn"] == {"/c/a": 24}
    assert rows[-1]["memory"] == report(3, 0)["data"]["memory"]  # what it cannot measure too
    series = job_series(store, store.get_job(job_id=job.id))
    assert series["eval_step"] == [2] and series["eval_loss"] == [pytest.approx(5.8)]
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    [sample] = fams["trident_job_eval_loss"].samples  # the newest step that evaluated
    assert sample.labels == {"job_id": str(job.id)} and sample.value == pytest.approx(5.8)
    assert fams["trident_job_tokens"].samples[0].value == 768
