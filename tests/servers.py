"""Servers the tests run: the API under uvicorn on a free local port in a thread, and the
fixtures that start one as a user's first start would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root."""

HTTP = httpx.Client(timeout=5)
"""The tests' own HTTP client, one per test process, with `httpx.get`'s 5 s timeout: each
`httpx.get` (`post`, ...) builds a client and with it an SSL context, about 20 ms of CPU here,
which a loop polling a server 10 to 20 times a second paid on every poll (a fifth to two fifths
of a core while it waited). Its idle connections to a server that has since ended are dropped
when next picked, so a stack restarted on the same port is reached anew."""


def wait_healthy(url: str, timeout_s: float = 60, *, controller: bool = True,
                 proc: subprocess.Popen | None = None,
                 log: Callable[[], str] = lambda: "") -> None:
    """Poll until the API answers 200 (the database answers and a controller holds the
    lease), or, with `controller=False` (an API without a controller), until the database
    answers; a deadline, not a count, so that slow starts are fine. Fails at once if `proc`
    (the server's process) ends first; a failure ends with `log()`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{url}: its process exited ({proc.returncode}) before it"
                                 f" was healthy\n{log()}")
        try:
            r = HTTP.get(url + "/api/v1/healthz")
            if r.status_code == 200 or (not controller and r.json().get("database") == "ok"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout_s} s\n{log()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(asgi: Any) -> Iterator[str]:
    """An API app served by uvicorn on a free local port in a thread; yields its URL once
    its database answers, and stops it on exit."""
    srv = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=free_port(),
                                        log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.config.port}"
        wait_healthy(url, controller=False)
        yield url
    finally:
        srv.should_exit = True
        t.join(5)


def admin_headers(data_dir: Path) -> dict[str, str]:
    """The bootstrap admin's token, from the file the server's first start wrote."""
    return {"Authorization": f"Bearer {(data_dir / 'admin.token').read_text().strip()}"}


def first_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                database_url: str = "") -> Iterator[str]:
    """An API server's first start on `tmp_path` (the admin made, its token file written),
    the CLI pointed at its data dir: its URL."""
    from api.app import create_app
    from service.settings import Settings

    monkeypatch.setenv("TRIDENT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("TRIDENT_TOKEN", raising=False)
    with serving(create_app(Settings(data_dir=tmp_path, database_url=database_url))) as url:
        yield url


@contextmanager
def api_processes(data_dir: Path, workers: int, database_url: str = "") -> Iterator[str]:
    """`python -m api.serve --workers N` (N uvicorn processes sharing the port, as the compose
    stack and `trident up --api-workers N` run them; no controller) on `data_dir`, each
    answer naming its process (`X-Trident-Pid`); yields its URL once one process answers,
    and stops them all (their process group) on exit."""
    port = free_port()
    env = {**os.environ, "TRIDENT_DATA_DIR": str(data_dir), "TRIDENT_DEBUG_PID_HEADER": "1",
           "TRIDENT_DATABASE_URL": database_url, "PYTHONPATH": str(ROOT)}
    log = data_dir / "api.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "api.serve", "--port", str(port),
                             "--workers", str(workers), "--log-level", "warning"], cwd=ROOT,
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, 120, controller=False)
        except AssertionError:
            raise AssertionError(f"api.serve did not answer: {log.read_text()[-3000:]}") from None
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
