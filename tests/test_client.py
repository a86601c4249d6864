"""`client.TridentClient` against a live API server (uvicorn on a free port, the `live`
fixture): every route's method returns the API's typed records; refusals are exceptions
naming the status and, for a 422, the field; an unreachable server is a `ConnectionFailed`
naming its URL; only idempotent requests are retried (a submission under one
Idempotency-Key). The store is written as the controller would write it, so that each view
has something exact to show; the `trident` commands' tests (tests/test_cli*.py) are these
plus formatting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import update

from client import payloads
from client import rest as client_module
from client.payloads import (
    JobOut,
    LayoutSearch,
    NodeInfo,
    Placement,
    PlanOut,
    ProbeStatus,
    ProbeSummary,
    StackAnswer,
)
from client.rest import (
    ApiError,
    BadServerURL,
    Conflict,
    ConnectionFailed,
    Forbidden,
    Invalid,
    NotFound,
    NotTridentAPI,
    TridentClient,
    Unauthorized,
    Unavailable,
)
from service.contract.hardware import PROFILES
from service.contract.reports import ProbeRowModel
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.stack_collect import group_stacks
from service.files.ranklogs import attempt_log_dir
from service.store.heartbeats import HeartbeatLog
from service.store.lease import Leader
from service.store.stack_requests import StackRequests, StackStatus
from service.store.tables import JobRow
from tests.cli_stack import Live
from tests.conftest import record_steps, tiny_spec, user_token
from tests.servers import free_port
from tests.waiting import wait_for

HANG_STACK = "Traceback (most recent call last):\n  File \"train.py\", line 9, in step\n" \
             "    dist.all_reduce(grad)\n"


@pytest.fixture
def client(live: Live) -> Iterator[TridentClient]:
    with TridentClient(live.url) as c:
        yield c


def running(live: Live, c: TridentClient, steps: int = 3) -> int:
    """A job the controller would have placed on two hosts and run `steps` steps of, with
    timed collectives, a heartbeat of rank 0, a straggler and a hang diagnosis: its id."""
    job = c.submit(JobSpec.model_validate(tiny_spec(name="viewed")))
    store = live.store
    store.transition(job_id=job.id, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=job.id)
    store.transition(job_id=job.id, to=JobState.RUNNING, message="running", attempt=1)
    store.set_placement(job_id=job.id, number=1, placement={"ranks": [
        {"rank": r, "node_id": f"node-h{r}", "hostname": f"h{r}", "gpu_ids": []}
        for r in (0, 1)], "master": "127.0.0.1:1"})
    record_steps(store, job_id=job.id, attempt=1, rows=[
        {"step": s, "rank": r, "loss": 4.0 / s, "step_time_s": 0.5, "tokens_per_s": 100.0,
         "data": {"comm": {"dp": {"all_reduce": {"time_s": 0.1, "bytes": 1000, "calls": 1}}},
                  "memory": {"process_peak_bytes": 1 << 20}}}
        for s in range(1, steps + 1) for r in (0, 1)])
    HeartbeatLog(store).record(job_id=job.id, attempt=1, seen={0: time.time() - 60})
    store.add_event(job_id=job.id, attempt=1, kind="straggler", message="rank 1 is slow",
                    data={"rank": 1})
    store.add_event(job_id=job.id, attempt=1, kind="hang", message="no progress for 60 s",
                    data={"never_arrived": [1]})
    for r in (0, 1):
        store.add_event(job_id=job.id, attempt=1, kind="stacks", message=f"rank {r} stacks",
                        data={"rank": r, "stacks": HANG_STACK})
    return job.id


def test_an_answer_from_a_newer_server_still_reads() -> None:
    """The contract's rule for old clients and new servers (`client.payloads`): a field the
    client does not know is ignored, and a field added since an older server's answer has a
    default, so neither answer is refused."""
    models = [m for m in vars(payloads).values() if isinstance(m, type)
              and m.__module__ == payloads.__name__ and issubclass(m, BaseModel)]
    assert len(models) > 40  # every answer of the API
    assert [m.__name__ for m in models if m.model_config.get("extra") == "forbid"] == []
    event = {"id": 1, "job_id": 2, "attempt": None, "time": "2026-01-01T00:00:00Z",
             "kind": "started", "message": "m", "data": {}}
    newer = TypeAdapter(payloads.Event).validate_python({**event, "added_later": 3})
    assert newer == TypeAdapter(payloads.Event).validate_python(event)
    older = payloads.Health.model_validate({"status": "ok", "database": "ok",
                                            "controller": None, "added_later": True})
    assert older.data_dir is None and not hasattr(older, "added_later")


def test_the_client_finds_its_server_and_token(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The server: the argument, else TRIDENT_SERVER, else the local default; the token: the
    argument, else as the CLI finds it (tests/test_cli.py checks that order)."""
    monkeypatch.setenv("TRIDENT_TOKEN", "trd_env")
    monkeypatch.setenv("TRIDENT_SERVER", "https://trident.example:8443/")
    with TridentClient() as c:
        assert c.server == "https://trident.example:8443" and c.token_source == "TRIDENT_TOKEN"
    monkeypatch.delenv("TRIDENT_SERVER")
    with TridentClient(token="trd_mine") as c:
        assert c.server == "http://127.0.0.1:8000" and c.token_source == "the caller"
    with TridentClient("http://10.0.0.5:8000/proxy/trident/") as c:
        assert c.server == "http://10.0.0.5:8000/proxy/trident"
    with pytest.raises(BadServerURL, match=r"http://h:8000/api/v1 ends in /api/v1: give the"
                                           r" server's base URL, http://h:8000$"):
        TridentClient("http://h:8000/api/v1")
    with pytest.raises(BadServerURL, match="'h:8000' is not an http"):
        TridentClient("h:8000")


def test_jobs_submit_list_cancel_and_resubmit(live: Live, client: TridentClient,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    job = client.submit(JobSpec.model_validate(tiny_spec()))
    assert isinstance(job, JobOut) and job.state == JobState.QUEUED and job.owner == "admin"
    assert job.plan.layout.label == "tp1 pp1 dp2 zero2" and job.world_size == 2
    assert job.total_steps == 6 and job.queue_position == 1 and job.cpus is None
    other = client.submit({**tiny_spec(name="second"), "train": {"steps": 7}},
                          project="default")
    assert other.name == "second" and other.project == "default" and other.total_steps == 7
    got = client.get_job(job.id)
    assert got.id == job.id and got.predicted_vs_measured is not None
    assert got.predicted_vs_measured.step_s.predicted == got.plan.time.step_s
    assert got.predicted_vs_measured.steps_measured == 0
    page = client.list_jobs(name="second")
    assert page.total == 1 and [j.id for j in page.items] == [other.id]
    assert [j.id for j in client.list_jobs(sort="id", desc=False).items] == [job.id, other.id]
    # Paging: iter_jobs reads every page.
    more = [client.submit(tiny_spec(name=f"more-{i}")).id for i in range(3)]
    monkeypatch.setattr(client_module, "JOB_PAGE", 2)
    assert sorted(j.id for j in client.iter_jobs(state=["QUEUED"])) == sorted(
        [job.id, other.id, *more])
    cancelled = client.cancel_job(job.id)
    assert cancelled.state == JobState.CANCELLED
    with pytest.raises(Conflict) as refused:
        client.cancel_job(job.id)
    assert refused.value.status == 409 and refused.value.field is None
    assert str(refused.value) == f"409: job {job.id} is already CANCELLED"
    again = client.resubmit_job(job.id)
    assert again.id not in (job.id, other.id, *more) and again.state == JobState.QUEUED
    assert again.spec == live.store.get_job(job_id=job.id).spec


def test_a_spec_stored_before_a_newer_limit_reads_through_the_client(
        live: Live, client: TridentClient) -> None:
    """A spec stored before a limit it fails was added (a resource quantity Ray cannot claim,
    written here as an older server did) reads as it was stored, in the client's records and
    in `trident describe`; resubmitting it is refused on its field."""
    job = client.submit(JobSpec.model_validate(tiny_spec(name="older")))
    spec = job.spec.model_dump(mode="json")
    spec["resources"]["cpus_per_worker"] = 1e-9
    with live.store.engine.begin() as c:
        c.execute(update(JobRow).where(JobRow.id == job.id).values(spec=spec))
    got = client.get_job(job.id)
    assert got.spec.resources.cpus_per_worker == 1e-9 and got.name == "older"
    assert [j.spec.resources.cpus_per_worker for j in client.iter_jobs()] == [1e-9]
    with pytest.raises(Invalid) as refused:
        client.resubmit_job(job.id)
    assert refused.value.field == "resources.cpus_per_worker", refused.value
    r = live.cli("describe", str(job.id))
    assert r.exit_code == 0 and "cpus_per_worker: 1.0e-09" in r.output, r.output


def test_a_running_jobs_events_metrics_attempts_and_views(live: Live, client: TridentClient,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    job_id = running(live, client)
    events = client.list_events(job_id).items
    assert [e.id for e in events] == [e.id for e in live.store.list_events(job_id=job_id)]
    assert events[-1].kind == "stacks" and events[-1].data["rank"] == 1
    monkeypatch.setattr(client_module, "PAGE", 2)  # iter_events reads every page
    assert [e.id for e in client.iter_events(job_id)] == [e.id for e in events]
    assert [e.id for e in client.iter_events(job_id, after=events[1].id)] == [
        e.id for e in events[2:]]
    metrics = client.list_metrics(job_id, rank=1, attempt=1, after_step=1).items
    assert [(m.step, m.rank, m.attempt) for m in metrics] == [(2, 1, 1), (3, 1, 1)]
    assert metrics[0].loss == pytest.approx(2.0) and metrics[0].memory == {
        "process_peak_bytes": 1 << 20}
    attempt = client.list_attempts(job_id).items[0]
    assert attempt.number == 1 and attempt.status == "running"
    assert [(p.rank, p.hostname) for p in Placement.of(attempt).ranks] == [(0, "h0"),
                                                                            (1, "h1")]
    comm = client.get_comm(job_id, last=10)
    assert comm.attempt == 1 and comm.dims["dp"].time_s_per_step == pytest.approx(0.1)
    assert [r.rank for r in comm.ranks] == [0, 1]
    assert comm.ranks[0].dims["dp"].ops["all_reduce"].bytes == 1000
    split = client.get_comm_steps(job_id)
    assert [s.step for s in split.steps] == [1, 2, 3]
    assert split.steps[0].dp == pytest.approx(0.1) and split.steps[0].compute == \
        pytest.approx(0.4)
    assert split.predicted.step > 0
    series = client.get_series(job_id)
    assert series.rows == 3 and series.step == [1, 2, 3]
    assert series.loss == pytest.approx([4.0, 2.0, 4.0 / 3])
    ranks = client.get_ranks(job_id)
    assert ranks.attempt == 1 and [c.node for c in ranks.cells] == ["h0", "h1"]
    assert ranks.cells[0].heartbeat_age_s == pytest.approx(60, abs=30)
    assert ranks.cells[1].heartbeat_age_s is None and ranks.cells[1].straggler
    assert ranks.cells[1].hang_waits_for and ranks.cells[0].memory_peak_bytes == 1 << 20
    hang = client.list_hangs(job_id).items[0]
    assert hang.summary == "no progress for 60 s" and hang.diagnosis == {"never_arrived": [1]}
    assert [(g.ranks, g.text) for g in hang.stacks] == [([0, 1], HANG_STACK)]


def test_rank_logs_read_page_by_page_and_followed(live: Live, client: TridentClient) -> None:
    job_id = running(live, client)
    d = attempt_log_dir(live.settings.log_root, job_id, 1)
    d.mkdir(parents=True)
    lines = {r: [f"r{r} line {i}" for i in range(40)] for r in (0, 1)}
    for r, text in lines.items():
        (d / f"rank-{r}.log").write_text("\n".join(text) + "\n")
    page = client.get_logs(job_id, rank=[1], tail=2)
    assert page.attempt == 1 and [c.rank for c in page.ranks] == [1]
    assert page.ranks[0].text == "r1 line 38\nr1 line 39\n"
    # At most 64 bytes an answer: read_logs asks again from each rank's `next`.
    chunks = list(client.read_logs(job_id, max_bytes=64))
    assert len(chunks) > 10 and [c.rank for c in chunks] == sorted(c.rank for c in chunks)
    for r, text in lines.items():
        assert "".join(c.text for c in chunks if c.rank == r) == "\n".join(text) + "\n"
    followed: list[str] = []
    done = threading.Event()

    def follow() -> None:
        for c in client.follow_logs(job_id, rank=[0], tail=1):
            followed.append(c.text)
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    wait_for("the last line", lambda: "".join(followed) == "r0 line 39\n")
    with (d / "rank-0.log").open("a") as f:
        f.write("r0 after\n")
    wait_for("the new line", lambda: "".join(followed).endswith("r0 after\n"))
    live.store.transition(job_id=job_id, to=JobState.SUCCEEDED, message="done")
    assert done.wait(60), followed  # the stream ends with the job
    assert "".join(followed) == "r0 line 39\nr0 after\n"


def test_stacks_probes_the_cluster_and_the_planner(live: Live, client: TridentClient) -> None:
    queued = client.submit(tiny_spec(name="waits")).id
    with pytest.raises(Conflict, match="only a RUNNING job has ranks"):
        client.request_stacks(queued)
    job_id = running(live, client)
    req = client.request_stacks(job_id)
    assert req.status == StackStatus.PENDING and req.requested_by == "admin"
    StackRequests(live.store).finish(request_id=req.id, result=group_stacks({
        0: [{"thread": "train", "stack": HANG_STACK}],
        1: [{"thread": "train", "stack": HANG_STACK}]}))
    done = client.get_stacks(job_id, req.id)
    answer = StackAnswer.of(done)
    assert done.status == StackStatus.DONE and answer.ranks == 2
    assert [(t.thread, [g.ranks for g in t.groups]) for t in answer.threads] == [
        ("train", [[0, 1]])]
    # A probe, as the controller finishes it; the cluster it calibrated.
    probe = client.request_probe(ranks_per_node=1, max_bytes=4096)
    assert probe.status == ProbeStatus.PENDING and probe.request["max_bytes"] == 4096
    cpu = PROFILES["cpu"].to_json()
    live.store.finish_probe(probe_id=probe.id, status=ProbeStatus.DONE, results=[
        {"dim": "world", "op": "all_reduce", "group": [0, 1], "bytes": 4096, "time_s": 4e-6,
         "algbw": 1e9, "busbw": 2e9, "expected_busbw": 4e9, "ratio": 0.5}], summary={
        "profile": cpu, "matmul_flops": {"fp32": 1e12}, "links": {"intra_node_bw": 2e9},
        "ranks": 2, "nodes": 1})
    live.store.save_profile(name="cpu", profile=cpu, probe_id=probe.id)
    live.store.upsert_nodes(nodes=[{"node_id": "node-h0", "hostname": "h0", "accelerator":
                                    "cpu", "cpus": 8, "resources": {"CPU": 8.0}}])
    got = client.get_probe(probe.id)
    assert got.status == ProbeStatus.DONE and ProbeSummary.of(got).profile.name == "cpu"
    assert ProbeRowModel.model_validate(got.results[0]).busbw == 2e9
    assert [p.id for p in client.list_probes().items] == [probe.id]
    cluster = client.get_cluster()
    assert [n.node_id for n in cluster.nodes] == ["node-h0"]
    assert NodeInfo.of(cluster.nodes[0]).resources == {"CPU": 8.0}
    assert cluster.probe is not None and cluster.probe.id == probe.id
    assert cluster.profiles["cpu"].probe_id == probe.id
    assert [(j.job_id, j.ranks) for j in cluster.jobs["node-h0"]] == [(job_id, [0])]
    # The planner, nothing submitted: one plan, or the ranked layouts.
    plan = client.plan(JobSpec.model_validate(tiny_spec()))
    assert isinstance(plan, PlanOut) and plan.fits and plan.layout.label == "tp1 pp1 dp2 zero2"
    search = client.plan(tiny_spec(parallel="auto", cluster={"gpu": "cpu", "nodes": 1,
                                                             "gpus_per_node": 2}), top=2)
    assert isinstance(search, LayoutSearch) and search.best is not None
    assert len(search.ranked) == 2 and search.fitting >= 2
    with pytest.raises(Invalid) as bad:
        client.plan({**tiny_spec(), "parallel": {"tp": 3, "dp": 1}})
    assert bad.value.status == 422 and bad.value.field == "parallel.tp"
    assert bad.value.errors[0].location == "body"
    assert str(bad.value) == "422: parallel.tp: tp(3) does not divide heads(4)"


def test_identity(live: Live, client: TridentClient) -> None:
    me = client.whoami()
    assert (me.user, me.role, me.projects) == ("admin", "admin", ["default"])
    project = client.create_project("vision", gpus=8)
    assert project.gpu_quota == 8 and project.members == []
    alice = client.create_user("alice", projects=["vision"])
    assert (alice.role, alice.projects, alice.disabled) == ("member", ["vision"], False)
    new = client.create_token("laptop", user="alice", expires_in_days=1)
    assert new.token.startswith("trd_") and new.info.user == "alice"
    assert new.info.expires_at is not None
    with TridentClient(live.url, token=new.token) as as_alice:
        assert as_alice.whoami().user == "alice"
        with pytest.raises(Forbidden) as refused:
            as_alice.list_users()
        assert refused.value.status == 403 and "users:manage" in str(refused.value)
        assert [t.name for t in as_alice.list_tokens().items] == ["laptop"]
        revoked = client.revoke_token(new.info.id)
        assert revoked.revoked_at is not None
        with pytest.raises(Unauthorized) as unknown:
            as_alice.whoami()
        assert unknown.value.status == 401 and unknown.value.token_source == "the caller"
        assert str(unknown.value).startswith("401: token 'laptop' of alice was revoked")
        assert unknown.value.server == live.url
    assert client.set_quota("vision", gpus=16, cpus=4).cpu_quota == 4
    budget = client.set_budget("vision", gpu_hours=100, stop_running=True)
    assert (budget.budget_gpu_hours, budget.budget_stop_running) == (100, True)
    assert budget.budget_since is not None
    with pytest.raises(Invalid) as bad:
        client.set_budget("vision", gpu_hours=-1)
    assert bad.value.status == 422 and bad.value.field == "gpu_hours"
    assert client.remove_budget("vision").budget_since is None
    assert client.add_member("vision", "admin").members == ["admin", "alice"]
    assert {p.name: p.gpu_quota for p in client.list_projects().items}["vision"] == 16
    assert client.disable_user("alice").disabled
    assert {u.name: u.disabled for u in client.list_users().items} == {"admin": False,
                                                                       "alice": True}
    audit = client.list_audit(actor="admin").items
    assert ("POST", "/api/v1/projects", 201) in {(a.method, a.path, a.status) for a in audit}
    with pytest.raises(NotFound, match="404: "):
        client.revoke_token(99999)


def test_healthz_is_returned_degraded_or_ok(live: Live, client: TridentClient) -> None:
    health = client.healthz()  # no controller holds the lease: a 503, returned
    assert health.status == "degraded" and health.database == "ok"
    assert health.controller is not None and health.controller.holder is None
    assert health.controller.error == "no controller has held the lease"
    Leader(live.store, duration_s=60, holder="test-controller").acquire_or_renew()
    health = client.healthz()
    assert health.status == "ok" and health.controller is not None
    assert health.controller.holder == "test-controller" and health.controller.error is None


def test_refusals_name_the_status_the_field_and_the_url(live: Live, client: TridentClient,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    with pytest.raises(NotFound) as missing:
        client.get_job(999)
    assert missing.value.status == 404 and str(missing.value) == "404: job 999 not found"
    assert missing.value.method == "GET" and missing.value.url == f"{live.url}/api/v1/jobs/999"
    with pytest.raises(Invalid) as bad:
        client.list_jobs(limit=1000)
    assert (bad.value.field, bad.value.errors[0].location) == ("limit", "query")
    with pytest.raises(Invalid) as spec:
        client.submit({**tiny_spec(), "train": {"steps": 0, "stepz": 1}})
    assert {e.field for e in spec.value.errors} == {"train.steps", "train.stepz"}
    assert spec.value.field in ("train.steps", "train.stepz")
    assert live.store.list_jobs()[1] == 0  # nothing stored
    stranger = TridentClient(live.url, token="trd_not-a-token")
    with stranger, pytest.raises(Unauthorized, match="^401: "):
        stranger.whoami()
    # A URL where no Trident API answers: a path of another service, or nothing at all.
    lost = TridentClient(live.url + "/elsewhere")
    with lost, pytest.raises(NotTridentAPI) as wrong:
        lost.list_jobs()
    assert str(wrong.value).startswith(f"{live.url}/elsewhere/api/v1/jobs?")
    assert "no such route of the Trident API" in str(wrong.value)
    monkeypatch.setattr(client_module, "BACKOFF_S", 0.001)
    gone = f"http://127.0.0.1:{free_port()}"
    nobody = TridentClient(gone, retries=1)
    with nobody, pytest.raises(ConnectionFailed) as down:
        nobody.get_job(1)
    assert down.value.url == gone and str(down.value).startswith(
        f"cannot reach the Trident API at {gone}: ")
    assert isinstance(missing.value, ApiError) and not isinstance(down.value, ApiError)


class Flaky(httpx.BaseTransport):
    """Sends every request to the live server, except that it answers `fail` (a status, or
    a connection error) to the first `times` requests of each method and path."""

    def __init__(self, fail: int | type[Exception], times: int = 1) -> None:
        self.real, self.fail, self.times = httpx.HTTPTransport(), fail, times
        self.sent: list[tuple[str, str, str | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.method, request.url.path, request.headers.get("idempotency-key"))
        self.sent.append(key)
        if sum(1 for k in self.sent if k[:2] == key[:2]) <= self.times:
            if isinstance(self.fail, int):
                return httpx.Response(self.fail, json={"detail": "the database is away"},
                                      request=request)
            raise self.fail("connection refused", request=request)
        return self.real.handle_request(request)


def test_only_idempotent_requests_are_retried(live: Live,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "BACKOFF_S", 0.001)
    with TridentClient(live.url) as plain:
        queued = plain.submit(tiny_spec()).id
    failures: dict[str, int | type[Exception]] = {"503": 503, "502": 502,
                                                  "refused": httpx.ConnectError}
    for name, fail in failures.items():
        flaky = Flaky(fail)
        with TridentClient(live.url, transport=flaky) as c:
            assert c.get_job(queued).id == queued  # a GET: again, and answered
            job = c.submit(tiny_spec(name=f"retried-{name}"))
            posts = [k for k in flaky.sent if k[0] == "POST"]
            assert len(posts) == 2 and posts[0][2] == posts[1][2] and posts[0][2]
            assert job.name == f"retried-{name}"
            # A cancel is not repeated: the refusal (or the error) is the caller's.
            expected: Any = Unavailable if isinstance(fail, int) else ConnectionFailed
            with pytest.raises(expected):
                c.cancel_job(queued)
            assert [k[0] for k in flaky.sent].count("POST") == 3
    assert live.store.get_job(job_id=queued).state == JobState.QUEUED
    names = [j.name for j in live.store.list_jobs()[0]]
    assert sorted(n for n in names if n.startswith("retried-")) == sorted(
        f"retried-{name}" for name in failures)  # each submitted once
    # Out of retries: the last answer's refusal, after 1 + retries requests.
    flaky = Flaky(503, times=10)
    patient = TridentClient(live.url, transport=flaky, retries=2)
    with patient, pytest.raises(Unavailable) as away:
        patient.get_job(queued)
    assert away.value.status == 503 and len(flaky.sent) == 3


def test_the_token_comes_from_where_the_cli_finds_it(live: Live,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRIDENT_TOKEN, a server on this machine is asked with the bootstrap admin's
    token file in TRIDENT_DATA_DIR, as `trident` does."""
    secret = user_token(live.store, "boot", "admin")
    (live.settings.data_dir / "admin.token").write_text(secret + "\n")
    monkeypatch.delenv("TRIDENT_TOKEN")
    monkeypatch.setenv("TRIDENT_DATA_DIR", str(live.settings.data_dir))
    with TridentClient(live.url) as c:
        assert c.whoami().user == "boot"
        assert c.token_source == f"the bootstrap token file {live.settings.data_dir}/admin.token"
