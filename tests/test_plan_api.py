"""The planner through the control plane: POST /plan, submit-time checks, `parallel: auto`
jobs, and `trident plan`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from api.routes import jobs as jobs_route
from api.routes import plan as plan_route
from cli.main import app as cli
from service.contract.prices import money
from service.contract.spec import JobSpec
from service.planner.search import cpu_bound
from service.settings import Settings
from service.store import Store
from tests.conftest import authed_client, migrated_sqlite, tiny_spec

BIG = {"name": "gpt175b", "model": {"preset": "gpt3-175b"},
       "train": {"global_batch": 64, "micro_batch": 1},
       "parallel": {"tp": 1, "pp": 1, "dp": 8, "zero": 0},
       "resources": {"gpus_per_worker": 1, "cpus_per_worker": 8},
       "cluster": {"gpu": "a100-40gb", "nodes": 1, "gpus_per_node": 8}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    store = Store(migrated_sqlite(tmp_path / "p.db"))
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        yield c
    store.close()


def test_plan_of_an_explicit_layout_has_the_documented_keys(client: TestClient) -> None:
    r = client.post("/api/v1/plan", json=tiny_spec())
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["fits"] is True
    assert plan["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero": 2, "offload": "none",
                              "recompute": "none", "sequence_parallel": False,
                              "virtual_stages": 1, "partition": "uniform", "micro_batch": 2}
    for key in ("params", "grads", "optimizer", "activations", "other", "total"):
        assert plan["memory"][key] >= 0
    for key in ("step_s", "compute_s", "bubble_s", "tp_comm_s", "pp_comm_s", "dp_comm_s"):
        assert plan["time"][key] >= 0
    assert plan["time"]["dp_comm_s"] > 0 and plan["time"]["tp_comm_s"] == 0
    assert plan["tokens_per_s"] > 0 and 0 < plan["mfu"] <= 1 and plan["tflops_per_gpu"] > 0
    assert isinstance(plan["reasons"], list)


def test_layout_that_does_not_fit_is_planned_but_not_submitted(client: TestClient) -> None:
    plan = client.post("/api/v1/plan", json=BIG).json()
    assert plan["fits"] is False and plan["memory"]["total"] > 40e9
    r = client.post("/api/v1/jobs", json=BIG)
    assert r.status_code == 422
    (detail,) = r.json()["detail"]
    assert detail["loc"] == ["body", "parallel"]
    assert "does not fit" in detail["msg"] and "GB" in detail["msg"]
    assert client.get("/api/v1/jobs").json()["total"] == 0


def test_auto_job_stores_the_best_layout_and_runs_it(client: TestClient) -> None:
    spec = tiny_spec(parallel="auto", cluster={"gpu": "cpu", "nodes": 1, "gpus_per_node": 2})
    searched = client.post("/api/v1/plan", json=spec, params={"top": 3}).json()
    assert searched["ranked"] and len(searched["ranked"]) <= 3
    job = client.post("/api/v1/jobs", json=spec).json()
    layout = job["plan"]["layout"]
    assert layout == searched["ranked"][0]["layout"]
    assert layout["tp"] * layout["pp"] * layout["dp"] == 2
    assert job["plan"]["chosen_by"] == "search" and job["plan"]["search"]["fitting"] >= 1
    # Resolved once, at submission: the stored spec is the spec that runs.
    stored = job["spec"]
    assert stored["parallel"] != "auto"
    assert stored["parallel"] | {"micro_batch": stored["train"]["micro_batch"]} == layout
    run = JobSpec.model_validate(stored)
    assert run.layout.dims.world_size == 2 and run.cluster == JobSpec.model_validate(
        spec).cluster
    assert client.get(f"/api/v1/jobs/{job['id']}").json()["spec"] == stored


def test_calibrated_profile_is_used_for_plans(client: TestClient, tmp_path: Path) -> None:
    before = client.post("/api/v1/plan", json=tiny_spec()).json()["time"]["compute_s"]
    store: Store = client.app.state.store
    from service.contract.hardware import get_profile

    slow = get_profile("cpu").with_(peak_flops_fp32=get_profile("cpu").peak_flops_fp32 / 10,
                                    peak_flops_bf16=get_profile("cpu").peak_flops_bf16 / 10)
    store.save_profile(name="cpu", profile=slow.to_json())
    after = client.post("/api/v1/plan", json=tiny_spec()).json()["time"]["compute_s"]
    assert after > 5 * before


def test_trident_plan_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    spec = tmp_path / "big.yaml"
    spec.write_text(yaml.safe_dump(BIG))
    r = runner.invoke(cli, ["plan", str(spec), "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert plan["fits"] is False and plan["layout"]["dp"] == 8
    r = runner.invoke(cli, ["plan", str(spec)])
    assert r.exit_code == 0 and "Nearest layouts that fit" in r.output
    auto = tmp_path / "auto.yaml"
    auto.write_text(yaml.safe_dump({**BIG, "parallel": "auto"}))
    r = runner.invoke(cli, ["plan", str(auto), "--top", "2", "--json"])
    assert r.exit_code == 0
    assert len(json.loads(r.output)["ranked"]) <= 2


def test_trident_capacity_answers_with_the_arithmetic(tmp_path: Path) -> None:
    runner = CliRunner()
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({**BIG, "parallel": "auto"}))
    r = runner.invoke(cli, ["capacity", str(spec)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Can 8 x a100-40gb train gpt3-175b")
    assert "No layout fits" in r.output and "host memory: predicted" in r.output
    r = runner.invoke(cli, ["capacity", "--family", "gpt3", "--gpu", "a100-80gb", "--nodes",
                            "8", "--json"])
    rows = {row["strategy"]: row for row in json.loads(r.output)}
    # 64 x 80 GB hold 175B with ZeRO-3 (16 bytes/param / 64 = 44 GB of model states).
    assert rows["ZeRO-3"]["largest"] == "gpt3-175b"
    assert rows["data parallel (ZeRO-0)"]["params"] < rows["ZeRO-3"]["params"]


def test_plan_of_a_model_that_fits_nowhere_on_its_cluster_says_what_it_would_take(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # Five searches, one per GPU type: more than a request's CPU bound on this machine.
    monkeypatch.setattr(plan_route, "cpu_bound", lambda: cpu_bound(60))
    r = client.post("/api/v1/plan", json=BIG | {"parallel": "auto"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["best"] is None
    takes = {c["gpu"]: c for c in body["what_it_takes"]}
    assert set(takes) == {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200"}
    a100 = takes["a100-40gb"]
    assert a100["trains"] and a100["nodes"] > 1 and a100["gpus_per_node"] == 8
    assert a100["world_size"] == 8 * a100["nodes"]
    assert a100["step_s_range"][0] < a100["step_s"] < a100["step_s_range"][1]
    assert a100["gpu_hours_per_billion_tokens"] > 0
    # A spec that fits has ranges and no what_it_takes.
    small = client.post("/api/v1/plan", json=tiny_spec()).json()
    assert "what_it_takes" not in small and small["ranges"]["note"]


def test_a_request_spends_a_bounded_cpu_time_in_the_layout_search(
        client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A search that would take longer than the request's CPU bound is a 422 that says so
    (the plan and the submission alike); what it would take is left to `trident capacity`."""
    for route in (plan_route, jobs_route):
        monkeypatch.setattr(route, "cpu_bound", lambda: cpu_bound(0.0))
    huge = BIG | {"parallel": "auto", "train": {"global_batch": 1536, "micro_batch": 1},
                  "cluster": {"gpu": "a100-80gb", "nodes": 128, "gpus_per_node": 8}}
    for path in ("/api/v1/plan", "/api/v1/jobs"):
        r = client.post(path, json=huge)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"][0]
        assert detail["loc"] == ["body", "parallel"] and "s of CPU" in detail["msg"], detail
        assert "trident plan" in detail["msg"]
    assert client.get("/api/v1/jobs").json()["total"] == 0  # nothing was queued
    body = client.post("/api/v1/plan", json=BIG).json()  # an explicit layout is evaluated
    assert body["fits"] is False and body["what_it_takes"] is None
    assert "trident capacity" in body["what_it_takes_error"]
    # The bound is on CPU time: the 175B search over 1,024 GPUs costs more than it here.
    monkeypatch.setattr(plan_route, "cpu_bound", cpu_bound)
    r = client.post("/api/v1/plan", json=tiny_spec(parallel="auto", cluster={
        "gpu": "cpu", "nodes": 1, "gpus_per_node": 2}))
    assert r.status_code == 200, r.text


BIG_STEPS = JobSpec.model_validate(BIG).train.steps
PRICES = {"cpu": {"cpu_hour": 0.5}, "a100-40gb": {"gpu_hour": 2.0, "cpu_hour": 0.5}}


def test_a_priced_plan_says_what_its_steps_would_cost(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """cost = step time x train.steps x ranks x the price per GPU-hour (CPU-hour on CPU
    ranks), on the API and in `trident plan` (TRIDENT_PRICES); none without a price."""
    store = Store(migrated_sqlite(tmp_path / "p.db"))
    settings = Settings(data_dir=tmp_path, prices=PRICES)
    with authed_client(create_app(settings, store=store), store) as client:
        plan = client.post("/api/v1/plan", json=tiny_spec()).json()
        # 6 steps on 2 CPU ranks of 0.5 CPU each, at 0.5 a CPU-hour.
        assert plan["cost"] == pytest.approx(plan["time"]["step_s"] * 6 * 2 * 0.5 * 0.5 / 3600)
        big = client.post("/api/v1/plan", json={**BIG, "train": {**BIG["train"],
                                                                 "steps": 1000}}).json()
        # 8 GPU ranks at 2.0 a GPU-hour: their CPUs are in the GPU's price.
        assert big["cost"] == pytest.approx(big["time"]["step_s"] * 1000 * 8 * 2.0 / 3600)
        auto = client.post("/api/v1/plan", json=tiny_spec(parallel="auto", cluster={
            "gpu": "cpu", "nodes": 1, "gpus_per_node": 2})).json()
        best = auto["best"]
        assert best["cost"] == pytest.approx(best["time"]["step_s"] * 6 * 2 * 0.25 / 3600)
    store.close()
    store = Store(migrated_sqlite(tmp_path / "q.db"))
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        assert client.post("/api/v1/plan", json=tiny_spec()).json().get("cost") is None
    store.close()
    runner = CliRunner()
    spec = tmp_path / "big.yaml"
    spec.write_text(yaml.safe_dump(BIG))
    monkeypatch.setenv("TRIDENT_PRICES", json.dumps(PRICES))
    r = runner.invoke(cli, ["plan", str(spec), "--json"])
    assert r.exit_code == 0, r.output
    step_s = json.loads(r.output)["time"]["step_s"]
    cost = json.loads(r.output)["cost"]
    assert cost == pytest.approx(step_s * BIG_STEPS * 8 * 2.0 / 3600)
    r = runner.invoke(cli, ["plan", str(spec)])
    assert r.exit_code == 0, r.output
    assert (f"  cost: {money(cost)} ({BIG_STEPS} steps x {step_s:.4g} s x 8 ranks of 1 GPU(s) at 2"
            " per GPU-hour, a100-40gb prices)") in r.output
    monkeypatch.setenv("TRIDENT_PRICES", '{"cpu": {"cpu_hour": -1}}')
    r = runner.invoke(cli, ["plan", str(spec)])
    assert r.exit_code == 2
    assert r.output.strip() == ("error: TRIDENT_PRICES: cpu.cpu_hour: Input should be greater"
                                " than or equal to 0")
    monkeypatch.delenv("TRIDENT_PRICES")
    r = runner.invoke(cli, ["plan", str(spec)])
    assert r.exit_code == 0 and "cost:" not in r.output
