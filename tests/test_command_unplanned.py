"""A `command:` job without `model`, through the API in-process: the spec's rules (each
refusal a 422 naming its field), its placement from `resources.workers` alone, its stored
plan (`planned: false`, no prediction), and every view of a plan saying it was not planned
with the measured steps beside it: the job's REST answer, `trident describe`, `GET
/metrics`, the job page and the JSON its tabs read. A command job with a model stays
planned."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from cli.describe import gather, text
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.tracking.sinks import params
from tests.conftest import record_steps, tiny_spec, user_token
from tests.inprocess import client_of


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "code").mkdir()
    return tmp_path / "code"


@pytest.fixture
def admin(store: Store, tmp_path: Path, root: Path) -> Iterator[TestClient]:
    app = create_app(Settings(data_dir=tmp_path / "data", code_roots=str(root)), store=store)
    with TestClient(app, headers={"Authorization": f"Bearer {user_token(store)}"}) as c:
        yield c


def unplanned(root: Path, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "ddp", "command": [sys.executable, "train.py"],
                            "workdir": str(root),
                            "resources": {"workers": 3, "cpus_per_worker": 0.5},
                            "monitor": {"probe": False}}
    spec.update(over)
    return spec


def refusal(r: Any) -> tuple[list[str], str]:
    assert r.status_code == 422, r.text
    [d] = r.json()["detail"]
    return d["loc"], d["msg"]


def test_the_rules_of_a_spec_without_model() -> None:
    spec = JobSpec.model_validate(unplanned(Path("/code")))
    assert spec.model is None and not spec.planned and spec.world_size == 3
    assert spec.layout.model_dump(include={"tp", "pp", "dp"}) == {"tp": 1, "pp": 1, "dp": 3}
    # The stored form (its layout written out) reads back the same.
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec
    with pytest.raises(ValueError, match="gives no model"):
        _ = spec.planned_model


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"resources": {"cpus_per_worker": 0.5}}, "resources.workers", "give its ranks"),
    ({"parallel": {"dp": 3, "zero": 1}}, "parallel", "planned against a model"),
    ({"parallel": "auto"}, "parallel", "planned against a model"),
    ({"elastic": {"min_ranks": 1}, "checkpoint": {"every_steps": 1}, "max_retries": 1},
     "elastic", "not planned"),
    ({"cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 3}}, "cluster", "not planned"),
    ({"model": {"preset": "gpt-tiny"}, "parallel": {"dp": 2}}, "resources.workers",
     "workers(3) is not the job's 2 ranks"),
]


def test_what_a_job_without_model_may_not_ask_is_named(admin: TestClient, root: Path) -> None:
    for over, field, words in REFUSED:
        loc, msg = refusal(admin.post("/api/v1/jobs", json=unplanned(root, **over)))
        assert loc == ["body", *field.split(".")] and words in msg, (over, loc, msg)
    # Only a command job may leave model out.
    for over, words in [({}, "the built-in trainer needs the model"),
                        ({"entrypoint": "examples.custom_entrypoint:train"},
                         "an entrypoint needs the model")]:
        spec = {k: v for k, v in tiny_spec(**over).items() if k != "model"}
        loc, msg = refusal(admin.post("/api/v1/jobs", json=spec))
        assert loc == ["body", "model"] and words in msg, msg
    assert admin.get("/api/v1/jobs").json()["items"] == []
    # A planned command job may repeat its ranks as workers, and is planned.
    r = admin.post("/api/v1/jobs", json=unplanned(
        root, model={"preset": "gpt-tiny"}, parallel={"dp": 3},
        train={"global_batch": 6, "micro_batch": 2}))
    assert r.status_code == 201, r.text
    plan = r.json()["plan"]
    assert plan["planned"] is True and plan["time"]["step_s"] > 0


def test_nothing_is_predicted_and_every_view_says_not_planned(
        admin: TestClient, store: Store, root: Path) -> None:
    r = admin.post("/api/v1/jobs", json=unplanned(root))
    assert r.status_code == 201, r.text
    job = r.json()
    plan = job["plan"]
    assert plan["planned"] is False and "not planned" in plan["why"]
    assert plan["world_size"] == 3 and plan["layout"]["dp"] == 3
    assert [row["rank"] for row in plan["rank_layout"]] == [0, 1, 2]
    assert [plan.get(k) for k in ("time", "memory", "tokens_per_s", "mfu")] == [None] * 4
    stored = store.get_job(job_id=job["id"]).plan.to_json()  # as kept: no key of a prediction
    assert not {"time", "memory", "tokens_per_s", "mfu"} & set(stored), stored
    again = admin.post(f"/api/v1/jobs/{job['id']}/resubmit")  # its stored spec reads back
    assert again.status_code == 201 and again.json()["plan"]["planned"] is False, again.text
    assert again.json()["spec"]["parallel"]["dp"] == 3 and again.json()["spec"]["model"] is None
    refused = admin.post("/api/v1/plan", json=unplanned(root))
    loc, msg = refusal(refused)
    assert loc == ["body", "model"] and "not planned" in msg

    jid = job["id"]
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=jid, to=to, message=to.value)
    store.start_attempt(job_id=jid)
    record_steps(store, job_id=jid, attempt=1, rows=[
        {"step": s, "rank": rank, "loss": 3.0 - s / 10, "step_time_s": 0.25,
         "tokens_per_s": 100.0, "data": {"memory": {"process_peak_bytes": 1 << 20}}}
        for s in range(1, 7) for rank in range(3)])

    compared = admin.get(f"/api/v1/jobs/{jid}").json()["predicted_vs_measured"]
    assert compared["planned"] is False
    assert compared["step_s"] == {"predicted": None, "measured": 0.25, "ratio": None}
    assert compared["tokens_per_s"]["predicted"] is None
    assert compared["memory_bytes"] == {"predicted": None, "measured_peak": 1 << 20}
    [stage] = compared["memory_by_stage"]
    total = next(c for c in stage["categories"] if c["name"] == "total")
    assert total["planned"] is None and total["gap"] is None
    assert admin.get(f"/api/v1/jobs/{jid}/comm/steps").json()["predicted"] is None
    assert admin.get(f"/api/v1/jobs/{jid}/comm").status_code == 200
    cells = admin.get(f"/api/v1/jobs/{jid}/ranks").json()["cells"]
    assert [c["memory_predicted_bytes"] for c in cells] == [None, None, None]
    series = admin.get(f"/api/v1/jobs/{jid}/series").json()
    assert series["predicted"]["step_time_s"] is None and series["step"] == [1, 2, 3, 4, 5, 6]

    page = admin.get(f"/jobs/{jid}")
    assert page.status_code == 200 and 'id="not-planned"' in page.text
    assert "Step time split (predicted)" not in page.text
    rows = admin.get("/ui/jobs/rows")
    assert rows.status_code == 200 and "<td>not planned</td>" in rows.text
    what_if = admin.get("/plan", params={"job": jid})
    assert what_if.status_code == 200 and 'id="job-not-planned"' in what_if.text
    loc, msg = refusal(admin.post(f"/api/v1/jobs/{jid}/exports", json={}))
    assert loc == ["body", "job"] and "gives no model" in msg
    logged = params(store.get_job(job_id=jid))  # the MLflow run's parameters
    assert logged["plan.planned"] == "false" and "plan.step_s" not in logged

    metrics = admin.get("/metrics")
    assert metrics.status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(metrics.text)}

    def samples(name: str) -> list[float]:
        return [s.value for s in fams[name].samples if s.labels.get("job_id") == str(jid)]

    assert samples("trident_job_step_duration_seconds") == [0.25]
    for name in ("trident_job_step_duration_predicted_seconds",
                 "trident_job_step_duration_prediction_error_ratio",
                 "trident_job_tokens_per_second_predicted", "trident_job_mfu_ratio",
                 "trident_rank_memory_predicted_bytes"):
        assert samples(name) == [], name

    with client_of(admin) as client:
        described = gather(client, jid, events=5)
    assert described.plan.planned is False and described.plan.step_s is None
    shown = text(described)
    assert "not planned: placed from resources.workers alone" in shown
    assert re.search(r"s/step +not planned +0\.25 ", shown), shown
    assert "Memory by stage, measured" in shown


def test_a_rate_no_one_measured_is_stored_and_shown_as_not_known(
        admin: TestClient, store: Store, root: Path) -> None:
    """A script of a job without model that reports no tokens per second: its steps' rate is
    None all the way (the rank's report, the stored rows, the charts, /metrics, the goodput
    ledger), not a rate of 0; a step that reports one keeps it."""
    from workers.rank.command import Steps

    reports: list[Any] = []
    steps = Steps(0, 1, reports.append, tokens_per_step=0)
    steps.offer({"step": 1, "loss": 2.5})
    steps.offer({"step": 2, "loss": 2.4, "tokens_per_s": 300.0})
    assert [r.tokens_per_s for r in reports] == [None, 300.0]

    jid = admin.post("/api/v1/jobs", json=unplanned(
        root, resources={"workers": 2, "cpus_per_worker": 0.5})).json()["id"]
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=jid, to=to, message=to.value)
    store.start_attempt(job_id=jid)
    record_steps(store, job_id=jid, attempt=1, rows=[
        {**r.row(), "rank": rank} for r in reports for rank in (0, 1)])
    rows = admin.get(f"/api/v1/jobs/{jid}/metrics").json()["items"]
    assert [(r["step"], r["tokens_per_s"]) for r in rows if r["rank"] == 0] == [
        (1, None), (2, 300.0)]
    series = admin.get(f"/api/v1/jobs/{jid}/series").json()
    assert series["tokens_per_s"] == [None, 300.0] and series["mfu"] == [None, None]
    fams = {f.name: f for f in text_string_to_metric_families(admin.get("/metrics").text)}
    assert [s.value for s in fams["trident_job_tokens_per_second"].samples
            if s.labels["job_id"] == str(jid)] == [300.0]  # the newest step's
    ledger = admin.get(f"/api/v1/jobs/{jid}/goodput").json()
    assert ledger["tokens"] is None and ledger["goodput_tokens_per_s"] is None
