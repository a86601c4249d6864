"""A full data directory costs a job the checkpoints it could not save, never the control
plane: `trident up` (API, supervised controller, its own Ray head, SQLite) with its data
directory on a small filesystem of the test's own, filled while a real job of two DeepSpeed
ranks trains, then freed; all without restarting `trident up`."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from service.cluster.rayhead import stop_recorded_head
from tests.conftest import tiny_spec
from tests.servers import HTTP, free_port
from tests.smallfs import Filler, fill_last_page, small_fs
from tests.up import Up, last_step
from tests.waiting import wait_for
from workers.checkpoint.saving import MARKER

pytestmark = pytest.mark.slow

ENV = {"TRIDENT_LEASE_S": "3", "TRIDENT_POLL_INTERVAL_S": "0.2", "TRIDENT_ALLOW_FAULTS": "1"}
"""A short lease, so that the controller gives it up within seconds of the disk filling."""


def healthz(up: Up) -> dict:
    return HTTP.get(f"{up.server}/api/v1/healthz", timeout=10).json()


def daemon_pid(up: Up) -> int | None:
    """The controller daemon `trident up` runs now, if any."""
    for child in psutil.Process(up.proc.pid).children():
        try:
            if "service.control.daemon" in child.cmdline():
                return int(child.pid)
        except psutil.Error:  # it just ended
            pass
    return None


def tags(ckpt: Path) -> tuple[set[str], set[str]]:
    """The checkpoint tags of a job's directory, and those complete."""
    return ({p.name for p in ckpt.glob("step*")},
            {p.parent.name for p in ckpt.glob(f"step*/{MARKER}")})


def test_a_full_data_dir_costs_a_checkpoint_and_the_stack_recovers_by_itself(
        tmp_path: Path) -> None:
    # Room for the job's checkpoints (3.8 MB a tag, none removed) for minutes after the
    # disk is freed, at a save every 10 steps of at least 0.2 s.
    with small_fs(tmp_path / "data", 256) as data:
        up = Up(data, free_port(), ENV)
        filler = Filler(data / "filler")
        began = time.monotonic()
        try:
            up.wait_healthy()
            first_holder = healthz(up)["controller"]["holder"]
            spec = tiny_spec(train={"steps": 100_000, "global_batch": 8, "micro_batch": 2,
                                    "precision": "fp32", "lr": 0.003},
                             monitor={"probe": False}, checkpoint={"every_steps": 10},
                             # at least 0.2 s a step: a save every 2 s or more
                             faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}])
            r = HTTP.post(f"{up.server}/api/v1/jobs", json=spec, headers=up.auth, timeout=30)
            assert r.status_code == 201, r.text
            job_id = int(r.json()["id"])
            ckpt = data / "checkpoints" / f"job-{job_id}"
            wait_for("a complete checkpoint", lambda: bool(tags(ckpt)[1]), 240, up.log)

            first_daemon = daemon_pid(up)
            filler.start()  # and it keeps the disk full until freed
            # The controller log's last page too: the supervisor's next lines are refused,
            # however few the controller writes about the full disk.
            fill_last_page(data / "controller.log")
            full_at = ckpt.stat().st_mtime_ns
            stored = last_step(up, job_id)  # reads work on a full disk
            # The controller cannot renew its lease (SQLite cannot write): it lapses, the
            # daemon exits, and its supervisor starts another, though every line it writes
            # about it is refused (the supervisor's thread died of that, once).
            wait_for("the lease lapsed", lambda: "not renewed" in str(
                healthz(up)["controller"].get("error")), 60, up.log)
            wait_for("another controller started", lambda: daemon_pid(up) not in (
                None, first_daemon), 60, up.log)
            disk = healthz(up)["data_dir"]
            # Named, figures only: healthz answers without a token, so not the path.
            assert disk["status"] == "nearly full" and "path" not in disk, disk
            # A save was tried meanwhile (its tag made, then removed whole), none completed.
            wait_for("a save tried on the full disk", lambda: ckpt.stat().st_mtime_ns != full_at
                     and tags(ckpt)[0] == tags(ckpt)[1], 60, up.log)
            complete_while_full = tags(ckpt)[1]
            filler.free()
            freed = time.monotonic()

            # The controller leads again, by itself: a new process took the lease.
            wait_for("a controller leading again", lambda: (h := healthz(up))["status"] == "ok"
                     and h["controller"]["holder"] != first_holder, 120, up.log)
            led_again_s = time.monotonic() - freed
            # The job: re-attached (its ranks trained on), its failed saves reported, and
            # training goes on past what was stored before the disk filled.
            wait_for("the failed save reported", lambda: any(
                e["kind"] == "checkpoint" for e in up.get(f"/jobs/{job_id}/events")["items"]),
                120, up.log)
            wait_for("training on", lambda: last_step(up, job_id) > stored + 4, 120, up.log)
            events = up.get(f"/jobs/{job_id}/events", limit=1000)["items"]
            assert any(e["kind"] == "reattach" for e in events), (
                [(e["kind"], e["message"][:300]) for e in events], up.log())
            failed = [e for e in events if e["kind"] == "checkpoint"]
            for e in failed:
                assert e["message"].startswith(f"the checkpoint of step {e['data']['step']}"
                                               " was not saved; training goes on"), e
                assert re.search(r"No space left on device|MiB free on its filesystem",
                                 e["message"]), e
                assert f"step{e['data']['step']}" not in tags(ckpt)[0]  # no partial tag
            job = up.get(f"/jobs/{job_id}")
            assert job["state"] == "RUNNING" and job["attempts"] == 1, job
            steps = [m["step"] for m in up.get(f"/jobs/{job_id}/metrics", rank=0)["items"]]
            assert steps == list(range(1, len(steps) + 1)), "a step's report was lost"
            every, complete = tags(ckpt)
            assert complete_while_full <= complete  # last tags intact
            # Besides them, at most the save in flight (written in the background, marked at
            # a later step boundary), newer than every complete tag.
            in_flight = every - complete
            newest = max(int(t.removeprefix("step")) for t in complete)
            assert len(in_flight) <= 1 and all(
                int(t.removeprefix("step")) > newest for t in in_flight), (every, complete)

            # The supervisor's lines of the exit and the start were refused; it says so in
            # the log once the disk takes it.
            wait_for("the supervisor's notice", lambda: re.search(
                r"trident.supervisor \[trident\] the disk refused writes here \(No space left"
                r" on device\): \d+ lines? before this line could not be written",
                (data / "controller.log").read_text()) is not None, 60, up.log)

            # New jobs are admitted and run.
            r = HTTP.post(f"{up.server}/api/v1/jobs/{job_id}/cancel", headers=up.auth,
                          timeout=30)
            assert r.status_code == 202, r.text
            r = HTTP.post(f"{up.server}/api/v1/jobs", json=tiny_spec(
                train={"steps": 3, "global_batch": 8, "micro_batch": 2,
                       "precision": "fp32", "lr": 0.003}, monitor={"probe": False}),
                headers=up.auth, timeout=30)
            assert r.status_code == 201, r.text
            second = int(r.json()["id"])
            wait_for("the new job done", lambda: up.get(f"/jobs/{second}")["state"] in (
                "SUCCEEDED", "FAILED"), 240, up.log)
            assert up.get(f"/jobs/{second}")["state"] == "SUCCEEDED", up.log()
            assert up.get(f"/jobs/{job_id}")["state"] == "CANCELLED"
            assert up.proc.poll() is None  # the same `trident up` all along
            print(f"full disk: the controller led again {led_again_s:.1f} s after the space"
                  f" was freed; {len(failed)} save(s) failed; test {time.monotonic() - began:.0f}"
                  " s")
        finally:
            filler.free()
            out = up.stop()
            stop_recorded_head(data)  # left up if the test failed with a job active
    assert up.proc.returncode == 0, out
