"""The training guards through the whole stack, once, on a real local Ray: the rank actor gives
the trainer the job's nan and spike faults, the controller stores the guard's skip as an event
and fails the job the guard stopped without a retry (`docs/guards.md`)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from service.contract.states import JobState  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.waiting import drive  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_nan_step_is_skipped_and_a_spike_stops_the_job_without_a_retry(stack) -> None:
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        train={"steps": 8, "global_batch": 8, "micro_batch": 2,
               "guard": {"window": 3, "on_spike": "stop"}},
        max_retries=1, monitor={"probe": False},
        faults=[{"kind": "nan", "rank": 1, "step": 2},
                {"kind": "spike", "rank": 0, "step": 5, "factor": 1000.0}])).json()["id"]
    assert drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 240) == JobState.FAILED
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["attempts"] == 1  # not retried: the same data would stop it again
    assert "training guard stopped the job: loss spike" in job["error"]
    assert "not retried: the training guard stopped it" in job["error"]
    events = client.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
    skips = [e for e in events if e["kind"] == "guard_skip"]
    assert [e["data"]["step"] for e in skips] == [2]
    assert skips[0]["data"]["reason"] == "loss not finite"
    steps = {m.step: m for m in store.list_metrics(job_id=job_id)}
    assert steps[2].loss is None and steps[2].report.loss_nonfinite
    assert sorted(steps) == [1, 2, 3, 4]  # step 5's spike stopped every rank before its report
