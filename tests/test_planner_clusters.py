"""Ranges on predictions, and the smallest cluster of each GPU type that trains a model."""

from __future__ import annotations

import pytest

from service.contract.hardware import get_profile
from service.contract.spec import JobSpec, ParallelSpec
from service.planner import evaluate
from service.planner.capacity import can_train
from service.planner.clusters import gpu_hours_per_billion_tokens, smallest_cluster
from service.planner.report import plan_command, render_plan
from service.planner.stored import plan_json
from service.planner.uncertainty import held_out_error


def spec(preset: str = "gpt3-175b", gpu: str = "a100-80gb", nodes: int = 1,
         parallel: ParallelSpec | str = "auto", stack: str = "trident") -> JobSpec:
    return JobSpec(name="c", model={"preset": preset},
                   train={"global_batch": 1536, "micro_batch": 1, "stack": stack},
                   parallel=parallel, cluster={"gpu": gpu, "nodes": nodes, "gpus_per_node": 8})


def test_every_prediction_carries_a_range_from_held_out_error_and_names_its_constant():
    plan = evaluate(spec("gpt3-6.7b", parallel=ParallelSpec(tp=2, dp=4, zero=1),
                         stack="fsdp"))
    out = plan_json(plan)["ranges"]
    err, basis = held_out_error("time_error", "fsdp", "a100-80gb")
    assert basis == "fsdp/a100-80gb" and 0 < err < 1
    lo, hi = out["step_s"]
    assert lo == pytest.approx(plan.time.step_s * (1 - err))
    assert hi == pytest.approx(plan.time.step_s * (1 + err))
    assert out["memory_total"][0] < plan.memory.total < out["memory_total"][1]
    assert "efficiency" in out["dominant_time_constant"]
    assert "trident probe" in out["note"]
    assert "trident probe" in render_plan(plan)
    # A stack with no published runs of its own falls back to all runs' error.
    assert held_out_error("time_error", "trident", "cpu")[1] == "*"


def test_memory_reports_allocated_and_reserved_and_the_bytes_besides_tensors():
    plan = evaluate(spec("gpt3-6.7b", parallel=ParallelSpec(tp=2, pp=2, dp=2, zero=1)))
    m = plan_json(plan)["memory"]
    assert m["allocated"] < m["reserved_by_allocator"] < m["total"]
    assert m["reserved"] == pytest.approx(m["cuda_context"] + m["nccl_buffers"]
                                          + m["framework"] + m["allocator_slack"])
    # NCCL: one communicator each for TP, DP and the pipeline pair, 16 channels x peers x a
    # buffer per protocol (Simple 4 MiB, LL128 4.7 MiB, LL 0.5 MiB)
    per = 4 * (1 << 20) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
    assert m["nccl_buffers"] == 16 * per * (1 + 1 + 1)


def test_stacks_hold_different_bytes_for_the_same_layout():
    lay = ParallelSpec(dp=8, zero=3)
    ds, fsdp = (evaluate(spec("gpt3-6.7b", parallel=lay, stack=s)) for s in
                ("deepspeed", "fsdp"))
    n = ds.memory.params_per_rank
    assert ds.memory.model_states == pytest.approx(n * 20 / 8, rel=0.05)   # DeepSpeed 2+6+12
    assert fsdp.memory.model_states == pytest.approx(n * 16 / 8, rel=0.01)  # FSDP 4+4+8
    lay1 = ParallelSpec(dp=8, zero=1)
    mega = evaluate(spec("gpt3-6.7b", parallel=lay1, stack="megatron-lm"))
    assert mega.memory.model_states == pytest.approx(n * (6 + 12 / 8), rel=1e-6)


def test_a_model_that_fits_nowhere_gets_the_smallest_cluster_per_gpu_type():
    sp = spec()  # 175B on one node of 8 A100-80GB: no layout fits
    ans = can_train(sp)
    assert not ans.possible
    by_gpu = {c.gpu: c for c in ans.smallest_clusters}
    assert set(by_gpu) == {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200"}
    a100 = by_gpu["a100-80gb"]
    assert a100.nodes is not None and a100.nodes > 1 and a100.plan is not None
    assert a100.plan.fits and a100.plan.world_size == 8 * a100.nodes
    # One node fewer does not train it: not a single family fits at its most frugal.
    fewer = spec(nodes=a100.nodes - 1)
    assert not can_train(fewer).possible
    # Larger memory never needs more nodes.
    assert by_gpu["h200"].nodes <= by_gpu["h100-80gb"].nodes <= by_gpu["v100-32gb"].nodes
    j = a100.to_json()
    tokens = 1536 * 2048
    assert j["gpu_hours_per_billion_tokens"] == pytest.approx(
        a100.plan.world_size * a100.plan.time.step_s / 3600 * 1e9 / tokens)
    assert j["step_s_range"][0] < j["step_s"] < j["step_s_range"][1]
    assert "GPU-hours per billion tokens" in ans.text()
    # The plan command gives the same for an explicit layout that cannot fit the cluster.
    out = plan_command(spec(parallel=ParallelSpec(tp=8)), as_json=True)
    assert isinstance(out, dict)
    assert [c["nodes"] for c in out["what_it_takes"]] == [c.nodes for c in
                                                          ans.smallest_clusters]


def test_smallest_cluster_is_the_first_node_count_whose_frugal_layout_fits():
    prof = get_profile("a100-40gb")
    ans = smallest_cluster(spec("gpt3-13b", gpu="a100-40gb"), prof)
    assert ans.nodes == 1  # 13B trains on one node of 40 GB GPUs (TP, ZeRO, recompute)
    assert gpu_hours_per_billion_tokens(8, 1.0, 1e9) == pytest.approx(8 / 3600)
