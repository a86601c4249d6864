"""End to end, with Ray: a job with a secret runs on 2 light CPU ranks (`program: light`,
`workers.rank.light`, its custom entrypoint reporting the steps) under the controller, whose
exporter sends its steps to a real `mlflow server` and writes its TensorBoard files; the MLflow
server is killed for 30 s in the middle of the job and started again.

One scenario for the module (a Ray, a controller stepping in a thread, the API on a port),
read by each test: no training step is lost and the exporter holds nothing up; MLflow has every
step and the final state once it is back (nothing dropped); TensorBoard's own reader reads the
stored scalars; the secret is in the ranks' environment (the entrypoint checks its digest) and
in no answer of the API, no page, not the audit log, the rank logs, the database file, the
MLflow run or the TensorBoard files.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")
mlflow = pytest.importorskip("mlflow")

from api.app import create_app  # noqa: E402
from api.auth import api_routes  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.secrets import SecretBox  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import Store  # noqa: E402
from service.tracking.config import TrackingConfig  # noqa: E402
from tests.conftest import tiny_spec, user_token  # noqa: E402
from tests.servers import HTTP, served_stack  # noqa: E402

pytestmark = pytest.mark.slow

SECRET = "tr1dent-e2e-secret-" + "Zq8vL2pX7mN4"  # found by grep wherever it might leak
OUTAGE_S = 30.0
"""How long the MLflow server stays dead (the issue's acceptance)."""
DEADLINE_S = 600.0
"""Waits for events (a job to start, to end, an export to finish): far beyond need."""


def wait(what: str, cond: Any, timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s"
        time.sleep(0.3)
    return got


@dataclass
class Scenario:
    url: str
    store: Store
    settings: Settings
    headers: dict[str, str]
    job: dict[str, Any]
    """The job as the API answered at the end."""
    answers: list[tuple[str, str]] = field(default_factory=list)
    """(what, text) of every answer and page read, for the secret's grep."""
    steps_before: int = 0
    steps_during: int = 0
    killed_at: float = 0.0
    back_at: float = 0.0
    logs: list[str] = field(default_factory=list)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        r = HTTP.get(self.url + path, headers=self.headers, timeout=60, **kw)
        self.answers.append((path, r.text))
        return r


class _Records(logging.Handler):
    def __init__(self, out: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(self.format(record))


@pytest.fixture(scope="module")
def scenario(local_ray: None, mlflow_server: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Scenario]:
    data = tmp_path_factory.mktemp("tracking-e2e")
    settings = Settings(data_dir=data, mlflow_uri=mlflow_server.uri,
                        public_url="http://trident.test", mlflow_token="srv-token",
                        entrypoint_modules="tests.entrypoints", light_ranks=True)
    logs: list[str] = []
    handler = _Records(logs)
    logging.getLogger().addHandler(handler)

    def backoff(controller: Controller) -> None:
        assert controller.exporter is not None
        controller.exporter.max_backoff_s = 4  # the test waits less once the server is back

    go = data / "go"
    try:
        with served_stack(settings, before=backoff, start_timeout_s=600,
                          box=SecretBox.of(None, data),
                          tracking=TrackingConfig.of(settings)) as served:
            url, store = served.url, served.store
            headers = {"Authorization": f"Bearer {user_token(store)}"}
            sc = Scenario(url, store, settings, headers, {}, logs=logs)
            spec = tiny_spec(name="tracked", entrypoint="tests.entrypoints:tracked",
                             program="light",
                             secrets={"TRIDENT_TEST_SECRET": SECRET},
                             env={"TRIDENT_TEST_GO": str(go), "TRIDENT_TEST_SECRET_SHA256":
                                  hashlib.sha256(SECRET.encode()).hexdigest()},
                             monitor={"probe": False})
            r = HTTP.post(f"{url}/api/v1/jobs", json=spec, headers=headers, timeout=60)
            assert r.status_code == 201, r.text
            sc.answers.append(("POST /jobs", r.text))
            job_id = r.json()["id"]
            run_url = f"/api/v1/jobs/{job_id}/tracking"

            def exported() -> int:
                found = [e for e in sc.get(run_url).json()["exports"] if e["sink"] == "mlflow"]
                return int(found[0]["exported"]) if found else 0

            wait("steps sent to MLflow", lambda: exported() >= 3)
            sc.steps_before = len(store.list_metrics(job_id=job_id))
            sc.get("/metrics")  # while it runs: its custom metric is there
            mlflow_server.kill()
            sc.killed_at = time.time()
            time.sleep(OUTAGE_S)  # the outage itself: what the acceptance asks for
            sc.steps_during = len(store.list_metrics(job_id=job_id)) - sc.steps_before
            mlflow_server.start()
            sc.back_at = time.time()
            go.touch()
            wait("the job's end", lambda: sc.get(f"/api/v1/jobs/{job_id}").json()["state"]
                 in ("SUCCEEDED", "FAILED", "CANCELLED"))
            ended = time.time()
            wait("every export done", lambda: all(
                e["done"] for e in sc.get(run_url).json()["exports"]))
            sc.job = sc.get(f"/api/v1/jobs/{job_id}").json()
            print(f"tracking e2e: {sc.steps_before} steps before the kill, {sc.steps_during}"
                  f" stored during the {OUTAGE_S:g} s outage, {sc.job['step']} in all; MLflow"
                  f" back {sc.back_at - sc.killed_at:.1f} s after the kill, every export done"
                  f" {time.time() - ended:.1f} s after the job ended")
            yield sc
    finally:
        logging.getLogger().removeHandler(handler)


def test_no_training_step_is_lost_while_mlflow_is_down(scenario: Scenario) -> None:
    job = scenario.job
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [m.step for m in scenario.store.list_metrics(job_id=job["id"], rank=None)
             if m.rank == 0]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == job["step"]
    for rank in (0, 1):
        assert len(scenario.store.list_metrics(job_id=job["id"], rank=rank)) == len(steps)
    # The ranks went on and the controller stored their steps while the tracker was away.
    assert scenario.steps_during > 0
    down = [m for m in scenario.store.list_metrics(job_id=job["id"])
            if scenario.killed_at < m.time.timestamp() < scenario.back_at]
    assert len(down) >= scenario.steps_during


def test_mlflow_has_every_step_and_the_final_state_once_it_is_back(scenario: Scenario,
                                                                  mlflow_server: Any) -> None:
    job_id = scenario.job["id"]
    stored = {m.step: m for m in scenario.store.list_metrics(job_id=job_id)}
    [e] = [e for e in scenario.get(f"/api/v1/jobs/{job_id}/tracking").json()["exports"]
           if e["sink"] == "mlflow"]
    # Complete: every step sent, none dropped (the cursor waited in the store).
    assert (e["exported"], e["dropped"], e["done"], e["error"]) == (len(stored), 0, True, None)
    assert e["run_url"].startswith(mlflow_server.uri)
    client = mlflow.MlflowClient(mlflow_server.uri)
    run = client.get_run(e["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["trident.state"] == "SUCCEEDED"
    assert run.data.tags["trident.job_id"] == str(job_id)
    assert run.data.tags["trident.url"] == f"http://trident.test/jobs/{job_id}"
    assert run.data.params["entrypoint"] == "tests.entrypoints:tracked"
    loss = {m.step: m.value for m in client.get_metric_history(e["run_id"], "loss")}
    assert loss == {s: m.loss for s, m in stored.items()}
    acc = {m.step: m.value for m in client.get_metric_history(e["run_id"], "accuracy")}
    assert acc == {s: m.data["custom"]["accuracy"] for s, m in stored.items()}
    events = [ev for ev in scenario.get(f"/api/v1/jobs/{job_id}/events?limit=1000").json()
              ["items"] if ev["kind"] == "tracking"]
    assert [ev["data"]["down"] for ev in events] == [True, False], events
    page = scenario.get(f"/jobs/{job_id}").text  # the job's page lists its trackers
    assert f'<a href="{e["run_url"]}">' in page
    assert f'<td class="exported">{len(stored)}</td><td class="dropped">0</td>' in page
    metrics = scenario.get("/metrics").text
    assert f'trident_tracking_exported_steps_total{{sink="mlflow"}} {float(len(stored))}' \
        in metrics
    assert 'trident_tracking_dropped_steps_total{sink="mlflow"} 0.0' in metrics
    running = [t for w, t in scenario.answers if w == "/metrics"][0]
    assert f'trident_job_custom{{job_id="{job_id}",name="accuracy"}}' in running


def test_tensorboards_reader_reads_the_finished_jobs_stored_scalars(scenario: Scenario) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job_id = scenario.job["id"]
    [e] = [e for e in scenario.get(f"/api/v1/jobs/{job_id}/tracking").json()["exports"]
           if e["sink"] == "tensorboard"]
    assert e["directory"] == str(scenario.settings.data_dir / "tensorboard" / f"job-{job_id}")
    acc = EventAccumulator(e["directory"], size_guidance={"scalars": 0})
    acc.Reload()
    stored = scenario.store.list_metrics(job_id=job_id)
    for name, value in (("loss", lambda m: m.loss), ("step_time_s", lambda m: m.step_time_s),
                        ("tokens_per_s", lambda m: m.tokens_per_s),
                        ("accuracy", lambda m: m.data["custom"]["accuracy"])):
        read = acc.Scalars(name)
        assert [x.step for x in read] == [m.step for m in stored], name
        assert [x.value for x in read] == [np.float32(value(m)) for m in stored], name


def test_the_secret_is_in_the_ranks_environment_and_nowhere_else(scenario: Scenario,
                                                                 mlflow_server: Any) -> None:
    job = scenario.job
    job_id = job["id"]
    # In the ranks' environment: the entrypoint compared its digest, else the job failed.
    assert job["state"] == "SUCCEEDED" and job["secrets"] == ["TRIDENT_TEST_SECRET"]
    assert "TRIDENT_TEST_SECRET" not in job["spec"]["env"] and "secrets" not in job["spec"]
    # The owner resubmits: the new job has the secret too, and its answer does not show it.
    r = HTTP.post(f"{scenario.url}/api/v1/jobs/{job_id}/resubmit", headers=scenario.headers,
                  timeout=60)
    assert r.status_code == 201, r.text
    scenario.answers.append(("POST resubmit", r.text))
    again = r.json()["id"]
    assert r.json()["secrets"] == ["TRIDENT_TEST_SECRET"]
    r = HTTP.post(f"{scenario.url}/api/v1/jobs/{again}/cancel", headers=scenario.headers,
                  timeout=60)
    assert r.status_code == 202, r.text
    scenario.answers.append(("POST cancel", r.text))
    # Every GET route of the API, every page.
    app = create_app(scenario.settings, store=scenario.store)
    status: dict[str, int] = {}
    for method, path, _ in api_routes(app):
        url = path.replace("{job_id}", str(job_id))
        if method != "GET" or "{" in url:  # another kind of id: a probe's, a request's
            continue
        url += f"?jobs={job_id}&jobs={again}" if path.endswith("/compare") else ""
        r = scenario.get(url)
        status[path] = r.status_code
        assert r.status_code in (200, 404, 503), (url, r.status_code, r.text[:300])
    # The routes that hold what a leak would show answered (a refusal would grep clean).
    for path in ("/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/events",
                 "/api/v1/jobs/{job_id}/metrics", "/api/v1/jobs/{job_id}/logs",
                 "/api/v1/jobs/{job_id}/attempts", "/api/v1/jobs/{job_id}/series",
                 "/api/v1/jobs/{job_id}/tracking", "/api/v1/audit", "/api/v1/compare"):
        assert status.get(path) == 200, (path, status.get(path), sorted(status))
    for page in ("/", "/ui/jobs/rows", f"/jobs/{job_id}", f"/plan?job={job_id}", "/queue",
                 "/cluster", f"/compare?jobs={job_id}&jobs={again}",
                 f"/jobs/{job_id}/logs/rank-0.log", f"/jobs/{job_id}/logs/rank-1.log"):
        assert scenario.get(page).status_code == 200, page
    # The audit log: it holds the submit, the resubmit and the cancel.
    r = scenario.get("/api/v1/audit?limit=1000")
    assert r.status_code == 200, r.text
    audited = {(a["method"], a["path"], a["status"]) for a in r.json()["items"]}
    assert {("POST", "/api/v1/jobs", 201), ("POST", f"/api/v1/jobs/{job_id}/resubmit", 201),
            ("POST", f"/api/v1/jobs/{again}/cancel", 202)} <= audited, audited
    # The rank logs through the API: both ranks' output, where a leak would be.
    r = scenario.get(f"/api/v1/jobs/{job_id}/logs?rank=0&rank=1")
    assert r.status_code == 200, r.text
    chunks = {c["rank"]: c["text"] for c in r.json()["ranks"]}
    assert set(chunks) == {0, 1}
    for rank, text in chunks.items():
        assert f"tracked rank {rank}: its secret is in its environment" in text, text[-500:]
    assert len(scenario.answers) > 30
    for what, text in scenario.answers:
        assert SECRET not in text, f"the secret is in {what}"
    # The rank logs, the database (sealed at rest), the TensorBoard files, the logs of this
    # process (the controller's and the API's).
    data = scenario.settings.data_dir
    files = [p for p in [*data.rglob("*"), *mlflow_server.folder.rglob("*")]
             if p.is_file() and not p.name.endswith(".key")]
    assert any(p.name == "rank-0.log" for p in files) and any(p.suffix == ".db" for p in files)
    assert "its secret is in its environment" in (
        next(p for p in files if p.name == "rank-0.log").read_text())
    for p in files:
        try:
            held = p.read_bytes()
        except FileNotFoundError:  # a transient file gone since it was listed (SQLite's
            continue               # journal of the MLflow server, which still writes)
        assert SECRET.encode() not in held, f"the secret is in {p}"
    assert not [line for line in scenario.logs if SECRET in line]
    # Nor in the tracker.
    [e] = [e for e in scenario.get(f"/api/v1/jobs/{job_id}/tracking").json()["exports"]
           if e["sink"] == "mlflow"]
    run = mlflow.MlflowClient(scenario.settings.mlflow_uri).get_run(e["run_id"])
    assert SECRET not in str(run.to_dictionary())

