"""`trident up` stops within its grace (`TRIDENT_STOP_GRACE_S`, measured from the signal)
whatever Ray is doing, on real processes and a real Ray head: with every process of its head
stopped (SIGSTOP: a head that takes connections and answers nothing) while the controller is
connected to it as its driver, Ctrl-C still ends `trident up`, its two API processes, the
controller and every process of the head within the grace, and one line says what had to be
killed. The
database's side (a file damaged under the stack) is tests/test_e2e_damaged_db.py's."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from service.cluster.rayhead import live_head
from tests.servers import free_port
from tests.up import Up
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

GRACE_S = 12.0


def session_of(sid: int) -> list[int]:
    """The pids of session `sid` (a `ray start --block` that `trident up` started leads
    its head's session)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def test_ctrl_c_ends_everything_within_the_grace_when_the_ray_head_answers_nothing(
        tmp_path: Path) -> None:
    # Two API processes: their supervisor's signal begins the stop too (`api.serve.serve`).
    up = Up(tmp_path, free_port(), {"TRIDENT_LEASE_S": "3", "TRIDENT_POLL_INTERVAL_S": "0.2",
                                    "TRIDENT_STOP_GRACE_S": str(GRACE_S)}, api_workers=2)
    head_pids: list[int] = []
    try:
        up.wait_healthy()
        address = live_head(tmp_path)
        assert address is not None
        # The controller acts (it holds the lease after connecting to Ray as its driver).
        wait_for("the controller acting", lambda: up.get("/healthz")["controller"]["holder"],
                 60)
        # Out of `ray.init` (whose own handler would end it at SIGTERM): its handler is back.
        wait_for("the controller connected to Ray", lambda: "driver of the Ray cluster at" in
                 (tmp_path / "controller.log").read_text(), 60)
        head = int(json.loads(
            (tmp_path / "ray" / "head.json").read_text())["pid"])
        head_pids = session_of(head)
        names = " ".join(Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                         for p in head_pids)
        assert "gcs_server" in names and "raylet" in names, names
        for pid in head_pids:
            os.kill(pid, signal.SIGSTOP)
        took, running = up.stop_within(GRACE_S, signal.SIGINT)
    finally:
        out = up.stop()
        for pid in session_of(head_pids[0]) if head_pids else []:  # the test failed: free them
            os.kill(pid, signal.SIGKILL)
    assert not running, (f"{took:.1f} s after Ctrl-C", running, up.log())
    assert up.proc.returncode == 0, out
    assert "Traceback" not in out, out
    # Nothing could be asked of the stopped head: its `ray start` took no SIGTERM, and its
    # session was killed at the end of its part of the grace, which one line says.
    killed = [line for line in out.splitlines() if "did not stop within" in line]
    assert any(line.startswith(f"the Ray head at {address} did not stop within")
               and line.endswith(": killed") for line in killed), out
    assert len(killed) <= 2, killed  # the controller's own line, when Ray held it too
    log = (tmp_path / "controller.log").read_text()
    assert "signal SIGTERM: stopping" in log, log[-3000:]  # a driver of the head, in its loop
