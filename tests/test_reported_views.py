"""The memory and communication views say which figures the steps carried, and name the rest:
"not measured" for Trident's trainer, "not reported" for a command job's script
(`service.store.reported`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.monitor.comm import comm_view
from service.settings import Settings
from service.store import Store
from service.store.reported import NOT_MEASURED, NOT_REPORTED, reported
from service.submission.intake import submit
from service.views.prediction import compare
from tests.conftest import authed_client, migrated_sqlite, record_steps, tiny_spec

COMM = {"dp": {"all_reduce": {"time_s": 0.02, "bytes": 1e6, "calls": 2.0}}}


def _row(step: int, rank: int = 0, **data: Any) -> dict[str, Any]:
    return {"step": step, "rank": rank, "loss": 2.0, "step_time_s": 0.5,
            "tokens_per_s": 100.0, "data": data}


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(migrated_sqlite(tmp_path / "r.db"))
    yield s
    s.close()


def _job(store: Store, rows: list[dict[str, Any]]) -> int:
    job = submit(store, JobSpec.model_validate(tiny_spec()))
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value)
    store.start_attempt(job_id=job.id)
    record_steps(store, job_id=job.id, attempt=1, rows=rows)
    return job.id


def test_each_memory_figure_newest_value_or_none(store: Store) -> None:
    job_id = _job(store, [_row(1, memory={"params_bytes": 10, "process_peak_bytes": 99}),
                          _row(2, memory={"process_peak_bytes": 120}, comm=COMM)])
    metrics = store.list_metrics(job_id=job_id, rank=None)
    out = reported(metrics, script=True)
    assert out == {"source": "script", "steps": 2, "comm_steps": 1, "missing": NOT_REPORTED,
                   "memory": {"params_bytes": 10, "grads_bytes": None, "optimizer_bytes": None,
                              "activations_peak_bytes": None, "process_peak_bytes": 120}}
    assert reported(metrics, script=False)["missing"] == NOT_MEASURED
    assert reported([], script=True)["steps"] == 0


def test_compare_and_comm_carry_what_was_reported(store: Store) -> None:
    job_id = _job(store, [_row(s, memory={"process_peak_bytes": 100 + s}) for s in (1, 2)])
    job = store.get_job(job_id=job_id)
    metrics = store.list_metrics(job_id=job_id, rank=None)
    out = compare(job.plan, metrics, script=True)
    assert out["model_state_bytes"]["measured"] is None
    assert out["reported"]["memory"]["process_peak_bytes"] == 102
    assert out["reported"]["missing"] == NOT_REPORTED
    view = comm_view(store, job, last=20)
    assert view["dims"]["dp"]["time_s_per_step"] == 0.0  # only the plan's row: none counted
    assert view["reported"]["comm_steps"] == 0 and view["reported"]["steps"] == 2
    assert view["reported"]["missing"] == NOT_MEASURED  # Trident's trainer: a built-in job


def test_the_job_page_lists_each_memory_figure(tmp_path: Path) -> None:
    store = Store(migrated_sqlite(tmp_path / "d.db"))
    job_id = _job(store, [_row(1, memory={"process_peak_bytes": 3 << 20})])
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        page = c.get(f"/jobs/{job_id}").text
        api = c.get(f"/api/v1/jobs/{job_id}").json()["predicted_vs_measured"]["reported"]
        comm = c.get(f"/api/v1/jobs/{job_id}/comm").json()["reported"]
    assert 'id="memory-reported"' in page
    assert "<tr><td>params</td><td>not measured</td></tr>" in page
    assert "<tr><td>process_peak</td><td>3 MiB</td></tr>" in page
    assert api["memory"]["process_peak_bytes"] == 3 << 20 and api["source"] == "trainer"
    assert comm["comm_steps"] == 0 and comm["missing"] == NOT_MEASURED


def test_a_command_jobs_page_says_not_reported(tmp_path: Path) -> None:
    store = Store(migrated_sqlite(tmp_path / "d.db"))
    spec = tiny_spec(command=["python", "train.py"], workdir=str(tmp_path),
                     progress={"preset": "hf-trainer"})
    job = submit(store, JobSpec.model_validate(spec))
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value)
    store.start_attempt(job_id=job.id)
    record_steps(store, job_id=job.id, attempt=1,
                 rows=[_row(1, memory={"process_peak_bytes": 3 << 20})])
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        page = c.get(f"/jobs/{job.id}").text
        comm = c.get(f"/api/v1/jobs/{job.id}/comm").json()["reported"]
    assert "Memory reported by the script" in page
    assert "<tr><td>params</td><td>not reported</td></tr>" in page
    assert "<tr><td>process_peak</td><td>3 MiB</td></tr>" in page
    assert comm == {"source": "script", "steps": 1, "comm_steps": 0, "missing": NOT_REPORTED,
                    "memory": {"params_bytes": None, "grads_bytes": None,
                               "optimizer_bytes": None, "activations_peak_bytes": None,
                               "process_peak_bytes": 3 << 20}}
