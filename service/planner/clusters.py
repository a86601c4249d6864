"""What would it take: the smallest cluster of each GPU type that trains a model.

When a spec's model does not fit its cluster, `trident capacity SPEC` and `POST /api/v1/plan`
add, for every GPU profile (not `cpu`), the fewest nodes of `gpus_per_node` GPUs on which
some layout fits, the fastest layout there, its predicted step time (with its range) and what
the run costs in GPU-hours per billion tokens.

Finding the node count is cheap: a cluster can train the model when some (tp, pp, ZeRO,
offload) family fits at its most frugal (micro-batch 1, full recompute, sequence parallel),
which is one memory evaluation per family; node counts double until one fits, then a
bisection finds the smallest (more nodes never hold more bytes per GPU). Only that cluster
gets a full layout search (the next ones too, when the global batch does not divide).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from service.contract.hardware import PROFILES, HardwareProfile
from service.contract.spec import JobSpec, ParallelSpec
from service.planner.explain import layout_name
from service.planner.memory import stage_memory
from service.planner.plan import Plan
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.search import (
    ZERO_OFFLOAD,
    SearchOutOfTime,
    SearchTooLarge,
    divisors,
    search,
)
from service.planner.shape import ModelShape
from service.planner.uncertainty import ranges

MAX_NODES = 4096
"""The most nodes a spec's cluster may have (ClusterSpec.nodes)."""
SEARCH_TRIES = 3
"""Node counts searched in full from the smallest whose frugal layout fits."""


@dataclass
class ClusterAnswer:
    gpu: str
    nodes: int | None
    """Fewest nodes that train the model; None when even MAX_NODES do not."""
    gpus_per_node: int
    plan: Plan | None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpu": self.gpu, "nodes": self.nodes,
                               "gpus_per_node": self.gpus_per_node}
        p = self.plan
        if self.nodes is None or p is None:
            return out | {"trains": False,
                          "reason": f"no layout fits on up to {MAX_NODES} nodes"}
        sc = p.scenario
        tokens = sc.global_batch * sc.shape.seq_len
        return out | {
            "trains": True, "world_size": p.world_size, "layout": p.layout_json(),
            "name": layout_name(p), "step_s": p.time.step_s,
            "step_s_range": ranges(p)["step_s"], "tokens_per_s": p.tokens_per_s,
            "memory_total": p.memory.total,
            "gpu_hours_per_billion_tokens": gpu_hours_per_billion_tokens(p.world_size,
                                                                         p.time.step_s,
                                                                         tokens)}

    def line(self) -> str:
        if self.nodes is None or self.plan is None:
            return f"  {self.gpu:<10} no layout fits on up to {MAX_NODES} nodes"
        j = self.to_json()
        return (f"  {self.gpu:<10} {self.nodes} x {self.gpus_per_node} GPUs: {j['name']},"
                f" {j['step_s']:.2f} s/step ({j['step_s_range'][0]:.2f}-"
                f"{j['step_s_range'][1]:.2f}), {j['gpu_hours_per_billion_tokens']:,.0f}"
                " GPU-hours per billion tokens")


def gpu_hours_per_billion_tokens(world: int, step_s: float, tokens_per_step: float) -> float:
    return world * step_s / 3600.0 * 1e9 / tokens_per_step


def _some_family_fits(spec: JobSpec, shape: ModelShape, prof: HardwareProfile, world: int,
                      gpn: int) -> bool:
    """Whether some layout family of `world` ranks fits at its most frugal."""
    gb = spec.train.global_batch
    base = Scenario(shape=shape, layout=ParallelSpec(), micro_batch=1, global_batch=gb,
                    precision=spec.train.precision, profile=prof, gpus_per_node=gpn,
                    nodes=max(1, world // gpn), zero_cfg=ZeroConfig(), stack=spec.train.stack)
    for tp in divisors(world):
        if tp > gpn or shape.heads % tp or shape.kv_heads % tp or shape.ffn_hidden % tp:
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if pp > shape.layers or gb % dp:
                continue
            for zero, offload in ZERO_OFFLOAD:
                if zero >= 2 and pp > 1:
                    continue
                lay = ParallelSpec(tp=tp, pp=pp, dp=dp, zero=zero, offload=offload,
                                   recompute="full", sequence_parallel=tp > 1)
                sc = replace(base, layout=lay)
                floor = max((stage_memory(sc, s) for s in {0, pp - 1}),
                            key=lambda m: m.total)
                if floor.total <= prof.memory_bytes and \
                        floor.host_per_node <= prof.host_memory_bytes:
                    return True
    return False


def smallest_cluster(spec: JobSpec, prof: HardwareProfile, gpus_per_node: int = 8
                     ) -> ClusterAnswer:
    shape = ModelShape.from_spec(spec.planned_model)

    def fits(nodes: int) -> bool:
        return _some_family_fits(spec, shape, prof, nodes * gpus_per_node, gpus_per_node)

    lo, hi = 0, 1
    while hi <= MAX_NODES and not fits(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_NODES:
        return ClusterAnswer(prof.name, None, gpus_per_node, None)
    while hi - lo > 1:  # smallest in (lo, hi]: lo does not fit, hi does
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    # One full search there; a batch that does not divide may push it a node or two further.
    for nodes in range(hi, min(hi + SEARCH_TRIES, MAX_NODES + 1)):
        try:
            best = search(spec, profile=prof, world_size=nodes * gpus_per_node,
                          gpus_per_node=gpus_per_node).best
        except SearchOutOfTime:
            raise  # the caller's CPU bound, not this size: no answer rather than a wrong one
        except SearchTooLarge:
            continue
        if best is not None:
            return ClusterAnswer(prof.name, nodes, gpus_per_node, best)
    return ClusterAnswer(prof.name, None, gpus_per_node, None)


def smallest_clusters(spec: JobSpec, *, gpus_per_node: int = 8,
                      profiles: list[HardwareProfile] | None = None) -> list[ClusterAnswer]:
    """The smallest cluster of every GPU profile (not `cpu`) that trains the spec's model."""
    profs = profiles or [p for p in PROFILES.values() if not p.device_is_host]
    return [smallest_cluster(spec, p, gpus_per_node) for p in profs]


def model_fits_cluster(spec: JobSpec, profile: HardwareProfile | None = None) -> bool:
    """Whether some layout of the spec's own cluster fits (at its most frugal)."""
    from service.contract.hardware import get_profile

    prof = profile or get_profile(spec.target.gpu)
    return _some_family_fits(spec, ModelShape.from_spec(spec.planned_model), prof, spec.world_size,
                             spec.target.gpus_per_node)


def what_it_takes(spec: JobSpec, profile: HardwareProfile | None = None
                  ) -> list[ClusterAnswer] | None:
    """The smallest clusters per GPU type when the model fits no layout of the spec's own
    cluster (None when it fits: nothing to add)."""
    if model_fits_cluster(spec, profile):
        return None
    return smallest_clusters(spec, gpus_per_node=spec.target.gpus_per_node)


def what_it_takes_text(answers: list[ClusterAnswer]) -> str:
    return "\n".join(["The model fits no layout of this cluster. Smallest cluster that trains"
                      " it, per GPU type:", *(a.line() for a in answers)])
