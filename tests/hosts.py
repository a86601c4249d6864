"""Several hosts on this machine: network namespaces on a bridge, each a Ray node of its own.

`Hosts` makes one private /24 on a bridge of its own (`10.213.X.0/24`, X free on this machine;
the bridge holds `.1`), the cluster's head on the bridge's address in this (the root)
namespace, and each host a network namespace with its own address (`.11`, `.12`, ...) on a
veth pair into the bridge, running `trident node start --address HEAD` as an operator runs it
there, with the head's token (`--node-ip-address` its own address). The namespaces get no
default route: their traffic reaches the bridge's /24 and nothing else. What a test then
does to a host is what happens to one in a data centre:

- `kill(host)`: every process in its namespace killed at once (a power-off);
- `partition(host)` / `heal(host)`: its link down (the bridge's end of its veth), then up;
- `slow(host, rate)`: its link limited to `rate` both ways (`tc ... tbf`; this kernel has no
  `netem`, so a delay cannot be added, only a rate limit and the queueing it makes);
- `add()`: one more host (a spare joining).

Everything is torn down on `close()` (a context manager), also when the test fails: every
process in the namespaces, the namespaces, the veths, the bridge, the head. It needs root
(CI runs as root); `available()` says whether this machine can make hosts, and why not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.servers import HTTP, free_port
from tests.up import Up
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
SUBNET_PREFIX = "10.213"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def available() -> str | None:
    """None when this machine can make hosts (root, `ip`, network namespaces), else why not."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) is not installed"
    name = f"trprobe{secrets.token_hex(3)}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet() -> str:
    """A `10.213.X` no interface of this machine has an address in."""
    used = _ip("-o", "-4", "addr").stdout
    free = [x for x in range(1, 255) if f" {SUBNET_PREFIX}.{x}." not in used]
    return f"{SUBNET_PREFIX}.{random.choice(free)}"


def sweep() -> list[str]:
    """Remove what a harness killed before its teardown left (its namespaces, the processes
    in them, its links); called holding the lock, so none of it is another harness's. The
    names removed."""
    gone = []
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith("trh-"):
            continue
        for pid in _ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name, check=False)
        gone.append(name)
    for line in _ip("-o", "link").stdout.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if name.startswith(("trb", "tv")) and len(name) >= 9:
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


@dataclass
class Host:
    """One host: its namespace, its address, its end of the bridge and its node's data dir."""

    index: int
    netns: str
    address: str
    link: str
    """The bridge's end of the host's veth (down: the host is cut off)."""
    inner: str
    """The host's own end of its veth, inside its namespace."""
    data_dir: Path
    temp_dir: str
    node_log: str = ""
    alive: bool = True
    cut_joins: int | None = None
    """While the host is (or was) cut off: how many times its node had joined before, so that
    its joining again (its keeper restarts Ray once the head has marked it dead) is seen."""

    def joins(self) -> int:
        """How many times the host's node has said it runs (`trident node start`'s keeper
        starts Ray again after it ends: each start that joined says so once)."""
        from service.cluster.raynode import READY

        try:
            return Path(self.node_log).read_text(errors="replace").count(READY)
        except OSError:
            return 0

    def pids(self) -> list[int]:
        r = _ip("netns", "pids", self.netns, check=False)
        return [int(p) for p in r.stdout.split()]


@dataclass
class Hosts:
    """A head on a bridge and hosts in network namespaces, each a `trident node start` node."""

    root: Path
    cpus_per_host: int = 2
    head_cpus: int = 0
    env: dict[str, str] = field(default_factory=dict)
    """Added to the environment of every node (head and hosts) and of the test's driver."""
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.id = secrets.token_hex(3)
        self.subnet = _free_subnet()
        self.head_ip = f"{self.subnet}.1"
        self.bridge = f"trb{self.id}"
        self.port = 6379
        self.short = tempfile.mkdtemp(prefix="trh-", dir="/tmp")
        self.head_dir = self.root / "head"
        self.token = self.head_dir / "ray" / "auth_token"

    @property
    def address(self) -> str:
        """The head's GCS address (what `trident up --ray-address` and the hosts join)."""
        return f"{self.head_ip}:{self.port}"

    @property
    def driver_env(self) -> dict[str, str]:
        """The environment of a driver of this cluster (the controller): its token."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token), **self.env}

    def __enter__(self) -> Hosts:
        # One cluster of hosts at a time on this machine (two test processes may each want
        # one): each is several Ray nodes, and the machine has few cores.
        self._lock = open("/tmp/trident-hosts.lock", "w")  # noqa: SIM115
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        sweep()
        try:
            self._bridge_up()
            self._start_head()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bridge_up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _node(self, *args: str, netns: str | None = None,
              timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """`trident node ...` as an operator runs it on a host (in its namespace)."""
        argv = [sys.executable, "-m", "cli.main", "node", *args]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **self.env})

    def _start_head(self) -> None:
        """The head as `trident node start --head` starts it (`service.cluster.raynode`), on
        the bridge's address, but with free ports for the servers Ray gives a fixed one (its
        client server, 10001, and the dashboard agent's HTTP, 52365), which other Rays of
        this machine's tests may hold in this namespace."""
        from service.cluster.rayhead import HEALTH_CHECK_ENV, auth_env, metric_ports
        from service.cluster.raynode import (
                        START_WAIT_ENV,
            ray_start_argv,
            start_node,
        )
        self.port = free_port()
        argv = ray_start_argv(head=True, address=self.address, num_cpus=self.head_cpus,
                              num_gpus=0, labels={"trident.io/accelerator": "cpu"},
                              node_ip=self.head_ip, temp_dir=f"{self.short}/head")
        argv += [f"--ray-client-server-port={free_port()}",
                 f"--dashboard-agent-listen-port={free_port()}"]
        env = {**START_WAIT_ENV, **HEALTH_CHECK_ENV, **os.environ, **metric_ports(),
               **self.env, **auth_env(self.token)}
        start_node(self.head_dir, role="head", address=self.address, argv=argv, env=env,
                   temp_dir=f"{self.short}/head", timeout_s=180)

    def add(self, cpus: int | None = None) -> Host:
        """One more host, joined to the head; returns once its node runs."""
        i = len(self.hosts) + 1
        host = Host(index=i, netns=f"trh-{self.id}-{i}", address=f"{self.subnet}.{10 + i}",
                    link=f"tv{self.id}{i}", inner=f"tv{self.id}{i}p",
                    data_dir=self.root / f"host{i}", temp_dir=f"{self.short}/h{i}")
        self.hosts.append(host)
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", host.inner)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        _ip("link", "set", host.inner, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.inner)
        _ip("-n", host.netns, "link", "set", host.inner, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        self.start_node(host, cpus)
        return host

    def start_node(self, host: Host, cpus: int | None = None) -> None:
        """`trident node start` on `host`, joining the head (again, after a power-off)."""
        r = self._node("start", "--address", self.address, "--auth-token-file",
                       str(self.token), "--node-ip-address", host.address, "--num-cpus",
                       str(self.cpus_per_host if cpus is None else cpus), "--num-gpus", "0",
                       "--temp-dir", host.temp_dir, "--data-dir", str(host.data_dir),
                       netns=host.netns)
        if r.returncode != 0:
            raise RuntimeError(f"host {host.index} did not join: {r.stdout}{r.stderr}")
        host.node_log = str(host.data_dir / "node" / "ray-node.log")
        host.alive = True

    def kill(self, host: Host) -> float:
        """Power `host` off: SIGKILL every process in its namespace at once; the time it
        happened (`time.time()`)."""
        pids = host.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        host.alive = False
        return time.time()

    def partition(self, host: Host) -> float:
        """Cut `host` off the network (its link down); when it happened."""
        if host.cut_joins is None:
            host.cut_joins = host.joins()
        _ip("link", "set", host.link, "down")
        return time.time()

    def heal(self, host: Host) -> float:
        _ip("link", "set", host.link, "up")
        return time.time()

    def slow(self, host: Host, rate: str = "8mbit") -> None:
        """Limit `host`'s link to `rate` each way (a token bucket on both ends of its veth)."""
        for args in (["tc", "qdisc", "replace", "dev", host.link],
                     ["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev",
                      host.inner]):
            subprocess.run([*args, "root", "tbf", "rate", rate, "burst", "32kbit",
                            "latency", "400ms"], check=True, capture_output=True, timeout=30)

    def unslow(self, host: Host) -> None:
        """Lift `slow`'s limit from both ends of `host`'s veth."""
        for args in (["tc", "qdisc", "del", "dev", host.link, "root"],
                     ["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev",
                      host.inner, "root"]):
            subprocess.run(args, check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        """Tear everything down, whatever state it is in."""
        for host in self.hosts:
            if host.alive:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self._node("stop", "--data-dir", str(host.data_dir), "--grace", "5",
                               netns=host.netns, timeout_s=60)
            self.kill(host)
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.link, check=False)
        from service.cluster.raynode import stop_node

        stop_node(self.head_dir, grace_s=5)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.short, ignore_errors=True)
        if getattr(self, "_lock", None) is not None:
            self._lock.close()
            self._lock = None


@contextlib.contextmanager
def up_on_hosts(root: Path, n: int, env: dict[str, str] | None = None
                ) -> Iterator[tuple[Hosts, Up]]:
    """`n` hosts, and `trident up --ray-address` on the head's host driving them (faults and
    light ranks allowed), once its inventory has every host; `env` added to every node's
    environment (the head's: after Trident's settings, which it can override)."""
    with Hosts(root / "hosts", env=dict(env or {})) as cluster:
        for _ in range(n):
            cluster.add()
        (root / "up").mkdir()
        up = Up(root / "up", free_port(), {"TRIDENT_RAY_ADDRESS": cluster.address,
                                          "TRIDENT_ALLOW_FAULTS": "1",
                                          "TRIDENT_LIGHT_RANKS": "1",
                                          "PYTHONPATH": str(ROOT), **cluster.driver_env})
        try:
            up.wait_healthy()
            all_joined(cluster, up)
            yield cluster, up
        finally:
            up.stop()


def all_joined(cluster: Hosts, up: Up, timeout_s: float = 120) -> None:
    """Until every host's node runs and the control plane's inventory says so: a host back
    on the network after the head marked it dead joins again (its keeper restarts Ray)
    within seconds, a host powered on again has joined once `start_node` returns; the
    inventory (which the API's placement check reads) follows within its survey period.
    Then it lists one live node at each host's address and the head, and no other."""
    for host in cluster.hosts:
        if host.cut_joins is None:
            continue
        before = host.cut_joins
        wait_for(f"host {host.address} joined again", lambda h=host, n=before: h.joins() > n,
                 timeout_s, up.log)
        host.cut_joins = None
    want = sorted([cluster.head_ip, *(h.address for h in cluster.hosts)])

    def listed() -> bool:
        nodes = up.get("/cluster")["nodes"]
        return sorted(n["info"].get("address") for n in nodes if n["alive"]) == want
    wait_for("every host in the inventory", listed, timeout_s, up.log)


# What the tests on hosts read of a job, through the REST API of `up_on_hosts`' stack.

def submit(up: Up, spec: dict[str, Any]) -> int:
    r = HTTP.post(f"{up.server}/api/v1/jobs", json=spec, headers=up.auth, timeout=30)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def finish(up: Up, job_id: int, timeout_s: float = 600) -> dict[str, Any]:
    wait_for(f"job {job_id} finished", lambda: up.get(f"/jobs/{job_id}")["state"] in (
        "SUCCEEDED", "FAILED", "CANCELLED"), timeout_s, up.log)
    return dict(up.get(f"/jobs/{job_id}"))


def steps(up: Up, job_id: int, attempt: int | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {} if attempt is None else {"attempt": attempt}
    return list(up.get(f"/jobs/{job_id}/metrics", **params)["items"])


def dp_job(name: str, dp: int, *, steps: int = 60, every: int = 3,
           **over: Any) -> dict[str, Any]:
    """A tiny GPT job of `steps` steps with one rank a host (1.5 of a host's 2 CPUs, `dp`
    ranks), a checkpoint every `every` steps, no probe: what the host drills run."""
    from tests.conftest import tiny_spec

    return tiny_spec(
        name=name, max_retries=2, checkpoint={"every_steps": every},
        parallel={"tp": 1, "pp": 1, "dp": dp, "zero": 2},
        train={"steps": steps, "global_batch": 12, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False}, resources={"gpus_per_worker": 0, "cpus_per_worker": 1.5},
        **over)


def events(up: Up, job_id: int, kind: str) -> list[dict[str, Any]]:
    """A job's events of one kind, oldest first."""
    return [e for e in up.get(f"/jobs/{job_id}/events", limit=1000)["items"]
            if e["kind"] == kind]


def stored_once(items: list[dict[str, Any]], total: int) -> dict[int, list[int]]:
    """Each attempt's steps (rank 0's), checked: no step stored twice by one attempt, each
    attempt's steps one run without a gap, and the job's history (a step's newest values:
    a resumed attempt redoes the steps after its checkpoint) every step from 1 to `total`."""
    by_attempt: dict[int, list[int]] = {}
    for m in items:
        by_attempt.setdefault(m["attempt"], []).append(m["step"])
    for got in by_attempt.values():
        assert got == list(range(got[0], got[0] + len(got))), by_attempt
    newest = {step: a for a, got in sorted(by_attempt.items()) for step in got}
    assert sorted(newest) == list(range(1, total + 1)), by_attempt
    return by_attempt


def attempts(up: Up, job_id: int) -> list[dict[str, Any]]:
    return list(up.get(f"/jobs/{job_id}/attempts")["items"])


