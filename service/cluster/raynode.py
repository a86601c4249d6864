"""`trident node start|stop`: a Ray node of this host, started the way Trident needs it.

`start` runs `ray start --block` (head, or a worker joining `--address`) under a keeper
(`keep`), a process of its own session, so that it outlives the command, with the node's labels
(`service.cluster.node_labels`),
its CPUs and GPUs, and Ray's token authentication (`service.cluster.rayhead.auth_env`). It listens
on every interface of the host: that is how the other hosts reach it, and starting a node with it
is how a cluster of several hosts opts in (`trident up`'s own head is on loopback only:
`service.cluster.rayhead.LOOPBACK_ENV`; Ray replaces a loopback `--node-ip-address` here by the
host's address, so that the others can join). It waits until Ray says the node runs and
records what it started in `<data_dir>/node/state.json`: the keeper's pid (also its process
group), the address, the temp dir and the log. `stop` stops that node and nothing else:
SIGTERM to the recorded keeper (which stops `ray start --block`, which stops the node's
processes), then SIGKILL to what is left of its process group after the grace. It never runs
`ray stop`, which would stop every Ray node of the host, other people's too.

The keeper starts `ray start --block` again whenever it ends after it ran (with a backoff from
1 s to 30 s), so that a host rejoins by itself: a node cut off from the head for longer than
the head's health checks allow (`service.cluster.rayhead.HEALTH_CHECK_ENV`) is marked dead, and
its raylet, once it hears so, exits (Ray never takes a dead node back); a worker whose head
restarted loses its raylet too. Without the keeper the host would stay out until someone ran
`trident node start` again. A first start that fails before Ray says the node runs ends the
keeper with its status (a wrong address or token is an error to show, not to retry).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from service.cluster.rayhead import NO_LOG_MONITOR

READY = "Ray runtime started"
"""What `ray start` prints once the node runs (head or worker)."""


@dataclass
class NodeState:
    """What `trident node start` started on this host (`<data_dir>/node/state.json`)."""

    pid: int
    role: str
    """`head` or `worker`."""
    address: str
    """The head's GCS address (the one to join, and `trident up --ray-address`)."""
    log: str
    temp_dir: str | None
    argv: list[str]


def host_ip() -> str:
    """This host's address as other hosts reach it, as Ray finds it (the source address of
    the route to a public address; no packet is sent), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def state_path(data_dir: Path) -> Path:
    return data_dir / "node" / "state.json"


def read_state(data_dir: Path) -> NodeState | None:
    try:
        return NodeState(**json.loads(state_path(data_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


KEEPER = "service.cluster.raynode"
"""The module whose `keep` runs `ray start --block` for `trident node start`."""


def alive(state: NodeState) -> bool:
    """Whether the recorded keeper of `ray start --block` still runs (and its pid was not
    reused)."""
    try:
        cmd = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return KEEPER.encode() in cmd[:3] and b"--block" in cmd and b"start" in cmd


def keep(argv: list[str], log_path: Path, *, backoff_min_s: float = 1.0,
         backoff_max_s: float = 30.0, stable_s: float = 60.0) -> int:
    """Run `argv` (`ray start --block`), its output appended to `log_path`, and run it again
    whenever it ends, until SIGTERM or SIGINT (passed on to it; then its status). The backoff
    doubles from `backoff_min_s` to `backoff_max_s` and starts over once a run lasted
    `stable_s`. A first run that ends before `READY` is in its output ends the keeper with
    its status."""
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    backoff, runs = backoff_min_s, 0
    while True:
        offset = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as out:
            # The keeper's own process group: `stop_node`'s SIGKILL reaches it all.
            child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        runs += 1
        began = time.monotonic()
        code = child.wait()
        ran = time.monotonic() - began
        if stopping:
            return code
        with log_path.open("rb") as out_read:
            out_read.seek(offset)
            was_ready = READY.encode() in out_read.read()
        if runs == 1 and not was_ready:
            return code or 1
        backoff = backoff_min_s if ran >= stable_s else backoff
        with log_path.open("a") as f:
            f.write(f"\ntrident node: ray exited with status {code} after {ran:.0f} s;"
                    f" starting it again (joining the cluster) in {backoff:g} s\n")
        deadline = time.monotonic() + backoff
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.2)
        if stopping:
            return code
        backoff = min(backoff * 2, backoff_max_s)


START_WAIT_ENV = {"RAY_raylet_start_wait_time_s": "120"}
"""How long `ray start` waits for its raylet to register with the GCS: 120 s, not Ray's 30.
On a loaded host (a node joining while the head's host trains) registration took longer than
30 s, and `ray start` then gave up on a node that would have come up. An operator's own
setting in the environment wins; `trident node start --timeout` still bounds the whole start."""


def ray_start_argv(*, head: bool, address: str, num_cpus: int, num_gpus: int,
                   labels: dict[str, str], node_ip: str | None, temp_dir: str | None
                   ) -> list[str]:
    """`ray start --block` for this node: the head listens on `address`'s port; a worker
    joins the head at `address`."""
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", "--disable-usage-stats",
            NO_LOG_MONITOR,
            "--labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))]
    if head:
        argv += ["--head", f"--port={address.rpartition(':')[2]}", "--include-dashboard=false"]
    else:
        argv.append(f"--address={address}")
    if node_ip:
        argv.append(f"--node-ip-address={node_ip}")
    if temp_dir:
        argv.append(f"--temp-dir={temp_dir}")
    return argv


def start_node(data_dir: Path, *, role: str, address: str, argv: list[str],
               env: dict[str, str], temp_dir: str | None, timeout_s: float) -> NodeState:
    """Start the node and wait until Ray says it runs; RuntimeError (with the log's tail)
    when it exits first or takes longer than `timeout_s`."""
    known = read_state(data_dir)
    if known is not None and alive(known):
        raise RuntimeError(f"a node started from {data_dir} still runs (pid {known.pid}, "
                           f"{known.role} of {known.address}): `trident node stop` it first")
    log_path = data_dir / "node" / "ray-node.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_bytes(b"")
    keeper = [sys.executable, "-m", KEEPER, str(log_path), *argv]
    with log_path.open("ab") as out:  # what the keeper itself says before it runs
        proc = subprocess.Popen(keeper, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    state = NodeState(pid=proc.pid, role=role, address=address, log=str(log_path),
                      temp_dir=temp_dir, argv=argv)
    state_path(data_dir).write_text(json.dumps(asdict(state)))
    deadline = time.monotonic() + timeout_s
    while READY not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (f"exited with status {proc.returncode}" if proc.returncode is not None
                   else f"did not start within {timeout_s:g} s")
            stop_node(data_dir, grace_s=10)
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"ray start {why} (log {log_path}):\n{tail}")
        time.sleep(0.2)
    return state


def stop_node(data_dir: Path, grace_s: float = 30.0) -> NodeState | None:
    """Stop the node recorded under `data_dir` (and only it); the state of the node stopped,
    or None when none was recorded or it no longer ran."""
    state = read_state(data_dir)
    if state is None:
        return None
    running = alive(state)
    if running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while alive(state) and time.monotonic() < deadline:
            time.sleep(0.2)
        # The keeper, `ray start --block` and the node's processes are one process group
        # (the session `start_node` gave the keeper): what outlived the grace is ours to kill.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(state.pid, signal.SIGKILL)
    state_path(data_dir).unlink(missing_ok=True)
    return state if running else None


if __name__ == "__main__":  # the keeper: python -m service.cluster.raynode LOG ARGV...
    sys.exit(keep(sys.argv[2:], Path(sys.argv[1])))
