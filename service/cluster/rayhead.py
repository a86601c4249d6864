"""The embedded default's Ray head: a process of its own, supervised by `trident up`.

Jobs' worker groups are detached actors on this head, so the head must not belong to the
controller (whose restart would take every job with it) nor end with `trident up`: it runs as
`ray start --head --block` in a session of its own, restarted by a `Supervisor` when it exits.
Its address is kept in `<data_dir>/ray/head.json`, and Ray's token authentication is on, with a
token of the data directory's (`<data_dir>/ray/auth_token`, owner-only) given to the head and
the controller. It listens on loopback only (`LOOPBACK_ENV`): nothing of it can be reached
from another host. A `trident up` that starts while a head from an earlier one still answers
there (that one was killed) watches it instead of starting a second. `trident up` stops the
head when it stops, unless jobs are still active in the store (without `--stop-jobs`), which
keep training on it and are re-attached by the next controller.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path

from service.cluster.supervisor import Supervisor, kill_session
from service.secrets import without_server_secrets

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's environment for a node that listens on loopback only (127.0.0.1), and its drivers.

Ray's servers bind to the node's address when it is a loopback one, else to every interface
(the GCS and the raylet's gRPC servers: `0.0.0.0` unless the node is on `127.0.0.1`; the
dashboard agent, the runtime-env agent, the metrics exporter and the Ray client server: the
node's address). But `ray start` replaces a loopback `--node-ip-address` by the host's
address, so that other hosts can join (`ray._private.services.resolve_ip_for_localhost`),
unless Ray's multi-node mode is off, which this variable does (its default on macOS and
Windows). A node started so cannot be joined by another (a worker's `ray start` goes to the
host's address, where it does not listen; with the variable set, Ray refuses to start a worker
node): a cluster of several hosts is `trident node start` (`service.cluster.raynode`)."""


UNUSED_OFF_ENV = {"RAY_enable_metrics_collection": "0"}
"""Ray's environment for what of it Trident does not use, off: its metrics collection (Ray's
`enable_metrics_collection` setting, read by every Ray process from its environment: the
GCS, the raylet, the workers, which then record and send no metrics, and the dashboard
agent, which then runs no Prometheus exporter and records no node stats). Trident's own
metrics are its store's (`GET /metrics`). The dashboard is off by `--include-dashboard=false`
(Ray still runs its API server, `dashboard.py`, without the dashboard's modules, and a
dashboard agent per node: Ray has no setting that leaves them out). Set on the Ray that
Trident starts (`trident up`'s head and the daemon's own) and its drivers, never on a cluster
named by `TRIDENT_RAY_ADDRESS`, whose metrics are its operator's."""


HEALTH_CHECK_ENV = {"RAY_health_check_initial_delay_ms": "2000",
                    "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "2000",
                    "RAY_health_check_failure_threshold": "5"}
"""How the head's GCS finds a host gone: a check of each raylet every second, one unanswered
for 2 s failed, five failed in a row and the node is dead (Ray's defaults: every 3 s, 10 s,
five). A host whose raylet refuses at once is dead within about 5 s (Ray's: 15 s); one that
answers nothing, powered off or cut off, within about 15 s (Ray's: up to 65 s; measured on
the hosts harness, `docs/reliability.md`: 15.4 s against 63.8 s). Five in a row, not fewer,
so that a raylet busy for a moment on a loaded host (its check is a gRPC call served by its
own thread) is not taken for dead. A node's death is what the controller acts on when no
collective failed first (its ranks' actors die with it, and the attempt's poll says so), so
this is the longest time to detect a lost host. Set on the heads that
`trident node start` (`service.cluster.raynode`) and `trident up` start (only the GCS reads
them); an operator's own setting in the environment wins."""


NO_LOG_MONITOR = "--include-log-monitor=false"
"""`ray start`'s flag that leaves out the node's log monitor, which Trident does not use (on
every node it starts, head and workers: `service.cluster.raynode`). Ray's log monitor tails every
worker's output files and publishes their lines to the drivers (`log_to_driver`), polling the
node's log directory as long as the node runs: 0.7 % of a core beside a training job of two
ranks, a seventh of what Trident's processes and Ray's take beside its ranks. A rank's output
goes to its rank log instead (its file descriptors are redirected: `workers.runtime.ranklog`), and
the controller, Ray's driver, does not ask for the lines (`service.control.daemon`)."""


NO_AUTOSCALER_MONITOR = "--no-monitor"
"""`ray start`'s flag that leaves out the head's autoscaler monitor (`monitor.py`), on the
embedded default's head (`trident up`): it scales no cluster there (one node, no autoscaling
configuration), and Trident reads nodes and resources from the GCS, not from it. It cost 0.55 %
of a core beside a training job of two ranks, and half a CPU-second at each start. A head of
`trident node start` keeps it: an operator's `ray status` reads what it reports."""


WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}
"""Ray's workers at niceness 0, not Ray's 15: a rank is the job's work, not background work
(`workers.rank.actor.RANK_RUNTIME_ENV`). Set on the Ray that Trident starts and its drivers (the
controller, which then starts its ranks without a runtime environment:
`workers.rank.actor.rank_runtime_env`)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric_ports() -> dict[str, str]:
    """Free ports, in Ray's environment, for the dashboard's and the autoscaler's metrics
    servers, which Ray would put on 44227 and 44217 whatever other Ray runs on the host."""
    return {"DASHBOARD_METRIC_PORT": str(_free_port()),
            "AUTOSCALER_METRIC_PORT": str(_free_port())}


def answers(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def live_head(data_dir: Path) -> str | None:
    """The address of the head recorded under `data_dir`, if it answers there."""
    try:
        address = str(json.loads((data_dir / "ray" / "head.json").read_text())["address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return address if answers(address) else None


def auth_env(token: Path) -> dict[str, str]:
    """The environment of a Ray process (head, node, driver) under Ray's token authentication
    with the token in file `token`, which is made (random, owner-only) if it does not exist.
    `trident node start --head` shares it with `trident up`'s embedded head."""
    if not token.exists():
        token.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


class RayHead:
    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir / "ray"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.dir / "head.json"
        recorded = live_head(data_dir)
        self._adopting = recorded is not None
        self.address = recorded or f"127.0.0.1:{_free_port()}"
        port = self.address.rpartition(":")[2]
        # Free ports for the servers Ray gives a fixed one (the client server 10001, the
        # dashboard agent's HTTP 52365, the metrics servers: `metric_ports`): with Ray's, a
        # second Ray on this host (another stack's) would find them taken.
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                NO_LOG_MONITOR, NO_AUTOSCALER_MONITOR,
                "--disable-usage-stats", f"--ray-client-server-port={_free_port()}",
                f"--dashboard-agent-listen-port={_free_port()}"]
        # Its processes run jobs: without the server's secrets (`service.secrets`).
        self.supervisor = Supervisor(argv, env={**HEALTH_CHECK_ENV,
                                                **without_server_secrets(os.environ),
                                                **self.env(), **metric_ports()},
                                     name="ray head",
                                     log_path=data_dir / "ray-head.log",
                                     running_elsewhere=self._adopted,
                                     on_start=self._record)

    def env(self) -> dict[str, str]:
        """What the head and every driver of it (the controller) need: Ray's token
        authentication, with a token of this data directory's, readable by its owner only,
        and every Ray process on loopback (`LOOPBACK_ENV`), with what Trident does not use
        off (`UNUSED_OFF_ENV`) and its workers at niceness 0 (`WORKER_NICENESS_ENV`)."""
        return {**auth_env(self.dir / "auth_token"), **LOOPBACK_ENV, **UNUSED_OFF_ENV,
                **WORKER_NICENESS_ENV}

    def _record(self, pid: int) -> None:
        # Whole or not at all: a full disk must not leave an empty head.json, which would
        # hide a live head from the next `trident up` (the address is the same every start).
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"address": self.address, "pid": pid}))
        os.replace(tmp, self.state_path)

    def _adopted(self) -> bool:
        """Whether the head to watch is one this `trident up` did not start (and lives)."""
        if not self._adopting:
            return False
        self._adopting = answers(self.address)
        return self._adopting

    def start(self, timeout_s: float = 120.0) -> str:
        """Start (or adopt) the head and wait until it answers; its address."""
        self.supervisor.start()
        deadline = time.monotonic() + timeout_s
        while not answers(self.address):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not answer at {self.address} within"
                                   f" {timeout_s:g} s (log: {self.supervisor.log_path})")
            time.sleep(0.5)
        return self.address

    @property
    def pid(self) -> int | None:
        """The pid of the `ray start --block` this `trident up` started (None: adopted)."""
        return self.supervisor.pid

    @property
    def adopted(self) -> bool:
        return self._adopting

    def stop(self, grace_s: float = 30.0) -> bool:
        """Stop the head (and everything on it), whether this `trident up` started it or
        adopted it: SIGTERM to its `ray start --block`, then SIGKILL to what is left of its
        session once it has ended or `grace_s` is over (a head whose processes are stopped
        or hung ends so too). Returns within `grace_s` and a second or two; whether it
        ended by itself (False: it was killed)."""
        deadline = time.monotonic() + grace_s
        ended = True
        if self._adopting:
            self._adopting = False
            ended = self._stop_adopted(grace_s)
        ended = self.supervisor.stop(max(0.0, deadline - time.monotonic())) and ended
        self.state_path.unlink(missing_ok=True)
        return ended

    def kill(self) -> None:
        """SIGKILL the head's process group now (the one this `trident up` started, or the
        one it adopted)."""
        self.supervisor.kill()
        kill_recorded_head(self.dir.parent)

    def _stop_adopted(self, grace_s: float) -> bool:
        """Whether the adopted head ended by itself within `grace_s` (or was gone)."""
        return _stop_recorded(self.dir.parent, grace_s) is not False


def _recorded_pid(data_dir: Path) -> int | None:
    """The pid of the `ray start --block` recorded under `data_dir` (started by an earlier
    `trident up`, in a session of its own), if that process still runs it."""
    state = data_dir / "ray" / "head.json"
    try:
        recorded = json.loads(state.read_text())
        pid, address = int(recorded["pid"]), str(recorded["address"])
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if b"--block" not in cmd or f"--port={address.rpartition(':')[2]}".encode() not in cmd:
        return None  # the pid was reused
    return pid


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_recorded_head(data_dir: Path) -> None:
    """SIGKILL the session of the head recorded under `data_dir` (its `ray start` led it)."""
    pid = _recorded_pid(data_dir)
    if pid is not None:
        kill_session(pid)


def _stop_recorded(data_dir: Path, grace_s: float) -> bool | None:
    """`stop_recorded_head`'s work: None when no head was running, else whether it ended by
    itself within `grace_s`."""
    pid = _recorded_pid(data_dir)
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    ended = not _running(pid)
    kill_session(pid)
    return ended


def stop_recorded_head(data_dir: Path, grace_s: float = 30.0) -> bool:
    """Stop the head recorded under `data_dir` that is not this process's child (started by
    an earlier `trident up`): SIGTERM to its `ray start --block` process, which stops the
    head's processes, then SIGKILL to what is left of its session once that process has
    ended or `grace_s` is over (its address is not asked: a stopped head's port still takes
    connections). Whether one was running."""
    return _stop_recorded(data_dir, grace_s) is not None
