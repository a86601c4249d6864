"""The plan as a job stores it: `plan_json` writes it from a `Plan`, `StoredPlan` reads it back.

`plan_json(plan)` is the plan JSON documented in docs/planner.md (`plan_job` adds `chosen_by`
and `search`). The store hands a stored plan out as `Job.plan`, a `StoredPlan`: the scheduler,
the controller, the workers' launcher, the API and the CLI read it through that view instead
of by string keys. Unknown keys are kept (`extra="allow"`), so a stored plan dumps back to
the JSON it was read from.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from service.parallel import rank_layout
from service.planner.explain import explain, tuning_notes
from service.planner.memory import stage_memory
from service.planner.plan import Plan
from service.planner.uncertainty import ranges
from service.spec import ParallelSpec

# JSON numbers are kept as they were stored: an int stays an int (a plain `float` field would
# turn 0 into 0.0 and change the JSON).
Number = int | float


def plan_json(plan: Plan, *, with_ranks: bool = True) -> dict[str, Any]:
    """The plan JSON a job stores (docs/planner.md); `with_ranks=False` leaves out
    `rank_layout` (one row per rank)."""
    sc = plan.scenario
    out: dict[str, Any] = {
        "job": plan.job,
        "profile": sc.profile.name,
        "world_size": plan.world_size,
        "nodes": sc.nodes,
        "gpus_per_node": sc.gpus_per_node,
        "precision": sc.precision,
        "global_batch": sc.global_batch,
        "micro_batches": sc.micro_batches,
        "layout": plan.layout_json(),
        "fits": plan.fits,
        "reasons": plan.reasons,
        "capacity_bytes": plan.capacity_bytes,
        "memory": plan.memory.to_json(),
        "memory_by_stage": [
            {k: v for k, v in stage_memory(sc, s).to_json().items()
             if k in ("stage", "params", "grads", "optimizer", "activations",
                      "other", "total")} | {"layers": [list(r) for r in sc.stage_ranges[s]],
                                                 "blocks": sc.stage_blocks[s],
                                                 "micro_batch_s": plan.time.stage_micro_batch_s[s]}
            for s in range(sc.layout.pp)],
        "stages": plan.stages_json(),
        "ranges": ranges(plan),
        "host_memory": {"per_rank": plan.memory.host_per_rank,
                        "per_node": plan.memory.host_per_node,
                        "capacity_per_node": plan.host_capacity_bytes},
        "time": plan.time.to_json(),
        "tokens_per_s": plan.tokens_per_s,
        "mfu": plan.mfu,
        "tflops_per_gpu": plan.tflops_per_gpu,
        "hardware_tflops_per_gpu": plan.hardware_tflops_per_gpu,
        "shares": plan.shares,
        "params_total": sc.shape.total_params,
        "explanation": explain(plan),
        "notes": tuning_notes(plan),
    }
    if with_ranks:
        out["rank_layout"] = rank_layout(sc.dims, sc.stage_ranges)
    return out


class _View(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class PlannedLayout(ParallelSpec):
    """The layout the plan is for: the spec's `parallel` fields plus the micro-batch."""

    model_config = ConfigDict(extra="allow", frozen=True)

    micro_batch: int

    @property
    def label(self) -> str:
        """The layout in a few characters, as the status page and the CLI list it."""
        return f"tp{self.tp} pp{self.pp} dp{self.dp} zero{self.zero}"

    @property
    def parallel(self) -> ParallelSpec:
        """The layout as a spec's `parallel` field (without the micro-batch)."""
        return ParallelSpec.model_validate(
            self.model_dump(include=set(ParallelSpec.model_fields)))


class RankRow(_View):
    """One rank of `rank_layout`: its (pp, dp, tp) coordinates and the layers it runs."""

    rank: int
    pp: int
    dp: int
    tp: int
    layers: list[tuple[int, int]]
    """[start, end) layer ranges, one per virtual stage."""
    first_stage: bool
    last_stage: bool


class PlannedTime(_View):
    """Seconds per step, as `TimeBreakdown.to_json`."""

    step_s: Number
    compute_s: Number
    recompute_s: Number
    bubble_s: Number
    tp_comm_s: Number
    pp_comm_s: Number
    dp_comm_s: Number
    zero3_gather_s: Number
    offload_s: Number
    optimizer_s: Number
    overhead_s: Number
    gemm_efficiency: Number
    hardware_flops: Number


class PlannedMemory(_View):
    """Bytes per GPU of the most loaded rank, as `MemoryBreakdown.to_json`."""

    params: Number
    grads: Number
    optimizer: Number
    activations: Number
    logits: Number
    zero_buffers: Number
    reserved: Number
    stage: int
    in_flight: Number
    host_per_rank: Number
    host_per_node: Number
    params_per_rank: Number
    other: Number
    """logits + zero_buffers + reserved."""
    total: Number

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states."""
        return self.params + self.grads + self.optimizer


class StoredPlan(_View):
    """A job's plan as stored; the fields the control plane reads are typed, the rest kept."""

    layout: PlannedLayout
    world_size: int
    rank_layout: list[RankRow]
    time: PlannedTime
    memory: PlannedMemory
    tokens_per_s: Number
    chosen_by: Literal["spec", "search"] = "spec"
    """`search` when the layout was chosen for `parallel: auto` (then `search` summarises it)."""
    _keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        plan = handler(data)
        if isinstance(data, dict) and isinstance(plan, StoredPlan):
            plan._keys = tuple(data)
        return plan

    @model_serializer(mode="wrap")
    def _in_stored_key_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The typed fields would otherwise come first: keep the order the plan was stored in.
        out: dict[str, Any] = handler(self)
        return {k: out[k] for k in self._keys if k in out} | out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoredPlan:
        return cls.model_validate(data)

    def to_json(self) -> dict[str, Any]:
        """The JSON this plan was read from (what the store keeps and the API returns)."""
        return self.model_dump(mode="json", exclude_unset=True)

    def stage_of(self) -> dict[int, int]:
        """Each rank's pipeline stage."""
        return {r.rank: r.pp for r in self.rank_layout}
