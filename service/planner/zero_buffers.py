"""DeepSpeed's buffers of one rank, by category: ZeRO-3's gathered and prefetched parameters,
and the communication buckets (docs/planner-model.md, "What each category means"). Also
Adam's step counters, which the optimizer state holds besides its moments.

Called by `service.planner.memory`.
"""

from __future__ import annotations

from service.planner.scenario import Scenario
from service.planner.shape import ModelShape

STEP_COUNTER_BYTES = 4
"""torch's Adam keeps its step as a 4-byte tensor per optimized tensor."""


def largest_tensor_block(shape: ModelShape, t: int) -> float:
    """Largest unit ZeRO-3 gathers at once on one rank: a layer or the embedding."""
    return max(shape.layer_params, shape.vocab * shape.hidden) / t


def persistent_params(shape: ModelShape, sc: Scenario, stage_params: float, stage: int) -> float:
    """Parameters ZeRO-3 keeps whole on `stage` (tensors under
    `stage3_param_persistence_threshold`: norms, biases, small matrices, and small embedding,
    position and head matrices on the end stages)."""
    thr = sc.zero_cfg.stage3_param_persistence_threshold
    h, f, kv, t = shape.hidden, shape.ffn_hidden, shape.kv_dim, sc.layout.tp
    q = shape.q_dim
    mats = [h * (q + 2 * kv) / t, q * h / t] + [h * f / t] * (3 if shape.swiglu else 2)
    small = sc.stage_blocks[stage] * (sum(x for x in mats if x < thr) + shape.layer_vector_params)
    ends = []
    if stage == 0:
        ends.append(shape.vocab * h / t)
        if shape.learned_positions:
            ends.append(shape.seq_len * h)
    if stage == sc.layout.pp - 1:
        if not shape.tied or sc.layout.pp > 1:
            ends.append(shape.vocab * h / t)
        ends.append(h * (2 if shape.layer_norm else 1))
    small += sum(x for x in ends if x < thr)
    return min(stage_params, small)


def gathered_bytes(sc: Scenario, stage: int, stage_params: float) -> float:
    """ZeRO-3's whole weights on the rank at once: those it keeps whole, plus the largest
    block it gathers and the prefetch bucket, capped by `stage3_max_live_parameters` and by
    the stage's other parameters. 0 without ZeRO-3 (or under FSDP, `_fsdp_buffers`)."""
    if sc.layout.zero != 3 or sc.stack_constants.optimizer_layout == "fsdp":
        return 0.0
    zc, shape = sc.zero_cfg, sc.shape
    kept = persistent_params(shape, sc, stage_params, stage)
    window = min(largest_tensor_block(shape, sc.layout.tp) + zc.stage3_prefetch_bucket_size,
                 zc.stage3_max_live_parameters, stage_params - kept)
    return (kept + window) * sc.act_bytes


def bucket_bytes(sc: Scenario, stage_params: float) -> float:
    """Communication buckets: with contiguous gradients the reduction bucket of
    `reduce_bucket_size` elements (fp32 for ZeRO-1, the training precision for ZeRO-2 and 3,
    twice with `overlap_comm` for ZeRO-1 and 2), and under ZeRO-3 the whole gradients of the
    gathered block waiting for their reduce-scatter. A GPU allocates a bucket whole; on a CPU
    rank its pages become resident only as gradients are written into it, at most the stage's
    own."""
    zc, lay, stack = sc.zero_cfg, sc.layout, sc.stack_constants
    w = sc.act_bytes
    bucket = min(zc.reduce_bucket_size, stage_params) if sc.profile.device_is_host \
        else zc.reduce_bucket_size
    if stack.optimizer_layout == "fsdp":
        return 0.0
    if lay.zero <= 1 and (stack.optimizer_layout == "megatron" or (
            stack.optimizer_layout == "bf16_optimizer" and sc.precision == "bf16")):
        return 0.0  # the gradient buffer is the fp32 main gradients, counted as grads
    out = 0.0
    if lay.zero in (1, 2) and zc.contiguous_gradients:
        out += bucket * (4 if lay.zero == 1 else w) * (2 if zc.overlap(lay.zero) else 1)
    if lay.zero == 3:
        if zc.contiguous_gradients:
            out += bucket * w
        if not sc.profile.device_is_host:  # on CPU the bucket above bounds them already
            out += min(largest_tensor_block(sc.shape, lay.tp) + zc.stage3_prefetch_bucket_size,
                       zc.stage3_max_live_parameters, stage_params) * w
    return out


def rank_tensors(shape: ModelShape, sc: Scenario, stage: int) -> int:
    """Parameter tensors of one rank of `stage`, as the built-in trainer makes them (fused
    q/k/v, fused gate/up)."""
    block = 2 * (2 if shape.layer_norm else 1) + 2 * int(shape.qk_norm)
    block += 1 + int(shape.qkv_biased) + 1 + int(shape.o_biased) + 2 + 2 * int(shape.mlp_biased)
    n = sc.stage_blocks[stage] * block
    if stage == 0:
        n += 1 + int(shape.learned_positions)
    if stage == sc.layout.pp - 1:
        n += (2 if shape.layer_norm else 1) + int(not shape.tied or sc.layout.pp > 1)
    return n


def step_counter_bytes(sc: Scenario, stage: int) -> float:
    """Adam's step counters: one per tensor without ZeRO, one per flat partition (parameter
    group) with it."""
    if sc.layout.zero >= 1:
        return float(STEP_COUNTER_BYTES * sc.param_groups)
    return float(STEP_COUNTER_BYTES * rank_tensors(sc.shape, sc, stage))
