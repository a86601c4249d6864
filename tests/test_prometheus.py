"""`GET /metrics`, parsed by Prometheus's own text parser and checked against the store (on
SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.heartbeats import HeartbeatLog
from service.store.lease import CONTROLLER, Leases
from service.submission.intake import submit
from tests.conftest import authed_client, record_steps, tiny_spec


def report(step: int, rank: int, *, peak: int, comm_s: float = 0.01) -> dict[str, Any]:
    return {"step": step, "rank": rank, "loss": 5.0 - step / 10, "step_time_s": 0.2 + rank / 100,
            "tokens_per_s": 1000.0 * step, "lr": 1e-3 / step, "grad_norm": 2.0 + step,
            "data": {
                "memory": {"process_peak_bytes": peak}, "bubble_s": bubble(step, rank),
                "comm": {"dp": {"all_reduce": {"time_s": comm_s, "bytes": 4096.0,
                                               "calls": 2.0}}}, "timed": True}}


def bubble(step: int, rank: int) -> float:
    return 0.01 * step + 0.02 * rank


def scrape(client: TestClient) -> dict[str, Any]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fam: Any, name: str | None = None, **labels: str) -> float:
    hits = [s.value for s in fam.samples if (name is None or s.name == name)
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (fam.name, labels, fam.samples)
    return float(hits[0])


@pytest.mark.parametrize("per_rank", [True, False])
def test_metrics_match_the_store(store: Store, tmp_path, per_rank: bool) -> None:
    spec = JobSpec.model_validate(tiny_spec())
    running = submit(store, spec)
    queued = [submit(store, spec) for _ in range(2)]
    done = submit(store, spec)
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=running.id, to=to, message=to.value)
    store.start_attempt(job_id=running.id)
    store.set_placement(job_id=running.id, number=1, placement={"ranks": [
        {"rank": 0, "hostname": "node-a", "gpu_ids": []},
        {"rank": 1, "hostname": "node-b", "gpu_ids": []}]})
    record_steps(store, job_id=running.id, attempt=1, rows=[
        report(s, r, peak=100 * s + r) for s in (1, 2, 3) for r in (0, 1)])
    store.transition(job_id=done.id, to=JobState.CANCELLED, message="x")
    Leases(store).acquire(name=CONTROLLER, holder="c1", duration_s=30)
    Leases(store).acquire(name=CONTROLLER, holder="c1", duration_s=30, last_pass_s=0.042)
    HeartbeatLog(store).record(job_id=running.id, attempt=1,
                                      seen={0: time.time() - 12.5, 1: time.time() - 0.5})
    seen = HeartbeatLog(store).last_seen(job_id=running.id, attempt=1)

    settings = Settings(data_dir=tmp_path, metrics_per_rank=per_rank)
    with authed_client(create_app(settings, store=store), store) as client:
        client.get(f"/api/v1/jobs/{running.id}")
        client.get("/api/v1/jobs/999999")
        before = datetime.now(UTC)
        fams = scrape(client)
        after = datetime.now(UTC)
        cells = client.get(f"/api/v1/jobs/{running.id}/ranks").json()["cells"]

    assert fams["trident_jobs"].type == "gauge"
    assert value(fams["trident_jobs"], state="QUEUED") == len(queued)
    assert value(fams["trident_jobs"], state="RUNNING") == 1
    assert value(fams["trident_jobs"], state="CANCELLED") == 1
    assert value(fams["trident_jobs"], state="FAILED") == 0
    job = str(running.id)
    info = fams["trident_job_info"]
    assert [s.labels["job_id"] for s in info.samples] == [job]  # active jobs only
    assert info.samples[0].labels == {"job_id": job, "name": "tiny", "owner": "local",
                                      "state": "RUNNING", "tp": "1", "pp": "1", "dp": "2",
                                      "zero": "2"}
    latest = store.latest_metric(job_id=running.id)
    assert latest is not None and latest.step == 3
    assert value(fams["trident_job_step"], job_id=job) == 3
    assert value(fams["trident_job_steps"], job_id=job) == 6
    assert value(fams["trident_job_step_duration_seconds"], job_id=job) == latest.step_time_s
    pred = running.plan.time.step_s
    assert value(fams["trident_job_step_duration_predicted_seconds"], job_id=job) == \
        pytest.approx(pred)
    assert value(fams["trident_job_step_duration_prediction_error_ratio"], job_id=job) == \
        pytest.approx((latest.step_time_s - pred) / pred)
    assert value(fams["trident_job_tokens_per_second"], job_id=job) == 3000.0
    assert value(fams["trident_job_loss"], job_id=job) == pytest.approx(4.7)
    assert value(fams["trident_job_learning_rate"], job_id=job) == pytest.approx(1e-3 / 3)
    assert value(fams["trident_job_grad_norm"], job_id=job) == pytest.approx(5.0)
    mfu_pred = running.plan.mfu
    assert value(fams["trident_job_mfu_ratio"], job_id=job) == pytest.approx(
        mfu_pred * 3000.0 / running.plan.tokens_per_s)
    bubbles = fams["trident_pipeline_bubble_ratio"]
    assert value(bubbles, job_id=job, kind="predicted") == pytest.approx(
        running.plan.time.bubble_s / pred)
    newest = store.list_metrics(job_id=running.id, rank=None, after_step=2)
    assert {m.rank for m in newest} == {0, 1}  # the newest step, every rank
    assert value(bubbles, job_id=job, kind="measured") == pytest.approx(
        sum(m.data["bubble_s"] / m.step_time_s for m in newest) / 2)
    assert value(fams["trident_job_comm_seconds"], job_id=job, dim="dp", op="all_reduce") == 0.01
    assert value(fams["trident_job_comm_bytes"], job_id=job, dim="dp", op="all_reduce") == 4096
    assert value(fams["trident_controller_pass_duration_seconds"]) == 0.042
    if per_rank:
        assert value(fams["trident_rank_memory_peak_bytes"], job_id=job, rank="1",
                     node="node-b", gpu="") == 301
        assert value(fams["trident_rank_memory_predicted_bytes"], job_id=job, rank="0",
                     node="node-a") == running.plan.memory.total
        assert value(fams["trident_rank_last_report_age_seconds"], job_id=job, rank="0") >= 0
        beats = fams["trident_rank_heartbeat_age_seconds"]
        assert beats.type == "gauge"
        for rank, node in ((0, "node-a"), (1, "node-b")):
            age = value(beats, job_id=job, rank=str(rank), node=node, gpu="")
            assert (before - seen[rank]).total_seconds() <= age <= \
                (after - seen[rank]).total_seconds()
        assert (before - seen[0]).total_seconds() >= 12.5
        # One status per rank: the ranks grid's (`trident top`'s) cells, gauge for gauge.
        assert [c["rank"] for c in cells] == [0, 1]
        for c in cells:
            labels = {"job_id": job, "rank": str(c["rank"]), "node": c["node"],
                      "gpu": c["gpu"] or ""}
            assert value(fams["trident_rank_memory_peak_bytes"], **labels) == \
                c["memory_peak_bytes"]
            assert value(fams["trident_rank_memory_predicted_bytes"], **labels) == \
                pytest.approx(c["memory_predicted_bytes"])
    else:
        assert not fams["trident_rank_memory_peak_bytes"].samples
        assert not fams["trident_rank_heartbeat_age_seconds"].samples
    hist = fams["trident_api_request_duration_seconds"]
    assert hist.type == "histogram"
    assert value(hist, "trident_api_request_duration_seconds_count", method="GET",
                 route="/api/v1/jobs/{id}", status="200") == 1
    assert value(hist, "trident_api_request_duration_seconds_count", method="GET",
                 route="/api/v1/jobs/{id}", status="404") == 1
    for name, fam in fams.items():  # conventions: counters end in _total, no unitless time
        assert name.startswith("trident_")
        assert fam.type in ("gauge", "histogram", "counter"), name
        if fam.type == "counter":  # the exporter's steps sent and dropped, the ledgers,
            # the training guard's events
            assert name.startswith(("trident_tracking_", "trident_job_seconds",
                                    "trident_project_", "trident_job_guard_events"))
            assert all(s.name == f"{name}_total" for s in fam.samples), fam.samples


def test_custom_metrics_and_the_exporters_counts_are_exposed(store: Store, tmp_path) -> None:
    from service.store.tracking_exports import Exports, Sink
    from service.submission.intake import Submitter
    from service.tracking.config import TrackingConfig

    uri = "http://mlflow.test:5000"
    cfg = TrackingConfig(mlflow_uri=uri, mlflow_allowed=frozenset({uri}),
                         tensorboard_root=tmp_path / "tensorboard")
    job = submit(store, JobSpec.model_validate(tiny_spec()), by=Submitter(tracking=cfg))
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value)
    store.start_attempt(job_id=job.id)
    record_steps(store, job_id=job.id, attempt=1, rows=[
        {**report(1, 0, peak=1), "data": {"custom": {"accuracy": 0.25, "phase": "warm"}}},
        {**report(2, 0, peak=1), "data": {"custom": {"accuracy": 0.5, "top5": 0.9}}}])
    exports = Exports(store)
    exports.advance(job_id=job.id, sink=Sink.MLFLOW, attempt=1, step=7, exported=5, dropped=2)
    exports.advance(job_id=job.id, sink=Sink.TENSORBOARD, attempt=1, step=7, exported=7)
    exports.failing(job_id=job.id, sink=Sink.MLFLOW, error="refused")
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        fams = scrape(client)
    custom = {(s.labels["job_id"], s.labels["name"]): s.value
              for s in fams["trident_job_custom"].samples}
    # The newest step's, numbers only.
    assert custom == {(str(job.id), "accuracy"): 0.5, (str(job.id), "top5"): 0.9}
    sent, dropped = fams["trident_tracking_exported_steps"], fams["trident_tracking_dropped_steps"]
    assert value(sent, sink="mlflow") == 5 and value(sent, sink="tensorboard") == 7
    assert value(dropped, sink="mlflow") == 2 and value(dropped, sink="tensorboard") == 0
    failing = fams["trident_tracking_failing_exports"]
    assert value(failing, sink="mlflow") == 1 and value(failing, sink="tensorboard") == 0


def test_goodput_counters_sum_every_jobs_ledger(store: Store, tmp_path) -> None:
    """`trident_job_seconds_total{category}` is the jobs' ledgers summed, and the GPU- and
    CPU-seconds per project are their projects' ledgers; a queued job's wait grows from one
    scrape to the next."""
    from service.store.views import AttemptStatus
    from service.submission.intake import Submitter

    ended = []
    for project, name in (("default", "a"), ("vision", "b"), ("vision", "c")):
        job = submit(store, JobSpec.model_validate(tiny_spec(name=name)),
                     by=Submitter(owner="alice", project=project))
        for to in (JobState.PLACING, JobState.RUNNING):
            store.transition(job_id=job.id, to=to, message=to.value)
        store.start_attempt(job_id=job.id)
        for step in (1, 2, 3):
            time.sleep(0.02)
            record_steps(store, job_id=job.id, attempt=1, rows=[
                {**report(step, r, peak=1), "data": {"ended_at": time.time()}} for r in (0, 1)])
        store.end_attempt(job_id=job.id, number=1, status=AttemptStatus.SUCCEEDED)
        store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="done")
        ended.append(job.id)
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        ledgers = {j: client.get(f"/api/v1/jobs/{j}/goodput").json() for j in ended}
        fams = scrape(client)
        seconds = fams["trident_job_seconds"]
        assert all(s.name == "trident_job_seconds_total" for s in seconds.samples)
        for category in ("training", "start", "finishing", "queued"):
            assert value(seconds, category=category) == pytest.approx(sum(
                c["seconds"] for lg in ledgers.values() for c in lg["categories"]
                if c["category"] == category), abs=1e-9)
        assert value(seconds, category="training") > 0
        total = sum(s.value for s in seconds.samples)
        assert total == pytest.approx(sum(lg["wall_s"] for lg in ledgers.values()))
        cpu, gpu = fams["trident_project_cpu_seconds"], fams["trident_project_gpu_seconds"]
        for project, jobs in (("default", ended[:1]), ("vision", ended[1:])):
            want = sum(c["cpu_seconds"] for j in jobs for c in ledgers[j]["categories"]
                       if c["category"] == "training")
            assert value(cpu, project=project, category="training") == pytest.approx(want)
            assert want > 0
            # CPU ranks (tiny_spec): no GPU-seconds.
            assert value(gpu, project=project, category="training") == 0
        # A queued job: its wait is counted, and grows; it holds nothing.
        waiting = submit(store, JobSpec.model_validate(tiny_spec(name="w")),
                         by=Submitter(owner="bob", project="queue"))
        first = value(scrape(client)["trident_job_seconds"], category="queued")
        time.sleep(0.2)
        again = scrape(client)
        assert value(again["trident_job_seconds"], category="queued") >= first + 0.2
        assert value(again["trident_project_cpu_seconds"], project="queue",
                     category="queued") == 0
        assert store.get_job(job_id=waiting.id).state == JobState.QUEUED


def test_a_scrape_beside_one_reading_the_ledgers_answers_the_last_totals(store: Store) -> None:
    """Ledgers are read by one scrape at a time: one beside it answers the totals of the
    scrape before (none before the first: no goodput counters rather than zeros)."""
    from api.prometheus import StoreCollector
    from service.submission.intake import Submitter

    collector = StoreCollector(lambda: store, per_rank=False)
    names = ("trident_job_seconds", "trident_project_gpu_seconds",
             "trident_project_cpu_seconds")

    def goodput() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(f.name, tuple(sorted(s.labels.items()))): s.value
                for f in collector.collect() if f.name in names for s in f.samples}

    submit(store, JobSpec.model_validate(tiny_spec()), by=Submitter(project="first"))
    with collector._ledgers:  # a scrape reads them now
        assert goodput() == {}
    before = goodput()
    assert before[("trident_job_seconds", (("category", "queued"),))] > 0
    submit(store, JobSpec.model_validate(tiny_spec()), by=Submitter(project="second"))
    time.sleep(0.05)
    with collector._ledgers:
        assert goodput() == before
    after = goodput()
    assert after[("trident_job_seconds", (("category", "queued"),))] > before[
        ("trident_job_seconds", (("category", "queued"),))]
    assert ("trident_project_cpu_seconds", (("category", "queued"), ("project", "second"))) \
        in after


def test_an_ended_job_is_added_to_the_running_totals_once_it_has_settled(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose ledger can no longer change (it ended `SETTLED` ago) is summed once into
    totals the collector keeps; a scrape then reads only the others. Its seconds are counted
    once in every scrape: before it settled, as it settles, and after."""
    import api.prometheus
    import service.store.goodput
    from api.prometheus import StoreCollector
    from service.store.goodput import GoodputLedger
    from service.store.views import AttemptStatus

    settle = timedelta(seconds=0.5)
    monkeypatch.setattr(api.prometheus, "SETTLED", settle)
    monkeypatch.setattr(service.store.goodput, "SETTLED", settle)
    job = submit(store, JobSpec.model_validate(tiny_spec()))
    store.start_attempt(job_id=job.id)
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value, attempt=1)
    store.end_attempt(job_id=job.id, number=1, status=AttemptStatus.SUCCEEDED)
    store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="done", attempt=1)
    wall = GoodputLedger(store).ledger(job.id).wall_s
    collector = StoreCollector(lambda: store, per_rank=False)

    def total() -> float:
        return sum(s.value for f in collector.collect() if f.name == "trident_job_seconds"
                   for s in f.samples)

    assert total() == pytest.approx(wall)  # not settled yet: read whole
    time.sleep(0.6)
    assert total() == pytest.approx(wall)  # settles: added to the kept totals
    assert collector._horizon is not None and collector._settled[0]["start"] > 0
    assert total() == pytest.approx(wall)  # kept, and not read again
