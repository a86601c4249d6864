"""Calibration: turn measurements of a live cluster into a hardware profile.

`trident probe` (workers side) measures achieved matmul FLOP/s and collective bus bandwidth;
`profile_from_measurements` folds them into a copy of the base profile that the control plane
stores and passes as `profile=` to `evaluate` / `search` / `plan_job` for jobs on that
cluster. `fit_overheads` fits the per-layer and per-step overhead constants to measured step
times of real jobs (what dominates tiny models on CPU), so predicted and measured converge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from service.contract.hardware import HardwareProfile
from service.planner.plan import Plan


def profile_from_measurements(
        base: HardwareProfile, *, matmul_flops: float, allreduce_busbw: float,
        precision: str = "bf16", inter_node_busbw: float | None = None,
        intra_node_latency_s: float | None = None, inter_node_latency_s: float | None = None,
        memory_bytes: float | None = None, host_memory_bytes: float | None = None,
        name: str | None = None, source: str = "trident probe") -> HardwareProfile:
    """A copy of `base` with measured rates.

    matmul_flops: achieved FLOP/s of a large square GEMM in `precision` on one device; it sets
    the peak so that the widest GEMMs reach it (peak = matmul_flops / gemm_eff_max).
    allreduce_busbw: nccl-tests bus bandwidth (bytes/s) of an all-reduce inside one node;
    inter_node_busbw: the same across nodes (per device), when measured.
    """
    if matmul_flops <= 0 or allreduce_busbw <= 0:
        raise ValueError(f"measurements must be positive: matmul_flops({matmul_flops}), "
                         f"allreduce_busbw({allreduce_busbw})")
    peak = matmul_flops / base.gemm_eff_max
    changes: dict[str, object] = {"name": name or f"{base.name}-probed",
                                  "intra_node_bw": allreduce_busbw,
                                  "source": f"{source} (base {base.name}: {base.source})"}
    changes["peak_flops_fp32" if precision == "fp32" else "peak_flops_bf16"] = peak
    for key, value in (("inter_node_bw", inter_node_busbw),
                       ("intra_node_latency_s", intra_node_latency_s),
                       ("inter_node_latency_s", inter_node_latency_s),
                       ("memory_bytes", memory_bytes), ("host_memory_bytes", host_memory_bytes)):
        if value is not None:
            changes[key] = value
    return replace(base, **changes)  # type: ignore[arg-type]


def fit_overheads(samples: Sequence[tuple[Plan, float]]) -> HardwareProfile:
    """Least-squares fit of `layer_overhead_s` and `step_overhead_s` to measured step times.

    Each sample is (plan predicted with the profile to correct, measured seconds per step).
    The model: measured = predicted_without_overheads + a * (layer micro-batch passes per
    step on the slowest stage) + b. With one sample only `a` is fitted (b kept).
    """
    if not samples:
        raise ValueError("fit_overheads needs at least one (plan, measured step) sample")
    base = samples[0][0].scenario.profile
    xs, ys = [], []
    for plan, measured in samples:
        sc = plan.scenario
        t = plan.time
        passes = sc.micro_batches * sc.stage_blocks[plan.time.slowest_stage] \
            * (4 / 3 if sc.layout.recompute == "full" else 1)
        xs.append(passes)
        ys.append(measured - (t.step_s - t.overhead_s))
    n = len(xs)
    if n == 1 or max(xs) == min(xs):
        a = max(0.0, (sum(ys) / n - base.step_overhead_s) / (sum(xs) / n))
        return replace(base, layer_overhead_s=a)
    mx, my = sum(xs) / n, sum(ys) / n
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    a = max(0.0, a)
    b = max(0.0, my - a * mx)
    return replace(base, layer_overhead_s=a, step_overhead_s=b)
