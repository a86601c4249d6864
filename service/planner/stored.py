"""`StoredPlan`: the typed view of the plan JSON stored with a job (`Plan.to_json()` plus
`plan_job`'s `chosen_by` / `search`, documented in docs/planner.md).

The store hands it out as `Job.plan`; the scheduler, the controller, the workers' launcher,
the API and the CLI read a stored plan through it instead of by string keys. Unknown keys
are kept (`extra="allow"`), so a stored plan dumps back to the JSON it was read from. Imports
only the spec's vocabulary, never the planner's model or search.
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

from service.spec import ParallelSpec

# JSON numbers are kept as they were stored: an int stays an int (a plain `float` field would
# turn 0 into 0.0 and change the JSON).
Number = int | float


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
