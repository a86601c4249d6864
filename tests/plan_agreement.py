"""Test helper: the plan against the built-in trainer's `memory` reports, category by category
(docs/planner-model.md, "What each category means"). A layout runs on 2 forked CPU ranks
(`tests.workers_spawn.run_ranks`, gloo, real DeepSpeed); each rank's last step is set against
the plan of its pipeline stage. Used by tests/test_plan_agreement.py and
bench/plan_agreement.py (the table in docs/planner.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.contract.hardware import CPU_FRAMEWORK_GROWTH_BYTES
from service.contract.spec import JobSpec
from service.planner import evaluate, offload
from service.planner.memory import MemoryBreakdown, stage_memory
from service.planner.scenario import Scenario
from tests.workers_spawn import run_ranks

STEPS = 6
CATEGORIES = {  # planned field: measured field
    "params": "params_bytes", "grads": "grads_bytes", "optimizer": "optimizer_bytes",
    "host_params": "host_params_bytes", "host_grads": "host_grads_bytes",
    "host_optimizer": "host_optimizer_bytes", "offload_buffers": "offload_buffers_bytes",
    "activations": "activations_peak_bytes", "gathered": "gathered_peak_bytes",
}


def spec(**parallel: Any) -> JobSpec:
    """gpt-tiny, 2 CPU ranks, fp32, 6 steps (issue 46's runs)."""
    return JobSpec.model_validate({
        "name": "agree", "model": {"preset": "gpt-tiny"}, "parallel": parallel,
        "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 1},
        "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}})


@dataclass
class RankAgreement:
    rank: int
    stage: int
    planned: MemoryBreakdown
    measured: dict[str, Any]
    dp_rank: int = 0
    scenario: Scenario | None = None

    def pair(self, category: str) -> tuple[float, float | None]:
        """(planned, measured) bytes of one category. `offload_buffers` differ by DP rank (a
        parameter straddling two partitions is held whole by both): the plan's for this
        rank's partition, not the most loaded rank's."""
        planned = getattr(self.planned, category)
        if category == "offload_buffers" and self.scenario is not None:
            planned = offload.host_buffer_bytes(self.scenario, self.stage, self.dp_rank)
        return planned, self.measured.get(CATEGORIES[category])

    @property
    def planned_total_here(self) -> float:
        """The plan's total with its framework bytes as this rank measured them at its
        training's start (its own memory once imports, `torch._dynamo` included, and process
        group are done: a forked rank shares its fork server's pages, one that Ray runs holds
        Ray's core worker too) plus the framework's growth while it builds the engine and runs
        the first step (the `cpu` profile's)."""
        framework = self.measured["framework_bytes"] + CPU_FRAMEWORK_GROWTH_BYTES
        return self.planned.total - self.planned.framework + framework


def agreement(**parallel: Any) -> list[RankAgreement]:
    """Each rank's last-step report against its stage's plan."""
    s = spec(**parallel)
    rows = run_ranks(s)[0]
    sc = evaluate(s).scenario
    out = []
    for r in sorted(rows, key=lambda r: r["rank"]):
        if r["step"] == STEPS:
            out.append(RankAgreement(r["rank"], r["pp_rank"], stage_memory(sc, r["pp_rank"]),
                                     r["memory"], r["dp_rank"], sc))
    return out
