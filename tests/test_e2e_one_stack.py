"""A data directory belongs to one `trident up`, on real processes: a second one on it says so
in one line and exits, leaving the first (its API, its controller, its Ray head) untouched;
once the first is killed with SIGKILL, the next one takes the directory and adopts the Ray
head the killed one left running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from service.cluster.rayhead import answers, live_head, stop_recorded_head
from tests.servers import HTTP, ROOT, free_port
from tests.up import Up

pytestmark = pytest.mark.slow


def test_a_second_trident_up_on_a_data_dir_in_use_exits_and_leaves_the_first_alone(
        tmp_path: Path) -> None:
    first = Up(tmp_path, free_port(), {})
    try:
        first.wait_healthy()
        holder = HTTP.get(f"{first.server}/api/v1/healthz").json()["controller"]["holder"]
        head = json.loads((tmp_path / "ray" / "head.json").read_text())

        second = subprocess.run(
            [str(Path(sys.executable).parent / "trident"), "up", "--port", str(free_port())],
            env={**os.environ, "TRIDENT_DATA_DIR": str(tmp_path)}, cwd=ROOT,
            capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert second.stdout == ""
        assert second.stderr == (
            f"error: data dir {tmp_path} is in use by another `trident up` (pid"
            f" {first.proc.pid}); stop it, or give this one another --data-dir\n")

        # The first is untouched: the same controller leads, the same Ray head answers.
        r = HTTP.get(f"{first.server}/api/v1/healthz")
        assert r.status_code == 200 and r.json()["controller"]["holder"] == holder
        assert json.loads((tmp_path / "ray" / "head.json").read_text()) == head
        assert live_head(tmp_path) == head["address"]

        # kill -9 of the first: the lock goes with it, its Ray head stays, and the next
        # `trident up` on the directory adopts that head.
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        first.stop()
        assert answers(head["address"])
        first = Up(tmp_path, free_port(), {})
        first.wait_healthy()
        assert json.loads((tmp_path / "ray" / "head.json").read_text())["pid"] == head["pid"]
    finally:
        out = first.stop()
        stopped = stop_recorded_head(tmp_path)  # only if the test failed with the head up
    assert "(already running: adopted)" in out, out
    assert first.proc.returncode == 0, out
    assert not stopped and not answers(head["address"])  # no job: the head stopped with it


def test_trident_up_on_a_port_in_use_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """The API's port is checked before anything starts, and held while the Ray head starts:
    a head's servers once took the port just found free, and the API then failed to bind
    after the head and the controller were up."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = subprocess.run(
            [str(Path(sys.executable).parent / "trident"), "up", "--port", str(port)],
            env={**os.environ, "TRIDENT_DATA_DIR": str(tmp_path)}, cwd=ROOT,
            capture_output=True, text=True, timeout=120)
    assert up.returncode != 0 and up.stdout == ""
    assert up.stderr == (f"error: cannot serve the API on 127.0.0.1:{port}: Address already in"
                         " use; stop what holds it, or give this one another --port\n")
    assert not (tmp_path / "ray").exists() and not (tmp_path / "controller.log").exists()


def test_the_port_reserved_for_the_api_is_not_handed_out_meanwhile() -> None:
    """While `trident up` holds its port, a server asking the system for a free port (as the
    Ray head's do) is given another, and the API binds it once the reservation is closed."""
    from api.serve import reserve_port

    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    for _ in range(200):  # the system hands a just-released port out again, often at once
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            assert other.getsockname()[1] != port
    with pytest.raises(OSError), socket.socket() as other:
        other.bind(("127.0.0.1", port))
    reserved.close()
    with socket.socket() as api:
        api.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        api.bind(("127.0.0.1", port))
        api.listen()
