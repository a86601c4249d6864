"""Uneven pipeline stages in the planner: layers that do not divide by pp (pure, fast)."""

from __future__ import annotations

import pytest

from service.contract.parallel import Dim, ParallelDims
from service.contract.spec import JobSpec, ModelSpec, ParallelSpec
from service.planner import StoredPlan, evaluate, search
from service.planner.memory import stage_memory
from service.planner.plan import scenario_for
from service.planner.shape import ModelShape
from service.planner.stored import plan_json


def spec(layers: int, pp: int, partition: str = "uniform", gpu: str = "a100-80gb",
         preset: str = "gpt3-1.3b", gb: int = 16) -> JobSpec:
    return JobSpec(name="u", model={"preset": preset, "layers": layers},
                   train={"global_batch": gb, "micro_batch": 1},
                   parallel=ParallelSpec(pp=pp, partition=partition),
                   cluster={"gpu": gpu, "nodes": 1, "gpus_per_node": pp})


def test_five_layers_on_two_stages_split_three_and_two_and_the_plan_shows_it():
    plan = evaluate(spec(5, 2))
    out = plan_json(plan)
    assert out["stages"]["blocks"] == [3, 2]
    assert [s["layers"] for s in out["memory_by_stage"]] == [[[0, 3]], [[3, 5]]]
    assert [r["layers"] for r in out["rank_layout"]] == [[[0, 3]], [[3, 5]]]
    # The first stage has one block more, the embedding and the most micro-batches in flight.
    assert out["stages"]["most_loaded"]["stage"] == 0
    assert out["stages"]["most_loaded"]["memory_total"] == out["memory"]["total"]
    first, last = (stage_memory(plan.scenario, s) for s in (0, 1))
    shape = ModelShape.from_spec(ModelSpec(preset="gpt3-1.3b", layers=5))
    assert first.params_per_rank == 3 * shape.layer_params + shape.embedding_params
    assert last.params_per_rank == 2 * shape.layer_params + shape.head_params \
        + shape.vocab * shape.hidden  # the tied head's copy
    # The pipeline runs at the pace of its slowest stage, which sets the bubble.
    t = plan.time
    assert t.stage_micro_batch_s[t.slowest_stage] == max(t.stage_micro_batch_s)
    assert out["stages"]["slowest"]["stage"] == t.slowest_stage


def test_uneven_stages_cost_what_their_slowest_stage_costs():
    # 5 blocks on 2 stages: stage 0 holds 3 blocks, stage 1 two blocks and the LM head (a
    # 50k x 2048 head is about two blocks of GPT-3 1.3B): stage 1 sets the pace.
    five, six = evaluate(spec(5, 2)), evaluate(spec(6, 2))
    t5, t6 = five.time, six.time
    assert t5.stage_micro_batch_s[0] == pytest.approx(t6.stage_micro_batch_s[0], rel=1e-12)
    block = t6.stage_micro_batch_s[1] - t5.stage_micro_batch_s[1]
    assert block == pytest.approx(t6.stage_micro_batch_s[0] / 3, rel=1e-9)
    assert t5.slowest_stage == 1
    m = five.scenario.micro_batches
    prof = five.scenario.profile
    assert t5.compute_s + t5.elementwise_s + t5.overhead_s - prof.step_overhead_s == pytest.approx(
        m * t5.stage_micro_batch_s[1], rel=1e-9)


def test_parameters_partition_counts_embedding_and_head():
    # GPT-3 1.3B with 24 blocks on 3 stages: the embedding (50k x 2048 plus positions) and
    # the last stage's copy of the tied head weigh about two blocks each, so balancing by
    # parameters moves blocks from the end stages to the middle one.
    plan = evaluate(spec(24, 3, "parameters"))
    blocks = plan_json(plan)["stages"]["blocks"]
    assert sum(blocks) == 24 and blocks[1] > blocks[0] and blocks[1] > blocks[2]
    uniform = evaluate(spec(24, 3, "uniform"))
    assert plan_json(uniform)["stages"]["blocks"] == [8, 8, 8]
    # ... which lowers the heaviest stage's parameters (and so its memory).
    heaviest = [max(stage_memory(p.scenario, s).params_per_rank for s in range(3))
                for p in (plan, uniform)]
    assert heaviest[0] < heaviest[1]
    assert plan.memory.total < uniform.memory.total


def test_fewer_layers_than_stages_is_refused_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"layers\(3\) is fewer than pp\(4\)"):
        spec(3, 4)


def test_search_offers_uneven_pipelines():
    sp = JobSpec(name="s", model={"preset": "gpt3-1.3b", "layers": 25},
                 train={"global_batch": 8, "micro_batch": 1}, parallel="auto",
                 cluster={"gpu": "v100-32gb", "nodes": 1, "gpus_per_node": 4})
    res = search(sp)
    pps = {p.layout.pp for p in res.ranked}
    assert {2, 4} <= pps  # 25 layers divide by neither
    assert not any("not divisible by pp" in r.reason for r in res.rejected)
    sc = scenario_for(sp, ParallelSpec(pp=4))
    assert sc.stage_blocks == (7, 6, 6, 6)


def test_each_rank_plan_is_its_stored_row_with_every_stage_and_its_groups():
    """`StoredPlan.rank_plan`, the row the launcher sends a rank: the stored row's stage and
    layers (here the `parameters` balance of an uneven split), every stage's layers, and the
    ranks of its TP, PP and DP groups."""
    job = JobSpec(name="u", model={"preset": "gpt3-1.3b", "layers": 7},
                  train={"global_batch": 16, "micro_batch": 1},
                  parallel=ParallelSpec(tp=2, pp=3, dp=2, partition="parameters"),
                  cluster={"gpu": "a100-80gb", "nodes": 2, "gpus_per_node": 6})
    plan = StoredPlan.from_json(plan_json(evaluate(job)))
    dims = plan.layout.dims
    stages = ModelShape.from_spec(job.model).stages(3, 1, "parameters")
    assert stages != ModelShape.from_spec(job.model).stages(3)  # not the uniform split
    for rank, row in enumerate(plan.rank_layout):
        mine = plan.rank_plan(rank)
        assert (mine.rank, mine.pp, mine.dp, mine.tp) == (row.rank, row.pp, row.dp, row.tp)
        assert mine.layers == row.layers == stages[row.pp]
        assert mine.stages == stages
        assert mine.blocks == [i for a, b in stages[row.pp] for i in range(a, b)]
        assert mine.first_stage == row.first_stage and mine.last_stage == row.last_stage
        for dim in Dim:
            assert mine.groups[dim] in dims.groups(dim) and rank in mine.groups[dim]
    assert plan.rank_plan(5).groups == {Dim.TP: [4, 5], Dim.DP: [5, 7], Dim.PP: [1, 5, 9]}


def test_a_ranks_group_along_a_dim_is_its_entry_of_the_groups():
    for dims in (ParallelDims(tp=2, pp=3, dp=2), ParallelDims(dp=5), ParallelDims(tp=4, pp=2)):
        for dim in Dim:
            for group in dims.groups(dim):
                assert all(dims.group_of(r, dim) == group for r in group)
