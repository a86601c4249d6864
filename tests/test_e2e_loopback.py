"""Nothing of the embedded stack can be reached from another host: every socket that `trident
up`, its controller, its Ray head and the head's processes and workers listen on is on
loopback, while a job runs too (its ranks' rendezvous store and gloo sockets,
`workers.runtime.rendezvous`); so is the Ray the controller daemon starts inside itself when it runs
alone. Real processes, real Ray, a real job through the API; the sockets as the kernel lists
them (`psutil.net_connections`)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from service.cluster.rayhead import UNUSED_OFF_ENV, answers, live_head
from tests.conftest import tiny_spec
from tests.servers import HTTP, ROOT, free_port
from tests.up import Up
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also written as an IPv4-mapped IPv6 address (::ffff:127.0.0.1)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


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
    """A 2-rank job long enough to be checked while it trains (`--stop-jobs` ends it)."""
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


def test_the_embedded_stack_listens_on_loopback_only_while_a_job_runs(tmp_path: Path) -> None:
    port = free_port()
    # --stop-jobs: the job and the Ray head end with `trident up`, even when a check fails.
    # Its API processes as a user's start makes them (the machine's cores).
    up = Up(tmp_path, port, {"TRIDENT_LEASE_S": "3", "TRIDENT_POLL_INTERVAL_S": "0.2"},
            "--stop-jobs", api_workers=0)
    head = None
    try:
        up.wait_healthy()
        controller = up.controller_pid()
        # The controller is a Ray driver: it listens for Ray's calls once connected.
        servers = (*NODE_SERVERS, "ray.util.client.server", "service.control.daemon")
        wait_for("every server of the stack listening",
                 lambda: all_listening(tree(up.proc.pid), servers), 180, up.log)
        head = live_head(tmp_path)
        job_id = submit_running_job(up)
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
        out = up.stop()
    assert up.proc.returncode == 0, out
    assert head is not None and not answers(head), "the Ray head outlived trident up"


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
