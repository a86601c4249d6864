"""`trident up` as a user runs it, in a process (and session) of its own, and what the tests
that kill, restart and outage it read of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from tests.servers import HTTP, ROOT, wait_healthy


class Up:
    """`trident up` as a user runs it, in its own process (and session)."""

    def __init__(self, data_dir: Path, port: int, env: dict[str, str],
                 *args: str, api_workers: int = 1) -> None:
        """`trident up --port PORT --api-workers API_WORKERS ARGS` on `data_dir`, with `env`
        added to the test's environment. One API process unless asked (0: `trident up`'s
        default, the machine's cores): the tests of what the API's processes do run two
        (`tests/test_api_workers.py`) and so does the `kill -9` of `trident up`, whose API
        processes must end with it; every further process costs the others' CPU."""
        self.data_dir = data_dir
        self.server = f"http://127.0.0.1:{port}"
        self.out = (data_dir / f"up-{time.monotonic_ns()}.out").open("w")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "trident"), "up", "--port", str(port),
             "--api-workers", str(api_workers), *args],
            env={**os.environ, "TRIDENT_DATA_DIR": str(data_dir), **env}, cwd=ROOT,
            stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        """The tails of `trident up`'s own output, its controller's log and its head's."""
        if not self.out.closed:
            self.out.flush()
        parts = [f"--- trident up\n{Path(self.out.name).read_text()[-3000:]}"]
        for name in ("controller.log", "ray-head.log"):
            path = self.data_dir / name
            if path.exists():
                parts.append(f"--- {name}\n" + path.read_text()[-6000:])
        return "\n".join(parts)

    def wait_healthy(self, timeout_s: float = 180) -> None:
        """Until the stack answers healthy; at once a failure if `trident up` exits first."""
        wait_healthy(self.server, timeout_s, proc=self.proc, log=self.log)

    @property
    def auth(self) -> dict[str, str]:
        """The bootstrap admin's token, from the file `trident up` wrote on its first start."""
        return {"Authorization": f"Bearer {(self.data_dir / 'admin.token').read_text().strip()}"}

    def get(self, path: str, **params: Any) -> Any:
        r = HTTP.get(f"{self.server}/api/v1{path}", params=params, headers=self.auth,
                     timeout=10)
        r.raise_for_status()
        return r.json()

    def controller_pid(self) -> int:
        return int(self.get("/healthz")["controller"]["holder"].split(":")[1])

    def stop_within(self, grace_s: float, sig: int = signal.SIGTERM
                    ) -> tuple[float, list[str]]:
        """`sig` (SIGTERM, or SIGINT as Ctrl-C sends it) to `trident up`, then wait, until
        `grace_s` after the signal at most, for it and every process it had started by then
        (its descendants: the API, the controller, the Ray head's processes and workers) to
        be gone. The seconds from the signal until the last of them was gone (`grace_s` or
        more: some were not), and what was still running then. Its output is `stop()`'s."""
        started = {p.pid: _cmdline(p) for p in
                   psutil.Process(self.proc.pid).children(recursive=True)}
        began = time.monotonic()
        self.proc.send_signal(sig)
        deadline = began + grace_s
        while True:
            running = [f"{pid} {cmd}" for pid, cmd in started.items() if alive(pid)]
            if self.proc.poll() is None:
                running.insert(0, f"{self.proc.pid} trident up")
            if not running or time.monotonic() >= deadline:
                return time.monotonic() - began, running
            time.sleep(0.05)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(90)
        self.out.close()
        return Path(self.out.name).read_text()


def last_step(up: Up, job_id: int) -> int:
    items = up.get(f"/jobs/{job_id}/metrics", after_step=0)["items"]
    return max((m["step"] for m in items), default=0)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:100]
    except psutil.Error:
        return "?"


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
