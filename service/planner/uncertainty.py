"""How sure a prediction is: ranges from the planner's error on published runs it never saw.

The half-width of a range is the held-out (leave-one-source-out) mean absolute error of the
published runs of the same stack and GPU type, else of the same stack, else of all runs
(`uncertainty` in data/fitted.json, written by `python -m service.planner.fit --write`). The
plan also names the constant that dominates the uncertainty, from the share of the step or of
the bytes it drives, and says that `trident probe` on the real cluster narrows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.planner.software_stacks import fitted_constants

if TYPE_CHECKING:
    from service.planner.plan import Plan

DEFAULT_ERROR = 0.25
"""Half-width used when no fitted file is present (the issue's observed error)."""
PROBE_NOTE = ("`trident probe` on the real cluster measures matmul FLOP/s and collective bus"
              " bandwidth and replaces the profile's constants, which narrows this range;"
              " with --calibrate its calibration jobs measure the trident stack's efficiency"
              " and overheads too (`constants` says which are measured)")


def held_out_error(what: str, stack: str, gpu: str) -> tuple[float, str]:
    """(error, the group it comes from) for `time_error` or `memory_error`."""
    table = fitted_constants().get("uncertainty", {}).get(what, {})
    for key in (f"{stack}/{gpu}", stack, "*"):
        if key in table:
            return float(table[key]), key
    return DEFAULT_ERROR, "default"


def _dominant_time(plan: Plan) -> str:
    t = plan.time
    parts = {
        "efficiency (the stack x GPU GEMM rate: gemm_eff_max, the fitted efficiency)":
            t.compute_s + t.bubble_s + t.overhead_s,
        "HBM bandwidth (memory-bound element-wise work)": t.elementwise_s,
        "intra-node bandwidth (TP all-reduces)": t.tp_comm_s,
        "inter-node bandwidth and dp_overlap (exposed DP/ZeRO traffic)": t.dp_comm_s,
        "pipeline send latency and bandwidth": t.pp_comm_s,
        "host link bandwidth and CPU Adam rate (offload)": t.offload_s + t.optimizer_s,
    }
    return max(parts, key=lambda k: parts[k])


def _dominant_memory(plan: Plan) -> str:
    m = plan.memory
    parts = {
        "activation bytes (recompute and the stack's attention kernel)": m.activations + m.logits,
        "model-state bytes per parameter (the stack's optimizer layout)": m.model_states,
        "framework and ZeRO buffers": m.zero_buffers + m.framework,
        "allocator slack, CUDA context and NCCL buffers":
            m.allocator_slack + m.cuda_context + m.nccl_buffers,
    }
    return max(parts, key=lambda k: parts[k])


def ranges(plan: Plan) -> dict[str, Any]:
    sc = plan.scenario
    te, tkey = held_out_error("time_error", sc.stack, sc.profile.name)
    me, mkey = held_out_error("memory_error", sc.stack, sc.profile.name)
    step, mem = plan.time.step_s, plan.memory.total
    return {
        "step_s": [step * (1 - te), step * (1 + te)],
        "memory_total": [mem * (1 - me), mem * (1 + me)],
        "time_error": te, "time_basis": tkey, "memory_error": me, "memory_basis": mkey,
        "dominant_time_constant": _dominant_time(plan),
        "dominant_memory_constant": _dominant_memory(plan),
        "note": PROBE_NOTE,
    }
