"""Capacity answers: which models a cluster can train, with which strategy, and why not.

`can_train` answers "can 8 x A100-40GB train a 175B model, and with what?": the best
fitting layout, or for each strategy its most frugal layout (micro-batch 1, full recompute,
sequence parallel, the most sharding) and how far it is over device or host memory.
`capacity` walks a model family (service.contract.presets.FAMILIES) and reports, per strategy, the
largest model that fits, with and without offload. Called by `trident plan` and the API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.contract.hardware import GB, HardwareProfile, get_profile
from service.contract.presets import FAMILIES
from service.contract.spec import JobSpec, Offload, ParallelSpec, Zero
from service.planner.clusters import ClusterAnswer, smallest_clusters, what_it_takes_text
from service.planner.explain import layout_name
from service.planner.plan import Plan, assess
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.search import divisors, search
from service.planner.shape import ModelShape

Pred = Callable[[ParallelSpec], bool]


@dataclass(frozen=True)
class Strategy:
    name: str
    matches: Pred
    """Whether a layout belongs to this strategy."""
    zero: Zero
    offload: Offload
    model_parallel: str
    """`none`, `tp` (within a node) or `tp+pp` for the frugal layout."""


STRATEGIES = [
    Strategy("data parallel (ZeRO-0)", lambda p: p.tp == p.pp == 1 and p.zero == 0, 0, "none",
             "none"),
    Strategy("ZeRO-1", lambda p: p.tp == p.pp == 1 and p.zero == 1 and p.offload == "none",
             1, "none", "none"),
    Strategy("ZeRO-2", lambda p: p.tp == p.pp == 1 and p.zero == 2 and p.offload == "none",
             2, "none", "none"),
    Strategy("ZeRO-3", lambda p: p.tp == p.pp == 1 and p.zero == 3 and p.offload == "none",
             3, "none", "none"),
    Strategy("ZeRO-2 + optimizer offload",
             lambda p: p.tp == p.pp == 1 and p.zero == 2 and p.offload == "optimizer",
             2, "optimizer", "none"),
    Strategy("ZeRO-3 + optimizer offload",
             lambda p: p.tp == p.pp == 1 and p.zero == 3 and p.offload == "optimizer",
             3, "optimizer", "none"),
    Strategy("ZeRO-3 + parameter offload",
             lambda p: p.tp == p.pp == 1 and p.zero == 3 and p.offload == "optimizer+params",
             3, "optimizer+params", "none"),
    Strategy("TP + ZeRO (any stage)", lambda p: p.tp > 1 and p.pp == 1 and p.offload == "none",
             1, "none", "tp"),
    Strategy("TP + PP (+ ZeRO-0/1)", lambda p: p.pp > 1 and p.offload == "none", 1, "none",
             "tp+pp"),
    Strategy("TP + PP + ZeRO-1 + optimizer offload",
             lambda p: p.pp > 1 and p.offload == "optimizer", 1, "optimizer", "tp+pp"),
]


@dataclass
class StrategyAnswer:
    strategy: str
    fits: bool
    plan: Plan
    """The fastest fitting plan, or the most frugal one when none fits."""

    def line(self) -> str:
        p = self.plan
        if self.fits:
            return (f"{self.strategy}: yes, {layout_name(p)}: {p.memory.total / GB:.1f} GB "
                    f"per GPU, {p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.mfu:.1f}%")
        return f"{self.strategy}: no, even {layout_name(p)}: " + "; ".join(p.reasons)


@dataclass
class CanTrain:
    model: str
    params: int
    cluster: str
    answers: list[StrategyAnswer] = field(default_factory=list)
    best: Plan | None = None
    smallest_clusters: list[ClusterAnswer] = field(default_factory=list)
    """When nothing fits: the smallest cluster of each GPU type that trains the model."""

    @property
    def possible(self) -> bool:
        return self.best is not None

    def text(self) -> str:
        head = (f"Can {self.cluster} train {self.model} ({self.params / 1e9:.1f}B parameters)? "
                + (f"Yes: best {layout_name(self.best)} at {self.best.tokens_per_s:,.0f} "
                   f"tokens/s, MFU {100 * self.best.mfu:.1f}%."
                   if self.best else "No layout fits."))
        lines = [head, *("  " + a.line() for a in self.answers)]
        if self.smallest_clusters:
            lines.append(what_it_takes_text(self.smallest_clusters))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "params": self.params, "cluster": self.cluster,
                "possible": self.possible,
                "best": self.best.summary() if self.best else None,
                "strategies": [{"strategy": a.strategy, "fits": a.fits,
                                "layout": a.plan.layout_json(), "reasons": a.plan.reasons,
                                "memory_total": a.plan.memory.total}
                               for a in self.answers],
                "smallest_clusters": [c.to_json() for c in self.smallest_clusters],
                "text": self.text()}


def _frugal(st: Strategy, shape: ModelShape, world: int, gpn: int,
            build: Callable[[ParallelSpec], Plan]) -> Plan | None:
    """The strategy's layout with the smallest memory: full recompute, SP, micro-batch 1."""
    cands = []
    for tp in divisors(world):
        if shape.heads % tp or shape.kv_heads % tp or shape.ffn_hidden % tp:
            continue
        for pp in divisors(world // tp):
            if shape.layers < pp:
                continue
            kind = "none" if tp == pp == 1 else ("tp" if pp == 1 and tp <= gpn else
                                                  "tp+pp" if pp > 1 else "")
            if kind != st.model_parallel:
                continue
            cands.append(ParallelSpec(tp=tp, pp=pp, dp=world // (tp * pp), zero=st.zero,
                                      offload=st.offload, recompute="full",
                                      sequence_parallel=tp > 1))
    plans = [build(lay) for lay in cands]
    return min(plans, key=lambda p: p.memory.total, default=None)


def can_train(spec: JobSpec, *, profile: HardwareProfile | None = None,
              world_size: int | None = None) -> CanTrain:
    """Every strategy's answer for this spec's model on its cluster."""
    prof = profile or get_profile(spec.target.gpu)
    world = world_size or spec.target.nodes * spec.target.gpus_per_node
    gpn = spec.target.gpus_per_node
    res = search(spec, profile=prof, world_size=world)
    shape = ModelShape.from_spec(spec.planned_model)
    nodes = f" ({spec.target.nodes} nodes)" if spec.target.nodes > 1 else ""
    out = CanTrain(model=spec.planned_model.preset or spec.name, params=shape.total_params,
                   cluster=f"{world} x {prof.name}{nodes}", best=res.best)
    for st in STRATEGIES:
        best = next((p for p in res.ranked if st.matches(p.layout)), None)
        if best is not None:
            out.answers.append(StrategyAnswer(st.name, True, best))
            continue

        def build(lay: ParallelSpec) -> Plan:
            return assess(Scenario(
                shape=shape, layout=lay, micro_batch=1,
                global_batch=max(spec.train.global_batch, lay.dp),
                precision=spec.train.precision, profile=prof, gpus_per_node=gpn,
                nodes=spec.target.nodes, zero_cfg=ZeroConfig(), stack=spec.train.stack))

        frugal = _frugal(st, shape, world, gpn, build)
        if frugal is not None:
            out.answers.append(StrategyAnswer(st.name, False, frugal))
    if res.best is None:
        out.smallest_clusters = smallest_clusters(spec, gpus_per_node=gpn)
    return out


@dataclass
class CapacityRow:
    strategy: str
    largest: str | None
    """Largest preset of the family that fits, None if none does."""
    params: int
    plan: Plan | None


def capacity(family: str, *, gpu: str, nodes: int = 1, gpus_per_node: int = 8,
             global_batch: int | None = None, precision: str = "bf16",
             profile: HardwareProfile | None = None) -> list[CapacityRow]:
    """Per strategy, the largest model of `family` the cluster can train."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    world = nodes * gpus_per_node
    rows = {st.name: CapacityRow(st.name, None, 0, None) for st in STRATEGIES}
    for preset in FAMILIES[family]:
        spec = JobSpec.model_validate({
            "name": "capacity", "model": {"preset": preset},
            "train": {"global_batch": global_batch or world, "micro_batch": 1,
                      "precision": precision},
            "parallel": "auto",
            "cluster": {"gpu": gpu, "nodes": nodes, "gpus_per_node": gpus_per_node}})
        ans = can_train(spec, profile=profile)
        for a in ans.answers:
            if a.fits and ans.params > rows[a.strategy].params:
                rows[a.strategy] = CapacityRow(a.strategy, preset, ans.params, a.plan)
    return list(rows.values())


def capacity_text(rows: list[CapacityRow], *, family: str, cluster: str) -> str:
    lines = [f"Largest {family} model per strategy on {cluster}:"]
    for r in rows:
        what = (f"{r.largest} ({r.params / 1e9:.1f}B)" if r.largest else "none of the family")
        lines.append(f"  {r.strategy:<38} {what}")
    return "\n".join(lines)
