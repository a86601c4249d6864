"""A project's budget against a job that really runs, on the real local Ray (`stack`, light
ranks): a small CPU budget set while the job runs sees the controller's `budget` warning at
80 %, the next submission is refused with the 422 once it is spent while the running job is
left to run, and `stop_running` then cancels it (docs/goodput.md, "Prices and budgets")."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

ray = pytest.importorskip("ray")

from service.contract.states import JobState  # noqa: E402
from service.store.budgets import Budgets  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.waiting import drive, drive_until  # noqa: E402

BUDGET_CPU_S = 3.0
"""The budget, in CPU-seconds: the job's two ranks of 0.5 CPU hold 1 CPU, so it is spent about
3 s after it is set."""

LIGHT = tiny_spec(program="light", monitor={"probe": False},
                  train={"steps": 100000, "global_batch": 8, "micro_batch": 2,
                         "precision": "fp32"})


def budget_events(store, job_id: int) -> list:
    return [e for e in store.list_events(job_id=job_id, limit=1000) if e.kind == "budget"]


def test_a_small_cpu_budget_warns_at_80_percent_then_refuses_the_next_job(stack) -> None:
    client, store, controller = stack
    controller.budgets.every_s = 0.2  # read at most every 0.2 s (5 s by default)
    job_id = client.post("/api/v1/jobs", json=LIGHT).json()["id"]
    drive(controller, store, job_id, {JobState.RUNNING}, 180)
    since = datetime.now(UTC)
    r = client.put("/api/v1/projects/default/budget",
                   json={"cpu_hours": BUDGET_CPU_S / 3600, "since": since.isoformat()})
    assert r.status_code == 200, r.text
    budgets = Budgets(store)

    drive_until(controller, lambda: bool(budget_events(store, job_id)), 60,
                "the budget's 80 % warning")
    [warning] = budget_events(store, job_id)
    spent_s = (warning.time - since).total_seconds()  # 1 CPU held since the budget began
    assert spent_s >= 0.8 * BUDGET_CPU_S * 0.99
    assert warning.data["budget"] == "cpu_hours" and warning.data["used"] >= 0.8
    assert warning.data["spent"] * 3600 == pytest.approx(warning.data["used"] * BUDGET_CPU_S)
    assert warning.message.startswith("project default spent ")
    assert store.get_job(job_id=job_id).state == JobState.RUNNING
    # At 100 %: the next job is refused naming the budget; the running one runs on.
    drive_until(controller, lambda: budgets.statuses(["default"])[0].used >= 1.0, 60,
                "the budget spent")
    refused = client.post("/api/v1/jobs", json=LIGHT)
    assert refused.status_code == 422, refused.text
    [detail] = refused.json()["detail"]
    assert detail["msg"].startswith("project default: budget spent: ")
    assert f"CPU-hours since {since.strftime('%Y-%m-%dT%H:%MZ')}" in detail["msg"]
    controller.step()
    assert store.get_job(job_id=job_id).state == JobState.RUNNING
    assert len(budget_events(store, job_id)) == 1  # said once
    [status] = client.get("/api/v1/goodput?project=default").json()["budgets"]
    assert status["used"] >= 1.0 and status["cpu_hours"] == pytest.approx(BUDGET_CPU_S / 3600)
    # The admin asks for the running jobs to stop: the job is cancelled, saying why.
    r = client.put("/api/v1/projects/default/budget",
                   json={"cpu_hours": BUDGET_CPU_S / 3600, "since": since.isoformat(),
                         "stop_running": True})
    assert r.status_code == 200, r.text
    assert drive(controller, store, job_id, {JobState.CANCELLED}, 60) == JobState.CANCELLED
    stopped = [e for e in budget_events(store, job_id) if e.data.get("stopped")]
    assert len(stopped) == 1 and "(stop_running)" in stopped[0].message
