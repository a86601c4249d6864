"""Nothing of the embedded stack can be reached from another host: every socket that `trident
up`, its controller, its Ray head and the head's processes and workers listen on is on
loopback, while a job runs too (its ranks' rendezvous store and gloo sockets,
`workers.runtime.rendezvous`); so is the Ray the controller daemon starts inside itself when it runs
alone. Real processes, real Ray, a real job through the API; the sockets as the kernel lists
them (`psutil.net_connections`).

One `trident up` serves the tests that neither stop nor kill it (the `up` fixture): the
README's demo path and the sockets while a job runs; its stop, with no job active, is the
module's last check (the fixture's end): a clean exit, the controller's own SIGTERM handler
run, the Ray head and the controller ended with it."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from service.cluster.rayhead import UNUSED_OFF_ENV, answers, live_head, stop_recorded_head
from service.contract.states import JobState
from tests.conftest import tiny_spec
from tests.servers import HTTP, ROOT, admin_headers, free_port
from tests.up import Up
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also written as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`trident up` as the README starts it (its API processes as a user's start makes
    them: the machine's cores; a short poll interval, so that jobs start sooner), shared by
    the module's tests, which leave no job active. At the end: SIGTERM, and what a stop
    without active jobs does."""
    data = tmp_path_factory.mktemp("up")
    stack = Up(data, free_port(), {"TRIDENT_POLL_INTERVAL_S": "0.2"}, api_workers=0)
    head = None
    try:
        stack.wait_healthy()
        head = live_head(data)
        yield stack
        # A test that failed half way may have left its job active: cancelled, so that the
        # stop below is still that of a stack without active jobs.
        active = [j["id"] for j in stack.get("/jobs")["items"] if JobState(j["state"]).active]
        for job_id in active:
            HTTP.post(f"{stack.server}/api/v1/jobs/{job_id}/cancel", headers=stack.auth,
                      timeout=30)
        wait_for("no job active", lambda: not [
            j for j in stack.get("/jobs")["items"] if JobState(j["state"]).active], 120,
            stack.log)
    finally:
        out = stack.stop()
        left_up = stop_recorded_head(data)  # only if a job was still active
    assert stack.proc.returncode == 0, out
    assert f"its API token is in {data / 'admin.token'}" in out, out
    # The controller's own SIGTERM handler ran: it logged, stopped and released its lease.
    log = (data / "controller.log").read_text()
    assert "signal SIGTERM: stopping" in log and re.search(r"controller \S+ stopped", log), log
    # No job is active: the Ray head `trident up` started stops with it.
    assert not left_up, out
    said = re.search(r"ray head at (\S+)", out)
    assert said and live_head(data) is None and not answers(said.group(1)), out
    assert head is not None and not answers(head), "the Ray head outlived trident up"
    # The controller ends with `trident up`.
    controller_pid = int(re.search(r"controller pid (\d+)", out).group(1))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(controller_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"controller {controller_pid} outlived `trident up`:\n{out}")


def test_trident_up_runs_the_demo_job(up: Up) -> None:
    """The README's demo path: `trident up`, then `trident submit examples/tiny.yaml` (which
    follows the job and exits 0 when it succeeds)."""
    trident = str(Path(sys.executable).parent / "trident")
    env = {**os.environ, "TRIDENT_DATA_DIR": str(up.data_dir)}
    done = subprocess.run([trident, "submit", str(ROOT / "examples/tiny.yaml"),
                           "--server", up.server], capture_output=True, text=True, timeout=400,
                          cwd=ROOT, env=env)
    log = (up.data_dir / "controller.log").read_text()
    assert done.returncode == 0, done.stdout + done.stderr + log
    assert "SUCCEEDED" in done.stdout and "step    30/30" in done.stdout
    assert "dashboard" not in done.stdout  # the dashboard line comes from `up` / demo.sh
    page = HTTP.get(up.server + "/", headers=admin_headers(up.data_dir)).text
    assert '<td class="state SUCCEEDED">SUCCEEDED</td>' in page


def test_loopback_tells_the_addresses_apart() -> None:
    assert all(map(loopback, ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2"]))


def tree(pid: int) -> dict[int, str]:
    """Process `pid` and all its descendants: pid -> whole command line (or name). Never cut:
    a checkout at a long path puts a Ray worker's `default_worker.py` far into its line."""
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            out[p.pid] = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
    return out


def listening(pids: dict[int, str]) -> list[tuple[str, int, str]]:
    """(address, port, process) of every inet socket those processes listen on."""
    return [(c.laddr.ip, c.laddr.port, pids[c.pid])
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def ray_worker(cmd: str) -> bool:
    """A Ray worker process (an idle worker, or an actor), not one of the node's agents."""
    return (cmd.startswith("ray::") and "Agent" not in cmd) or "default_worker.py" in cmd


NODE_SERVERS = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "dashboard.py")
"""The Ray processes of a head that listen: `ray start --head` adds its client server, and
the daemon's own Ray (`ray.init`) its autoscaler monitor, which `trident up`'s head leaves
out (`service.cluster.rayhead.NO_AUTOSCALER_MONITOR`)."""


def all_listening(pids: dict[int, str], servers: tuple[str, ...]) -> bool:
    """Whether each of `servers` and a Ray worker listen already (they start one by one)."""
    cmds = [cmd for _, _, cmd in listening(pids)]
    return (all(any(s in cmd for cmd in cmds) for s in servers)
            and any(map(ray_worker, cmds)))


def check_all_on_loopback(pids: dict[int, str]) -> None:
    sockets = listening(pids)
    exposed = [s for s in sockets if not loopback(s[0])]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))


def check_metrics_off(pids: dict[int, str]) -> None:
    """Ray's metrics collection is off on the Ray that Trident starts (`UNUSED_OFF_ENV`): its
    GCS and raylet run with the setting, and its dashboard agent runs no Prometheus exporter
    (it writes -1 for that port into the session directory)."""
    servers = [pid for pid, cmd in pids.items() if "gcs_server" in cmd or "/raylet" in cmd]
    assert len(servers) >= 2, pids
    for pid in servers:
        env = psutil.Process(pid).environ()
        assert {k: env.get(k) for k in UNUSED_OFF_ENV} == UNUSED_OFF_ENV, pids[pid]
    gcs = next(pid for pid in servers if "gcs_server" in pids[pid])
    log_dir = next(a.split("=", 1)[1] for a in psutil.Process(gcs).cmdline()
                   if a.startswith("--log_dir="))
    session = Path(log_dir).parent

    def exporter_port_written() -> bool:
        # The dashboard agent writes it once it has started, after it listens.
        ports = list(session.glob("metrics_export_port_*"))
        return bool(ports) and all(p.read_text().strip() for p in ports)

    wait_for("the dashboard agent writing its exporter's port", exporter_port_written, 60)
    ports = list(session.glob("metrics_export_port_*"))
    assert all(p.read_text().strip() == "-1" for p in ports), ports


def submit_running_job(up: Up) -> int:
    """A 2-rank job long enough to be checked while it trains (its test cancels it)."""
    spec = tiny_spec(train={"steps": 100_000, "global_batch": 8, "micro_batch": 2,
                            "precision": "fp32", "lr": 0.003}, monitor={"probe": False})
    r = HTTP.post(f"{up.server}/api/v1/jobs", json=spec, headers=up.auth, timeout=30)
    assert r.status_code == 201, r.text
    job_id = int(r.json()["id"])

    def trained_a_step() -> bool:
        job = up.get(f"/jobs/{job_id}")
        assert job["state"] in ("QUEUED", "PLACING", "RUNNING"), (job["error"], up.log())
        return bool(up.get(f"/jobs/{job_id}/metrics", rank=1)["items"])

    wait_for("the job training on both ranks", trained_a_step, 240, up.log)
    return job_id


def test_the_embedded_stack_listens_on_loopback_only_while_a_job_runs(up: Up) -> None:
    """(After it, the `up` fixture's end: the stack stops cleanly, its Ray head with it.)"""
    port = int(up.server.rsplit(":", 1)[1])
    job_id = None
    try:
        controller = up.controller_pid()
        job_id = submit_running_job(up)
        # The controller is a Ray driver: it listens for Ray's calls once connected. Waited
        # for with the job running, whose ranks are Ray workers that listen (the idle
        # workers Ray starts ahead may be gone on a stack that has run jobs before).
        servers = (*NODE_SERVERS, "ray.util.client.server", "service.control.daemon")
        wait_for("every server of the stack listening",
                 lambda: all_listening(tree(up.proc.pid), servers), 180, up.log)
        head = live_head(up.data_dir)
        placement = up.get(f"/jobs/{job_id}/attempts")["items"][-1]["placement"]
        pids = tree(up.proc.pid)
        assert controller in pids, pids
        sockets = listening(pids)
        assert ("127.0.0.1", port) in [(a, p) for a, p, _ in sockets]  # the API
        check_all_on_loopback(pids)
        check_metrics_off(pids)
        # No log monitor (`service.cluster.rayhead.NO_LOG_MONITOR`): the ranks write rank logs.
        assert not [c for c in pids.values() if "log_monitor" in c], pids
        # Nor an autoscaler monitor (`service.cluster.rayhead.NO_AUTOSCALER_MONITOR`).
        assert not [c for c in pids.values() if "autoscaler/_private/monitor.py" in c], pids
        assert head is not None and head.startswith("127.0.0.1:"), head
        # The ranks are processes of the stack, and they listen: rank 0 its rendezvous store
        # on the master address (loopback: where Ray put rank 0), each its gloo sockets.
        # Ranks at niceness 0 (`WORKER_NICENESS_ENV`), without a runtime environment.
        assert all(r["nice"] == 0 for r in placement["ranks"]), placement
        ranks = {r["rank"]: r["pid"] for r in placement["ranks"]}
        assert set(ranks) == {0, 1} and set(ranks.values()) <= set(pids), (ranks, pids)
        master_addr, master_port = placement["master"].rsplit(":", 1)
        assert loopback(master_addr), placement["master"]
        by_pid = {pid: [(a, p) for a, p, _ in listening({pid: ""})] for pid in ranks.values()}
        assert (master_addr, int(master_port)) in by_pid[ranks[0]], by_pid
        assert len(by_pid[ranks[1]]) > 1, by_pid  # its actor's server and its gloo sockets
    finally:
        # The shared stack stops with no job active (the `up` fixture checks that stop).
        if job_id is not None:
            r = HTTP.post(f"{up.server}/api/v1/jobs/{job_id}/cancel", headers=up.auth,
                          timeout=30)
            assert r.status_code == 202, r.text
            wait_for("the job cancelled", lambda: up.get(f"/jobs/{job_id}")["state"]
                     == "CANCELLED", 120, up.log)


def test_the_daemon_alone_starts_its_ray_on_loopback(tmp_path: Path) -> None:
    """`python -m service.control.daemon` without TRIDENT_RAY_ADDRESS: a Ray inside the daemon."""
    env = {k: v for k, v in os.environ.items() if k != "TRIDENT_RAY_ADDRESS"}
    env.update(TRIDENT_DATA_DIR=str(tmp_path), PYTHONPATH=str(ROOT),
               TRIDENT_POLL_INTERVAL_S="0.2", TRIDENT_LEASE_S="3")
    log = (tmp_path / "daemon.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "service.control.daemon"], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the Ray of the daemon listening, with a worker",
                 lambda: all_listening(tree(proc.pid), (*NODE_SERVERS, "monitor.py")), 180,
                 lambda: (tmp_path / "daemon.log").read_text()[-4000:])
        check_all_on_loopback(tree(proc.pid))
        check_metrics_off(tree(proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
