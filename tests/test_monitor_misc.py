"""Heartbeat, NCCL environment and node inventory (single process, no torch.distributed)."""

import threading
import time

from service.cluster.inventory import node_inventory, parse_topo_matrix
from workers.runtime.heartbeat import Heartbeat, dump_stacks
from workers.runtime.nccl_env import pg_timeout, rank_env

TOPO = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tSYS\tPIX\t0-55\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\tSYS\t0-55\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \tSYS\t56-111\t1\t\tN/A\n"
    "NIC0\tPIX\tSYS\tSYS\t X \n\n"
    "Legend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP\n"
)


def test_parse_topo_matrix():
    m = parse_topo_matrix(TOPO)
    assert set(m) == {"GPU0", "GPU1", "GPU2", "NIC0"}
    assert m["GPU0"]["GPU1"] == "NV18"
    assert m["GPU0"]["GPU2"] == "SYS"
    assert m["GPU1"]["GPU1"] == "X"
    assert m["GPU0"]["NIC0"] == "PIX"
    assert "CPU Affinity" not in m["GPU0"]


def test_inventory_says_cpu_here():
    inv = node_inventory()
    assert inv["cpus"] >= 1 and inv["memory_bytes"] > 0 and inv["hostname"]
    assert inv["accelerator"] == "cpu" and inv["gpus"] == [] and inv["topology"] is None


def test_rank_env_adds_nccl_failure_settings_without_overriding():
    spec = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30"}
    env = rank_env(spec, on_gpu=True)
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "30"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in rank_env(
        {"NCCL_ASYNC_ERROR_HANDLING": "3"}, on_gpu=True)
    assert rank_env(spec, on_gpu=False) == spec
    assert pg_timeout(300).total_seconds() == 600


def test_heartbeat_read_from_another_thread_and_stacks():
    hb = Heartbeat(rank=3)
    hb.beat(5, "backward")
    seen = {}
    with hb.in_collective("all_reduce", "dp", [1, 3]):
        t = threading.Thread(target=lambda: seen.update(hb.read().model_dump()))
        t.start()
        t.join()
    assert seen["collective"] == "all_reduce" and seen["group"] == [1, 3]
    assert (seen["step"], seen["phase"], seen["dim"]) == (5, "backward", "dp")
    after = hb.read()
    assert after.collective is None and after.time >= seen["time"]
    assert abs(after.time - time.time()) < 5

    ready, stop = threading.Event(), threading.Event()

    def parked_in_a_named_function():
        ready.set()
        stop.wait()

    t = threading.Thread(target=parked_in_a_named_function, name="trainer")
    t.start()
    ready.wait()
    text = dump_stacks()
    stop.set()
    t.join()
    assert "Thread trainer" in text and "parked_in_a_named_function" in text


def test_a_straggler_against_idle_peers_has_a_finite_ratio() -> None:
    from service.monitor.stragglers import find_stragglers

    found = find_stragglers({0: [0.08] * 5, 1: [0.0] * 5}, {0: 0, 1: 0})
    assert [s.rank for s in found] == [0] and found[0].ratio == 80.0
