"""Calibration: turn measurements of a live cluster into a hardware profile.

`trident probe` (workers side) measures achieved matmul FLOP/s and collective bus bandwidth;
`profile_from_measurements` folds them into a copy of the base profile that the control plane
stores and passes as `profile=` to `evaluate` / `search` / `plan_job` for jobs on that
cluster. `fit_overheads` fits the per-layer and per-step overhead constants to measured step
times of real jobs (what dominates tiny models on CPU), so predicted and measured converge.
`fit_stack` fits a stack's efficiency and both overheads together to the calibration jobs of
`trident probe --calibrate` (`calibration_specs`: shapes chosen so that the three separate),
and the profile it returns carries them as measured (`HardwareProfile.calibration`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from service.contract.hardware import HardwareProfile, StackCalibration
from service.planner.linear import solve_linear
from service.planner.plan import Plan, assess
from service.planner.software_stacks import get_stack

CALIBRATION_WARMUP_STEPS = 3
"""Steps of a calibration job left out of its measured step time (allocator warm-up, first
kernel choices); the median of the rest is its step time."""
CALIBRATION_STEPS = 12
CALIBRATION_SHAPES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "cpu": ((64, 1, 4), (64, 6, 4), (512, 2, 8), (256, 3, 4)),
    "gpu": ((1024, 2, 16), (1024, 8, 16), (2048, 4, 16), (1536, 4, 12)),
}
"""(hidden, layers, heads) of the calibration jobs: two depths at one width separate the
per-layer from the per-step overhead, a wider model at another depth the GEMM efficiency; the
fourth leaves the fit a degree of freedom, so that its error says how well the model holds."""


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
                                  "intra_node_bw": allreduce_busbw, "probed": source,
                                  "calibration": None,
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


def calibration_specs(profile: HardwareProfile, *, stack: str = "trident") -> list[dict[str, Any]]:
    """The job specs of `trident probe --calibrate` on `profile`: one rank each (the probe
    measured the links; these time the stack's compute and overheads), `CALIBRATION_STEPS`
    steps, fp32 on CPU ranks and bf16 on a GPU."""
    cpu = profile.device_is_host
    seq, vocab, gb, mb = (32, 256, 4, 2) if cpu else (1024, 32000, 8, 4)
    out = []
    for hidden, layers, heads in CALIBRATION_SHAPES["cpu" if cpu else "gpu"]:
        out.append({
            "name": f"calibrate-{profile.name}-h{hidden}-l{layers}",
            "model": {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab,
                      "seq_len": seq},
            "train": {"steps": CALIBRATION_STEPS, "global_batch": gb, "micro_batch": mb,
                      "precision": "fp32" if cpu else "bf16", "stack": stack},
            "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0},
            "resources": {"gpus_per_worker": 0 if cpu else 1, "cpus_per_worker": 1},
            "cluster": {"gpu": profile.name, "nodes": 1, "gpus_per_node": 1},
            "monitor": {"probe": False},
        })
    return out


def measured_step_s(step_times: Sequence[float]) -> float:
    """A calibration job's step time: the median after `CALIBRATION_WARMUP_STEPS`."""
    steady = sorted(step_times[CALIBRATION_WARMUP_STEPS:])
    if not steady:
        raise ValueError(f"{len(step_times)} steps measured; a calibration job needs more than"
                         f" {CALIBRATION_WARMUP_STEPS}")
    return steady[len(steady) // 2]


def _unit_terms(plan: Plan) -> tuple[float, float, float]:
    """(compute seconds at efficiency 1, layer micro-batch passes, the rest) of a plan: its
    step time is compute / efficiency + passes x layer overhead + step overhead + rest."""
    sc = plan.scenario
    if sc.layout.pp > 1:
        raise ValueError(f"job {plan.job or '?'}: pp({sc.layout.pp}) > 1; the calibration fits"
                         " single-stage runs (a bubble mixes compute and overheads)")
    prof = replace(sc.profile, layer_overhead_s=0.0, step_overhead_s=0.0, calibration=None)
    unit = assess(replace(sc, profile=prof, gpu_efficiency=1.0,
                          constants=replace(get_stack(sc.stack), efficiency=1.0)))
    t = unit.time
    passes = sc.micro_batches * sc.stage_blocks[t.slowest_stage] \
        * (4 / 3 if sc.layout.recompute == "full" else 1)
    return t.compute_s, passes, t.step_s - t.compute_s


def fit_stack(samples: Sequence[tuple[Plan, float]], *, jobs: Sequence[int],
              at: str) -> HardwareProfile:
    """The profile of the samples' plans with the stack's efficiency and the per-layer and
    per-step overheads fitted to measured step times (`StackCalibration`).

    Each sample is (plan of a calibration job on the profile to calibrate, its measured
    seconds per step). Weighted least squares on the relative error of
    measured = compute_at_1 / efficiency + a x passes + b + rest, three unknowns (1/efficiency,
    a, b); an overhead that comes out negative is held at 0 and the others refitted. Raises
    ValueError when the shapes cannot separate them or the fit is not physical.
    """
    if len(samples) < 3:
        raise ValueError(f"{len(samples)} calibration jobs; the fit needs 3 (two depths and"
                         " two widths)")
    stacks = {p.scenario.stack for p, _ in samples}
    profiles = {p.scenario.profile.name for p, _ in samples}
    peaks = {p.scenario.precision == "fp32" for p, _ in samples}
    if len(stacks) != 1 or len(profiles) != 1 or len(peaks) != 1:
        raise ValueError(f"calibration jobs must share one stack, one profile and one peak"
                         f" (fp32, or bf16/fp16), got stacks {sorted(stacks)}, profiles"
                         f" {sorted(profiles)} and precisions"
                         f" {sorted({p.scenario.precision for p, _ in samples})}")
    rows = []
    for plan, measured in samples:
        if not measured > 0:
            raise ValueError(f"job {plan.job}: measured step time {measured} is not positive")
        c, passes, rest = _unit_terms(plan)
        rows.append(([c, passes, 1.0], measured - rest, measured))
    free = [0, 1, 2]
    while True:
        theta = _weighted_lstsq(rows, free)
        negative = [i for i in free if i > 0 and theta[i] < 0]
        if not negative:
            break
        free.remove(negative[0])
    inv_eff, a, b = theta
    if not inv_eff > 0:
        raise ValueError("the calibration jobs' step times do not grow with their FLOPs; no"
                         " efficiency fits them")
    err = math.sqrt(sum((sum(x * t for x, t in zip(xs, theta, strict=True)) - y) ** 2 / m ** 2
                        for xs, y, m in rows) / len(rows))
    base = samples[0][0].scenario.profile
    cal = StackCalibration(stack=stacks.pop(), efficiency=1.0 / inv_eff,
                           jobs=tuple(int(j) for j in jobs), at=at, error=err,
                           precision=samples[0][0].scenario.precision)
    return replace(base, layer_overhead_s=a, step_overhead_s=b, calibration=cal)


def _weighted_lstsq(rows: Sequence[tuple[list[float], float, float]],
                    free: list[int]) -> list[float]:
    """Least squares over the `free` unknowns (the others 0), each row weighted by
    1 / measured^2 (relative errors); ValueError when they are not separable."""
    n = len(free)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for xs, y, m in rows:
        w = 1.0 / (m * m)
        for i, fi in enumerate(free):
            b[i] += w * xs[fi] * y
            for j, fj in enumerate(free):
                a[i][j] += w * xs[fi] * xs[fj]
    scale = [math.sqrt(a[i][i]) or 1.0 for i in range(n)]
    norm = [[a[i][j] / (scale[i] * scale[j]) for j in range(n)] for i in range(n)]
    if _det(norm) < 1e-9:
        raise ValueError("the calibration jobs' shapes do not separate the efficiency from the"
                         " per-layer and per-step overheads: they need two depths at one width"
                         " and another width")
    sol = solve_linear(a, b)
    theta = [0.0, 0.0, 0.0]
    for i, fi in enumerate(free):
        theta[fi] = sol[i]
    return theta


def _det(m: list[list[float]]) -> float:
    if len(m) == 1:
        return m[0][0]
    return sum((-1) ** j * m[0][j] * _det([row[:j] + row[j + 1:] for row in m[1:]])
               for j in range(len(m)))
