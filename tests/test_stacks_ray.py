"""`trident stacks` on a real local Ray: REST request -> controller -> every rank actor's
thread stacks -> stored grouped -> REST answer, while the job runs on (light ranks:
`program: light`, `workers.rank.light`, whose loop the work threads are seen in)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from pydantic import TypeAdapter  # noqa: E402

from cli.stacks import render  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.store.stack_requests import StackRequest  # noqa: E402
from tests.conftest import tiny_spec  # noqa: E402
from tests.waiting import drive_until  # noqa: E402

pytestmark = pytest.mark.slow


def test_stacks_of_a_training_job_are_grouped_and_show_the_training_loop(
        stack) -> None:  # noqa: F811
    client, store, controller = stack
    job_id = client.post("/api/v1/jobs", json=tiny_spec(
        program="light",
        train={"steps": 400, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False},
        # Every step takes at least 0.2 s, so that the job outlasts the request.
        faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}])).json()["id"]

    def training() -> bool:
        job = store.get_job(job_id=job_id)
        assert not job.state.terminal, f"job ended: {job.error}"
        return any(m.step >= 2 for m in store.list_metrics(job_id=job_id, rank=1))

    drive_until(controller, training, 240, "step 2 of rank 1")
    r = client.post(f"/api/v1/jobs/{job_id}/stacks")
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]
    url = f"/api/v1/jobs/{job_id}/stacks/{request_id}"
    drive_until(controller, lambda: client.get(url).json()["status"] in ("done", "failed"),
                60, f"stack request {request_id} answered")
    req = client.get(url).json()
    assert req["status"] == "done", req["error"]
    assert req["attempt"] == 1 and store.get_job(job_id=job_id).state == JobState.RUNNING
    res = req["result"]
    assert res["ranks"] == 2 and res["missing"] == [] and res["left_out"] == 0
    train = res["threads"][0]
    assert train["thread"] == "train"
    assert sorted(r for g in train["groups"] for r in g["ranks"]) == [0, 1]
    for g in train["groups"]:  # each rank's work thread is inside its program's step loop
        assert "in _steps" in g["stack"], g["stack"]
        assert "workers/rank/light.py" in g["stack"], g["stack"]
    assert {"MainThread"} <= {t["thread"] for t in res["threads"]}
    text = render(TypeAdapter(StackRequest).validate_python(req))
    assert "=== thread train:" in text and "in _steps" in text
    assert ("--- ranks 0-1 (2 of 2)" in text) == (len(train["groups"]) == 1)
