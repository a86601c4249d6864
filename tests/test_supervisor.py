"""`trident up`'s supervision: a controller process that exits is started again (with
backoff), and healthz is 200 again once the new one holds the lease; `stop` ends it cleanly;
a log the disk refuses costs its lines, never the supervision."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from api.app import create_app
from service.cluster.supervisor import Supervisor, wait_exit
from service.settings import Settings
from tests.conftest import migrated_sqlite
from tests.servers import HTTP, serving, wait_healthy
from tests.smallfs import Filler, small_fs
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_a_killed_controller_is_restarted_and_health_returns(tmp_path: Path) -> None:
    url = migrated_sqlite(tmp_path / "trident.db")
    with serving(create_app(Settings(data_dir=tmp_path, database_url=url))) as server:
        assert HTTP.get(server + "/api/v1/healthz").status_code == 503  # no controller yet

        log = tmp_path / "controller.log"
        started: list[int] = []
        sup = Supervisor([sys.executable, str(ROOT / "tests/_lease_holder.py"), url, "1.5"],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, log_path=log,
                         backoff_min_s=0.2, backoff_max_s=1, on_start=started.append)
        sup.start()
        try:
            wait_healthy(server)
            first = HTTP.get(server + "/api/v1/healthz").json()["controller"]["holder"]
            assert first.split(":")[1] == str(started[0])
            os.kill(started[0], signal.SIGKILL)
            wait_for("restarted", lambda: len(started) == 2)
            assert started[1] != started[0] and sup.exits == [-signal.SIGKILL]

            def new_holder() -> bool:
                r = HTTP.get(server + "/api/v1/healthz")
                return r.status_code == 200 and r.json()["controller"]["holder"] != first

            wait_for("healthy under the new controller", new_holder)
        finally:
            sup.stop(10)
    text = log.read_text()
    assert f"controller pid {started[0]} exited with status -9" in text
    assert "restarting in 0.2 s" in text and f"controller pid {started[1]} started" in text
    # `stop` ends it with SIGTERM, which the controller handles: it released its lease.
    assert text.rstrip().endswith("stopped")
    assert len(started) == 2  # not restarted after stop


def test_backoff_doubles_up_to_its_bound(tmp_path: Path) -> None:
    log = tmp_path / "controller.log"
    sup = Supervisor([sys.executable, "-c", "import sys; sys.exit(7)"], env=dict(os.environ),
                     log_path=log, backoff_min_s=0.05, backoff_max_s=0.2, stable_s=60)
    sup.start()
    try:
        wait_for("restarted four times", lambda: sup.starts >= 5)
    finally:
        sup.stop(5)
    waits = [line.rsplit("restarting in ", 1)[1] for line in log.read_text().splitlines()
             if "restarting in" in line]
    assert waits[:4] == ["0.05 s", "0.1 s", "0.2 s", "0.2 s"]
    assert set(sup.exits) == {7}


def test_the_wait_for_a_supervised_process_ends_with_it_not_at_its_timeout() -> None:
    """`wait_exit` blocks on the process's pidfd: it returns the status as the process ends
    (not when the timeout runs out, nor at a poll after it), and None while it runs."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.5);"
                             " sys.exit(3)"])
    assert wait_exit(proc, 0.05) is None  # still running
    began = time.monotonic()
    assert wait_exit(proc, 120) == 3
    assert time.monotonic() - began < 60  # the end, not the timeout, ended the wait
    assert wait_exit(proc, 120) == 3  # reaped already: at once


def test_the_wait_works_in_a_process_with_over_a_thousand_files_open() -> None:
    """The pidfd gets the lowest free number: past 1023 when that many files are open, out of
    `select`'s range (`wait_exit` polls it instead)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    held: list[int] = []
    try:
        while len(held) < 1100 and (not held or held[-1] < 1100):
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert held[-1] >= 1024, held[-1]
        proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.3);"
                                 " sys.exit(5)"])  # running still when the wait begins
        assert wait_exit(proc, 120) == 5
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_daemon_keeps_its_sigterm_handler_across_ray_init(monkeypatch) -> None:
    """ray.init installs a bare `sys.exit` for SIGTERM; the daemon's own handler (which logs
    and stops cleanly) must still be the one that runs."""
    from types import SimpleNamespace

    import service.control.daemon as daemon
    from service.cluster.rayhead import UNUSED_OFF_ENV, WORKER_NICENESS_ENV

    def ray_init(**_: object) -> None:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))

    fakes = {"ray": SimpleNamespace(init=ray_init),
             "workers.launch.group": SimpleNamespace(NAMESPACE="trident"),
             "workers.launch.launcher": SimpleNamespace(RayLauncher=lambda **_: "launcher")}
    monkeypatch.setattr(daemon.importlib, "import_module", fakes.__getitem__)
    # A local Ray is on loopback (service.cluster.rayhead.LOOPBACK_ENV), its metrics collection off
    # (UNUSED_OFF_ENV); undone after the test.
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "DASHBOARD_METRIC_PORT",
                 "AUTOSCALER_METRIC_PORT", *UNUSED_OFF_ENV, *WORKER_NICENESS_ENV):
        monkeypatch.setenv(name, "1")

    def ours(_signum: int, _frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, ours)
    try:
        assert daemon.connect_ray(Settings()) == "launcher"
        assert signal.getsignal(signal.SIGTERM) is ours
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
        assert {k: os.environ[k] for k in UNUSED_OFF_ENV} == UNUSED_OFF_ENV
        assert {k: os.environ[k] for k in WORKER_NICENESS_ENV} == WORKER_NICENESS_ENV
    finally:
        signal.signal(signal.SIGTERM, before)


def test_supervision_outlives_a_full_disk_under_its_log(tmp_path: Path) -> None:
    """The log on a small filesystem filled before the first start: every line the
    supervisor writes is refused, and so is what `on_start` prints, yet it keeps restarting
    the process; once the disk is freed its next line says how many were lost."""
    with small_fs(tmp_path / "fs", 1) as fs:
        log = fs / "controller.log"
        started: list[int] = []

        def on_start(pid: int) -> None:  # `trident up` echoes to a terminal that may be a file
            started.append(pid)
            raise OSError(errno.ENOSPC, "No space left on device")

        filler = Filler(fs / "filler").start()
        sup = Supervisor([sys.executable, "-c", "import sys; sys.exit(3)"],
                         env=dict(os.environ), log_path=log, backoff_min_s=0.05,
                         backoff_max_s=0.1, on_start=on_start)
        sup.start()
        try:
            wait_for("restarted while the disk is full", lambda: sup.starts >= 4)
            assert sup.refused.count >= 4 and log.stat().st_size == 0
            filler.free()
            wait_for("a line in the log again", lambda: log.stat().st_size > 0)
            at = sup.starts
            wait_for("restarting on", lambda: sup.starts >= at + 2)
        finally:
            sup.stop(5)
            filler.free()
        text = log.read_text()
    assert re.search(r"the disk refused writes here \(No space left on device\): \d+ lines"
                     r" before this line could not be written\n", text), text
    assert text.count("the disk refused writes") == 1
    assert set(sup.exits) == {3} and len(started) == sup.starts


def test_a_log_that_cannot_be_opened_costs_the_output_not_the_start(tmp_path: Path) -> None:
    sup = Supervisor([sys.executable, "-c", "print('lost'); import sys; sys.exit(5)"],
                     env=dict(os.environ), log_path=tmp_path / "gone" / "controller.log",
                     backoff_min_s=0.05, backoff_max_s=0.1)
    sup.start()
    try:
        wait_for("started twice", lambda: len(sup.exits) >= 2)
    finally:
        sup.stop(5)
    assert set(sup.exits) == {5}  # it ran (and exited by itself) every time
    assert sup.refused.count >= 2  # the supervisor's own lines had nowhere to go either


def test_a_start_that_fails_is_tried_again_with_the_backoff(tmp_path: Path) -> None:
    log = tmp_path / "controller.log"
    sup = Supervisor([str(tmp_path / "no-such-program")], env=dict(os.environ), log_path=log,
                     backoff_min_s=0.05, backoff_max_s=0.1)
    sup.start()
    try:
        wait_for("tried three times", lambda: log.exists() and log.read_text().count(
            "starting controller failed (FileNotFoundError") >= 3)
    finally:
        sup.stop(5)
    assert sup.starts == 0 and "trying again in 0.05 s" in log.read_text()
