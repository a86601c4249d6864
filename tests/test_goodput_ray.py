"""The goodput ledger of jobs that really ran, on a real local Ray: where a killed rank's time
went (the steps redone, the recovery), a preempted job's wait, a cancelled job's end. The
numbers asserted are measured by DeepSpeed ranks (`stack`, `tests.conftest`); the ledger is
read through the API (`GET /api/v1/jobs/{id}/goodput`)."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from service.contract.states import JobState  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.waiting import drive, drive_until  # noqa: E402

pytestmark = pytest.mark.slow

SLOW_S = 0.3
"""Every step sleeps this long (a `slow` fault): steps long enough that the loop's own
overhead between them is a small part of them."""


def seconds(ledger: dict, category: str) -> float:
    return next(c["seconds"] for c in ledger["categories"] if c["category"] == category)


def test_a_killed_rank_costs_the_steps_since_the_checkpoint_and_a_recovery(stack) -> None:
    client, store, controller = stack
    slow = [{"kind": "slow", "rank": 0, "step": 1, "seconds": SLOW_S, "attempt": a}
            for a in (1, 2)]
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        train={"steps": 8, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        # Saved synchronously: the step-3 tag is complete with step 3, so the steps redone
        # are 4 and 5 (a tag saved in the background may complete steps later).
        checkpoint={"every_steps": 3, "async": False}, max_retries=1, monitor={"probe": False},
        faults=[*slow, {"kind": "kill", "rank": 1, "step": 6, "attempt": 1}])).json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 300) == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    ledger = client.get(f"/api/v1/jobs/{job_id}/goodput").json()
    steps = {(m.attempt, m.step): m for m in
             controller.ingest.list_steps(job_id=job_id)}
    assert sorted(steps) == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 4), (2, 5), (2, 6),
                             (2, 7), (2, 8)]
    # Steps 4 and 5 of the first attempt were redone after the kill: their measured time.
    redone = steps[1, 4].step_time_max + steps[1, 5].step_time_max
    assert seconds(ledger, "lost") == pytest.approx(redone, rel=0.10)
    assert ledger["steps_lost"] == 2 and ledger["steps_counted"] == 8
    # The steps that count, their measured time; the saves and loads said apart.
    kept = sum(m.step_time_max for k, m in steps.items() if k not in ((1, 4), (1, 5)))
    assert seconds(ledger, "training") == pytest.approx(kept, rel=0.10)
    assert seconds(ledger, "recovery") > 0
    assert seconds(ledger, "checkpoint_save") > 0 and seconds(ledger, "checkpoint_load") > 0
    total = sum(c["seconds"] for c in ledger["categories"])
    assert total == pytest.approx(ledger["wall_s"], rel=0.01)
    job = store.get_job(job_id=job_id)
    assert job.finished_at is not None
    assert ledger["wall_s"] == pytest.approx((job.finished_at - job.created_at).total_seconds(),
                                             abs=0.01)
    assert ledger["ettr"] == pytest.approx(seconds(ledger, "training") / ledger["wall_s"])
    # The segments tile the wall time, in order.
    segs = ledger["segments"]
    assert segs[0]["start"] == ledger["start"] and segs[-1]["end"] == ledger["end"]
    assert all(a["end"] == b["start"] for a, b in zip(segs, segs[1:], strict=False))
    # A queued job holds nothing; a running one its two ranks.
    for c in ledger["categories"]:
        held = 0 if c["category"] == "queued" else 2
        assert c["rank_seconds"] == pytest.approx(c["seconds"] * held, rel=1e-6)


def light(**over: object) -> dict:
    """A light-rank job (`workers.rank.light`): steps on the clock, for the ledger's spans."""
    spec = {"program": "light", "monitor": {"probe": False},
            "train": {"steps": over.pop("steps", 10), "global_batch": 8, "micro_batch": 2,
                      "precision": "fp32"},
            "env": {"TRIDENT_LIGHT_STEP_S": "0.2"}, **over}
    return tiny_spec(**spec)


def state_times(store, job_id: int, to: str) -> list:
    return [e.time for e in store.list_events(job_id=job_id, limit=1000)
            if e.kind == "state" and e.data.get("to") == to]


def test_a_job_behind_its_projects_full_quota_is_queued_for_quota(stack) -> None:
    client, store, controller = stack
    assert client.post("/api/v1/projects", json={"name": "vision", "cpus": 1}).status_code == 201
    first = client.post("/api/v1/jobs", params={"project": "vision"},
                        json=light(name="first")).json()["id"]
    drive(controller, store, first, {JobState.RUNNING}, 120)
    second = client.post("/api/v1/jobs", params={"project": "vision"},
                         json=light(name="second")).json()["id"]
    drive(controller, store, second, {JobState.SUCCEEDED, JobState.FAILED}, 240)
    a = store.get_job(job_id=first)
    b = store.get_job(job_id=second)
    assert a.state == b.state == JobState.SUCCEEDED, (a.error, b.error)
    ledger = client.get(f"/api/v1/jobs/{second}/goodput").json()
    # It waited for the quota from the pass that said so until the first job ended and let go.
    assert a.finished_at is not None
    placed = state_times(store, second, "PLACING")[0]
    said = next(e.time for e in store.list_events(job_id=second, limit=1000)
                if e.kind == "quota" and not e.data.get("cleared"))
    assert ledger["queued_reasons"]["quota"] >= (a.finished_at - said).total_seconds()
    assert ledger["queued_reasons"]["quota"] <= (placed - b.created_at).total_seconds()
    assert seconds(ledger, "queued") == pytest.approx(
        (placed - b.created_at).total_seconds(), abs=0.01)
    queued = next(c for c in ledger["categories"] if c["category"] == "queued")
    assert queued["rank_seconds"] == 0 and queued["cpu_seconds"] == 0  # queued costs nothing
    assert client.get(f"/api/v1/jobs/{first}/goodput").json()["queued_reasons"].get(
        "quota", 0.0) == 0.0


def test_a_cancelled_job_ends_its_ledger_at_the_cancel(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=light(steps=100000)).json()["id"]
    drive_until(controller, lambda: len(store.list_metrics(job_id=job_id, rank=0)) >= 3, 120,
                "three steps")
    assert client.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 202
    asked = next(e.time for e in store.list_events(job_id=job_id, limit=1000)
                 if e.kind == "cancel")
    drive(controller, store, job_id, {JobState.CANCELLED}, 60)
    drive_until(controller, lambda: controller.teardowns.pending == 0, 60, "teardowns done")
    job = store.get_job(job_id=job_id)
    ledger = client.get(f"/api/v1/jobs/{job_id}/goodput").json()
    assert ledger["ended"] and ledger["state"] == "CANCELLED"
    assert job.finished_at is not None
    assert ledger["wall_s"] == pytest.approx((job.finished_at - job.created_at).total_seconds(),
                                             abs=0.01)
    # From the cancel on, its ranks were stopping; before it, they trained.
    assert seconds(ledger, "stopping") == pytest.approx(
        (job.finished_at - asked).total_seconds(), abs=0.01)
    assert seconds(ledger, "training") > 0.4 and ledger["steps_counted"] >= 3
    total = sum(c["seconds"] for c in ledger["categories"])
    assert total == pytest.approx(ledger["wall_s"], rel=0.01)
    time.sleep(1.0)  # an ended job's ledger does not grow
    assert client.get(f"/api/v1/jobs/{job_id}/goodput").json()["wall_s"] == ledger["wall_s"]


def test_a_hung_job_is_stalled_from_its_last_step_until_the_hang_is_declared(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=light(
        steps=50, monitor={"probe": False, "hang_timeout_s": 3},
        faults=[{"kind": "hang", "rank": 1, "step": 4, "seconds": 120}])).json()["id"]
    assert drive(controller, store, job_id, {JobState.FAILED}, 120) == JobState.FAILED
    ledger = client.get(f"/api/v1/jobs/{job_id}/goodput").json()
    last = max(controller.ingest.list_steps(job_id=job_id), key=lambda m: m.step)
    assert last.step == 3
    # Stalled from the last step's end (its slowest rank's) until the hang was declared:
    # the job's end (`finished_at`, which its FAILED event follows by a moment: 0.4 ms
    # here, 15 ms on a loaded machine), at least the hang timeout later: nothing moved that
    # long.
    declared = store.get_job(job_id=job_id).finished_at
    assert declared is not None
    assert state_times(store, job_id, "FAILED")[0] >= declared
    ended = max(m.data["ended_at"] for m in store.list_metrics(job_id=job_id, rank=None)
                if m.step == 3)
    assert seconds(ledger, "stall") == pytest.approx(declared.timestamp() - ended, abs=0.01)
    assert seconds(ledger, "stall") >= 3.0
    held = next(c for c in ledger["categories"] if c["category"] == "stall")
    assert held["rank_seconds"] == pytest.approx(2 * held["seconds"])  # the whole group
