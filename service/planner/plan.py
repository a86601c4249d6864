"""`Plan`: one layout's predicted memory and time, and `evaluate`, which makes it.

Called by search.py for every candidate and by the control plane (through
`service.planner.evaluate` / `plan_job`) for explicit layouts. The words about a plan
(explain.py), its ranges (uncertainty.py) and the plan JSON a job stores (stored.py's
`plan_json`) are built on top of it, never imported by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.contract.hardware import GB, HardwareProfile, get_profile
from service.contract.parallel import layer_split_errors
from service.contract.spec import JobSpec, ParallelSpec
from service.planner.memory import MemoryBreakdown, memory
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.shape import ModelShape
from service.planner.timing import TimeBreakdown, step_time


def gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def structural_problems(shape: ModelShape, lay: ParallelSpec, *, global_batch: int,
                        micro_batch: int, world_size: int | None = None) -> list[str]:
    """Why a layout cannot run at all, with the arithmetic (empty if it can)."""
    out: list[str] = []
    if shape.heads % lay.tp:
        out.append(f"tp({lay.tp}) does not divide heads({shape.heads})")
    elif shape.kv_heads % lay.tp:
        out.append(f"tp({lay.tp}) does not divide kv_heads({shape.kv_heads})")
    if shape.ffn_hidden % lay.tp:
        out.append(f"tp({lay.tp}) does not divide ffn_hidden({shape.ffn_hidden})")
    out += [msg for _, msg in layer_split_errors(shape.layers, lay.pp, lay.virtual_stages,
                                                 lay.partition)]
    if lay.virtual_stages > 1 and lay.pp == 1:
        out.append(f"virtual_stages({lay.virtual_stages}) needs pp > 1")
    if global_batch % (micro_batch * lay.dp):
        out.append(f"global_batch({global_batch}) is not divisible by micro_batch"
                   f"({micro_batch}) * dp({lay.dp}) = {micro_batch * lay.dp}")
    m = global_batch // max(1, micro_batch * lay.dp)
    if lay.virtual_stages > 1 and lay.pp > 1 and m % lay.pp:
        out.append(f"interleaving needs micro-batches({m}) divisible by pp({lay.pp})")
    if lay.zero >= 2 and lay.pp > 1:
        out.append(f"zero({lay.zero}) with pp({lay.pp}) > 1 is not supported by DeepSpeed's "
                   "pipeline engine")
    if lay.offload != "none" and lay.zero == 0:
        out.append(f"offload={lay.offload!r} needs zero >= 1")
    if lay.offload == "optimizer+params" and lay.zero != 3:
        out.append(f"offload='optimizer+params' needs zero 3, got zero({lay.zero})")
    if lay.sequence_parallel and lay.tp == 1:
        out.append("sequence_parallel needs tp > 1")
    world = lay.tp * lay.pp * lay.dp
    if world_size is not None and world != world_size:
        out.append(f"tp({lay.tp}) * pp({lay.pp}) * dp({lay.dp}) = {world} != world size "
                   f"{world_size}")
    return out


@dataclass(frozen=True)
class Plan:
    """Predictions for one layout on one cluster (`service.planner.stored.plan_json` is the
    form a job stores)."""

    scenario: Scenario
    memory: MemoryBreakdown
    time: TimeBreakdown
    job: str = ""
    """The job's name, for reports."""

    @property
    def layout(self) -> ParallelSpec:
        return self.scenario.layout

    @property
    def micro_batch(self) -> int:
        return self.scenario.micro_batch

    @property
    def world_size(self) -> int:
        return self.scenario.dims.world_size

    @property
    def capacity_bytes(self) -> float:
        return self.scenario.profile.memory_bytes

    @property
    def host_capacity_bytes(self) -> float:
        return self.scenario.profile.host_memory_bytes

    @property
    def fits_device(self) -> bool:
        return self.memory.total <= self.capacity_bytes

    @property
    def fits_host(self) -> bool:
        return self.memory.host_per_node <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def reasons(self) -> list[str]:
        """Why it does not fit (empty when it fits)."""
        out = []
        mem = self.memory
        if not self.fits_device:
            out.append(
                f"memory: predicted {gb(mem.total)} per GPU on stage {mem.stage} (params "
                f"{gb(mem.params)} + grads {gb(mem.grads)} + optimizer {gb(mem.optimizer)} + "
                f"activations {gb(mem.activations)} + other {gb(mem.other)}) > capacity "
                f"{gb(self.capacity_bytes)} of {self.scenario.profile.name}")
        if not self.fits_host:
            out.append(f"host memory: predicted {gb(mem.host_per_node)} per node > "
                       f"{gb(self.host_capacity_bytes)}")
        return out

    @property
    def tokens_per_s(self) -> float:
        sc = self.scenario
        return sc.global_batch * sc.shape.seq_len / self.time.step_s

    @property
    def model_flops(self) -> float:
        sc = self.scenario
        return sc.shape.model_flops(sc.global_batch * sc.shape.seq_len)

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.time.step_s * self.world_size
                                   * self.scenario.peak_flops())

    @property
    def tflops_per_gpu(self) -> float:
        """Model FLOP/s per GPU in TFLOP/s (MFU's numerator; recompute not counted)."""
        return self.model_flops / self.time.step_s / self.world_size / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """FLOP/s per GPU executed, recompute included (what many papers publish)."""
        return self.time.hardware_flops / self.time.step_s / self.world_size / 1e12

    @property
    def shares(self) -> dict[str, float]:
        """Fraction of the step each parallel dimension costs."""
        t = self.time
        return {"tp": t.tp_comm_s / t.step_s,
                "pp": (t.pp_comm_s + t.bubble_s) / t.step_s,
                "dp": t.dp_comm_s / t.step_s,
                "compute": (t.compute_s + t.elementwise_s + t.overhead_s) / t.step_s,
                "offload": (t.offload_s + t.optimizer_s) / t.step_s}

    def stages_json(self) -> dict[str, Any]:
        """The pipeline split: blocks per stage, the most loaded stage by memory and the
        slowest by time (with uneven stages they need not be the first and the last)."""
        sc, t = self.scenario, self.time
        return {"partition": sc.layout.partition, "blocks": list(sc.stage_blocks),
                "most_loaded": {"stage": self.memory.stage, "memory_total": self.memory.total,
                                "blocks": sc.stage_blocks[self.memory.stage]},
                "slowest": {"stage": t.slowest_stage, "blocks": sc.stage_blocks[t.slowest_stage],
                            "micro_batch_s": t.stage_micro_batch_s[t.slowest_stage]}}

    def layout_json(self) -> dict[str, Any]:
        out: dict[str, Any] = self.layout.model_dump()
        out["micro_batch"] = self.micro_batch
        return out

    def summary(self) -> dict[str, Any]:
        """A compact form, for ranked lists."""
        return {"layout": self.layout_json(), "fits": self.fits,
                "memory_total": self.memory.total, "step_s": self.time.step_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def scenario_for(spec: JobSpec, layout: ParallelSpec, *, micro_batch: int | None = None,
                 profile: HardwareProfile | None = None,
                 zero_cfg: ZeroConfig | None = None) -> Scenario:
    shape = ModelShape.from_spec(spec.planned_model)
    world = layout.tp * layout.pp * layout.dp
    return Scenario(
        shape=shape, layout=layout,
        micro_batch=micro_batch if micro_batch is not None else spec.train.micro_batch,
        global_batch=spec.train.global_batch, precision=spec.train.precision,
        profile=profile or get_profile(spec.target.gpu),
        gpus_per_node=spec.target.gpus_per_node,
        nodes=max(spec.target.nodes, -(-world // spec.target.gpus_per_node)),
        zero_cfg=zero_cfg or ZeroConfig(), stack=spec.train.stack,
        document_mask=spec.data.document_mask, param_groups=param_groups(spec),
        async_save=spec.checkpoint.background and spec.checkpoint.every_steps > 0)


def param_groups(spec: JobSpec) -> int:
    """The trainer's optimizer parameter groups (`Scenario.param_groups`)."""
    t = spec.train
    return 1 if t.weight_decay_all or t.weight_decay == 0 else 2


def assess(sc: Scenario, *, job: str = "") -> Plan:
    """Predict one scenario (no validity checks: see `structural_problems`)."""
    return Plan(scenario=sc, memory=memory(sc), time=step_time(sc), job=job)


def evaluate(spec: JobSpec, layout: ParallelSpec | None = None, *,
             micro_batch: int | None = None, profile: HardwareProfile | None = None,
             zero_cfg: ZeroConfig | None = None) -> Plan:
    """Exactly this layout (default: the spec's own), even when it does not fit.

    Raises ValueError with the arithmetic when the layout cannot run at all (for example
    tp does not divide the heads).
    """
    if layout is None:
        layout = spec.layout
    sc = scenario_for(spec, layout, micro_batch=micro_batch, profile=profile,
                      zero_cfg=zero_cfg)
    problems = structural_problems(sc.shape, layout, global_batch=sc.global_batch,
                                   micro_batch=sc.micro_batch)
    if problems:
        raise ValueError("; ".join(problems))
    return assess(sc, job=spec.name)
