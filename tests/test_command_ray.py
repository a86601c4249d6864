"""`command:` jobs end to end on a real local Ray, through REST: a plain `torch.distributed`
DDP script (`examples/command/ddp_train.py`) run once per rank with torchrun's environment
trains to SUCCEEDED with its steps read from its output; a script that exits 3 on one rank
fails the attempt with that code and is retried from its own checkpoint
(`TRIDENT_RESUME_STEP`); without model nor parallel the script runs unplanned on the ranks of
`resources.workers`; a script that hangs is ended by the hang monitor with every rank's
process stacks (`py-spy dump`) stored, and `trident stacks` shows those processes before."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("ray")

from service.contract.states import JobState  # noqa: E402
from tests.command_stack import EXAMPLES, logs, stack  # noqa: E402,F401
from tests.waiting import drive, drive_until  # noqa: E402

pytestmark = pytest.mark.slow

PROGRESS = {"regex": r"^step (?P<step>\d+) loss (?P<loss>[0-9.e+-]+)", "rank": 0}


def command_spec(*args: str, **over: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "name": "ddp", "model": {"preset": "gpt-tiny"}, "parallel": {"dp": 2},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "resources": {"cpus_per_worker": 0.5},
        "command": [sys.executable, "ddp_train.py", *args], "workdir": str(EXAMPLES),
        "progress": PROGRESS, "monitor": {"probe": False}}
    spec.update(over)
    return spec


def test_a_ddp_script_trains_with_its_steps_read_from_its_output(stack) -> None:  # noqa: F811
    client, store, controller = stack
    r = client.post("/api/v1/jobs", json=command_spec("--steps", "6"))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    state = drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, 240)
    assert state == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    steps = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    losses = [m["loss"] for m in steps]
    assert all(isinstance(x, float) for x in losses) and losses[-1] < losses[0], losses
    text = logs(client, job_id, 1)
    assert "step 6 loss" in text[0] and "ddp_train.py" in text[1], text
    assert "the command exited with code 0" in text[1]
    # Planned as any job with a model and a layout, and its measured steps compared.
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["plan"]["layout"]["dp"] == 2
    compared = job["predicted_vs_measured"]
    assert compared["step_s"]["predicted"] > 0 and compared["step_s"]["measured"] > 0
    assert compared["tokens_per_s"]["ratio"] is not None


def test_a_ddp_script_without_model_runs_unplanned_on_its_workers(stack) -> None:  # noqa: F811
    """No model nor parallel: placed from `resources.workers` alone, with WORLD_SIZE 2, its
    steps stored and measured, and nothing predicted."""
    client, store, controller = stack
    spec = {k: v for k, v in command_spec("--steps", "4").items()
            if k not in ("model", "parallel", "train")}
    spec["resources"] = {"workers": 2, "cpus_per_worker": 0.5}
    r = client.post("/api/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert r.json()["plan"]["planned"] is False and r.json()["world_size"] == 2
    state = drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, 240)
    assert state == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    steps = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["items"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    text = logs(client, job_id, 1)
    assert set(text) == {0, 1} and "the command exited with code 0" in text[1], text
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    compared = job["predicted_vs_measured"]
    assert compared["planned"] is False and compared["step_s"]["predicted"] is None
    assert compared["step_s"]["measured"] > 0 and compared["step_s"]["ratio"] is None


def test_an_exit_3_fails_the_attempt_and_the_retry_resumes_from_the_scripts_checkpoint(
        stack) -> None:  # noqa: F811
    client, store, controller = stack
    r = client.post("/api/v1/jobs", json=command_spec(
        "--steps", "6", "--save-every", "2", "--fail-at", "3:1:3", max_retries=1))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    state = drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, 300)
    assert state == JobState.SUCCEEDED, store.get_job(job_id=job_id).error
    attempts = client.get(f"/api/v1/jobs/{job_id}/attempts").json()["items"]
    first = attempts[0]
    assert first["status"] == "failed" and "rank(s) [1] failed" in first["error"], first
    assert "exited with code 3" in first["error"]
    assert "rank 1: exiting with code 3 at step 3" in first["error"]  # its last lines
    second = logs(client, job_id, 2)
    assert "rank 1: resumed from step 2 (restart 1)" in second[1], second[1]
    steps = client.get(f"/api/v1/jobs/{job_id}/metrics", params={"attempt": 2}).json()["items"]
    assert [m["step"] for m in steps] == [3, 4, 5, 6]


def test_a_hung_script_is_failed_by_the_hang_monitor_with_every_ranks_stacks(stack) -> None:  # noqa: F811
    client, store, controller = stack
    r = client.post("/api/v1/jobs", json=command_spec(
        "--steps", "20", "--hang-at", "3", monitor={"probe": False, "hang_timeout_s": 30}))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    # Before the hang monitor ends it: `trident stacks` shows each rank's script process
    # (py-spy) beside the actor's threads.
    def hanging() -> bool:
        if store.get_job(job_id=job_id).state != JobState.RUNNING:
            return False
        told = logs(client, job_id, 1)
        return len(told) == 2 and all("hanging at step 3" in t for t in told.values())

    drive_until(controller, hanging, 120, "both ranks hanging at step 3")
    r = client.post(f"/api/v1/jobs/{job_id}/stacks")
    assert r.status_code == 202, r.text
    asked = f"/api/v1/jobs/{job_id}/stacks/{r.json()['id']}"
    drive_until(controller, lambda: client.get(asked).json()["status"] != "pending"
                and client.get(asked).json()["status"] != "running", 25, "the stacks")
    answer = client.get(asked).json()
    [command] = [t for t in answer["result"]["threads"] if t["thread"] == "command"]
    assert sum(len(g["ranks"]) for g in command["groups"]) == 2, answer
    assert all("hang_here" in g["stack"] for g in command["groups"]), command
    state = drive(controller, store, job_id, {JobState.SUCCEEDED, JobState.FAILED}, 300)
    job = store.get_job(job_id=job_id)
    assert state == JobState.FAILED and "hung: no progress" in (job.error or ""), job.error

    def stacks() -> dict[int, str]:
        events = client.get(f"/api/v1/jobs/{job_id}/events").json()["items"]
        return {e["data"]["rank"]: e["data"]["stacks"] for e in events if e["kind"] == "stacks"}

    # Taken on the teardown's thread, stored once the controller reaps it.
    drive_until(controller, lambda: len(stacks()) == 2, 60, "both ranks' stacks stored")
    taken = stacks()
    assert sorted(taken) == [0, 1]
    for text in taken.values():
        assert "py-spy dump of the command" in text and "hang_here" in text, text
