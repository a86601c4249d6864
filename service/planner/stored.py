"""The plan as a job stores it: `plan_json` writes it from a `Plan`, `StoredPlan` reads it back.

`plan_json(plan)` is the plan JSON documented in docs/planner.md (`plan_job` adds `chosen_by`
and `search`). The store hands a stored plan out as `Job.plan`, a `StoredPlan`: the scheduler,
the controller, the workers' launcher, the API and the CLI read it through that view, never
by string keys. Its `time` and `memory` are the planner's own records (`TimeBreakdown`,
`MemoryBreakdown`), not copies of them; keys no field names are kept (`extra="allow"`), so a
stored plan dumps back to the JSON it was read from.

Its per-rank rows (`rank_layout`) are validated on first use (`RankRows`): every controller
pass reads the plan of every active job, and a job of 4,096 ranks has 4,096 rows, which only
the launcher (a rank's row, `rank_plan`), the rank-to-stage map and the ranks grid read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    GetCoreSchemaHandler,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    field_serializer,
    model_serializer,
    model_validator,
)
from pydantic_core import CoreSchema, core_schema

from service.contract.parallel import Dim, rank_layout
from service.contract.spec import ParallelSpec
from service.planner.explain import constants_json, explain, tuning_notes
from service.planner.memory import MemoryBreakdown, stage_memory
from service.planner.plan import Plan
from service.planner.timing import TimeBreakdown
from service.planner.uncertainty import ranges

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
             if k in StageMemory.MEMORY_KEYS} | {"layers": [list(r) for r in sc.stage_ranges[s]],
                                                 "blocks": sc.stage_blocks[s],
                                                 "micro_batch_s": plan.time.stage_micro_batch_s[s]}
            for s in range(sc.layout.pp)],
        "stages": plan.stages_json(),
        "ranges": ranges(plan),
        "host_memory": {"per_rank": plan.memory.host_per_rank,
                        "checkpoint_copy": plan.memory.checkpoint_copy,
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
        "constants": constants_json(plan),
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


_ROWS: TypeAdapter[list[RankRow]] = TypeAdapter(list[RankRow])


class RankRows(Sequence[RankRow]):
    """`rank_layout` as it was stored, its rows validated into `RankRow`s on first use (and
    then kept). It dumps back to the stored list."""

    __slots__ = ("_raw", "_rows")

    def __init__(self, raw: list[Any]) -> None:
        self._raw = raw
        self._rows: list[RankRow] | None = None

    def _parsed(self) -> list[RankRow]:
        if self._rows is None:
            self._rows = _ROWS.validate_python(self._raw)
        return self._rows

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, i: int) -> RankRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[RankRow]: ...

    def __getitem__(self, i: int | slice) -> RankRow | list[RankRow]:
        return self._parsed()[i]

    def __iter__(self) -> Iterator[RankRow]:
        return iter(self._parsed())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankRows) and self._raw == other._raw

    __hash__ = None  # type: ignore[assignment]  # mutable contents, as a list's

    def to_json(self) -> list[Any]:
        return self._raw

    @classmethod
    def _validate(cls, value: Any) -> RankRows:
        if isinstance(value, RankRows):
            return value
        if not isinstance(value, list):
            raise ValueError(f"rank_layout must be a list of rows, got {type(value).__name__}")
        return cls(value)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate, json_schema_input_schema=handler.generate_schema(list[RankRow]),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda rows: rows.to_json()))


class RankPlan(BaseModel):
    """One rank's row of a stored plan, as the launcher sends it to the rank
    (`StoredPlan.rank_plan`): where the rank sits, the layers it builds and the ranks of its
    groups. The rank builds from it; it never works the plan out again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    pp: int
    dp: int
    tp: int
    layers: list[tuple[int, int]]
    """This rank's [start, end) block ranges, one per model chunk (virtual stage)."""
    stages: list[list[tuple[int, int]]]
    """Every pipeline stage's block ranges, stage by stage (a pipeline engine is given every
    stage's boundaries)."""
    groups: dict[Dim, list[int]]
    """The global ranks of this rank's TP, PP and DP groups."""
    memory_predicted_bytes: float | None = None
    """The bytes per device the plan predicts for this rank's stage (None: a plan without
    them)."""
    memory_capacity_bytes: float | None = None
    """The device memory the plan was made for: the rank's memory monitor watches every step
    once its peak comes near it (`workers.monitor.memory`)."""

    @property
    def first_stage(self) -> bool:
        return self.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.pp == len(self.stages) - 1

    @property
    def blocks(self) -> list[int]:
        """The block indices this rank builds, in order."""
        return [i for start, end in self.layers for i in range(start, end)]


class StageMemory(_View):
    """One pipeline stage's predicted bytes per device (`memory_by_stage`)."""

    MEMORY_KEYS: ClassVar[tuple[str, ...]] = ("stage", "params", "grads", "optimizer",
                                              "activations", "logits", "zero_buffers",
                                              "reserved", "gathered", "buckets", "framework",
                                              "other", "total")
    """The keys of `MemoryBreakdown.to_json` a stage's entry carries (in its order)."""

    params: Number
    grads: Number
    optimizer: Number
    activations: Number
    logits: Number | None = None
    zero_buffers: Number | None = None
    reserved: Number | None = None
    """`other`'s parts (None in plans stored before they were kept per stage)."""
    stage: int
    gathered: Number | None = None
    buckets: Number | None = None
    framework: Number | None = None
    """Parts of `zero_buffers` and `reserved` (None in plans stored before)."""
    other: Number
    total: Number
    layers: list[tuple[int, int]] | None = None
    """Its block ranges (None in plans stored before stages could be uneven)."""
    blocks: int | None = None
    micro_batch_s: Number | None = None
    """One micro-batch's compute on this stage."""


class StoredPlan(_View):
    """A job's plan as stored; the fields the control plane reads are typed, the rest kept."""

    layout: PlannedLayout
    world_size: int
    rank_layout: RankRows
    planned: bool = True
    """False for a command job without model (`service.planner.job_plan.placement_json`):
    the plan is its placement only, and `time`, `memory` and `tokens_per_s` are None."""
    time: TimeBreakdown | None = None
    memory: MemoryBreakdown | None = None
    memory_by_stage: list[StageMemory] = []
    """Plans stored before it was added have none."""
    tokens_per_s: Number | None = None
    mfu: Number | None = None
    chosen_by: Literal["spec", "search", "elastic", "resources"] = "spec"
    """`search` when the layout was chosen for `parallel: auto` (then `search` summarises it);
    `elastic` when an elastic re-plan chose it (`service.policy.elastic_replan`);
    `resources` for a job that is not planned."""
    _keys: tuple[str, ...] = PrivateAttr(default=())
    _memory_json: dict[str, Any] | None = PrivateAttr(default=None)
    _dumped: dict[tuple[Any, ...], dict[str, Any]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        plan = handler(data)
        if isinstance(data, dict) and isinstance(plan, StoredPlan):
            plan._keys = tuple(data)
        return plan

    @model_validator(mode="after")
    def _predicted_when_planned(self) -> StoredPlan:
        predictions = (self.time, self.memory, self.tokens_per_s)
        if self.planned and any(p is None for p in predictions):
            raise ValueError("a planned job's plan holds time, memory and tokens_per_s")
        if not self.planned and any(p is not None for p in (*predictions, self.mfu)):
            raise ValueError("a plan with planned: false holds no prediction")
        return self

    @field_serializer("memory")
    def _memory_as_planned(self, memory: MemoryBreakdown | None) -> dict[str, Any] | None:
        # With `other`, `total` and the allocator's views, as the planner writes it; worked
        # out once per plan (a job's plan is read, and answered, on every poll of its page).
        if memory is None:
            return None
        if self._memory_json is None or memory is not self.memory:
            self._memory_json = memory.to_json()
        return self._memory_json

    @model_serializer(mode="wrap")
    def _in_stored_key_order(self, handler: SerializerFunctionWrapHandler,
                             info: SerializationInfo) -> dict[str, Any]:
        # The typed fields would otherwise come first: keep the order the plan was stored in.
        # Worked out once per plan and way of dumping it (a plan never changes, and a
        # 4,096-rank plan is answered on every poll of its job's page and in every list). What
        # it returns is read, never changed, by its callers (a copy at the top level only).
        key = None
        if info.include is None and info.exclude is None:
            key = (info.mode, info.by_alias, info.exclude_unset, info.exclude_defaults,
                   info.exclude_none, info.round_trip)
            if (found := self._dumped.get(key)) is not None:
                return dict(found)
        out: dict[str, Any] = handler(self)
        ordered = {k: out[k] for k in self._keys if k in out} | out
        if key is not None:
            self._dumped[key] = ordered
        return ordered

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoredPlan:
        return cls.model_validate(data)

    def to_json(self) -> dict[str, Any]:
        """The JSON this plan was read from (what the store keeps and the API returns)."""
        return self.model_dump(mode="json", exclude_unset=True)

    @property
    def planned_time(self) -> TimeBreakdown:
        """`time`, where only a planned job comes (the elastic moves: an elastic job gives a
        model); a ValueError on a plan with `planned: false`."""
        if self.time is None:
            raise ValueError("the job is not planned: it has no predicted step")
        return self.time

    def stage_of(self) -> dict[int, int]:
        """Each rank's pipeline stage."""
        return {r.rank: r.pp for r in self.rank_layout}

    def stage_bytes(self) -> dict[int, float]:
        """Each pipeline stage's predicted bytes per device (`total`; empty when the plan has
        no `memory_by_stage`)."""
        return {m.stage: float(m.total) for m in self.memory_by_stage}

    def rank_plan(self, rank: int) -> RankPlan:
        """Rank `rank`'s row, with every stage's layers and its groups' ranks."""
        rows, dims = self.rank_layout, self.layout.dims
        row = rows[rank]
        assert row.rank == rank, f"rank_layout[{rank}] is rank {row.rank}'s row"
        stages = [rows[dims.rank(pp=s, dp=0, tp=0)].layers for s in range(dims.pp)]
        capacity = (self.model_extra or {}).get("capacity_bytes")
        return RankPlan(rank=row.rank, pp=row.pp, dp=row.dp, tp=row.tp, layers=row.layers,
                        stages=stages, groups={d: dims.group_of(rank, d) for d in Dim},
                        memory_predicted_bytes=self.stage_bytes().get(row.pp),
                        memory_capacity_bytes=capacity if isinstance(capacity, int | float)
                        else None)
