"""Step time of one layout, split by where it goes.

Called by `evaluate` (plan.py). The model (docs/planner-model.md, with its sources):

- compute: FLOPs of the slowest pipeline stage per micro-batch (forward, backward = 2x
  forward, plus the recomputed forward: all of it for full recompute, the attention core for
  selective) at peak x a GEMM efficiency that rises with the per-GPU GEMM width h/tp, plus
  the profile's fixed per-layer overhead;
- memory-bound work outside the GEMMs (`elementwise_bytes`: norms, residual adds, dropouts,
  the MLP's activation, rotary positions, a flash kernel's reads and writes) at the
  profile's HBM bandwidth, per block and micro-batch on the critical path (GPU profiles);
- TP: Megatron's all-reduces of b*s*h elements, 2 forward and 2 backward per layer per
  micro-batch (a third pair with full recompute; sequence parallelism's reduce-scatter +
  all-gather cost the same), on the critical path;
- pipeline bubble: (p - 1) / v micro-batch times (1F1B, interleaved);
- PP: one send forward and one backward per micro-batch per model chunk, b*s*h/tp elements
  each (Megatron's scatter/gather of the boundary activation over the TP group);
- DP/ZeRO: ring collectives over the DP group: one all-reduce of the gradients per step
  (ZeRO-0/1), a reduce-scatter per micro-batch plus one parameter all-gather per step
  (ZeRO-2, as DeepSpeed reduces at every micro-step), and for ZeRO-3 two parameter
  all-gathers and one gradient reduce-scatter per micro-batch. A fraction `dp_overlap` of it
  hides behind backward compute, never more than the backward time available;
- offload: gradients down and weights up over the host link per step (parameters each
  forward and backward with parameter offload), and the CPU Adam step on the node's cores;
  without offload, the GPU Adam step is memory-bound at HBM bandwidth.

Ring collectives (alpha-beta): all-reduce 2(n-1)a + 2(n-1)/n * S/B; all-gather and
reduce-scatter (n-1)a + (n-1)/n * S/B, with B the link the group really uses: a group
inside one node uses the intra-node bus bandwidth, a group spanning nodes the per-device
inter-node bandwidth times its ranks per node (NCCL's rings run one rail per NIC; at most
the intra-node bus bandwidth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from service.planner import sac
from service.planner.scenario import Scenario


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per optimizer step; `step_s` is the sum of the exposed parts."""

    step_s: float
    compute_s: float
    """Forward, backward and recompute of all micro-batches on the slowest stage."""
    recompute_s: float
    """The part of compute_s spent recomputing activations."""
    bubble_s: float
    """Pipeline fill and drain: (p-1)/v micro-batch times."""
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    """Exposed (not overlapped) DP/ZeRO communication, ZeRO-3 gathers included."""
    zero3_gather_s: float
    """ZeRO-3 parameter all-gathers before overlap (part of dp_comm_s's source)."""
    offload_s: float
    """Host link transfers for CPU offload."""
    optimizer_s: float
    """Optimizer step: CPU Adam with offload, memory-bound GPU Adam otherwise."""
    overhead_s: float
    """Fixed per-layer launch overheads and the per-step overhead of the profile."""
    gemm_efficiency: float
    """Fraction of peak FLOP/s assumed for this layout's GEMMs."""
    hardware_flops: float
    """FLOPs executed per step by all ranks, recompute included."""
    slowest_stage: int = 0
    """The pipeline stage whose micro-batch takes longest: it sets the pipeline's pace."""
    stage_micro_batch_s: list[float] = field(default_factory=list)
    """Compute seconds of one micro-batch (forward, backward, recompute) on each stage."""
    elementwise_s: float = 0.0
    """Memory-bound work outside the GEMMs (norms, residual adds, dropouts, the MLP's
    activation, rotary positions, a flash kernel's reads and writes) at HBM bandwidth."""

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def ring_time(kind: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Alpha-beta ring time of one collective over `n` ranks of `nbytes` bytes per rank."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) * alpha + (n - 1) / n * nbytes / bw
    raise ValueError(f"unknown collective {kind!r}")


def group_link(sc: Scenario, stride: int, size: int) -> tuple[float, float, bool]:
    """(bandwidth, latency, spans_nodes) of a group of `size` ranks `stride` apart.

    A group spanning nodes with k of its ranks on each node runs NCCL's rings on k rails:
    each channel's ring leaves a node through the NIC of the GPU it exits from, so the k
    ranks' NICs carry the inter-node hops side by side and the ring's bus bandwidth is
    k x the per-device inter-node bandwidth (one NIC per GPU, as on DGX nodes), never more
    than the intra-node bus the ring also crosses. With one rank per node (Megatron's DP
    groups under TP 8, `trident probe`'s DP groups) it is the per-device bandwidth."""
    spans = stride * size > sc.gpus_per_node if size > 1 else False
    prof = sc.profile
    if spans:
        per_node = min(size, sc.gpus_per_node // stride) if stride < sc.gpus_per_node else 1
        return (min(prof.intra_node_bw, max(1, per_node) * prof.inter_node_bw),
                prof.inter_node_latency_s, True)
    return prof.intra_node_bw, prof.intra_node_latency_s, False


def gemm_efficiency(sc: Scenario) -> float:
    width = sc.shape.hidden / sc.layout.tp
    prof = sc.profile
    return prof.gemm_eff_max * width / (width + prof.gemm_half_width) * sc.efficiency


def step_time(sc: Scenario) -> TimeBreakdown:
    shape, lay = sc.shape, sc.layout
    t, p, v, n, m, b = lay.tp, lay.pp, lay.virtual_stages, lay.dp, sc.micro_batches, \
        sc.micro_batch
    w = sc.act_bytes
    tokens = b * shape.seq_len
    eff = gemm_efficiency(sc)
    rate = sc.peak_flops() * eff

    # Per micro-batch compute on one rank of the slowest stage (the pipeline runs at its pace).
    layer_fwd = shape.layer_forward_flops(tokens) / t
    extra = {"none": 0.0, "selective": shape.attention_core_flops(tokens) / t,
             "op": tokens * sac.recompute_flops_per_token(shape, tp=t),
             "full": layer_fwd}[sc.recompute]
    head_fwd = shape.head_forward_flops(tokens) / t
    per_layer_overhead = sc.profile.layer_overhead_s * (4 / 3 if lay.recompute == "full" else 1)
    # On a host "device" (`cpu`) the per-layer overhead is fitted to the trainer's measured
    # steps and holds this work already.
    block_mem = 0.0 if sc.profile.device_is_host else elementwise_bytes(sc, b) / sc.profile.hbm_bw
    stage_s = stage_micro_batch_seconds(sc, layer_fwd, extra, head_fwd, rate,
                                        per_layer_overhead + block_mem)
    longest = max(stage_s)
    slowest = p - 1 - stage_s[::-1].index(longest)  # the last of equals (it has the head)
    layers = sc.stage_blocks[slowest]
    mb_flops = layers * (3 * layer_fwd + extra) + (3 * head_fwd if slowest == p - 1 else 0.0)
    mb_recompute = layers * extra
    overhead_mb = layers * per_layer_overhead
    elementwise_mb = layers * block_mem
    mb_compute = mb_flops / rate + overhead_mb + elementwise_mb

    # TP all-reduces on the critical path.
    tp_bw, tp_alpha, _ = group_link(sc, 1, t)
    n_ar = 6 if lay.recompute == "full" else 4
    tp_mb = layers * n_ar * ring_time("all_reduce", tokens * shape.hidden * w, t, tp_bw,
                                      tp_alpha)
    mb_time = mb_compute + tp_mb

    compute_s = m * (mb_flops / rate)
    recompute_s = m * mb_recompute / rate
    overhead_s = m * overhead_mb + sc.profile.step_overhead_s
    elementwise_s = m * elementwise_mb
    tp_comm_s = m * tp_mb
    bubble_s = (p - 1) / v * mb_time

    # PP point-to-point.
    pp_comm_s = 0.0
    if p > 1:
        pp_bw, pp_alpha, _ = group_link(sc, t * n, p)
        msg = tokens * shape.hidden * w / t
        pp_comm_s = m * v * 2 * (pp_alpha + msg / pp_bw)

    # DP / ZeRO collectives over the rank's parameter shard.
    dp_bw, dp_alpha, _ = group_link(sc, t, n)
    pr = _params_per_rank(sc)
    grad_bytes = pr * w
    zero3_gather_s = 0.0
    if lay.zero in (0, 1):
        dp_raw = ring_time("all_reduce", grad_bytes, n, dp_bw, dp_alpha)
        window = (2 / 3) * mb_compute  # the last micro-batch's backward
    elif lay.zero == 2:
        dp_raw = (m * ring_time("reduce_scatter", grad_bytes, n, dp_bw, dp_alpha)
                  + ring_time("all_gather", grad_bytes, n, dp_bw, dp_alpha))
        window = m * (2 / 3) * mb_compute
    else:
        zero3_gather_s = m * 2 * ring_time("all_gather", grad_bytes, n, dp_bw, dp_alpha)
        dp_raw = zero3_gather_s + m * ring_time("reduce_scatter", grad_bytes, n, dp_bw,
                                                dp_alpha)
        window = m * mb_compute
    overlap = sc.stack_constants.dp_overlap
    hidden = min((sc.profile.dp_overlap if overlap is None else overlap) * dp_raw, window)
    dp_comm_s = dp_raw - hidden

    # Optimizer and offload.
    shard = pr / n if lay.zero >= 1 else pr
    ranks_per_node = min(sc.gpus_per_node, sc.dims.world_size)
    offload_s = 0.0
    if lay.offload == "none":
        # Adam reads and writes weights, master, m, v and reads gradients: ~36 bytes/param.
        optimizer_s = shard * 36 / sc.profile.hbm_bw
    else:
        optimizer_s = shard * ranks_per_node / sc.profile.cpu_adam_params_per_s
        offload_s = 2 * shard * w / sc.profile.host_link_bw
        if lay.offload == "optimizer+params":
            offload_s += m * 2 * shard * w / sc.profile.host_link_bw

    step_s = (compute_s + elementwise_s + overhead_s + tp_comm_s + bubble_s + pp_comm_s + dp_comm_s
              + offload_s + optimizer_s)
    hardware_flops = (shape.model_flops(sc.global_batch * shape.seq_len)
                      + sc.global_batch / b * shape.layers * extra * t)
    return TimeBreakdown(
        step_s=step_s, compute_s=compute_s, recompute_s=recompute_s, bubble_s=bubble_s,
        tp_comm_s=tp_comm_s, pp_comm_s=pp_comm_s, dp_comm_s=dp_comm_s,
        zero3_gather_s=zero3_gather_s, offload_s=offload_s, optimizer_s=optimizer_s,
        overhead_s=overhead_s, gemm_efficiency=eff, hardware_flops=hardware_flops,
        slowest_stage=slowest, stage_micro_batch_s=stage_s, elementwise_s=elementwise_s)


def elementwise_bytes(sc: Scenario, b: int) -> float:
    """HBM bytes one block moves per micro-batch on one rank outside its GEMMs.

    Per token, in elements of the training precision (one byte per dropout-mask element):
    forward, each op reads its inputs and writes its output: two norms 2h each, two residual
    adds 3h each (with their dropouts, 2h and an h-byte mask each), the MLP's activation 2f
    (GELU) or 3f (SwiGLU's gate x up), rotary positions 2(q + kv) for q and k, a flash
    kernel's q, k, v in and o out; backward reads the saved input and the output gradient
    and writes the input gradient: norms 3h, residual branches 3h, activation 3f or 5f, the
    flash kernel's q, k, v, o, dO in and dQ, dK, dV out. Full recompute runs the forward
    again. Norms and residual adds are whole on every TP rank (split with sequence
    parallelism); the rest is split over TP. The s x s attention scores of a non-flash
    kernel are not counted (docs/planner.md says why)."""
    shape, lay, w = sc.shape, sc.layout, sc.act_bytes
    h, f, q, kv = shape.hidden, shape.ffn_hidden, shape.q_dim, shape.kv_dim
    drop = shape.dropout and sc.stack_constants.dropout
    rep_f = 2 * 2 * h + 2 * 3 * h + (2 * 2 * h if drop else 0)
    rep_b = 2 * 3 * h + 2 * 3 * h + (2 * 2 * h if drop else 0)
    mask = (2 * h / w) if drop else 0.0
    act_f, act_b = (3 * f, 5 * f) if shape.swiglu else (2 * f, 3 * f)
    rot = 2 * (q + kv) if shape.positions == "rotary" else 0
    fl_f, fl_b = (2 * q + 2 * kv, 4 * q + 4 * kv) if sc.flash else (0, 0)
    rep_div = lay.tp if lay.sequence_parallel else 1
    fwd = (rep_f + mask) / rep_div + (act_f + rot + fl_f) / lay.tp
    bwd = (rep_b + mask) / rep_div + (act_b + rot + fl_b) / lay.tp
    again = fwd if sc.recompute == "full" else 0.0
    return b * shape.seq_len * w * (fwd + bwd + again)


def stage_micro_batch_seconds(sc: Scenario, layer_fwd: float, extra: float, head_fwd: float,
                              rate: float, per_layer_overhead: float) -> list[float]:
    """One micro-batch's compute on each stage: its blocks, and the head on the last."""
    p = sc.layout.pp
    per_block = (3 * layer_fwd + extra) / rate + per_layer_overhead
    out = [n * per_block for n in sc.stage_blocks]
    out[p - 1] += 3 * head_fwd / rate
    return out


def _params_per_rank(sc: Scenario) -> float:
    """Parameters of the most loaded stage's rank (its blocks and end pieces) / tp."""
    shape, lay = sc.shape, sc.layout
    p = lay.pp
    if p == 1:
        return shape.total_params / lay.tp
    head = shape.head_params + (shape.vocab * shape.hidden if shape.tied else 0)
    blocks, lp = sc.stage_blocks, shape.layer_params
    middle = max(blocks[1:-1]) * lp if p > 2 else 0
    return max(blocks[0] * lp + shape.embedding_params, blocks[-1] * lp + head,
               middle) / lay.tp
