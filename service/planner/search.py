"""Search: every valid layout for a world size, ranked by predicted throughput.

Called by `plan_job` for `parallel: "auto"` jobs and for the nearest fitting layouts of an
explicit one, and by `trident plan`. Enumerates tp, pp (dp follows from the world size),
zero, offload, recompute, sequence parallelism, virtual stages and micro-batch; every
candidate that is rejected keeps its reason. Rejections are recorded at the level where
they are decided: a tp that does not divide the heads rejects every layout with that tp in
one entry, model states that do not fit reject all activation settings of that layout, and
the first micro-batch that does not fit rejects the larger ones (activations only grow with
it). That keeps a 175B model on 1024 GPUs well under a second (bench/bench_planner.py).

The work is bounded: micro-batches go up to the spec's largest, and a search that would
look at more than `SEARCH_BUDGET` candidates stops with `SearchTooLarge` (a 422 at the API)
instead of taking seconds of a request.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from service.contract.hardware import HardwareProfile, get_profile
from service.contract.spec import MAX_MICRO_BATCH, JobSpec, Offload, ParallelSpec, Zero
from service.planner.explain import compare, explain, layout_name
from service.planner.memory import stage_memory
from service.planner.plan import Plan, assess, param_groups
from service.planner.scenario import Scenario, ZeroConfig
from service.planner.shape import ModelShape
from service.planner.stored import plan_json

SEARCH_BUDGET = 16_000
"""Candidates (layout families and layouts with their micro-batch) one search may look at."""

ZERO_OFFLOAD: list[tuple[Zero, Offload]] = [
    (0, "none"), (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"), (3, "none"),
    (3, "optimizer"), (3, "optimizer+params")]
RECOMPUTE = ["none", "selective", "full"]


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (in O(sqrt n): n may be a batch of a million)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class SearchTooLarge(ValueError):
    """The search would look at more candidates than `SEARCH_BUDGET`, or take more CPU time
    than the `cpu_bound` it runs under."""


class SearchOutOfTime(SearchTooLarge):
    """The search ran out of the CPU time of its `cpu_bound` (not a property of the model:
    callers that try other sizes must stop too)."""


API_SEARCH_CPU_S = 0.5
"""CPU seconds of layout search one API request may spend (`cpu_bound`); `trident plan` and
`trident capacity` run locally without it."""

@dataclass
class _Bound:
    """This thread's CPU-time deadline inside `cpu_bound` (None until its first search
    charges a candidate), the bound in seconds, and the thread's CPU time when a garbage
    collection it runs began (None outside one)."""

    seconds: float
    deadline: float | None = None
    collecting_since: float | None = None

    def passed(self) -> bool:
        """Whether the searches have spent the bound; the first call starts the clock."""
        now = time.thread_time()
        if self.deadline is None:
            self.deadline = now + self.seconds
        return now > self.deadline


_BOUND: ContextVar[_Bound | None] = ContextVar("search_cpu_bound", default=None)


def _discount_collections(phase: str, info: dict[str, int]) -> None:
    """A `gc.callbacks` hook: a garbage collection that runs in a bounded search's thread
    moves the deadline by the CPU time it took. A full collection walks every object of the
    process (0.2 s for a process that imported torch and transformers, more in a larger
    one): it is not the search's work, and without this a 15 ms search could be refused."""
    bound = _BOUND.get()
    if bound is None:
        return
    if phase == "start":
        bound.collecting_since = time.thread_time()
    elif bound.collecting_since is not None:
        if bound.deadline is not None:
            bound.deadline += time.thread_time() - bound.collecting_since
        bound.collecting_since = None


gc.callbacks.append(_discount_collections)


@contextmanager
def cpu_bound(seconds: float = API_SEARCH_CPU_S) -> Iterator[None]:
    """Searches run inside stop with SearchTooLarge once this thread has spent `seconds` of
    CPU time in them: the API's bound on a request (CPU time, not wall time, so that a busy
    machine does not change which requests are refused; garbage collections the thread runs
    meanwhile do not count, `_discount_collections`). The clock starts at the first candidate
    a search charges, not on entry: what the request does before its search (the submission's
    corpus check, `service.files.data_check`) is not the search's."""
    token = _BOUND.set(_Bound(seconds=seconds))
    try:
        yield
    finally:
        _BOUND.reset(token)


@dataclass(frozen=True)
class Rejection:
    """A layout, or a family of layouts (the fields given), and why it cannot be used."""

    layout: dict[str, Any]
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "reason": self.reason}


@dataclass
class SearchResult:
    world_size: int
    profile: str
    ranked: list[Plan] = field(default_factory=list)
    """Layouts that fit, fastest first."""
    rejected: list[Rejection] = field(default_factory=list)
    considered: int = 0
    """Candidates evaluated by the model (rejections by rule are not evaluated)."""
    work: int = 0
    """Candidates looked at: families whose floor was computed, and layouts with their
    micro-batch, evaluated or rejected by rule; bounded by `budget`."""
    budget: int = SEARCH_BUDGET

    def charge(self, spec: JobSpec) -> None:
        """Count one candidate; SearchTooLarge once the budget (or the CPU bound) is spent."""
        self.work += 1
        bound = _BOUND.get() if self.work % 64 in (0, 1) else None
        if bound is not None and bound.passed():
            raise SearchOutOfTime(
                f"the layout search of {self.world_size} ranks used the {bound.seconds:g} s of CPU"
                f" a request may spend, after {self.work} candidates; give an explicit"
                " parallel layout, or run `trident plan SPEC` locally (no such bound)")
        if self.work > self.budget:
            t, m = spec.train, spec.planned_model
            raise SearchTooLarge(
                f"the layout search of {self.world_size} ranks would look at more than"
                f" {self.budget} candidates (layers {m.layers}, global_batch {t.global_batch}"
                f" with {len(divisors(t.global_batch))} divisors); give an explicit parallel"
                " layout, or a global_batch or world size with fewer divisors")

    @property
    def best(self) -> Plan | None:
        return self.ranked[0] if self.ranked else None

    def alternatives(self, n: int = 3) -> list[Plan]:
        """The fastest plans whose (tp, pp, zero) differ from the best and from each other."""
        seen = set()
        out = []
        for p in self.ranked:
            key = (p.layout.tp, p.layout.pp, p.layout.zero)
            if key in seen:
                continue
            seen.add(key)
            out.append(p)
            if len(out) > n:
                break
        return out[1:]

    def explanation(self) -> str:
        best = self.best
        if best is None:
            reasons = sorted({r.reason for r in self.rejected})[:5]
            return "No layout fits: " + "; ".join(reasons)
        lines = [f"Best of {len(self.ranked)} fitting layouts ({self.considered} evaluated, "
                 f"{len(self.rejected)} rejections): {explain(best)}"]
        lines += [compare(best, other) for other in self.alternatives()]
        return " ".join(lines)

    def to_json(self, top: int = 10) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "profile": self.profile,
            "considered": self.considered,
            "fitting": len(self.ranked),
            "best": plan_json(self.best) if self.best else None,
            "ranked": [p.summary() | {"name": layout_name(p)} for p in self.ranked[:top]],
            "rejected": [r.to_json() for r in self.rejected],
            "explanation": self.explanation(),
        }


def search(spec: JobSpec, *, profile: HardwareProfile | None = None,
           world_size: int | None = None, zero_cfg: ZeroConfig | None = None,
           gpus_per_node: int | None = None, budget: int = SEARCH_BUDGET,
           only: Callable[[ParallelSpec], bool] | None = None) -> SearchResult:
    """Every valid layout of `world_size` ranks (default: the spec's), ranked; SearchTooLarge
    when that would look at more than `budget` candidates. `only`: the layout families (tp,
    pp, dp, zero, offload) to consider at all (the others are left out, not rejected: an
    elastic re-plan looks only at the layouts its checkpoint conversion reaches)."""
    prof = profile or get_profile(spec.target.gpu)
    shape = ModelShape.from_spec(spec.planned_model)
    world = world_size or spec.world_size
    gpn = gpus_per_node or spec.target.gpus_per_node
    gb_ = spec.train.global_batch
    res = SearchResult(world_size=world, profile=prof.name, budget=budget)
    base = Scenario(shape=shape, layout=ParallelSpec(), micro_batch=1, global_batch=gb_,
                    precision=spec.train.precision, profile=prof, gpus_per_node=gpn,
                    nodes=max(1, -(-world // gpn)), zero_cfg=zero_cfg or ZeroConfig(),
                    stack=spec.train.stack, param_groups=param_groups(spec))
    cap = prof.memory_bytes
    for tp in divisors(world):
        why = _tp_problem(shape, tp)
        if why:
            res.rejected.append(Rejection({"tp": tp}, why))
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            fam = {"tp": tp, "pp": pp, "dp": dp}
            if shape.layers < pp:
                res.rejected.append(Rejection(
                    fam, f"layers({shape.layers}) is fewer than pp({pp}) stages"))
                continue
            if gb_ % dp:
                res.rejected.append(Rejection(
                    fam, f"global_batch({gb_}) is not divisible by dp({dp})"))
                continue
            if (ramp := spec.train.batch_ramp) is not None and (
                    ramp.start % dp or ramp.increment % dp):
                res.rejected.append(Rejection(
                    fam, f"train.batch_ramp: start({ramp.start}) and increment"
                         f"({ramp.increment}) are not both divisible by dp({dp})"))
                continue
            for zero, offload in ZERO_OFFLOAD:
                lay0 = ParallelSpec(tp=tp, pp=pp, dp=dp, zero=zero, offload=offload,
                                    recompute="full", sequence_parallel=tp > 1)
                if only is not None and not only(lay0):
                    continue
                fam2 = fam | {"zero": zero, "offload": offload}
                if zero >= 2 and pp > 1:
                    res.rejected.append(Rejection(
                        fam2, f"zero({zero}) with pp({pp}) > 1 is not supported by "
                              "DeepSpeed's pipeline engine"))
                    continue
                _search_family(res, replace(base, layout=lay0), fam2, cap, spec)
    res.ranked.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    return res


def _tp_problem(shape: ModelShape, tp: int) -> str:
    if shape.heads % tp:
        return f"tp({tp}) does not divide heads({shape.heads})"
    if shape.kv_heads % tp:
        return f"tp({tp}) does not divide kv_heads({shape.kv_heads})"
    if shape.ffn_hidden % tp:
        return f"tp({tp}) does not divide ffn_hidden({shape.ffn_hidden})"
    return ""


def _search_family(res: SearchResult, sc0: Scenario, fam: dict[str, Any], cap: float,
                   spec: JobSpec) -> None:
    """All activation settings of one (tp, pp, dp, zero, offload)."""
    lay0 = sc0.layout
    res.charge(spec)
    # The smallest footprint this family can have: full recompute, SP, micro-batch 1.
    floor = stage_memory(sc0, 0)
    if floor.total > cap:
        res.rejected.append(Rejection(
            fam, f"model states alone: params {floor.params / 1e9:.1f} + grads "
                 f"{floor.grads / 1e9:.1f} + optimizer {floor.optimizer / 1e9:.1f} GB, with "
                 f"micro_batch 1 and full recompute {floor.total / 1e9:.1f} GB > capacity "
                 f"{cap / 1e9:.1f} GB"))
        return
    if floor.host_per_node > sc0.profile.host_memory_bytes:
        res.rejected.append(Rejection(
            fam, f"host memory {floor.host_per_node / 1e9:.1f} GB per node > "
                 f"{sc0.profile.host_memory_bytes / 1e9:.1f} GB"))
        return
    tp, pp, dp = lay0.tp, lay0.pp, lay0.dp
    per_replica = sc0.global_batch // dp
    # Interleaving only over even splits; uneven stages run the plain 1F1B schedule.
    # A batch ramp: every batch of it whole micro-batches on every replica, and one schedule
    # (no interleaving); the rest is planned at the full batch, what the run ends at.
    ramp = spec.train.batch_ramp
    vs = [1] + ([v for v in divisors(sc0.shape.layers // pp) if v > 1]
                if pp > 1 and sc0.shape.layers % pp == 0 and ramp is None else [])
    mbs = [mb for mb in divisors(per_replica) if mb <= MAX_MICRO_BATCH and (
        ramp is None or not (ramp.start % (mb * dp) or ramp.increment % (mb * dp)))]
    for recompute in RECOMPUTE:
        for sp in ([False, True] if tp > 1 else [False]):
            for v in vs:
                lay = lay0.model_copy(update={"recompute": recompute, "sequence_parallel": sp,
                                              "virtual_stages": v})
                for mb in mbs:
                    res.charge(spec)
                    m = per_replica // mb
                    entry = fam | {"recompute": recompute, "sequence_parallel": sp,
                                   "virtual_stages": v, "micro_batch": mb}
                    if v > 1 and m % pp:
                        res.rejected.append(Rejection(
                            entry, f"interleaving needs micro-batches({m}) divisible by "
                                   f"pp({pp})"))
                        continue
                    plan = assess(replace(sc0, layout=lay, micro_batch=mb))
                    res.considered += 1
                    if not plan.fits:
                        entry["micro_batch"] = f">={mb}"
                        res.rejected.append(Rejection(entry, "; ".join(plan.reasons)))
                        break
                    res.ranked.append(plan)


def nearest_fitting(spec: JobSpec, layout: ParallelSpec, *, n: int = 3,
                    profile: HardwareProfile | None = None,
                    zero_cfg: ZeroConfig | None = None,
                    result: SearchResult | None = None) -> list[Plan]:
    """Fitting layouts of the same world size that change the fewest fields of `layout`."""
    res = result or search(spec, profile=profile, zero_cfg=zero_cfg,
                           world_size=layout.tp * layout.pp * layout.dp)
    want = layout.model_dump() | {"micro_batch": spec.train.micro_batch}

    def distance(p: Plan) -> tuple[int, float]:
        got = p.layout_json()
        return (sum(got[k] != want[k] for k in want), -p.tokens_per_s)

    return sorted(res.ranked, key=distance)[:n]
