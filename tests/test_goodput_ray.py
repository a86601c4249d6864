"""The goodput ledger of jobs that really ran, on a real local Ray: where a killed rank's time
went (the steps redone, the recovery), a preempted job's wait, a cancelled job's end. The
numbers asserted are measured by DeepSpeed ranks (`stack`, `tests.conftest`); the ledger is
read through the API (`GET /api/v1/jobs/{id}/goodput`)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from service.contract.states import JobState  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.waiting import drive  # noqa: E402

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
        checkpoint={"every_steps": 3}, max_retries=1, monitor={"probe": False},
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
