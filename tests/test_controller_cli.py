"""`trident controller`: the controller alone, as the production stack runs it: the real
daemon under the supervisor, restarted when it is killed, stopped cleanly by SIGTERM. Another
holder keeps the lease, so the daemon waits as standby and needs no Ray."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from service.store import Store
from service.store.lease import CONTROLLER, Leases
from tests.conftest import migrated_sqlite
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_trident_controller_restarts_a_killed_daemon_and_stops_on_sigterm(
        tmp_path: Path) -> None:
    url = migrated_sqlite(tmp_path / "trident.db")
    store = Store(url)
    held, _ = Leases(store).acquire(name=CONTROLLER, holder="other:1:a", duration_s=600)
    assert held
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIDENT_")}
    env.update(TRIDENT_DATABASE_URL=url, TRIDENT_DATA_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "controller"], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()

    def pids() -> list[int]:
        return [int(m.group(1)) for line in list(lines)
                if (m := re.search(r"controller pid (\d+) started", line))]

    def standby_lines() -> int:
        return sum("standby: the lease is held by other:1:a" in line for line in list(lines))

    try:
        wait_for("a standby daemon", lambda: standby_lines() == 1)
        first = pids()[0]
        os.kill(first, signal.SIGKILL)
        wait_for("a second standby daemon", lambda: standby_lines() == 2)
        second = pids()[1]
        assert second != first
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(lines)
    assert f"controller pid {first} exited with status -9" in text
    assert "signal SIGTERM: stopping the controller" in text  # the supervisor
    assert "signal SIGTERM: stopping" in text.split("stopping the controller", 1)[1]  # daemon
    assert re.search(r"controller \S+ stopped\n", text)
    assert len(pids()) == 2  # not restarted after SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    lease = Leases(store).read(name=CONTROLLER)
    assert lease is not None and lease.holder == "other:1:a"  # a standby never took it
    store.close()


def test_trident_controller_refuses_bad_settings_at_once() -> None:
    env = {k: None for k in os.environ if k.startswith("TRIDENT_")}
    result = CliRunner().invoke(app, ["controller"], env={**env, "TRIDENT_ENV": "prod"})
    assert result.exit_code == 2
    assert "TRIDENT_DATABASE_URL must name a server database in prod" in result.output
    result = CliRunner().invoke(app, ["controller"], env={**env, "TRIDENT_LEASE_S": "soon"})
    assert result.exit_code == 2 and "TRIDENT_LEASE_S: Input should be a valid number" \
        in result.output
