"""Text rendering for the CLI (`trident plan`): one plan, a ranked search, a capacity answer.

Pure formatting of what plan.py, search.py and capacity.py computed; no model here.
"""

from __future__ import annotations

from typing import Any

from service.contract.hardware import GB, HardwareProfile
from service.contract.prices import ProfilePrice, money, run_cost
from service.contract.spec import JobSpec
from service.planner.capacity import CanTrain, CapacityRow, capacity_text
from service.planner.explain import (
    constants_json,
    constants_text,
    explain,
    layout_name,
    tuning_notes,
)
from service.planner.job_plan import NOT_PLANNED
from service.planner.plan import Plan, evaluate
from service.planner.search import SearchResult, SearchTooLarge, nearest_fitting, search
from service.planner.stored import plan_json
from service.planner.uncertainty import ranges


def _gb(x: float) -> str:
    return f"{x / GB:8.2f} GB"


def _s(x: float) -> str:
    return f"{x * 1e3:10.2f} ms" if x < 1 else f"{x:10.3f} s "


def render_plan(plan: Plan) -> str:
    m, t, sc = plan.memory, plan.time, plan.scenario
    rg = ranges(plan)
    lines = [
        f"{plan.job or 'plan'}: {layout_name(plan)}  ({plan.world_size} x "
        f"{sc.profile.name}, {sc.precision}, m={sc.micro_batches})",
        f"  fits: {'yes' if plan.fits else 'NO'}",
        *([f"  stages ({sc.layout.partition}): blocks {sc.stage_blocks}, most loaded"
           f" {m.stage}, slowest {t.slowest_stage}"] if sc.layout.pp > 1 else []),
        f"  memory per GPU (most loaded rank, stage {m.stage}):",
        f"    params      {_gb(m.params)}",
        f"    grads       {_gb(m.grads)}",
        f"    optimizer   {_gb(m.optimizer)}",
        f"    activations {_gb(m.activations)}  ({m.in_flight:g} micro-batches in flight)",
        f"    other       {_gb(m.other)}  (logits {m.logits / GB:.2f}, ZeRO buffers "
        f"{m.zero_buffers / GB:.2f}, reserved {m.reserved / GB:.2f})",
        f"    total       {_gb(m.total)}  of {plan.capacity_bytes / GB:.1f} GB",
        f"    host/node   {_gb(m.host_per_node)}  of {plan.host_capacity_bytes / GB:.0f} GB"
        + (f"  (a save in the background: {m.checkpoint_copy / GB:.2f} per rank)"
           if m.checkpoint_copy else ""),
        "  time per step:",
        f"    compute     {_s(t.compute_s)}  (recompute {t.recompute_s * 1e3:.1f} ms, GEMM "
        f"efficiency {100 * t.gemm_efficiency:.0f}%)",
        f"    memory-bound {_s(t.elementwise_s)}  (element-wise work at HBM bandwidth)",
        f"    overheads   {_s(t.overhead_s)}",
        f"    bubble      {_s(t.bubble_s)}",
        f"    TP comm     {_s(t.tp_comm_s)}",
        f"    PP comm     {_s(t.pp_comm_s)}",
        f"    DP comm     {_s(t.dp_comm_s)}  (exposed)",
        f"    offload     {_s(t.offload_s + t.optimizer_s)}  (incl. optimizer step)",
        f"    step        {_s(t.step_s)}",
        f"  {plan.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.mfu:.1f}%, "
        f"{plan.tflops_per_gpu:.1f} TFLOP/s per GPU "
        f"({plan.hardware_tflops_per_gpu:.1f} with recompute)",
        "  shares: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in plan.shares.items()),
        f"  range: step {rg['step_s'][0]:.3g}-{rg['step_s'][1]:.3g} s, memory "
        f"{rg['memory_total'][0] / GB:.1f}-{rg['memory_total'][1] / GB:.1f} GB (held-out error"
        f" of {rg['time_basis']} runs {100 * rg['time_error']:.0f}% / "
        f"{100 * rg['memory_error']:.0f}%); dominated by {rg['dominant_time_constant']};"
        f" {rg['note']}",
        "  constants:",
        *(f"    {line}" for line in constants_text(constants_json(plan))),
        "",
        "  " + explain(plan),
    ]
    lines += [f"  - {n}" for n in tuning_notes(plan)]
    return "\n".join(lines)


def render_search(res: SearchResult, top: int = 10) -> str:
    lines = [f"{len(res.ranked)} layouts fit on {res.world_size} x {res.profile} "
             f"({res.considered} evaluated, {len(res.rejected)} rejections)",
             f"{'#':>3}  {'layout':<58} {'GB/GPU':>7} {'step':>9} {'tokens/s':>12} {'MFU':>6}"]
    for i, p in enumerate(res.ranked[:top], 1):
        lines.append(f"{i:>3}  {layout_name(p):<58} {p.memory.total / GB:7.1f} "
                     f"{p.time.step_s:9.3f} {p.tokens_per_s:12,.0f} {100 * p.mfu:5.1f}%")
    lines += ["", res.explanation()]
    if not res.ranked:
        lines += ["Rejected:"] + [f"  {r.layout}: {r.reason}" for r in res.rejected[:20]]
    return "\n".join(lines)


def render_can_train(ans: CanTrain) -> str:
    return ans.text()


def render_capacity(rows: list[CapacityRow], *, family: str, cluster: str) -> str:
    return capacity_text(rows, family=family, cluster=cluster)


def _what_it_takes(spec: JobSpec, profile: HardwareProfile | None
                   ) -> tuple[list[Any] | None, str | None]:
    """The smallest clusters that train the model, or why they were not searched (the API's
    CPU bound ran out: `trident capacity SPEC` has none)."""
    from service.planner.clusters import what_it_takes

    try:
        return what_it_takes(spec, profile), None
    except SearchTooLarge as exc:
        return None, f"{exc}; `trident capacity SPEC` answers it locally"


def _takes_json(takes: list[Any] | None, cut: str | None) -> dict[str, Any]:
    if cut is not None:
        return {"what_it_takes": None, "what_it_takes_error": cut}
    return {"what_it_takes": [a.to_json() for a in takes]} if takes else {}


def plan_cost(spec: JobSpec, plan: Plan, price: ProfilePrice | None) -> float | None:
    """What the plan's `train.steps` steps would cost at `price`: its step time times the
    steps, on its ranks, at their GPUs' (or, on CPU ranks, CPUs') price per hour."""
    return run_cost(price, step_s=plan.time.step_s, steps=spec.train.steps,
                    ranks=plan.world_size, gpus_per_rank=spec.resources.gpus_per_worker,
                    cpus_per_rank=spec.resources.cpus_per_worker)


def cost_text(spec: JobSpec, plan: Plan, price: ProfilePrice) -> str:
    """The plan's cost line (`plan_cost`), with its arithmetic."""
    cost = plan_cost(spec, plan, price)
    gpus = spec.resources.gpus_per_worker
    unit = (f"{gpus} GPU(s) at {price.gpu_hour or 0:g} per GPU-hour" if gpus else
            f"{spec.resources.cpus_per_worker:g} CPU(s) at {price.cpu_hour or 0:g} per CPU-hour")
    return (f"  cost: {money(cost)} ({spec.train.steps} steps x {plan.time.step_s:.4g} s"
            f" x {plan.world_size} ranks of {unit}, {spec.target.gpu} prices)")


class NotPlanned(ValueError):
    """A spec without a model: nothing to plan (a command job placed from resources)."""


def plan_command(spec: JobSpec, *, top: int = 5, as_json: bool = False,
                 profile: HardwareProfile | None = None,
                 price: ProfilePrice | None = None) -> str | dict[str, Any]:
    """What `trident plan SPEC [--top N] [--json]` prints.

    An explicit layout is evaluated exactly, even when it does not fit (the text then lists
    the nearest layouts that fit); `parallel: auto` searches and shows the top N and the best
    plan in full. With a `price` (the spec's profile's, `TRIDENT_PRICES`) the plan (or the
    best one) says what its steps would cost: `cost` in its JSON, a `cost:` line in the text.
    """
    from service.planner.clusters import what_it_takes_text

    if spec.model is None:
        raise NotPlanned(f"{NOT_PLANNED}; give model (and parallel) to plan it")
    priced = price is not None and (price.gpu_hour is not None or price.cpu_hour is not None)
    if isinstance(spec.parallel, str):
        res = search(spec, profile=profile)
        takes, cut = _what_it_takes(spec, profile) if res.best is None else (None, None)
        if as_json:
            out = res.to_json(top) | _takes_json(takes, cut)
            if priced and res.best is not None and out.get("best") is not None:
                out["best"]["cost"] = plan_cost(spec, res.best, price)
            return out
        text = render_search(res, top)
        if takes:
            text += "\n\n" + what_it_takes_text(takes)
        if res.ranked:
            text += "\n\n" + render_plan(res.ranked[0])
            if priced and price is not None:
                text += "\n" + cost_text(spec, res.ranked[0], price)
        return text
    plan = evaluate(spec, profile=profile)
    takes, cut = _what_it_takes(spec, profile) if not plan.fits else (None, None)
    if as_json:
        out = plan_json(plan) | _takes_json(takes, cut)
        if priced:
            out["cost"] = plan_cost(spec, plan, price)
        return out
    text = render_plan(plan)
    if priced and price is not None:
        text += "\n" + cost_text(spec, plan, price)
    if takes:  # nothing of this world size fits: no nearest layout to search for
        return (text + "\n\nNearest layouts that fit:\n  none of this world size\n\n"
                + what_it_takes_text(takes))
    if not plan.fits:
        try:
            near = nearest_fitting(spec, spec.layout, profile=profile)
        except SearchTooLarge as exc:
            return text + f"\n\nNearest layouts not searched: {exc}"
        text += "\n\nNearest layouts that fit:\n" + ("\n".join(
            f"  {layout_name(p)}: {p.memory.total / GB:.1f} GB, {p.tokens_per_s:,.0f} tokens/s"
            for p in near) or "  none of this world size")
    return text
