"""The exporter against a real `mlflow server` (SQLite, loopback; `tests.mlflow_server`),
read back with MLflow's own `MlflowClient`: a job's run with its parameters, every step's
figures by their stored names, its tags and final state; and the server's token, which goes
with every request and nowhere else. The steps come from the store as the controller stores
them (`MetricsIngest`), without Ray: the end-to-end run is tests/test_tracking_e2e.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.secrets import SecretBox
from service.store import Job, Store
from service.store.goodput import GoodputLedger
from service.store.metrics import MetricsIngest
from service.store.tracking_exports import Exports, Sink
from service.submission.intake import Submitter, submit
from service.tracking.config import TrackingConfig
from service.tracking.exporter import Exporter
from tests.conftest import tiny_spec

mlflow = pytest.importorskip("mlflow")

pytestmark = pytest.mark.slow  # a real mlflow server: processes of its own

SECRET = "sk-mlflow-test-secret-value-0123456789"
STEPS = 7


def rows(steps: range, world_size: int) -> list[dict[str, Any]]:
    """Stored rows as the ingest takes them, with per-step fields beyond today's report
    (eval_loss on some steps, lr, grad_norm): they reach MLflow by name with no code."""
    out = []
    for s in steps:
        for r in range(world_size):
            data: dict[str, Any] = {"lr": 1e-3 / s, "grad_norm": 2.0 + s,
                                    "memory": {"process_peak_bytes": 10**8 + r},
                                    "custom": {"accuracy": s / 10, "phase": "warm"}}
            if s % 3 == 0:
                data["eval_loss"] = 3.0 - s / 10
            out.append({"rank": r, "step": s, "loss": 4.0 - s / 7, "step_time_s": 0.05 * s,
                        "tokens_per_s": 1000.0 * s, "data": data})
    return out


def make_job(store: Store, cfg: TrackingConfig, tmp_path: Path) -> Job:
    spec = JobSpec.model_validate(tiny_spec(name="to-mlflow", env={"WANDB_MODE": "offline"},
                                            secrets={"API_KEY": SECRET}))
    job = submit(store, spec, by=Submitter(owner="alice", project="vision", tracking=cfg,
                                           box=SecretBox.of(None, tmp_path)))
    store.start_attempt(job_id=job.id)
    store.transition(job_id=job.id, to=JobState.PLACING, message="test")
    return store.transition(job_id=job.id, to=JobState.RUNNING, message="test")


def run_of(store: Store, job: Job, uri: str) -> Any:
    e = Exports(store).get(job_id=job.id, sink=Sink.MLFLOW)
    assert e is not None and e.run_id is not None, e
    return mlflow.MlflowClient(uri).get_run(e.run_id)


def test_a_job_is_an_mlflow_run_with_its_parameters_steps_tags_and_final_state(
        sqlite_store: Store, mlflow_server: Any, tmp_path: Path) -> None:
    uri = mlflow_server.uri
    cfg = TrackingConfig(mlflow_uri=uri, mlflow_allowed=frozenset({uri}),
                         public_url="https://trident.example.org")
    job = make_job(sqlite_store, cfg, tmp_path)
    ingest = MetricsIngest(sqlite_store)
    ingest.record(job_id=job.id, attempt=1, world_size=2, rows=rows(range(1, 5), 2))
    exporter = Exporter(sqlite_store, cfg.make_sink, allowed=cfg.allows, settle_s=0)
    assert exporter.cycle() == 4
    client = mlflow.MlflowClient(uri)
    run = run_of(sqlite_store, job, uri)
    assert run.info.status == "RUNNING" and run.data.tags["trident.state"] == "RUNNING"
    ingest.record(job_id=job.id, attempt=1, world_size=2, rows=rows(range(5, STEPS + 1), 2))
    sqlite_store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="test")
    assert exporter.cycle() == STEPS - 4
    exporter.close()

    run = run_of(sqlite_store, job, uri)
    assert run.info.status == "FINISHED" and run.info.run_name == "to-mlflow"
    assert client.get_experiment(run.info.experiment_id).name == "vision"  # the project
    tags = run.data.tags
    assert {k: tags[k] for k in ("trident.job_id", "trident.owner", "trident.project",
                                 "trident.state", "trident.url", "mlflow.user")} == {
        "trident.job_id": str(job.id), "trident.owner": "alice", "trident.project": "vision",
        "trident.state": "SUCCEEDED", "mlflow.user": "alice",
        "trident.url": f"https://trident.example.org/jobs/{job.id}"}
    params = run.data.params
    assert params["model.layers"] == "4" and params["train.lr"] == "0.003"  # gpt-tiny's
    assert params["layout.dp"] == "2" and params["layout.label"] == "tp1 pp1 dp2 zero2"
    assert float(params["plan.step_s"]) == pytest.approx(job.plan.time.step_s)
    assert float(params["plan.tokens_per_s"]) == pytest.approx(job.plan.tokens_per_s)
    assert not any(k.startswith(("env", "secrets")) for k in params)
    assert SECRET not in str(run.to_dictionary())
    stored = {m.step: m for m in sqlite_store.list_metrics(job_id=job.id)}
    assert sorted(stored) == list(range(1, STEPS + 1))

    def history(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}

    assert history("loss") == {s: m.loss for s, m in stored.items()}  # every step, as stored
    assert history("step_time_s") == {s: m.step_time_s for s, m in stored.items()}
    assert history("tokens_per_s") == {s: m.tokens_per_s for s, m in stored.items()}
    assert history("eval_loss") == {s: m.data["eval_loss"] for s, m in stored.items()
                                    if "eval_loss" in m.data}
    assert history("lr") == {s: m.data["lr"] for s, m in stored.items()}
    assert history("grad_norm") == {s: m.data["grad_norm"] for s, m in stored.items()}
    assert history("accuracy") == {s: s / 10 for s in stored}  # a custom metric, by its name
    assert set(history("memory/stage0/process_peak_bytes").values()) == {10**8}
    assert len(history("mfu")) == STEPS
    assert "phase" not in run.data.metrics  # a text value is kept with the step, not a metric
    e = Exports(sqlite_store).get(job_id=job.id, sink=Sink.MLFLOW)
    assert e is not None and (e.exported, e.dropped, e.done) == (STEPS, 0, True)


def test_an_ended_run_gets_its_goodput_ledger_once(sqlite_store: Store, mlflow_server: Any,
                                                   tmp_path: Path) -> None:
    """The ETTR and each category's seconds of the job's ledger, as run metrics, when (and
    only when) the job ended; a later round sends them no more."""
    uri = mlflow_server.uri
    # A server of its own (its URL tags the run): the session's MLflow has other job 1's.
    cfg = TrackingConfig(mlflow_uri=uri, mlflow_allowed=frozenset({uri}),
                         public_url="https://ledger.example.org")
    job = make_job(sqlite_store, cfg, tmp_path)
    MetricsIngest(sqlite_store).record(job_id=job.id, attempt=1, world_size=2,
                                       rows=rows(range(1, 4), 2))
    exporter = Exporter(sqlite_store, cfg.make_sink, allowed=cfg.allows, settle_s=0)
    assert exporter.cycle() == 3
    client = mlflow.MlflowClient(uri)
    assert not any(k.startswith("goodput.") for k in run_of(sqlite_store, job, uri).data.metrics)
    sqlite_store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="test")
    exporter.cycle()
    exporter.cycle()
    exporter.close()
    run = run_of(sqlite_store, job, uri)
    assert run.info.status == "FINISHED"
    ledger = GoodputLedger(sqlite_store).ledger(job.id)
    got = {k: v for k, v in run.data.metrics.items() if k.startswith("goodput.")}
    assert got["goodput.ettr"] == pytest.approx(ledger.ettr) and 0 < got["goodput.ettr"] <= 1
    for c in ledger.categories:
        assert got[f"goodput.{c.category}_s"] == pytest.approx(c.seconds)
    assert got["goodput.wall_s"] == pytest.approx(ledger.wall_s)
    assert got["goodput.steps_counted"] == 3 and got["goodput.steps_lost"] == 0
    # Once: one value each, at the last step.
    history = client.get_metric_history(run.info.run_id, "goodput.ettr")
    assert [(m.step, m.value) for m in history] == [(3, pytest.approx(ledger.ettr))]
    assert len(client.get_metric_history(run.info.run_id, "goodput.training_s")) == 1


class _TokenProxy(BaseHTTPRequestHandler):
    """A reverse proxy in front of the MLflow server that lets through only requests with
    the server's bearer token, and remembers every Authorization header it saw."""

    upstream = ""
    token = ""
    seen: list[str | None] = []

    def _forward(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.append(auth)
        if auth != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        r = httpx.request(self.command, self.upstream + self.path, content=body,
                          headers={"Content-Type": self.headers.get("Content-Type", "")},
                          timeout=30)
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    do_GET = do_POST = do_PATCH = do_DELETE = _forward

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def proxy(mlflow_server: Any) -> Iterator[tuple[str, type[_TokenProxy]]]:
    handler = type("Proxy", (_TokenProxy,), {"upstream": mlflow_server.uri,
                                             "token": "srv-token-42", "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def test_the_servers_mlflow_token_goes_with_every_request(
        sqlite_store: Store, proxy: tuple[str, type[_TokenProxy]], tmp_path: Path) -> None:
    uri, handler = proxy
    wrong = TrackingConfig(mlflow_uri=uri, mlflow_allowed=frozenset({uri}), token="wrong")
    job = make_job(sqlite_store, wrong, tmp_path)
    MetricsIngest(sqlite_store).record(job_id=job.id, attempt=1, world_size=2,
                                       rows=rows(range(1, 4), 2))
    refused = Exporter(sqlite_store, wrong.make_sink, allowed=wrong.allows)
    assert refused.cycle() == 0  # 401: the tracker is "not answering", nothing moves
    assert handler.seen and set(handler.seen) == {"Bearer wrong"}
    e = Exports(sqlite_store).get(job_id=job.id, sink=Sink.MLFLOW)
    assert e is not None and e.failing_since is not None and e.exported == 0
    handler.seen.clear()
    right = TrackingConfig(mlflow_uri=uri, mlflow_allowed=frozenset({uri}), token="srv-token-42")
    assert Exporter(sqlite_store, right.make_sink, allowed=right.allows).cycle() == 3
    assert handler.seen and set(handler.seen) == {"Bearer srv-token-42"}
