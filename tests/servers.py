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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import uvicorn

if TYPE_CHECKING:
    from service.control.controller import Controller
    from service.settings import Settings
    from service.store import Store

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


@contextmanager
def ray_head(log: Path, num_cpus: int = 2) -> Iterator[str]:
    """A Ray head of the test process's own: `ray start --head --block` in a session of its
    own, with `num_cpus` CPUs, without what Trident leaves out of the Ray it starts (the
    dashboard, the log and autoscaler monitors, metrics: `service.cluster.rayhead`), its
    workers at niceness 0 and without Ray's token (its drivers are this process, which has
    none); its address once it answers. On exit it is stopped (SIGTERM to `ray start`, which
    stops the head's processes), whatever still runs on it with it."""
    from service.cluster.rayhead import (
        NO_AUTOSCALER_MONITOR,
        NO_LOG_MONITOR,
        UNUSED_OFF_ENV,
        WORKER_NICENESS_ENV,
        answers,
        metric_ports,
    )

    port = free_port()
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={port}", f"--num-cpus={num_cpus}", "--include-dashboard=false",
            NO_LOG_MONITOR, NO_AUTOSCALER_MONITOR, "--disable-usage-stats",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", **UNUSED_OFF_ENV, **WORKER_NICENESS_ENV,
           **metric_ports()}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not answers(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the tests' Ray head did not answer at {address}:\n"
                                     f"{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@dataclass
class Served:
    """The served stack (`served_stack`): the API's URL, its store and settings, and the
    controller on the test process's Ray."""

    url: str
    store: Store
    settings: Settings
    controller: Controller


@contextmanager
def served_stack(settings: Settings, *, step_s: float | None = 0.2,
                 before: Callable[[Controller], object] | None = None,
                 **controller: Any) -> Iterator[Served]:
    """Ray, a controller and the served API, as `trident up` runs them but in this process:
    a store at `settings`' database (a copy of the migrated template, `migrated_sqlite`),
    a controller on the test process's Ray (its module holds `local_ray`) in a namespace of
    its own (`ray_namespace`), with the daemon's launcher (rank logs under the data directory,
    the server's data rules) and the checkpoints under the data directory (`controller`:
    further `Controller` arguments; `before` is called with it first), stepping in a thread
    every `step_s` as the daemon does (None: the test steps it), and the API app served by
    uvicorn over the same store. On exit the thread stops, the controller shuts down with its
    jobs, the namespace is emptied and the store closed."""
    from api.app import create_app
    from service.control.controller import Controller
    from service.files.order_cache import ServerData
    from service.store import Store
    from tests.conftest import migrated_sqlite, ray_namespace
    from workers.launch.launcher import RayLauncher

    assert not settings.database_url, "the served stack's store is a SQLite file of its own"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(migrated_sqlite(settings.data_dir / "trident.db"))
    stop = threading.Event()
    driver = None
    try:
        with ray_namespace() as namespace:
            launcher = RayLauncher(log_root=settings.log_root,
                                   log_max_bytes=settings.rank_log_max_bytes,
                                   server=ServerData.of(settings),
                                   light_ranks=settings.light_ranks, namespace=namespace)
            ctl = Controller(store, launcher, **{"checkpoint_root": settings.checkpoint_root,
                                                 "data_dir": settings.data_dir, **controller})
            if before is not None:
                before(ctl)
            if step_s is not None:
                def drive() -> None:
                    while not stop.is_set():
                        ctl.step()
                        stop.wait(step_s)

                driver = threading.Thread(target=drive, name="controller", daemon=True)
                driver.start()
            try:
                with serving(create_app(settings, store=store)) as url:
                    yield Served(url, store, settings, ctl)
            finally:
                stop.set()
                if driver is not None:
                    driver.join(60)
                ctl.shutdown(stop_jobs=True)
    finally:
        store.close()
