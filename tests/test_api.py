"""The REST API through the real app, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.lease import Leader
from service.store.tables import utcnow
from tests.conftest import authed_client, record_steps, tiny_spec
from tests.smallfs import Filler, small_fs


@pytest.fixture
def client(store: Store, tmp_path) -> Iterator[TestClient]:
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        yield c


def test_submit_returns_201_with_id_state_spec_plan(client: TestClient) -> None:
    r = client.post("/api/v1/jobs", json=tiny_spec())
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["state"] == "QUEUED" and body["id"] >= 1
    assert body["spec"]["parallel"]["zero"] == 2
    assert body["spec"]["model"]["hidden"] == 64  # the preset is resolved and stored
    assert body["plan"]["layout"]["dp"] == 2 and body["plan"]["layout"]["micro_batch"] == 2
    assert [r["rank"] for r in body["plan"]["rank_layout"]] == [0, 1]
    assert client.get(f"/api/v1/jobs/{body['id']}").json()["spec"] == body["spec"]
    # The REST job is the stored Job without its per-rank claim, plus (detail only) the
    # prediction next to the measurement, and its line of the jobs list.
    assert list(body) == ["id", "name", "owner", "project", "state", "priority", "spec", "plan",
                          "world_size", "cancel_requested", "attempts", "error", "created_at",
                          "updated_at", "started_at", "finished_at", "waiting", "preemptions",
                          "predicted_vs_measured", "step", "total_steps", "loss",
                          "loss_nonfinite", "lr",
                          "grad_norm", "eval_loss", "tokens", "epoch", "step_time_s",
                          "reported_at", "restarts", "queue_position", "reason", "secrets",
                          "env_hidden"]
    assert (body["total_steps"], body["queue_position"], body["restarts"]) == (6, 1, 0)
    assert body["reason"].startswith("first in line")


@pytest.mark.parametrize(
    ("spec", "loc", "msg"),
    [
        (tiny_spec(parallel={"tp": 3}), ["body", "parallel", "tp"], "tp(3) does not divide"),
        (tiny_spec(parallel={"dp": 3}), ["body", "train", "global_batch"],
         "global_batch(8) is not divisible by micro_batch(2) * dp(3) = 6"),
        (tiny_spec(extra=1), ["body", "extra"], "Extra inputs are not permitted"),
        (tiny_spec(train={"steps": -1}), ["body", "train", "steps"], "greater than or equal"),
        (tiny_spec(parallel={"dp": 2, "zero": 3}, train={"compile": True}),
         ["body", "parallel", "zero"], "train.compile is not supported with zero 3"),
        (tiny_spec(parallel={"recompute": "full"}, train={"compile": True}),
         ["body", "parallel", "recompute"], "train.compile is not supported with recompute"),
        (tiny_spec(monitor={"memory_every": 0}), ["body", "monitor", "memory_every"],
         "greater than or equal"),
    ],
)
def test_bad_specs_are_422_naming_the_field(client: TestClient, spec: dict, loc: list,
                                            msg: str) -> None:
    r = client.post("/api/v1/jobs", json=spec)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert any(d["loc"] == loc and msg in d["msg"] for d in detail), detail
    assert client.get("/api/v1/jobs").json()["total"] == 0  # nothing stored


def test_a_model_the_built_in_trainer_would_build_differently_is_refused_at_submit(
        client: TestClient) -> None:
    # ALiBi positions (BLOOM): the built-in trainer builds learned or rotary positions only.
    bloom = {"preset": "bloom-176b", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256,
             "seq_len": 32}
    r = client.post("/api/v1/jobs", json=tiny_spec(model=bloom))
    assert r.status_code == 422
    [d] = r.json()["detail"]
    assert d["loc"] == ["body", "model"] and "not 'alibi'" in d["msg"], d
    assert client.get("/api/v1/jobs").json()["total"] == 0
    # The planner still plans it, and a custom entrypoint may train it.
    assert client.post("/api/v1/plan", json=tiny_spec(model=bloom)).status_code == 200
    custom = tiny_spec(model=bloom, entrypoint="examples.custom_entrypoint:train")
    assert client.post("/api/v1/jobs", json=custom).status_code == 201
    # Plain dimensions (GPT style: biases, tied head, learned positions) train as counted.
    gpt = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}
    assert client.post("/api/v1/jobs", json=tiny_spec(model=gpt)).status_code == 201


def test_list_filters_by_state_and_paginates(client: TestClient, store: Store) -> None:
    ids = [client.post("/api/v1/jobs", json=tiny_spec(name=f"j{i}")).json()["id"]
           for i in range(5)]
    store.transition(job_id=ids[0], to=JobState.PLACING, message="x")
    page = client.get("/api/v1/jobs", params={"limit": 2, "offset": 1}).json()
    assert page["total"] == 5 and [j["id"] for j in page["items"]] == [ids[3], ids[2]]
    placing = client.get("/api/v1/jobs", params={"state": "PLACING"}).json()
    assert [j["id"] for j in placing["items"]] == [ids[0]]
    both = client.get("/api/v1/jobs", params=[("state", "PLACING"), ("state", "QUEUED")]).json()
    assert both["total"] == 5
    assert client.get("/api/v1/jobs", params={"state": "BOGUS"}).status_code == 422
    assert client.get("/api/v1/jobs", params={"limit": 0}).status_code == 422


def test_cancel_events_and_conflict(client: TestClient) -> None:
    job_id = client.post("/api/v1/jobs", json=tiny_spec()).json()["id"]
    r = client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202 and r.json()["state"] == "CANCELLED"
    assert client.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 409
    events = client.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    assert [e["kind"] for e in events] == ["state", "cancel", "state"]
    after = client.get(f"/api/v1/jobs/{job_id}/events", params={"after": events[1]["id"]})
    assert [e["id"] for e in after.json()["items"]] == [events[2]["id"]]


def test_metrics_shape(client: TestClient, store: Store) -> None:
    job_id = client.post("/api/v1/jobs", json=tiny_spec()).json()["id"]
    record_steps(store, job_id=job_id, attempt=1, rows=[
        {"rank": r, "step": 1, "loss": 5.5, "step_time_s": 0.2, "tokens_per_s": 1280.0,
         "lr": 2.5e-4, "grad_norm": 0.75, "data": {"memory": {"params": 1.0}}} for r in (0, 1)])
    items = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert len(items) == 1
    assert {"attempt": 1, "step": 1, "rank": 0, "loss": 5.5, "step_time_s": 0.2,
            "tokens_per_s": 1280.0, "lr": 2.5e-4, "grad_norm": 0.75}.items() <= items[0].items()
    assert client.get(f"/api/v1/jobs/{job_id}/metrics", params={"rank": 1}).json()["items"]


def test_unknown_job_is_404(client: TestClient) -> None:
    for path in ("/api/v1/jobs/999", "/api/v1/jobs/999/events", "/api/v1/jobs/999/metrics"):
        assert client.get(path).status_code == 404
    assert client.post("/api/v1/jobs/999/cancel").status_code == 404
    assert client.get("/api/v1/jobs/0").status_code == 422


def test_healthz_docs_and_status_page(client: TestClient, store: Store) -> None:
    Leader(store, duration_s=60, holder="ctl-1").acquire_or_renew()
    r = client.get("/api/v1/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert "/api/v1/jobs" in client.get("/openapi.json").json()["paths"]
    assert client.get("/docs").status_code == 200
    assert client.post("/api/v1/jobs", json=tiny_spec(name="<b>x</b>")).status_code == 422
    job_id = client.post("/api/v1/jobs", json=tiny_spec(name="shown-here")).json()["id"]
    page = client.get("/").text
    assert f'<tr data-job="{job_id}" data-state="QUEUED">' in page
    assert f'<a href="/jobs/{job_id}">shown-here</a>' in page
    assert '<td class="state QUEUED">QUEUED</td><td>tp1 pp1 dp2 zero2</td>' in page


def test_faults_need_the_server_setting(store: Store, tmp_path) -> None:
    spec = tiny_spec(faults=[{"kind": "hang", "rank": 1, "step": 2, "seconds": 5}])
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as c:
        r = c.post("/api/v1/jobs", json=spec)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "faults"]
    with authed_client(create_app(Settings(data_dir=tmp_path, allow_faults=True),
                                  store=store), store) as c:
        assert c.post("/api/v1/jobs", json=spec).status_code == 201
        bad = tiny_spec(faults=[{"kind": "hang", "rank": 7, "step": 2}])
        r = c.post("/api/v1/jobs", json=bad)
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "faults", "0", "rank"]


def test_comm_summarizes_stored_step_reports_per_dimension(client: TestClient,
                                                           store: Store) -> None:
    job_id = client.post("/api/v1/jobs", json=tiny_spec()).json()["id"]
    rows = []
    for step in (1, 2):
        for rank in (0, 1):
            comm = {"dp": {"all_reduce": {"time_s": 0.02, "bytes": 1e6, "calls": 2}}}
            rows.append({"rank": rank, "step": step, "loss": 1.0, "step_time_s": 0.1,
                         "tokens_per_s": 10.0, "data": {"comm": comm, "timed": True}})
    record_steps(store, job_id=job_id, attempt=1, rows=rows)
    body = client.get(f"/api/v1/jobs/{job_id}/comm").json()
    dp = body["dims"]["dp"]
    assert dp["time_s_per_step"] == pytest.approx(0.02)
    assert dp["fraction"] == pytest.approx(0.2)
    assert dp["bytes_per_step"] == pytest.approx(1e6)
    # all-reduce over 2 ranks: busbw = algbw * 2(n-1)/n = bytes / time
    assert dp["busbw"] == pytest.approx(1e6 / 0.02)
    assert [r["rank"] for r in body["ranks"]] == [0, 1]
    assert body["attempt"] == 1 and body["probe"] == []


def test_cluster_inventory_and_probe_requests(client: TestClient, store: Store) -> None:
    store.upsert_nodes(nodes=[{"node_id": "n1", "hostname": "h", "accelerator": "cpu"}])
    body = client.get("/api/v1/cluster").json()
    assert body["nodes"][0]["info"]["accelerator"] == "cpu" and body["probe"] is None
    r = client.post("/api/v1/probes", json={"ranks_per_node": 2, "max_bytes": 1 << 20})
    assert r.status_code == 202 and r.json()["status"] == "pending"
    assert client.get(f"/api/v1/probes/{r.json()['id']}").json()["request"]["max_bytes"] == 1 << 20
    assert client.post("/api/v1/probes", json={"profile": "tpu"}).status_code == 422
    assert client.post("/api/v1/probes", json={"ranks_per_node": 0}).status_code == 422
    assert client.get("/api/v1/probes/999").status_code == 404


def test_healthz_reports_the_database_and_the_controller_lease(client: TestClient,
                                                                store: Store) -> None:
    """503 degraded while no controller holds an unexpired lease; 200 while one does."""
    r = client.get("/api/v1/healthz")
    assert r.status_code == 503
    body = r.json()
    assert body.pop("data_dir")["status"] == "ok"
    assert body == {"status": "degraded", "database": "ok", "controller": {
        "holder": None, "lease_age_s": None, "expires_in_s": None,
        "error": "no controller has held the lease"}}
    leader = Leader(store, duration_s=60, holder="ctl-1")
    leader.acquire_or_renew()
    r = client.get("/api/v1/healthz")
    body = r.json()
    assert r.status_code == 200 and body["status"] == "ok" and body["database"] == "ok"
    assert body["controller"]["holder"] == "ctl-1"
    assert 0 <= body["controller"]["lease_age_s"] < 60 < body["controller"]["expires_in_s"] + 1
    # A lease not renewed in time: degraded, naming the last holder.
    leader.acquire_or_renew(now=utcnow() - timedelta(seconds=120))
    r = client.get("/api/v1/healthz")
    assert r.status_code == 503
    ctl = r.json()["controller"]
    assert r.json()["status"] == "degraded" and ctl["holder"] == "ctl-1"
    assert ctl["expires_in_s"] < 0 and ctl["lease_age_s"] >= 120
    assert ctl["error"] == "the controller has not renewed its lease in time"


def test_healthz_names_a_data_dir_that_is_nearly_full(store: Store, tmp_path) -> None:
    """On a filesystem of its own, with the threshold of the settings: `ok` while more is
    free, `nearly full` (with the figures and the threshold) once a filler takes the space;
    the stack's status stays that of its database and controller."""
    Leader(store, duration_s=60, holder="ctl-1").acquire_or_renew()
    with small_fs(tmp_path / "fs", 4) as fs:
        settings = Settings(data_dir=fs, data_dir_min_free=0.25)
        with authed_client(create_app(settings, store=store), store) as c:
            r = c.get("/api/v1/healthz")
            disk = r.json()["data_dir"]
            assert r.status_code == 200 and disk["status"] == "ok", disk
            assert "path" not in disk and disk["total_bytes"] == 4 << 20  # healthz is public
            assert disk["min_free_fraction"] == 0.25 and disk["free_fraction"] > 0.25
            filler = Filler(fs / "filler", leave_bytes=512 << 10).start()
            try:
                r = c.get("/api/v1/healthz")
            finally:
                filler.free()
    disk = r.json()["data_dir"]
    assert r.status_code == 200 and r.json()["status"] == "ok"  # nothing is down (yet)
    assert disk["status"] == "nearly full", disk
    assert disk["free_bytes"] <= 512 << 10 and disk["free_fraction"] < 0.25
    with TestClient(create_app(Settings(data_dir=tmp_path / "missing"), store=store)) as c:
        r = c.get("/api/v1/healthz")
    assert r.json()["data_dir"]["status"] == "unavailable: No such file or directory"


def test_healthz_names_the_database_when_it_does_not_answer(tmp_path) -> None:
    broken = Store(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}")
    with TestClient(create_app(Settings(data_dir=tmp_path), store=broken)) as c:
        r = c.get("/api/v1/healthz")
    assert r.status_code == 503
    assert r.json()["status"] == "degraded"
    assert r.json()["database"].startswith("unavailable: ")


def test_routes_answer_503_with_retry_after_while_the_database_is_away(tmp_path) -> None:
    """A PostgreSQL server that does not answer (nothing listens on the port): every route that
    reads or writes the store says 503 with Retry-After, never 500."""
    away = Store("postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2")
    try:
        with TestClient(create_app(Settings(data_dir=tmp_path), store=away),
                        headers={"Authorization": "Bearer any"}) as c:
            for method, path, body in [("GET", "/api/v1/jobs", None),
                                       ("GET", "/api/v1/jobs/1", None),
                                       ("POST", "/api/v1/jobs", tiny_spec()),
                                       ("GET", "/api/v1/cluster", None)]:
                r = c.request(method, path, json=body)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.headers["Retry-After"] == "5"
                assert "database is unavailable" in r.json()["detail"]
    finally:
        away.close()
