"""A real `mlflow server` for the tracking tests: SQLite backend in a folder of the test's,
on a free loopback port, started by the test (`tests.conftest.mlflow_server` shares one per
session). It can be killed and started again on the same port and database (the outage
test). MLflow's job runner (huey consumers, several processes) is off: nothing here needs it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.servers import HTTP, free_port

START_TIMEOUT_S = 180.0
"""A loaded 2-core machine takes seconds to start it; this is far beyond need."""


class MlflowServer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = Path(sys.executable).parent / "mlflow"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
               "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
        log = (self.folder / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [str(exe), "server", "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--default-artifact-root", str(self.folder / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}); see"
                                   f" {self.folder / 'server.log'}")
            try:
                if HTTP.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not up after {START_TIMEOUT_S:g} s")
            time.sleep(0.2)

    def kill(self) -> None:
        """Kill the server and the processes it started (its session), at once."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None
