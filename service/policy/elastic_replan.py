"""Elastic re-plan: which layout an elastic job moves to when it lost ranks, or when the room
of a larger one is free again, and what is said about it. Pure decisions; the controller
(`service.control.rescaling.Rescaling`, beside its loop) carries them out.

A job with `elastic: {min_ranks, wait_s, scale_up}` whose ranks were lost (its last attempt
failed or was lost) and that the free room cannot hold for `wait_s` is re-planned: the planner
(`service.planner.search`, with the job's own profile) ranks the layouts of the same model and
global batch (gradient accumulation takes up what fewer replicas leave) that fit the free room
now, of at least `min_ranks` and at most the submitted world size, among those the checkpoint
conversion reaches from the job's layout (`reachable`): a change of DP degree with
tp = pp = 1, ZeRO 1 or 2 on both sides (`workers.checkpoint.relayout` converts such a tag through
DeepSpeed's universal form), or ZeRO 0 on both sides in fp32 or fp16 (the tag loads as it is,
`workers.checkpoint.relayout.dp_free`); without offload, any change of tp, pp and ZeRO stage through
Trident's layout-free form (`workers.checkpoint.layout_free`; ZeRO 0 in fp32 only); never
interleaved stages. The fastest predicted step wins. The job's
stored spec, plan and world size become the new layout's; what it was submitted with is kept
in `jobs.elastic` (`ElasticState`) to move back: with `scale_up`, once the free room plus what
the job holds takes the submitted layout (moved back to as it was), or else a larger layout
predicted faster than the job's own, its ranks are asked to save a checkpoint now and stop,
and the job resumes on it. That attempt ends `moved` and spends no retry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from service.cluster.data_plane import NodeCapacity
from service.contract.hardware import HardwareProfile
from service.contract.spec import JobSpec, ParallelSpec
from service.planner.job_plan import plan_job
from service.planner.search import SearchTooLarge, search
from service.planner.stored import StoredPlan
from service.store import Job

ZEROS = (1, 2)
"""The ZeRO stages between which a tag converts (DeepSpeed's universal form, with tp = pp = 1)."""


def conversion_refusal(layout: ParallelSpec, precision: str = "fp32") -> str | None:
    """Why no other layout can resume this layout's checkpoints (None: some can). Mirrors
    what `workers.checkpoint.saving.load` converts: DeepSpeed's universal form, a ZeRO-0 tag as it
    is (`workers.checkpoint.relayout.dp_free`), Trident's layout-free form
    (`workers.checkpoint.layout_free`)."""
    if layout.virtual_stages > 1:
        return (f"it runs interleaved stages (virtual_stages {layout.virtual_stages}): the"
                " checkpoint conversion does not read torch.distributed.pipelining's per-rank"
                " files")
    if layout.zero == 0 and precision == "bf16":
        return ("it runs ZeRO 0 in bf16: DeepSpeed's bf16 optimizer shards its states over DP"
                " without ZeRO, which the conversion does not cover (ZeRO 0 in fp32 or fp16"
                " moves as it is, ZeRO 1-3 through the universal or the layout-free form)")
    return None


def _layout_free(zero: int, offload: str, precision: str) -> bool:
    """Whether the layout-free form (`workers.checkpoint.layout_free`) carries tags from or to such
    a
    layout: no offload, and ZeRO 1-3, or ZeRO 0 in fp32."""
    return offload == "none" and (zero > 0 or precision == "fp32")


def reachable(current: ParallelSpec,
              precision: str = "fp32") -> Callable[[ParallelSpec], bool]:
    """The layout families (`service.planner.search`'s `only`) a tag of `current` converts
    to: the same tp, pp and offload, any DP degree, ZeRO 1 or 2 from ZeRO 1 or 2 and ZeRO 0
    from ZeRO 0 (the universal form, or the tag as it is); and through the layout-free form,
    without offload, any tp, pp and ZeRO stage (ZeRO 0 in fp32 only); never interleaved
    stages."""
    zeros = ZEROS if current.zero in ZEROS else (current.zero,)
    out_ok = _layout_free(current.zero, current.offload, precision) and \
        current.virtual_stages == 1

    def ok(lay: ParallelSpec) -> bool:
        if (lay.tp, lay.pp, lay.offload, lay.virtual_stages) == \
                (current.tp, current.pp, current.offload, current.virtual_stages) \
                and lay.zero in zeros:
            return True
        return out_ok and lay.virtual_stages == 1 and \
            _layout_free(lay.zero, lay.offload, precision)
    return ok


@dataclass(frozen=True)
class ElasticState:
    """`jobs.elastic`: what the job was submitted with, and its moves up."""

    submitted: dict[str, Any]
    """{"parallel", "micro_batch", "cluster", "world_size", "plan"} as submitted."""
    moves_up: int = 0

    @classmethod
    def of(cls, job: Job) -> ElasticState:
        """The job's state; a job never re-planned runs what it was submitted with."""
        if job.elastic:
            return cls(submitted=dict(job.elastic["submitted"]),
                       moves_up=int(job.elastic.get("moves_up", 0)))
        spec = job.spec
        return cls(submitted={
            "parallel": spec.layout.model_dump(mode="json"),
            "micro_batch": spec.train.micro_batch,
            "cluster": spec.cluster.model_dump(mode="json") if spec.cluster else None,
            "world_size": job.world_size, "plan": job.plan.to_json()})

    @property
    def world_size(self) -> int:
        return int(self.submitted["world_size"])

    def to_json(self, *, moved_up: bool = False) -> dict[str, Any]:
        return {"submitted": self.submitted, "moves_up": self.moves_up + int(moved_up)}


@dataclass(frozen=True)
class Replan:
    """The layout an elastic job moves to."""

    spec: JobSpec
    plan: StoredPlan
    world_size: int

    @property
    def step_s(self) -> float:
        return self.plan.planned_time.step_s

    @property
    def cpus(self) -> float:
        """Per rank, as a stored job claims (`service.policy.scheduler.Claim`)."""
        return self.spec.resources.cpus_per_worker

    @property
    def gpus(self) -> float:
        return float(self.spec.resources.gpus_per_worker)


def fitting_ranks(spec: JobSpec, capacity: Sequence[NodeCapacity]) -> int:
    """How many of the job's ranks, in TP-group bundles of one node each, `capacity` holds."""
    tp = spec.layout.tp
    cpus, gpus = spec.resources.cpus_per_worker * tp, spec.resources.gpus_per_worker * tp
    groups = 0
    for n in capacity:
        by_cpu = math.floor(n.cpus / cpus + 1e-9)
        by_gpu = math.floor(n.gpus / gpus + 1e-9) if gpus else by_cpu
        groups += max(0, min(by_cpu, by_gpu))
    return groups * tp


def with_layout(spec: JobSpec, parallel: Mapping[str, Any], micro_batch: int,
                cluster: Mapping[str, Any] | None) -> JobSpec:
    """`spec` on another layout: its `parallel`, micro-batch and `cluster` replaced (faults
    aimed at ranks it no longer has dropped); ValueError when that is not a valid spec."""
    data = spec.model_dump(mode="json")
    data["parallel"] = dict(parallel)
    data["train"]["micro_batch"] = micro_batch
    data["cluster"] = dict(cluster) if cluster is not None else None
    world = int(parallel["tp"]) * int(parallel["pp"]) * int(parallel["dp"])
    data["faults"] = [f for f in data["faults"] if f["rank"] < world]
    return JobSpec.model_validate(data)


def _cluster_for(spec: JobSpec, world: int) -> dict[str, Any] | None | bool:
    """The `cluster` of `spec` on `world` ranks: whole nodes of its size, or one node of
    fewer; False when `world` is neither (None: the spec names no cluster)."""
    c = spec.cluster
    if c is None:
        return None
    if world % c.gpus_per_node == 0:
        return {"gpu": c.gpu, "nodes": world // c.gpus_per_node, "gpus_per_node": c.gpus_per_node}
    if world < c.gpus_per_node:
        return {"gpu": c.gpu, "nodes": 1, "gpus_per_node": world}
    return False


def replan(spec: JobSpec, state: ElasticState, capacity: Sequence[NodeCapacity], *,
           min_ranks: int, profile: HardwareProfile | None = None,
           exclude_world: int | None = None) -> Replan | str:
    """The fastest predicted layout of `spec`'s model and global batch that `capacity` holds,
    of `min_ranks` to the submitted world size and reachable from `spec`'s layout by the
    checkpoint conversion; or why there is none. `exclude_world`: a world size not to move to
    (the job's own)."""
    layout = spec.layout
    refusal = conversion_refusal(layout, spec.train.precision)
    if refusal is not None:
        return refusal
    room = min(fitting_ranks(spec, capacity), state.world_size)
    if room < min_ranks:
        return (f"the free room holds {room} of its ranks"
                f" ({spec.resources.cpus_per_worker:g} CPUs, {spec.resources.gpus_per_worker}"
                f" GPUs each), fewer than elastic.min_ranks({min_ranks})")
    unit = layout.tp * layout.pp
    best: Replan | None = None
    why: list[str] = []
    for dp in range(room // unit, 0, -1):
        world = dp * unit
        if world < min_ranks:
            break
        if world == exclude_world or spec.train.global_batch % dp:
            continue
        cluster = _cluster_for(spec, world)
        if cluster is False:
            continue
        try:
            probe = with_layout(spec, layout.model_dump(mode="json") | {"dp": dp}, 1,
                                cluster if isinstance(cluster, dict) else None)
            res = search(probe, profile=profile, world_size=world,
                         only=reachable(layout, spec.train.precision))
        except (ValueError, SearchTooLarge) as exc:
            why.append(f"{world} ranks: {exc}")
            continue
        if res.best is None:
            why.append(f"{world} ranks: no layout fits ({res.explanation()[:200]})")
            continue
        plan = res.best
        try:
            moved = with_layout(spec, plan.layout.model_dump(mode="json"), plan.micro_batch,
                                cluster if isinstance(cluster, dict) else None)
            stored = StoredPlan.from_json(plan_job(moved, profile=profile) | {
                "chosen_by": "elastic"})
        except ValueError as exc:
            why.append(f"{world} ranks: {exc}")
            continue
        candidate = Replan(spec=moved, plan=stored, world_size=world)
        if best is None or (candidate.step_s, -world) < (best.step_s, -best.world_size):
            best = candidate
    if best is None:
        return ("no layout of " + (f"{min_ranks} to {room}" if room > min_ranks else str(room))
                + " ranks fits: " + ("; ".join(why[:3]) or "the global batch"
                                     f"({spec.train.global_batch}) divides among none"))
    return best


def submitted(spec: JobSpec, state: ElasticState) -> Replan:
    """The layout the job was submitted with, as it was."""
    s = state.submitted
    return Replan(spec=with_layout(spec, s["parallel"], s["micro_batch"], s["cluster"]),
                  plan=StoredPlan.from_json(s["plan"]), world_size=state.world_size)


def describe(plan: StoredPlan, world: int) -> dict[str, Any]:
    """A layout as the `elastic` event's data names it."""
    lay = plan.layout
    return {"layout": lay.label, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero": lay.zero,
            "micro_batch": lay.micro_batch, "world_size": world,
            "predicted_step_s": plan.planned_time.step_s}


def moved_message(job: Job, to: Replan, *, why: str, checkpoint: int | None) -> str:
    """The `elastic` event of a move: old and new layout with their predicted step times."""
    old, new = job.plan.layout, to.plan.layout
    accum = job.spec.train.global_batch // (new.micro_batch * new.dp)
    resume = (f"resumes from its checkpoint of step {checkpoint}" if checkpoint
              else "starts from step 0 (no checkpoint yet)")
    return (f"elastic re-plan ({why}): {old.label} on {job.world_size} rank(s), predicted"
            f" {job.plan.planned_time.step_s:.4g} s/step -> {new.label} on {to.world_size} rank(s),"
            f" micro_batch {new.micro_batch} x {accum} accumulated, predicted"
            f" {to.step_s:.4g} s/step (global batch {job.spec.train.global_batch} as before);"
            f" {resume}")
