"""`trident profile` without Ray: what a request may ask (steps, ranks, the job's state, how many
wait), the controller storing the ranks' traces within the per-file and per-job bounds (the
oldest dropped), the listing and the download through the REST API, the client and the CLI
(the real torch ranks are in test_profile_ray.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import cli.profile
from api.app import create_app
from cli.main import app as cli_app
from client.payloads import PROFILE_MAX_OPEN, PROFILE_MAX_STEPS, StackStatus
from service.contract.states import JobState
from service.control.profile_collect import ProfileCollector
from service.files.profiles import ProfileFiles, profile_root
from service.settings import Settings
from service.store import Store
from service.store.profile_requests import ProfileRequests
from tests.conftest import authed_client
from tests.fakes import submit
from tests.inprocess import client_of
from tests.waiting import wait_for


def running_job(store: Store) -> int:
    job_id = submit(store)  # 2 ranks
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job_id, to=to, message="test")
    return job_id


@pytest.fixture
def api(sqlite_store: Store, tmp_path: Path) -> TestClient:
    with authed_client(create_app(Settings(data_dir=tmp_path), store=sqlite_store),
                       sqlite_store) as client:
        yield client


def _loc(r: Any) -> list[Any]:
    return [d["loc"][-1] for d in r.json()["detail"]]


def test_a_request_names_the_field_it_gets_wrong_and_waits_within_bounds(
        sqlite_store: Store, api: TestClient) -> None:
    job_id = running_job(sqlite_store)
    url = f"/api/v1/jobs/{job_id}/profile"
    for body, field in [({"steps": 0}, "steps"), ({"steps": PROFILE_MAX_STEPS + 1}, "steps"),
                        ({"steps": "3"}, "steps"), ({"ranks": [0, 2]}, "ranks"),
                        ({"ranks": [-1]}, "ranks"), ({"rank": [0]}, "rank")]:
        r = api.post(url, json=body)
        assert r.status_code == 422 and field in _loc(r), (body, r.text)
    assert "outside the job's world size 2" in api.post(url, json={"ranks": [2]}).text
    queued = submit(sqlite_store)
    r = api.post(f"/api/v1/jobs/{queued}/profile", json={})
    assert r.status_code == 409 and "only a RUNNING job" in r.json()["detail"]
    first = api.post(url, json={"ranks": [1, 1]})  # every rank named once
    assert first.status_code == 202 and first.json()["ranks"] == [1]
    assert first.json()["steps"] == 3 and first.json()["status"] == "pending"
    assert api.post(url).json()["ranks"] == [0, 1]  # no body: every rank, 3 steps
    r = api.post(url, json={"steps": 1})
    assert r.status_code == 429 and f"at most {PROFILE_MAX_OPEN}" in r.json()["detail"]


class Ranks:
    """A group whose ranks answer `trident profile` with the files given per request."""

    def __init__(self, answers: list[dict[int, Any]]) -> None:
        self.answers = answers
        self.asked: list[dict[str, Any]] = []

    def profile(self, request_id: int, **kw: Any) -> dict[int, Any]:
        self.asked.append({"request_id": request_id, **kw})
        return self.answers.pop(0)


def trace(rank: int, size: int, steps: tuple[int, int] = (5, 6), **more: bytes
          ) -> dict[str, Any]:
    files = {f"rank-{rank}.pt.trace.json.gz": bytes([rank]) * size}
    files.update({f"rank-{rank}.{k.replace('_', '-')}": v for k, v in more.items()})
    return {"rank": rank, "steps": list(steps), "files": files, "left_out": [], "error": None}


def test_traces_are_stored_within_the_bounds_listed_and_downloaded(
        sqlite_store: Store, api: TestClient, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = sqlite_store
    job_id = running_job(store)
    requests = ProfileRequests(store)
    files = ProfileFiles(profile_root(tmp_path))
    collector = ProfileCollector(requests, files, max_trace_bytes=1000, max_job_bytes=2600)
    ranks = Ranks([
        {0: trace(0, 900, memory_timeline_json_gz=b"m" * 1200), 1: trace(1, 800)},
        {0: trace(0, 900, (9, 9)), 1: "(actor gone: RayActorError)"},
        {0: trace(0, 1000, (12, 12)), 1: trace(1, 700, (12, 12))},
        {0: "not profiled: light rank (no torch)", 1: "not profiled: light rank (no torch)"},
    ])
    groups = {job_id: (ranks, 1)}

    def answer(**ask: Any) -> int:
        req = requests.create(job_id=job_id, requested_by="admin", **ask)

        def stored() -> bool:
            collector.step(groups)  # type: ignore[arg-type]
            return requests.get(job_id=job_id, request_id=req.id).status in (
                StackStatus.DONE, StackStatus.FAILED)

        wait_for(f"request {req.id} answered", stored)
        return req.id

    one = answer(steps=2, ranks=[0, 1], memory=True)
    assert ranks.asked[0] == {"request_id": one, "ranks": [0, 1], "steps": 2, "memory": True,
                              "max_bytes": 1000, "timeout_s": 900.0}
    got = requests.get(job_id=job_id, request_id=one)
    assert got.status == StackStatus.DONE and got.attempt == 1
    assert [(f.rank, f.name, f.bytes) for f in got.files] == [
        (0, "rank-0.pt.trace.json.gz", 900), (1, "rank-1.pt.trace.json.gz", 800)]
    assert got.left_out == [{"rank": 0, "name": "rank-0.memory-timeline-json-gz",
                             "bytes": 1200, "why": "not a trace file's name, or over the"
                             " per-trace limit"}]
    assert got.profiled_steps == {"0": [5, 6], "1": [5, 6]}
    two = answer(steps=1, ranks=[0, 1], memory=False)  # 900 more fit beside 1700
    got = requests.get(job_id=job_id, request_id=two)
    assert [f.rank for f in got.files] == [0]
    assert got.missing == [{"rank": 1, "reason": "(actor gone: RayActorError)"}]
    three = answer(steps=1, ranks=[0, 1], memory=False)  # 1700 more: the oldest is dropped
    dropped = requests.get(job_id=job_id, request_id=one)
    assert dropped.files == [] and f"dropped for request {three}" in (dropped.dropped or "")
    assert not files.folder(job_id, one).exists()
    assert [f.bytes for f in requests.get(job_id=job_id, request_id=three).files] == [1000, 700]
    four = answer(steps=1, ranks=[0, 1], memory=False)
    failed = requests.get(job_id=job_id, request_id=four)
    assert failed.status == StackStatus.FAILED and failed.files == []
    assert "rank 0: not profiled: light rank" in (failed.error or "")

    listing = api.get(f"/api/v1/jobs/{job_id}/profile").json()
    assert [r["id"] for r in listing["items"]] == [four, three, two, one]
    assert listing["stored_bytes"] == 900 + 1700 and listing["max_steps"] == PROFILE_MAX_STEPS
    r = api.get(f"/api/v1/jobs/{job_id}/profile/{three}/files/rank-1.pt.trace.json.gz")
    assert r.status_code == 200 and r.content == b"\x01" * 700
    for bad in (f"{three}/files/rank-2.pt.trace.json.gz", f"{one}/files/rank-0.pt.trace.json.gz",
                f"{three}/files/..%2Fx", f"{three + 9}/files/rank-0.pt.trace.json.gz"):
        r = api.get(f"/api/v1/jobs/{job_id}/profile/{bad}")
        assert r.status_code in (404, 422), (bad, r.text)
    assert "dropped for request" in api.get(
        f"/api/v1/jobs/{job_id}/profile/{one}/files/rank-0.pt.trace.json.gz").text
    page = api.get(f"/jobs/{job_id}").text  # its Profiles tab lists them (api/static/job.js)
    assert 'id="tab-profiles"' in page and f"trident profile {job_id} --steps" in page

    # The CLI: the listing, and an earlier request's traces downloaded file by file.
    monkeypatch.setattr(cli.profile, "connect", lambda s: client_of(api))
    runner = CliRunner()
    r = runner.invoke(cli_app, ["profile", str(job_id), "--list"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "4 request(s), 2600 bytes stored" in r.output
    assert "rank-1.pt.trace.json.gz  700 bytes steps 12-12" in r.output
    assert "no trace from rank 1: (actor gone: RayActorError)" in r.output
    out = tmp_path / "down"
    r = runner.invoke(cli_app, ["profile", str(job_id), "--request", str(three), "--out",
                                str(out)])
    assert r.exit_code == 0 and "2 file(s)" in r.output, r.output
    assert (out / "rank-0.pt.trace.json.gz").read_bytes() == b"\x00" * 1000
    assert sorted(p.name for p in out.iterdir()) == ["rank-0.pt.trace.json.gz",
                                                     "rank-1.pt.trace.json.gz"]
    r = runner.invoke(cli_app, ["profile", str(job_id), "--request", str(three), "--out",
                                str(out)])
    assert r.exit_code == 1 and "exists already" in r.output
    r = runner.invoke(cli_app, ["profile", str(job_id), "--ranks", "0,x"])
    assert r.exit_code == 2 and "--ranks" in r.output


def test_requests_that_cannot_be_answered_fail_with_the_reason(
        sqlite_store: Store, tmp_path: Path) -> None:
    requests = ProfileRequests(sqlite_store)
    job_id = running_job(sqlite_store)
    ask = {"job_id": job_id, "requested_by": "admin", "steps": 1, "ranks": [0],
           "memory": False}
    gone = requests.create(**ask)
    taken = requests.create(**ask)
    requests.take(request_id=taken.id, attempt=1)  # by a controller that then stopped
    ProfileCollector(requests, ProfileFiles(tmp_path)).step({})
    assert "no running ranks" in (requests.get(job_id=job_id, request_id=gone.id).error or "")
    assert "stopped before" in (requests.get(job_id=job_id, request_id=taken.id).error or "")
    nowhere = requests.create(**ask)
    ProfileCollector(requests, None).step({})
    assert "no data directory" in (requests.get(job_id=job_id, request_id=nowhere.id).error
                                   or "")


def test_a_jobs_ranks_profile_for_one_request_at_a_time(sqlite_store: Store,
                                                        tmp_path: Path) -> None:
    requests = ProfileRequests(sqlite_store)
    job_id = running_job(sqlite_store)
    release = threading.Event()

    class Slow(Ranks):
        def profile(self, request_id: int, **kw: Any) -> dict[int, Any]:
            assert release.wait(30)  # its steps take a while: the passes go on meanwhile
            return super().profile(request_id, **kw)

    ranks = Slow([{0: trace(0, 10)}, {0: trace(0, 20, (9, 9))}])
    groups = {job_id: (ranks, 1)}
    collector = ProfileCollector(requests, ProfileFiles(tmp_path))
    ask = {"job_id": job_id, "requested_by": "admin", "steps": 1, "ranks": [0],
           "memory": False}
    first, second = requests.create(**ask), requests.create(**ask)
    for _ in range(3):
        collector.step(groups)  # type: ignore[arg-type]
    assert requests.get(job_id=job_id, request_id=first.id).status == StackStatus.RUNNING
    assert requests.get(job_id=job_id, request_id=second.id).status == StackStatus.PENDING
    release.set()

    def both() -> bool:
        collector.step(groups)  # type: ignore[arg-type]
        return all(requests.get(job_id=job_id, request_id=r.id).status == StackStatus.DONE
                   for r in (first, second))

    wait_for("both requests answered", both)
    assert [a["request_id"] for a in ranks.asked] == [first.id, second.id]
