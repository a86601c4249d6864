"""A Ray cluster of two real `ray start` nodes on this machine, each started by `trident node
start` (its own port, temp dir and data dir; one CPU and no GPU each), `trident up
--ray-address` at the head, a job whose two ranks land one on each node (shown on both by
`trident cluster`), and `trident node stop` of each, which stops only what it started."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from cli.main import app
from service.cluster.raynode import alive, read_state
from tests.conftest import tiny_spec
from tests.servers import HTTP, free_port
from tests.up import Up
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def node(*args: str) -> subprocess.CompletedProcess[str]:
    """`trident node ...` as a user runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "cli.main", "node", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)


def processes_under(path: str) -> list[str]:
    """Command lines of this machine's processes that mention `path` (a node's temp dir)."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if path in cmd:
            out.append(f"{pid}: {cmd[:200]}")
    return out


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short directory for the nodes' Ray temp dirs (their socket paths must stay short)."""
    path = tempfile.mkdtemp(prefix="trn-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_job_runs_across_two_nodes_started_by_trident_node(
        tmp_path: Path, short_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    head_dir, worker_dir = tmp_path / "head", tmp_path / "worker"
    common = ["--num-cpus", "1", "--num-gpus", "0", "--node-ip-address", "127.0.0.1"]
    token = head_dir / "ray" / "auth_token"
    up = None
    started: list = []
    try:
        r = node("start", "--head", "--port", str(port), "--temp-dir", f"{short_dir}/h",
                 "--data-dir", str(head_dir), *common)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"trident up --ray-address 127.0.0.1:{port}" in r.stdout
        assert "listening on every interface" in r.stdout  # what the other hosts need
        gcs = [c.laddr.ip for c in psutil.net_connections(kind="inet")
               if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert gcs and not any(ip.startswith(("127.", "::ffff:127.")) for ip in gcs), gcs
        assert token.exists() and token.stat().st_mode & 0o077 == 0
        r = node("start", "--address", f"127.0.0.1:{port}", "--temp-dir", f"{short_dir}/w",
                 "--data-dir", str(worker_dir), "--auth-token-file", str(token), *common)
        assert r.returncode == 0, r.stdout + r.stderr
        started = [read_state(d) for d in (head_dir, worker_dir)]
        assert all(s is not None for s in started)

        (tmp_path / "up").mkdir()
        up = Up(tmp_path / "up", free_port(), {
            "TRIDENT_RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token), "TRIDENT_ALLOW_FAULTS": "1",
            "TRIDENT_LIGHT_RANKS": "1",
            "PYTHONPATH": str(ROOT)})
        up.wait_healthy()
        u = up  # for the closures below
        wait_for("two nodes in the inventory", lambda: len(
            [n for n in u.get("/cluster")["nodes"] if n["alive"]]) == 2, 120, u.log)
        nodes = u.get("/cluster")["nodes"]
        for n in nodes:  # what `trident node start` declared, read back by the inventory
            assert n["info"]["labels"] == {"accelerator": "cpu", "gpus": "0",
                                           "gpu-profile": "cpu"}, n["info"]
            assert n["info"]["profile"] == "cpu" and n["info"]["resources"]["CPU"] == 1.0

        # One CPU per rank and per node: rank 0 on one node, rank 1 on the other.
        spec = tiny_spec(program="light", train={"steps": 30, "global_batch": 8,
                                                 "micro_batch": 2, "precision": "fp32"},
                         monitor={"probe": False},
                         resources={"gpus_per_worker": 0, "cpus_per_worker": 1},
                         faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}])
        res = HTTP.post(f"{u.server}/api/v1/jobs", json=spec, headers=u.auth, timeout=30)
        assert res.status_code == 201, res.text
        job_id = res.json()["id"]
        wait_for("training", lambda: any(m["step"] >= 2 for m in u.get(
            f"/jobs/{job_id}/metrics", rank=1)["items"]), 300, u.log)

        monkeypatch.setenv("TRIDENT_TOKEN", (tmp_path / "up" / "admin.token").read_text())
        shown = runner.invoke(app, ["cluster", "--server", u.server])
        assert shown.exit_code == 0, shown.output
        lines = shown.output.splitlines()[1:3]
        assert sorted(line.rsplit(" ", 1)[1] for line in lines) == [
            f"{job_id}[r0]", f"{job_id}[r1]"], shown.output

        wait_for("SUCCEEDED", lambda: u.get(f"/jobs/{job_id}")["state"] in (
            "SUCCEEDED", "FAILED"), 300, u.log)
        job = u.get(f"/jobs/{job_id}")
        assert job["state"] == "SUCCEEDED", (job["error"], u.log())
        ranks = u.get(f"/jobs/{job_id}/attempts")["items"][0]["placement"]["ranks"]
        assert {r["node_id"] for r in ranks} == {n["node_id"] for n in nodes}
    finally:
        if up is not None:
            up.stop()
        stops = [node("stop", "--data-dir", str(d)) for d in (worker_dir, head_dir)]
    for r in stops:
        assert r.returncode == 0 and "node stopped" in r.stdout, r.stdout + r.stderr
    for s in started:  # gone (or a zombie, where this machine's init reaps none)
        assert s is not None and not alive(s)
    assert processes_under(short_dir) == []
    assert read_state(head_dir) is None and read_state(worker_dir) is None
