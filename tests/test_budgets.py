"""Project budgets (docs/goodput.md, "Prices and budgets"): set by admins with every field
checked, counted from the goodput ledger of jobs that held their ranks for a known time
(their state changes written through the store, on SQLite and PostgreSQL), a spent budget
refused at submission with a 422 naming it and what was spent, the 80 % warning said once per
budget, `stop_running`, the goodput summary's budgets and the jobs page's banner."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.budget_watch import BudgetWatch
from service.settings import Settings
from service.store import Store
from service.store.budgets import Budgets
from service.store.identity import Identity
from service.submission.intake import Submitter, submit
from tests.conftest import tiny_spec, user_token

HELD_S = 0.4
"""How long the job of `held_job` holds its ranks (two of 0.5 CPU: 1 CPU)."""


def app_client(store: Store, tmp_path: Path, **settings: Any) -> TestClient:
    """The API in-process, with an admin's token; `vision` and `speech` exist."""
    token = user_token(store, projects=("default", "vision", "speech"))
    return TestClient(create_app(Settings(data_dir=tmp_path, **settings), store=store),
                      headers={"Authorization": f"Bearer {token}"})


def held_job(store: Store, project: str = "vision", *, end: bool = True) -> tuple[int, float]:
    """A job of `project` that was PLACING then RUNNING for `HELD_S`, then (`end`) SUCCEEDED;
    its id and the CPU-seconds it held, read from its stored state changes."""
    job = submit(store, JobSpec.model_validate(tiny_spec()),
                 by=Submitter(owner="admin", project=project))
    store.transition(job_id=job.id, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=job.id)
    store.transition(job_id=job.id, to=JobState.RUNNING, message="running")
    time.sleep(HELD_S)
    if end:
        store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="done")
    times = {e.data.get("to"): e.time for e in store.list_events(job_id=job.id, limit=100)
             if e.kind == "state"}
    until = store.get_job(job_id=job.id).finished_at or datetime.now(UTC)  # the ledger's end
    return job.id, (until - times["PLACING"]).total_seconds() * 2 * 0.5


def hours(cpu_s: float) -> float:
    return cpu_s / 3600


# --- setting a budget ---------------------------------------------------------------------

@pytest.mark.parametrize(("body", "field"), [
    ({"gpu_hours": -1}, "gpu_hours"), ({"cpu_hours": 2e9}, "cpu_hours"),
    ({"gpu_hours": "ten"}, "gpu_hours"), ({}, "gpu_hours"),
    ({"gpu_hours": 1, "cost": 5}, "cost"),  # no prices on this server
    ({"gpu_hours": 1, "since": "2999-01-01T00:00:00Z"}, "since"),
    ({"gpu_hours": 1, "since": "1990-01-01T00:00:00Z"}, "since"),
    ({"gpu_hours": 1, "since": "yesterday"}, "since"),
    ({"gpu_hours": 1, "stop_running": "yes"}, "stop_running"),
    ({"gpu_hours": 1, "budget": 3}, "budget")])
def test_every_budget_field_is_checked_naming_it(store: Store, tmp_path: Path,
                                                 body: dict[str, Any], field: str) -> None:
    with app_client(store, tmp_path) as client:
        r = client.put("/api/v1/projects/vision/budget", json=body)
    assert r.status_code == 422, r.text
    assert field in [str(x) for d in r.json()["detail"] for x in d["loc"]], r.json()
    assert Identity(store).get_project(name="vision").budget_since is None


def test_an_admin_sets_and_removes_a_budget_members_may_not(store: Store,
                                                           tmp_path: Path) -> None:
    with app_client(store, tmp_path) as client:
        Identity(store).create_user(name="alice", role="member", projects=["vision"])
        alice = Identity(store).create_token(user="alice", name="t")[0]
        before = datetime.now(UTC)
        r = client.put("/api/v1/projects/vision/budget",
                       json={"gpu_hours": 10, "cpu_hours": 2.5, "stop_running": True})
        assert r.status_code == 200, r.text
        p = r.json()
        assert (p["budget_gpu_hours"], p["budget_cpu_hours"], p["budget_cost"],
                p["budget_stop_running"]) == (10, 2.5, None, True)
        assert before <= datetime.fromisoformat(p["budget_since"]) <= datetime.now(UTC)
        listed = {x["name"]: x for x in client.get("/api/v1/projects").json()["items"]}
        assert listed["vision"]["budget_gpu_hours"] == 10
        assert listed["speech"]["budget_since"] is None
        # A given start, without a zone: UTC.
        r = client.put("/api/v1/projects/vision/budget",
                       json={"cpu_hours": 1, "since": "2026-12-01T00:00:00"})
        assert r.json()["budget_since"].startswith("2026-12-01T00:00:00")
        assert r.json()["budget_gpu_hours"] is None and not r.json()["budget_stop_running"]
        assert client.put("/api/v1/projects/nope/budget",
                          json={"cpu_hours": 1}).status_code == 404
        as_alice = {"Authorization": f"Bearer {alice}"}
        assert client.put("/api/v1/projects/vision/budget", json={"cpu_hours": 99},
                          headers=as_alice).status_code == 403
        assert client.delete("/api/v1/projects/vision/budget",
                             headers=as_alice).status_code == 403
        r = client.delete("/api/v1/projects/vision/budget")
        assert r.status_code == 200
        assert (r.json()["budget_since"], r.json()["budget_cpu_hours"]) == (None, None)
    assert Budgets(store).budgets() == []


# --- what is spent, and the 422 -----------------------------------------------------------

def test_a_project_that_spent_its_budget_gets_the_422(store: Store, tmp_path: Path) -> None:
    """A job of `vision` held 1 CPU for `HELD_S`: a CPU budget below that is spent and the
    next submission is refused naming it; `speech` is not; a budget above it is not; a
    retry of a submission that created its job still gets it; removing the budget lifts it."""
    ident = Identity(store)
    ident.create_project(name="vision")
    started = datetime.now(UTC) - timedelta(seconds=1)
    job_id, cpu_s = held_job(store)
    assert cpu_s >= HELD_S * 0.99
    spent = Budgets(store).ledgers.spent(project="vision", since=started)
    assert spent.cpu_seconds == pytest.approx(cpu_s, rel=0.01)
    assert spent.gpu_seconds == 0 and spent.cost is None

    with app_client(store, tmp_path) as client:
        retry = client.post("/api/v1/jobs?project=vision", json=tiny_spec(name="keyed"),
                            headers={"Idempotency-Key": "k1"})
        assert retry.status_code == 201
        ident.set_budget(name="vision", cpu_hours=hours(cpu_s * 0.9), since=started)
        r = client.post("/api/v1/jobs?project=vision", json=tiny_spec())
        assert r.status_code == 422, r.text
        [detail] = r.json()["detail"]
        assert detail["loc"] == ["query", "project"]
        since = started.strftime("%Y-%m-%dT%H:%MZ")
        found = re.fullmatch(r"project vision: budget spent: (\S+) of (\S+) CPU-hours since"
                             r" (\S+); an admin raises or removes it \(trident project"
                             r" budget vision\)", detail["msg"])
        assert found is not None, detail["msg"]
        assert float(found[1]) == pytest.approx(hours(cpu_s), rel=0.01)
        assert float(found[2]) == pytest.approx(hours(cpu_s * 0.9), rel=1e-3)
        assert found[3] == since
        # Not another project's, and a retry gets the job it created.
        assert client.post("/api/v1/jobs?project=speech", json=tiny_spec()).status_code == 201
        again = client.post("/api/v1/jobs?project=vision", json=tiny_spec(name="keyed"),
                            headers={"Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["id"] == retry.json()["id"]
        # The summary's budgets and the jobs page's banner.
        [status] = client.get("/api/v1/goodput").json()["budgets"]
        assert status["project"] == "vision"
        assert status["spent_cpu_hours"] == pytest.approx(hours(cpu_s), rel=0.01)
        assert status["used"] == pytest.approx(1 / 0.9, rel=0.01)
        assert client.get("/api/v1/goodput?project=speech").json()["budgets"] == []
        page = client.get("/").text
        assert "Project vision has spent 111 % of its budget" in page
        assert "Its new jobs are refused." in page
        # Counted from a later start, nothing of that job is spent.
        ident.set_budget(name="vision", cpu_hours=hours(cpu_s * 0.9))
        assert client.post("/api/v1/jobs?project=vision", json=tiny_spec()).status_code == 201
        # A budget above what was spent: 88 % of it, the banner but no refusal.
        ident.set_budget(name="vision", cpu_hours=hours(cpu_s / 0.88), since=started)
        assert client.post("/api/v1/jobs?project=vision", json=tiny_spec()).status_code == 201
        page = client.get("/").text
        assert "Project vision has spent 88 % of its budget" in page
        assert "Its new jobs are refused." not in page
        ident.set_budget(name="vision", cpu_hours=hours(cpu_s * 2), since=started)
        assert "has spent" not in client.get("/").text
        ident.set_budget(name="vision", gpu_hours=0, since=started)  # none at all
        r = client.post("/api/v1/jobs?project=vision", json=tiny_spec())
        assert r.status_code == 422 and "0 of 0 GPU-hours" in r.text
        assert client.delete("/api/v1/projects/vision/budget").status_code == 200
        assert client.post("/api/v1/jobs?project=vision", json=tiny_spec()).status_code == 201
    assert job_id


def test_a_budget_in_money_is_counted_at_the_servers_prices(store: Store,
                                                            tmp_path: Path) -> None:
    """At 3,600 per CPU-hour a CPU-second costs 1: a money budget below what the job held
    is spent."""
    Identity(store).create_project(name="vision")
    started = datetime.now(UTC) - timedelta(seconds=1)
    _, cpu_s = held_job(store)
    with app_client(store, tmp_path, prices={"cpu": {"cpu_hour": 3600}}) as client:
        r = client.put("/api/v1/projects/vision/budget",
                       json={"cost": cpu_s * 0.5, "since": started.isoformat()})
        assert r.status_code == 200, r.text
        r = client.post("/api/v1/jobs?project=vision", json=tiny_spec())
        assert r.status_code == 422
        found = re.search(r"budget spent: (\S+) of (\S+) in cost since", r.text)
        assert found is not None, r.text
        assert float(found[1]) == pytest.approx(cpu_s, rel=0.01)
        assert float(found[2]) == pytest.approx(cpu_s * 0.5, rel=1e-3)
        [status] = client.get("/api/v1/goodput").json()["budgets"]
        assert status["spent_cost"] == pytest.approx(cpu_s, rel=0.01)


# --- the controller's side ----------------------------------------------------------------

def budget_events(store: Store, job_id: int) -> list[Any]:
    return [e for e in store.list_events(job_id=job_id, limit=1000) if e.kind == "budget"]


def test_the_warning_at_80_percent_is_said_once_per_budget(store: Store) -> None:
    """A running job of `vision` and a queued one: at 80 % of the budget each gets one
    `budget` event, once; setting the budget again says it again; below 80 % nothing."""
    ident = Identity(store)
    ident.create_project(name="vision")
    started = datetime.now(UTC) - timedelta(seconds=1)
    running, cpu_s = held_job(store, end=False)
    queued = submit(store, JobSpec.model_validate(tiny_spec()),
                    by=Submitter(owner="admin", project="vision")).id
    other = submit(store, JobSpec.model_validate(tiny_spec()),
                   by=Submitter(owner="admin", project="speech")).id
    watch = BudgetWatch(store, every_s=0)
    ident.set_budget(name="vision", cpu_hours=hours(cpu_s * 100), since=started)
    watch.step(store.active_jobs())
    assert not budget_events(store, running)  # about 1 % spent
    ident.set_budget(name="vision", cpu_hours=hours(cpu_s / 0.85), since=started)
    watch.step(store.active_jobs())
    watch.step(store.active_jobs())  # said once
    for job_id in (running, queued):
        [event] = budget_events(store, job_id)
        assert event.message.startswith("project vision spent ")
        assert "of its budget: " in event.message and " CPU-hours since " in event.message
        assert event.data["budget"] == "cpu_hours" and event.data["used"] >= 0.8
    assert not budget_events(store, other)
    assert Identity(store).get_project(name="vision").budget_since is not None
    assert Budgets(store).budgets(["vision"])[0].warned_at is not None
    # Not stopped: the budget asked nothing of running jobs.
    assert not store.get_job(job_id=running).cancel_requested
    ident.set_budget(name="vision", cpu_hours=hours(cpu_s / 0.85), since=started)
    watch.step(store.active_jobs())
    assert len(budget_events(store, running)) == 2


def test_a_spent_budget_that_stops_running_jobs_cancels_them(store: Store) -> None:
    """With `stop_running` a spent budget cancels the project's running and queued jobs (a
    queued one would start and spend); without it they are left alone."""
    ident = Identity(store)
    ident.create_project(name="vision")
    started = datetime.now(UTC) - timedelta(seconds=1)
    running, cpu_s = held_job(store, end=False)
    queued = submit(store, JobSpec.model_validate(tiny_spec()),
                    by=Submitter(owner="admin", project="vision")).id
    watch = BudgetWatch(store, every_s=3600)
    ident.set_budget(name="vision", cpu_hours=hours(cpu_s / 2), since=started)
    watch.step(store.active_jobs())  # spent, but the admin did not ask to stop them
    assert not store.get_job(job_id=running).cancel_requested
    ident.set_budget(name="vision", cpu_hours=hours(cpu_s / 2), since=started,
                     stop_running=True)
    watch.step(store.active_jobs())  # read less than `every_s` ago: nothing yet
    assert not store.get_job(job_id=running).cancel_requested
    watch.every_s = 0
    watch.step(store.active_jobs())
    assert store.get_job(job_id=running).cancel_requested
    stopped = [e for e in budget_events(store, running) if e.data.get("stopped")]
    assert len(stopped) == 1
    assert stopped[0].message.startswith("project vision: budget spent: ")
    assert stopped[0].message.endswith("its jobs are cancelled (stop_running)")
    assert store.get_job(job_id=queued).state == JobState.CANCELLED


# --- the revision ---------------------------------------------------------------------------

def test_the_stop_running_revision_both_ways_keeps_projects_and_members(db_url: str) -> None:
    """0021 adds `budget_stop_running` and its downgrade drops it alone: the projects, their
    budgets and their members stay (recreating the table on SQLite would cascade to them)."""
    from sqlalchemy import text

    from service.store.schema import downgrade, upgrade

    upgrade(db_url)
    s = Store(db_url)
    try:
        ident = Identity(s)
        ident.create_project(name="vision")
        ident.create_user(name="alice", role="member", projects=["vision"])
        ident.set_budget(name="vision", gpu_hours=3, stop_running=True)
        downgrade(db_url, "0020")
        with s.engine.begin() as c:
            assert c.execute(text("SELECT count(*) FROM memberships")).scalar_one() == 1
            assert c.execute(text("SELECT budget_gpu_hours FROM projects")).scalar_one() == 3
        upgrade(db_url)
        p = ident.get_project(name="vision")
        assert (p.members, p.budget_gpu_hours, p.budget_stop_running) == (["alice"], 3, False)
    finally:
        s.close()


def test_a_bad_goodput_window_is_a_422_naming_its_query_parameter(
        sqlite_store: Store, tmp_path: Path) -> None:
    """`GET /goodput`'s window refusals are shaped as every other 422 (a list naming the
    field), so that they match the schema the API publishes."""
    with app_client(sqlite_store, tmp_path) as client:
        early = client.get("/api/v1/goodput", params={"until": "1970-01-01T00:00:01"})
        backwards = client.get("/api/v1/goodput", params={"since": "2026-01-02T00:00:00",
                                                           "until": "2026-01-01T00:00:00"})
    assert (early.status_code, backwards.status_code) == (422, 422)
    assert early.json()["detail"][0]["loc"] == ["query", "until"]
    assert "before 2000" in early.json()["detail"][0]["msg"]
    assert backwards.json()["detail"][0]["msg"] == "until: must be after since"
