"""Jobs outlive the control plane, on real processes: `trident up` (API, supervised controller,
its own Ray head), a real job of two ranks, and then `kill -9` of the controller, of
`trident up` itself, and a PostgreSQL outage. Each time the job keeps its attempt (no retry is
used), succeeds, and every step of every rank is in /metrics exactly once. The ranks are light
(`program: light`, `workers.rank.light`) but in the outage, which counts the checkpoints that
DeepSpeed ranks complete while the database is away."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from service.cluster.rayhead import answers, live_head, stop_recorded_head
from tests._private_pg import PrivatePostgres
from tests.conftest import tiny_spec
from tests.servers import HTTP, free_port
from tests.up import Up, alive, last_step
from tests.waiting import wait_for
from workers.checkpoint.saving import MARKER

pytestmark = pytest.mark.slow

STEPS = 60


@pytest.fixture
def env() -> dict[str, str]:
    # A short lease, so that a killed controller's successor takes over within seconds.
    return {"TRIDENT_LEASE_S": "3", "TRIDENT_POLL_INTERVAL_S": "0.2",
            "TRIDENT_ALLOW_FAULTS": "1", "TRIDENT_LIGHT_RANKS": "1"}


def submit_long_job(up: Up, steps: int = STEPS, *, light: bool = True) -> int:
    """A job of two ranks, light ones unless `light` is False (DeepSpeed's, which save the
    checkpoints every 20 steps)."""
    spec = tiny_spec(train={"steps": steps, "global_batch": 8, "micro_batch": 2,
                            "precision": "fp32", "lr": 0.003},
                     monitor={"probe": False}, max_retries=2,
                     checkpoint={"every_steps": 20},
                     # Every step takes at least 0.2 s, so that the job outlasts the kills.
                     faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}])
    if light:
        spec["program"] = "light"
    r = HTTP.post(f"{up.server}/api/v1/jobs", json=spec, headers=up.auth, timeout=30)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def check_outcome(up: Up, job_id: int, reattached: int) -> None:
    """Succeeded on its first attempt with every step of every rank exactly once, after at
    least `reattached` re-attaches."""
    job = up.get(f"/jobs/{job_id}")
    assert job["state"] == "SUCCEEDED", (job["error"], up.log())
    assert job["attempts"] == 1, "a retry was used up"
    for rank in (0, 1):  # every step of every rank, exactly once
        steps = [m["step"] for m in up.get(f"/jobs/{job_id}/metrics", rank=rank)["items"]]
        assert steps == list(range(1, STEPS + 1)), (rank, steps)
    events = up.get(f"/jobs/{job_id}/events", limit=1000)["items"]
    # At least one re-attach per kill; a controller stalled past its 3 s lease on a loaded
    # machine loses it and re-attaches once more, which costs the job nothing either.
    assert sum(e["kind"] == "reattach" for e in events) >= reattached, events


def test_jobs_train_on_through_kill_9_of_the_controller_and_of_trident_up(
        tmp_path: Path, env: dict[str, str]) -> None:
    port = free_port()
    up = Up(tmp_path, port, env, api_workers=0)  # the default: its processes end with it
    try:
        up.wait_healthy()
        job_id = submit_long_job(up)
        wait_for("training", lambda: last_step(up, job_id) >= 3, 240, up.log)

        # kill -9 of the controller: trident up starts another, which takes the lease when
        # it expires and re-attaches to the ranks, which trained on meanwhile.
        killed = up.controller_pid()
        os.kill(killed, signal.SIGKILL)
        wait_for("re-attached", lambda: any(
            e["kind"] == "reattach" for e in up.get(f"/jobs/{job_id}/events")["items"]),
            120, up.log)
        assert up.controller_pid() != killed
        before = last_step(up, job_id)
        assert before < STEPS, "the job ended before the second kill"

        # kill -9 of trident up: the controller follows it, the Ray head and the ranks stay.
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)
        up.stop()
        time.sleep(2)
        assert live_head(tmp_path), "the Ray head ended with trident up"
        # Started again by hand, on the same data directory and port, which the killed
        # one's API processes no longer hold.
        up = Up(tmp_path, port, env, api_workers=0)
        up.wait_healthy()
        wait_for("SUCCEEDED", lambda: up.get(f"/jobs/{job_id}")["state"] in (
            "SUCCEEDED", "FAILED"), 300, up.log)
        check_outcome(up, job_id, reattached=2)
    finally:
        head = live_head(tmp_path)
        out = up.stop()
        stopped = stop_recorded_head(tmp_path)  # only if the test failed with a job active
    assert not stopped
    assert "adopted" in out, out
    # No job is active: stopping trident up stopped the Ray head too.
    assert head and not answers(head) and live_head(tmp_path) is None


def test_sigterm_to_trident_up_leaves_jobs_training_and_stop_jobs_stops_them(
        tmp_path: Path, env: dict[str, str]) -> None:
    """SIGTERM stops the API and the controller through their shutdown path (exit status 0,
    the daemon's lease released) and leaves the job's ranks and the Ray head running; the
    next `trident up` re-attaches them, and `trident up --stop-jobs` stops them with it."""
    port = free_port()
    up = Up(tmp_path, port, env)
    try:
        up.wait_healthy()
        job_id = submit_long_job(up, steps=100_000)  # it trains until stopped
        wait_for("training", lambda: last_step(up, job_id) >= 3, 240, up.log)
        [attempt] = up.get(f"/jobs/{job_id}/attempts")["items"]
        pids = [r["pid"] for r in attempt["placement"]["ranks"]]
        assert all(alive(p) for p in pids)

        out = up.stop()
        assert up.proc.returncode == 0, out
        log = (tmp_path / "controller.log").read_text()
        assert "signal SIGTERM: stopping" in log, log[-3000:]
        assert "leaving 1 worker group(s) running" in log, log[-3000:]
        assert re.search(r"controller \S+ stopped", log), log[-3000:]
        assert "1 job(s) still active keep the Ray head" in out, out
        assert live_head(tmp_path) and all(alive(p) for p in pids)

        up = Up(tmp_path, port, env, "--stop-jobs")
        up.wait_healthy()
        wait_for("re-attached", lambda: any(
            e["kind"] == "reattach" for e in up.get(f"/jobs/{job_id}/events")["items"]),
            120, up.log)
        before = last_step(up, job_id)
        wait_for("training on", lambda: last_step(up, job_id) > before, 120, up.log)
        job = up.get(f"/jobs/{job_id}")
        assert job["state"] == "RUNNING" and job["attempts"] == 1, job
        assert all(alive(p) for p in pids)  # the same ranks, re-attached

        out = up.stop()
        assert up.proc.returncode == 0, out
        wait_for("ranks stopped", lambda: not any(alive(p) for p in pids), 60, up.log)
        assert live_head(tmp_path) is None, out  # --stop-jobs: the head goes too
    finally:
        up.stop()
        stop_recorded_head(tmp_path)


@pytest.mark.postgres
def test_a_database_outage_costs_the_job_nothing(tmp_path: Path, env: dict[str, str]) -> None:
    pg = PrivatePostgres()
    pg.start()
    up = Up(tmp_path, free_port(), {**env, "TRIDENT_DATABASE_URL": pg.url})
    try:
        up.wait_healthy()
        job_id = submit_long_job(up, light=False)
        wait_for("training", lambda: last_step(up, job_id) >= 3, 240, up.log)
        seen = last_step(up, job_id)
        pg.stop()
        stopped = time.time()
        r = HTTP.get(f"{up.server}/api/v1/jobs/{job_id}", headers=up.auth, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0, r.text

        def completed_meanwhile() -> list[int]:
            """The checkpoints past the last stored step completed while the database was
            away: the ranks train on, their reports wait for the database."""
            done = {int(m.parent.name.removeprefix("step")): m.stat().st_mtime for m in
                    (tmp_path / "checkpoints" / f"job-{job_id}").glob(f"step*/{MARKER}")}
            return sorted(step for step, mtime in done.items() if step > seen and mtime > stopped)

        def lease_lost() -> bool:
            return "lease not renewed before it expired" in \
                (tmp_path / "controller.log").read_text()

        wait_for("a checkpoint completed and the lease lost while the database is away",
                 lambda: bool(completed_meanwhile()) and lease_lost(), 240, up.log)
        print(f"database away {time.time() - stopped:.0f} s from step {seen}: checkpoints"
              f" completed meanwhile {completed_meanwhile()}")
        r = HTTP.get(f"{up.server}/api/v1/jobs/{job_id}", headers=up.auth, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0, r.text
        pg.start()
        wait_for("SUCCEEDED", lambda: HTTP.get(
            f"{up.server}/api/v1/jobs/{job_id}", headers=up.auth, timeout=30
        ).json().get("state") in (
            "SUCCEEDED", "FAILED"), 300, up.log)
        log = (tmp_path / "controller.log").read_text()
        # The controller lost its lease while the database was away and was started again.
        assert re.search(r"lease not renewed before it expired", log), up.log()
        # It said the outage once, with its first retry's wait (TRIDENT_POLL_INTERVAL_S 0.2:
        # 0.4 s), not a traceback per failed pass; a controller started again after the
        # lease ran out, while the database was still away, waits for it saying so once too.
        assert log.count("database away: cannot reach the database") in (1, 2), up.log()
        assert "(next in 0.4 s)" in log and "controller pass failed" not in log, up.log()
        assert re.search(r"controller pid \d+ started \(start 2\)", log), up.log()
        check_outcome(up, job_id, reattached=1)
    finally:
        up.stop()
        stop_recorded_head(tmp_path)  # left up if the job was still active
        pg.close()
