"""`trident node` and `trident cluster` without starting Ray: the labels a node declares (and
what the controller's inventory reads back from them), the `ray start` command, stopping only
what was recorded, and the jobs per node of `GET /cluster` (the real two-node cluster is in
test_node_ray.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ray._private.label_utils import validate_node_label_syntax
from typer.testing import CliRunner

from cli.main import app
from service.cluster.inventory import parse_topo_matrix
from service.cluster.node_labels import PREFIX, gpu_link, node_facts, node_labels
from service.cluster.raynode import READY, NodeState, keep, read_state, state_path, stop_node
from service.contract.hardware import profile_for_gpu
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from tests.fakes import submit

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent

H100 = "NVIDIA H100 80GB HBM3"


def dgx(n: int = 8, link: str = "NV18") -> dict[str, Any]:
    """The inventory of an n-GPU node whose GPUs all reach each other over `link`."""
    names = [f"GPU{i}" for i in range(n)]
    text = "\t" + "\t".join(names + ["NIC0", "CPU Affinity"]) + "\n" + "".join(
        f"{a}\t" + "\t".join(" X " if a == b else link for b in names) + "\tPIX\t0-55\n"
        for a in names) + "\nLegend:\n"
    gpus = [{"index": i, "name": H100, "memory_bytes": 80 * 2**30} for i in range(n)]
    return {"hostname": "dgx", "cpus": 112, "accelerator": "gpu", "gpu_model": H100,
            "gpus": gpus, "topology": parse_topo_matrix(text)}


def test_a_gpu_node_declares_its_model_memory_profile_and_links() -> None:
    labels = node_labels(dgx())
    validate_node_label_syntax(labels)  # what `ray start --labels` accepts
    assert labels[PREFIX + "accelerator"] == "gpu" and labels[PREFIX + "gpus"] == "8"
    assert labels[PREFIX + "gpu-model"] == "NVIDIA-H100-80GB-HBM3"
    assert labels[PREFIX + "gpu-memory-gib"] == "80"
    assert labels[PREFIX + "gpu-profile"] == "h100-80gb"
    assert labels[PREFIX + "gpu-link"] == "nvlink"
    assert labels[PREFIX + "topo-gpu0"] == "X.NV18.NV18.NV18.NV18.NV18.NV18.NV18"
    # The controller's inventory of a node whose nvidia-smi gave no matrix: the labels'.
    facts = node_facts({**dgx(), "topology": None}, {**labels, "ray.io/node-id": "x"})
    assert facts["topology"] == {g: {h: v for h, v in row.items() if h.startswith("GPU")}
                                 for g, row in dgx()["topology"].items() if g != "NIC0"}
    assert facts["profile"] == "h100-80gb" and facts["gpu_link"] == "nvlink"
    assert "ray.io/node-id" not in facts["labels"]
    # Operator's override (fake GPUs in tests, a GPU no profile describes).
    assert node_labels(dgx(), "a100-80gb")[PREFIX + "gpu-profile"] == "a100-80gb"


def test_links_profiles_and_cpu_nodes() -> None:
    assert gpu_link(dgx(4, "PIX")["topology"]) == "pcie"
    mixed = dgx(2)["topology"]
    mixed["GPU0"]["GPU1"] = "SYS"
    assert gpu_link(mixed) == "mixed" and gpu_link(dgx(1)["topology"]) == "none"
    assert gpu_link(None) == "none"
    labels = node_labels(dgx(16))  # 16 GPUs: a row is longer than a label value may be
    validate_node_label_syntax(labels)
    assert not any("topo-" in k for k in labels) and labels[PREFIX + "gpu-link"] == "nvlink"
    cpu = node_labels({"hostname": "h", "cpus": 2, "accelerator": "cpu", "gpus": []})
    assert cpu == {PREFIX + "accelerator": "cpu", PREFIX + "gpus": "0",
                   PREFIX + "gpu-profile": "cpu"}
    assert node_facts({"accelerator": "cpu", "gpus": []}, None)["profile"] == "cpu"
    assert [profile_for_gpu(n, m * 2**30) for n, m in [
        ("NVIDIA A100-SXM4-40GB", 40), ("NVIDIA A100-SXM4-80GB", 80), ("NVIDIA H200", 141),
        ("Tesla V100-SXM2-32GB", 32), ("Tesla V100-SXM2-16GB", 16), ("NVIDIA L4", 24)]] == [
        "a100-40gb", "a100-80gb", "h200", "v100-32gb", None, None]


def test_node_start_dry_run_prints_the_labels_and_ray_start(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("service.cluster.inventory.node_inventory", lambda: dgx(2))
    r = runner.invoke(app, ["node", "start", "--head", "--port", "7001", "--num-cpus", "3",
                            "--data-dir", str(tmp_path), "--dry-run"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    argv = out["argv"]
    assert argv[3:5] == ["start", "--block"] and "--head" in argv and "--port=7001" in argv
    assert "--num-cpus=3" in argv and "--num-gpus=2" in argv  # GPUs: those detected
    labels = next(a for a in argv if a.startswith("--labels="))
    assert "trident.io/gpu-profile=h100-80gb" in labels and "topo-gpu1=NV18.X" in labels
    r = runner.invoke(app, ["node", "start", "--address", "10.0.0.1:6379", "--num-gpus", "0",
                            "--gpu-profile", "cpu", "--temp-dir", "/tmp/t", "--dry-run"])
    argv = json.loads(r.output)["argv"]
    assert "--address=10.0.0.1:6379" in argv and "--num-gpus=0" in argv
    assert "--temp-dir=/tmp/t" in argv and "--head" not in argv
    assert not list(tmp_path.iterdir())  # a dry run starts and writes nothing

    for args, message in [([], "either --head or --address"),
                          (["--head", "--address", "h:1"], "either --head or --address"),
                          (["--head", "--gpu-profile", "tpu"], "unknown hardware profile"),
                          (["--address", "h:1", "--auth-token-file", str(tmp_path / "no")],
                           "does not exist")]:
        r = runner.invoke(app, ["node", "start", "--data-dir", str(tmp_path), *args])
        assert r.exit_code == 2 and message in r.output, (args, r.output)


def test_node_stop_stops_only_what_it_recorded(tmp_path: Path) -> None:
    r = runner.invoke(app, ["node", "stop", "--data-dir", str(tmp_path)])
    assert r.exit_code == 1 and "no node started from" in r.output
    # A recorded pid that is no `ray start --block` (reused by another process: here this
    # test's own) is left alone, and the stale record removed.
    state_path(tmp_path).parent.mkdir(parents=True)
    state_path(tmp_path).write_text(json.dumps(NodeState(
        pid=os.getpid(), role="head", address="127.0.0.1:1", log="x", temp_dir=None,
        argv=[]).__dict__))
    assert read_state(tmp_path) is not None
    assert stop_node(tmp_path, grace_s=1) is None
    assert read_state(tmp_path) is None and not state_path(tmp_path).exists()


def _fake_ray(tmp_path: Path, *, ready: bool, code: int) -> list[str]:
    """A stand-in for `ray start --block` (which needs a head to join): says `READY` or not,
    counts its runs in a file (replaced whole, so that a reader never sees it half written),
    exits with `code`."""
    script = tmp_path / "fake_ray.py"
    script.write_text(
        "import os, pathlib, sys\n"
        f"runs = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "new = runs.with_suffix('.new')\n"
        "new.write_text(str(int(runs.read_text()) + 1) if runs.exists() else '1')\n"
        "os.replace(new, runs)\n"
        + (f"print({READY!r}, flush=True)\n" if ready else "")
        + f"sys.exit({code})\n")
    return [sys.executable, str(script), "start", "--block"]


def test_the_node_keeper_starts_ray_again_when_it_ends_after_it_ran(tmp_path: Path) -> None:
    """A node marked dead (its raylet exits) or whose head restarted joins again by itself;
    SIGTERM stops the keeper and what it runs."""
    log = tmp_path / "node.log"
    keeper = subprocess.Popen([sys.executable, "-c",
                               "import sys; from pathlib import Path;"
                               " from service.cluster.raynode import keep;"
                               " sys.exit(keep(sys.argv[2:], Path(sys.argv[1]),"
                               " backoff_min_s=0.05, backoff_max_s=0.1))",
                               str(log), *_fake_ray(tmp_path, ready=True, code=1)],
                              cwd=ROOT)
    try:
        # Three starts said READY in the keeper's log (a run counts itself before it says it,
        # so the count of runs alone may lead the log).
        deadline = time.monotonic() + 60
        while (log.read_text() if log.exists() else "").count(READY) < 3:
            assert keeper.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(30)
    text = log.read_text()
    assert int((tmp_path / "runs").read_text()) >= 3
    assert "ray exited with status 1" in text and "starting it again" in text


def test_a_node_that_never_joined_is_not_started_again(tmp_path: Path) -> None:
    """A first start that fails before Ray says it runs (a wrong address or token) ends the
    keeper with its status: an error to show, not to retry."""
    log = tmp_path / "node.log"
    assert keep(_fake_ray(tmp_path, ready=False, code=7), log, backoff_min_s=0.05) == 7
    assert (tmp_path / "runs").read_text() == "1" and "starting it again" not in log.read_text()


def test_cluster_shows_the_jobs_on_each_node(server: str, tmp_path: Path) -> None:  # noqa: F811
    store = Store(Settings(data_dir=tmp_path).db_url)
    store.upsert_nodes(nodes=[
        {"node_id": "a" * 56, "hostname": "gpu-1", **dgx(), **node_facts(dgx(), node_labels(
            dgx())), "resources": {"CPU": 112.0, "GPU": 8.0}},
        {"node_id": "b" * 56, "hostname": "cpu-1", "accelerator": "cpu", "cpus": 4,
         "profile": "cpu", "resources": {"CPU": 4.0}}])
    job_id = submit(store)
    store.transition(job_id=job_id, to=JobState.PLACING, message="t")
    store.start_attempt(job_id=job_id)
    store.set_placement(job_id=job_id, number=1, placement={"ranks": [
        {"rank": 0, "node_id": "a" * 56}, {"rank": 1, "node_id": "b" * 56},
        {"rank": 2, "node_id": "b" * 56}]})
    r = runner.invoke(app, ["cluster", "--server", server, "-o", "json"])
    assert r.exit_code == 0, r.output
    jobs = json.loads(r.output)["jobs"]
    assert jobs["b" * 56] == [{"job_id": job_id, "name": "tiny", "owner": "local",
                               "state": "PLACING", "attempt": 1, "ranks": [1, 2]}]
    r = runner.invoke(app, ["cluster", "--server", server])
    lines = r.output.splitlines()
    assert lines[0].split() == ["NODE", "HOST", "STATE", "CPU", "GPU", "HARDWARE", "LINK",
                                "JOBS"]
    assert "8 x NVIDIA H100 80GB HBM3" in lines[1] and "nvlink" in lines[1]
    assert lines[1].endswith(f"{job_id}[r0]") and lines[2].endswith(f"{job_id}[r1-2]")
    assert "CPU, 4 cores (cpu)" in lines[2]
    store.close()


def test_probe_prints_what_it_measured_and_the_profile_it_calibrated(
        server: str, tmp_path: Path) -> None:  # noqa: F811
    """`trident probe` against the API, its probe finished as the controller would: the
    ranks, FLOP/s, link bandwidth, each row, and the profile; a failed probe is one line."""
    import threading
    import time

    from service.contract.hardware import PROFILES
    from service.store import ProbeStatus

    store = Store(Settings(data_dir=tmp_path).db_url)

    def controller(status: ProbeStatus) -> None:
        deadline = time.monotonic() + 60
        while not (claimed := store.claim_probes(scope="cluster")):
            assert time.monotonic() < deadline, "no probe requested"
            time.sleep(0.05)
        store.finish_probe(
            probe_id=claimed[0].id, status=status,
            results=[{"dim": "world", "op": "all_reduce", "group": [0, 1], "bytes": 1 << 20,
                      "time_s": 4e-4, "algbw": 2.5e9, "busbw": 2.5e9,
                      "expected_busbw": 5e9, "ratio": 0.5}],
            summary={"profile": PROFILES["cpu"].to_json(), "matmul_flops": {"fp32": 1.5e12},
                     "links": {"intra_node_bw": 2.5e9, "inter_node_bw": None},
                     "ranks": 2, "nodes": 1} if status == ProbeStatus.DONE else {},
            error=None if status == ProbeStatus.DONE else "rank 1 died")

    try:
        for status in (ProbeStatus.DONE, ProbeStatus.FAILED):
            t = threading.Thread(target=controller, args=(status,), daemon=True)
            t.start()
            r = runner.invoke(app, ["probe", "--server", server, "--ranks-per-node", "1",
                                    "--timeout", "60"])
            t.join(10)
            if status == ProbeStatus.DONE:
                assert r.exit_code == 0, r.output
                assert r.stdout.splitlines() == [
                    "probe 1 requested; waiting for the controller",
                    "2 ranks on 1 node(s)",
                    "  matmul fp32: 1.500 TFLOP/s per rank",
                    "  intra_node_bw: 2.50 GB/s (all-reduce busbw)",
                    "  op             group           bytes  busbw GB/s",
                    "  all_reduce     [0, 1]        1048576       2.500",
                    "profile 'cpu' calibrated; new plans on this cluster use it"]
            else:
                assert r.exit_code == 1 and r.stderr == "error: probe 2 failed: rank 1 died\n"
    finally:
        store.close()
