"""Words for a plan: the deciding trade-off and tuning notes.

`explain(plan)` says where the step goes and what the layout pays for; `compare(best,
other)` says why the best beat another candidate; `tuning_notes(plan)` lists concrete
settings to look at (recompute, micro-batch count against the bubble, ZeRO-3 against its
communication share, NCCL settings). Called by `plan_json` (stored.py) for the plan a job
stores, by report.py for `trident plan`, and by search.py for the ranked result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.contract.hardware import GB, PROFILES

if TYPE_CHECKING:
    from service.planner.plan import Plan


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def layout_name(plan: Plan) -> str:
    lay = plan.layout
    parts = [f"tp{lay.tp}", f"pp{lay.pp}", f"dp{lay.dp}", f"zero{lay.zero}"]
    if lay.virtual_stages > 1:
        parts.append(f"v{lay.virtual_stages}")
    if lay.sequence_parallel:
        parts.append("sp")
    if lay.recompute != "none":
        parts.append(f"recompute={lay.recompute}")
    if lay.offload != "none":
        parts.append(f"offload={lay.offload}")
    parts.append(f"mb{plan.micro_batch}")
    return " ".join(parts)


def explain(plan: Plan) -> str:
    sc, t, mem = plan.scenario, plan.time, plan.memory
    lay = sc.layout
    lines = [
        f"{layout_name(plan)} on {plan.world_size} x {sc.profile.name}: "
        f"{'fits' if plan.fits else 'does NOT fit'} at {mem.total / GB:.1f} of "
        f"{plan.capacity_bytes / GB:.1f} GB per GPU (stage {mem.stage}); step "
        f"{t.step_s:.3g} s, {plan.tokens_per_s:,.0f} tokens/s, MFU {_pct(plan.mfu)}."]
    costs = {
        "TP all-reduces": t.tp_comm_s, "the pipeline bubble": t.bubble_s,
        "PP sends": t.pp_comm_s, "DP/ZeRO communication": t.dp_comm_s,
        "recompute": t.recompute_s, "offload and CPU optimizer": t.offload_s + t.optimizer_s,
        "per-op overheads": t.overhead_s, "memory-bound element-wise work": t.elementwise_s}
    name, worst = max(costs.items(), key=lambda kv: kv[1])
    if worst > 0:
        detail = ""
        if name == "TP all-reduces":
            spans = lay.tp > sc.gpus_per_node
            where = "spans nodes and pays the inter-node link" if spans else "inside one node"
            detail = f" (tp{lay.tp} {where})"
        elif name == "the pipeline bubble":
            frac = (lay.pp - 1) / (lay.virtual_stages * sc.micro_batches)
            detail = (f" ((pp-1)/(v*m) = ({lay.pp}-1)/({lay.virtual_stages}*"
                      f"{sc.micro_batches}) = {frac:.2f})")
        elif name == "DP/ZeRO communication":
            spans = lay.tp * lay.dp > sc.gpus_per_node
            detail = (f" (zero{lay.zero} over dp{lay.dp}, "
                      f"{'across nodes' if spans else 'inside one node'})")
        lines.append(f"Largest cost besides compute: {name}, {t_s(worst)} = "
                     f"{_pct(worst / t.step_s)} of the step{detail}.")
    if not plan.fits:
        lines.extend(plan.reasons)
    return " ".join(lines)


def t_s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def compare(best: Plan, other: Plan) -> str:
    """Why `best` beats `other`: the part of the step where they differ most."""
    keys = ["compute_s", "bubble_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "offload_s",
            "optimizer_s", "overhead_s", "elementwise_s"]
    diffs = {k: getattr(other.time, k) - getattr(best.time, k) for k in keys}
    k, d = max(diffs.items(), key=lambda kv: kv[1])
    label = {"compute_s": "compute on its slowest stage (recompute, GEMM efficiency or the LM "
                          "head on the last stage)", "bubble_s":
             "the pipeline bubble", "tp_comm_s": "TP all-reduce", "pp_comm_s": "PP sends",
             "dp_comm_s": "DP/ZeRO communication", "offload_s": "offload transfers",
             "optimizer_s": "the optimizer step", "overhead_s": "per-op overheads",
             "elementwise_s": "memory-bound element-wise work"}[k]
    sc, lay = other.scenario, other.layout
    if k == "tp_comm_s":
        label += (f" over the inter-node link (tp{lay.tp} > {sc.gpus_per_node} GPUs per node)"
                  if lay.tp > sc.gpus_per_node else f" (tp{lay.tp} inside a node)")
    elif k == "bubble_s":
        frac = (lay.pp - 1) / (lay.virtual_stages * sc.micro_batches)
        label += (f" at {sc.micro_batches} micro-batches ((pp-1)/(v*m) = {lay.pp - 1}/"
                  f"({lay.virtual_stages}*{sc.micro_batches}) = {frac:.2f})")
    elif k == "dp_comm_s":
        label += f" (zero{lay.zero} over dp{lay.dp})"
    return (f"{layout_name(other)} is {_pct(other.time.step_s / best.time.step_s - 1)} slower: "
            f"it loses {t_s(d)} per step to {label}.")


def tuning_notes(plan: Plan) -> list[str]:
    sc, t = plan.scenario, plan.time
    lay = sc.layout
    notes: list[str] = []
    m = sc.micro_batches
    headroom = 1 - plan.memory.total / plan.capacity_bytes
    if 0 <= headroom < 0.05:
        notes.append(f"Only {_pct(headroom)} memory headroom: allocator fragmentation can still "
                     "run out of memory; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True helps, "
                     "or take the next layout with more room.")
    if lay.pp > 1:
        frac = (lay.pp - 1) / (lay.virtual_stages * m)
        if frac > 0.1:
            notes.append(
                f"Pipeline bubble is {_pct(frac)} of compute: raise the micro-batch count "
                f"(m = {m}; global_batch or a smaller micro_batch) or interleave "
                f"(virtual_stages) to shrink (pp-1)/(v*m).")
    if lay.recompute == "full" and plan.fits:
        notes.append("Full recompute costs about a third more compute; try selective recompute "
                     "(with sequence_parallel when tp > 1) if memory allows.")
    if lay.tp > 1 and not lay.sequence_parallel:
        notes.append("sequence_parallel shards the LayerNorm/dropout activations at no extra "
                     "communication; enable it with tp > 1.")
    if lay.zero == 3 and t.dp_comm_s / t.step_s > 0.15:
        notes.append(f"ZeRO-3 gathers cost {_pct(t.dp_comm_s / t.step_s)} of the step: ZeRO-1/2 "
                     "or more TP/PP may be faster if memory allows; raise "
                     "stage3_prefetch_bucket_size to overlap more.")
    if lay.tp > sc.gpus_per_node:
        notes.append(f"tp({lay.tp}) > gpus_per_node({sc.gpus_per_node}): TP all-reduces cross "
                     "the inter-node link; keep tp within a node.")
    if lay.dp * lay.tp > sc.gpus_per_node and lay.dp > 1:
        notes.append("DP gradients cross nodes: NCCL_IB_* / NCCL_SOCKET_IFNAME must name the "
                     "fast fabric; NCCL_ALGO=Ring,Tree lets NCCL use trees at scale.")
    if lay.offload != "none":
        notes.append("CPU offload: the optimizer step runs on host cores; pin memory and give "
                     "each rank enough CPU threads (OMP_NUM_THREADS).")
    return notes


def constants_json(plan: Plan) -> dict[str, dict[str, Any]]:
    """Each constant of the step-time model that sets this plan's efficiency: its value,
    `measured` (on this cluster: by `trident probe`, and by its calibration jobs, with which
    and when) or `assumed` (with the source text of the figure used instead)."""
    from service.planner.software_stacks import FITTED_PATH, get_stack, profile_efficiency

    sc = plan.scenario
    prof, cal = sc.profile, sc.calibration
    # What a probe did not measure is the built-in profile's figure, with its source.
    book = PROFILES[prof.name].source if prof.probed and prof.name in PROFILES else prof.source
    probed = ("measured", prof.probed) if prof.probed else ("assumed", book)
    # The overheads are the profile's: measured by its calibration jobs, whatever this plan's
    # stack and precision; the efficiency only where the calibration covers both.
    timed = prof.calibration
    calibrated = ("measured", timed.source) if timed is not None else ("assumed", book)
    stack = sc.stack_constants
    if cal is not None:
        eff = ("measured", cal.source)
    else:
        fitted = (f"the {stack.name} stack's efficiency {stack.efficiency:g} x the"
                  f" {prof.name} GEMM factor {profile_efficiency(prof.name):g}, fitted to"
                  f" published runs ({FITTED_PATH.name}; priors in software_stacks.py):"
                  f" {get_stack(stack.name).source}")
        if timed is not None and timed.stack == sc.stack:
            fitted = (f"calibrated in {timed.precision} only ({timed.source}); {sc.precision}"
                      f" runs on the other peak: {fitted}")
        eff = ("assumed", fitted)

    def row(value: Any, how: tuple[str, str]) -> dict[str, Any]:
        return {"value": value, "status": how[0], "source": how[1]}

    return {
        "efficiency": row(sc.efficiency, eff),
        "layer_overhead_s": row(prof.layer_overhead_s, calibrated),
        "step_overhead_s": row(prof.step_overhead_s, calibrated),
        "peak_flops": row(sc.peak_flops(), probed),
        "intra_node_bw": row(prof.intra_node_bw, probed),
        "gemm_curve": row({"max": prof.gemm_eff_max, "half_width": prof.gemm_half_width},
                          ("assumed", book)),
        "dp_overlap": row(stack.dp_overlap if stack.dp_overlap is not None else prof.dp_overlap,
                          ("assumed", stack.source if stack.dp_overlap is not None else book)),
    }


def constants_text(constants: dict[str, dict[str, Any]]) -> list[str]:
    """One line per constant: measured or assumed, and from where (the what-if views)."""
    out = []
    for name, c in constants.items():
        value = c["value"]
        shown = ", ".join(f"{k} {v:g}" for k, v in value.items()) if isinstance(value, dict) \
            else f"{value:.4g}"
        source = c["source"] if c["status"] == "measured" else c["source"][:80] + (
            "..." if len(c["source"]) > 80 else "")
        out.append(f"{name} {shown}: {c['status']} ({source})")
    return out
