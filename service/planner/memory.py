"""Bytes per GPU of the most loaded rank, and host bytes per node.

Called by `evaluate` (plan.py). The terms (docs/planner-model.md derives each, with its sources):

- model states (parameters, gradients, optimizer states) per ZeRO stage, with the byte
  counts DeepSpeed really holds (its estimators' 2 + 18/N for ZeRO-2 and 18/N for ZeRO-3 in
  16-bit training), CPU offload moving the right ones to host memory;
- activations per layer by Korthikanti et al. 2022 (Table 2), for every recompute and
  sequence-parallel variant, times the micro-batches the 1F1B (or interleaved) schedule
  keeps in flight on the stage;
- logits and loss on the last stage, DeepSpeed's ZeRO buffers, and the profile's calibrated
  reserved bytes (context, fragmentation).

The first stage carries the embedding and the most in-flight micro-batches, the last stage
the LM head and the logits; both are computed and the larger one is reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from service.planner import offload, sac, zero_buffers
from service.planner.scenario import Scenario
from service.planner.shape import ModelShape
from service.planner.software_stacks import MIB as MIB_
from service.planner.software_stacks import loss_bytes_per_logit, nccl_buffer_bytes

# Bytes per parameter at the peak of model states: (weights, gradients, optimizer), each
# either whole on every DP rank or sharded over N. Entry: (param_full, param_shard,
# grad_full, grad_shard, opt_shard). Measured on real DeepSpeed 0.19 engines (CPU, gloo, every
# stage; tests/test_planner_deepspeed.py): ZeRO-1 and ZeRO-2 both reduce gradients into
# partitions; inside the optimizer step the fp32 gradient partition (4/N) sits next to the
# fp32 master weights and Adam m, v (12/N). ZeRO-3 also keeps the 16-bit gradient partition
# then (6/N). ZeRO-0 in 16-bit is Megatron's 18 bytes (fp32 gradient accumulation).
_MIXED = {
    0: (2, 0, 4, 0, 12),
    1: (2, 0, 0, 4, 12),
    2: (2, 0, 0, 4, 12),
    3: (0, 2, 0, 6, 12),
}
# fp32 training: no master copy at ZeRO-0 (Adam m and v only); ZeRO keeps an fp32 copy of
# its weight partition for the optimizer; ZeRO-3 holds a second gradient partition in step.
_FP32 = {
    0: (4, 0, 4, 0, 8),
    1: (4, 0, 0, 4, 12),
    2: (4, 0, 0, 4, 12),
    3: (0, 4, 0, 8, 12),
}
# Megatron-LM (fp32 main gradients in a contiguous buffer; "ZeRO-1" is its distributed
# optimizer: 6 + 12/d bytes, megatron/training/theoretical_memory_usage.py). It has no
# ZeRO-2/3; those fall back to DeepSpeed's bytes.
_MEGATRON = {0: (2, 0, 4, 0, 12), 1: (2, 0, 4, 0, 12), 2: _MIXED[2], 3: _MIXED[3]}
# Megatron-DeepSpeed in bf16 runs DeepSpeed's BF16_Optimizer: full fp32 gradients (4) as
# Megatron's, and the pipeline engine's update_hp_grads(clear_lp_grads=False) leaves the 16-bit
# gradients allocated next to them (2): deepspeed/runtime/pipe/engine.py, bf16_optimizer.py.
_BF16_OPTIMIZER = {0: (2, 0, 6, 0, 12), 1: (2, 0, 6, 0, 12), 2: _MIXED[2], 3: _MIXED[3]}
# PyTorch FSDP with bf16 mixed precision keeps fp32 sharded parameters, gradients and Adam
# states (16/N): FULL_SHARD (3); SHARD_GRAD_OP (2) also keeps the bf16 parameters whole;
# 0 and 1 are DDP (fp32 weights and gradients, Adam m and v), 1 sharding Adam over dp.
_FSDP = {0: (4, 0, 4, 0, 8), 1: (4, 0, 4, 0, 8), 2: (2, 4, 0, 4, 8), 3: (0, 4, 0, 4, 8)}
HOST_BUFFER_FACTOR = 1.5
"""Host memory over the offloaded tensors' bytes: pinned allocations (DeepSpeed estimators'
additional_buffer_factor)."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device of the most loaded rank (`stage` says which pipeline stage)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    """Logits and loss of one micro-batch (last stage)."""
    zero_buffers: float
    """DeepSpeed's buffers: `gathered` + `buckets` (the two fields below)."""
    reserved: float
    """Bytes besides tensors: CUDA context, NCCL buffers, framework and allocator slack (the
    four fields below); `total` (what nvidia-smi shows, or a CPU rank's resident memory)
    includes them."""
    stage: int
    """Pipeline stage of the most loaded rank."""
    in_flight: float
    """Micro-batches whose activations that stage holds at the peak."""
    host_per_rank: float
    """Host memory one rank's offload needs: `host_params` + `host_grads` + `host_optimizer`
    + `offload_buffers`, times `HOST_BUFFER_FACTOR` (pinned allocations)."""
    host_per_node: float
    """Host memory a node needs: its ranks' offloaded states plus per-process overhead."""
    params_per_rank: float
    """Parameters this rank's model-parallel shard holds (before ZeRO)."""
    gathered: float = 0.0
    """ZeRO-3's whole weights held at once: kept whole, gathered and prefetched (part of
    `zero_buffers`)."""
    buckets: float = 0.0
    """Communication buckets: gradient reduction, ZeRO-3's gradients awaiting their
    reduce-scatter (part of `zero_buffers`)."""
    cuda_context: float = 0.0
    """CUDA context and kernel images of the process (part of `reserved`)."""
    nccl_buffers: float = 0.0
    """NCCL's channel buffers of the rank's communicators (part of `reserved`)."""
    host_params: float = 0.0
    """Parameters offloaded to host memory (ZeRO-3's partition with parameter offload); not
    in `params`, which is the device's."""
    host_grads: float = 0.0
    """Gradient partitions offloaded to host memory (what the optimizer step reads); not in
    `grads`."""
    host_optimizer: float = 0.0
    """Optimizer states offloaded to host memory (master weights, moments, step counters); not
    in `optimizer`."""
    offload_buffers: float = 0.0
    """DeepSpeed's host staging buffers for ZeRO-1/2 offload: the 16-bit partition's copy, a
    gradient buffer of the largest parameter and, with gradient accumulation, a buffer per
    parameter of the partition (`service.planner.offload`). Its device gradient buffer is
    in `buckets`."""
    framework: float = 0.0
    """What torch and DeepSpeed hold themselves (part of `reserved`): their device buffers on
    a GPU; on a CPU rank the process's resident memory besides the tensors (the `cpu`
    profile's measured `reserved_bytes`: imports, process group, engine)."""
    allocator_slack: float = 0.0
    """The caching allocator's reserve over allocated tensors (part of `reserved`)."""
    checkpoint_copy: float = 0.0
    """Host memory a save in the background (`checkpoint.async`) holds while it is in flight:
    the copy of what the rank writes, its optimizer states and (its DP group's first rank,
    below ZeRO-3) the module's weights (`workers.checkpoint.background`); in
    `host_per_rank`. 0 with synchronous saves or none."""

    @property
    def allocated(self) -> float:
        """Tensor bytes at the peak (torch.cuda.max_memory_allocated)."""
        return self.total - self.reserved

    @property
    def reserved_by_allocator(self) -> float:
        """What the caching allocator holds (torch.cuda.max_memory_reserved)."""
        return self.allocated + self.allocator_slack

    @property
    def other(self) -> float:
        return self.logits + self.zero_buffers + self.reserved

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def to_json(self) -> dict[str, float]:
        out = asdict(self)
        out.update(other=self.other, total=self.total, allocated=self.allocated,
                   reserved_by_allocator=self.reserved_by_allocator)
        return out


def layer_activation_bytes(shape: ModelShape, *, micro_batch: int, tp: int,
                           sequence_parallel: bool, recompute: str, act_bytes: int = 2,
                           flash: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward, one micro-batch, one rank.

    Korthikanti et al. 2022, Table 2, generalised to GQA (K and V are kv_heads/heads of Q)
    and SwiGLU (gate, up, their product and the activation are ffn-wide). For GPT shapes:
    none s*b*h*(34 + 5as/h); TP s*b*h*(10 + 24/t + 5as/(ht)); TP+SP s*b*h*(34 + 5as/h)/t;
    selective drops the 5as/h attention-score term; full keeps only the layer input 2sbh
    (divided by t with SP). Dropout masks are 1 byte; other elements `act_bytes` (the
    paper's 2), scaled for fp32; a model without dropout (Llama) keeps no masks and no
    dropout outputs. Flash attention never stores the scores (as selective).
    `op` is torchtitan's op-level selective checkpointing (sac.py).
    """
    s, h, a = shape.seq_len, shape.hidden, shape.heads
    sbh = s * micro_batch * h
    scale = act_bytes / 2.0
    if recompute == "op":
        return s * micro_batch * sac.saved_bytes_per_token(
            shape, tp=tp, sequence_parallel=sequence_parallel, act_bytes=act_bytes)
    if recompute == "full":
        return 2.0 * sbh * scale / (tp if sequence_parallel else 1)
    r = shape.kv_heads / shape.heads
    f = shape.ffn_hidden / h
    w = shape.q_dim / h  # 1 but for a head_dim of its own (Qwen3, Gemma)
    # Not split by TP: two LayerNorm inputs (4), QKV and MLP inputs (4), two dropout masks (2).
    replicated = 10.0 if shape.dropout else 8.0
    # Split by TP: Q (2), K and V (4r), attention-output projection input (2), MLP inside.
    split = (2 + 4 * r + 2) * w + (8 * f if shape.swiglu else 4 * f)
    # Scores: softmax output (2), and with dropout its mask (1) and output (2).
    scores = 0.0 if recompute == "selective" or flash else \
        (5.0 if shape.dropout else 2.0) * a * s / h
    per = (replicated / tp if sequence_parallel else replicated) + (split + scores) / tp
    return per * sbh * scale


def attention_mask_bytes(sc: Scenario, stage: int, in_flight: float) -> float:
    """The explicit attention masks a stage holds (`workers.modeling.positions.attention_bias`:
    an additive mask in the activations' dtype, s x s per sample): with document masks one per
    micro-batch in flight (its blocks share it, their backward keeps it) and per kind of block
    on the stage (full, sliding); with a sliding window alone one (1, 1, s, s) mask, shared by
    every micro-batch. Plain causal attention needs none."""
    shape = sc.shape
    kinds = {shape.window(i) for start, end in sc.stage_ranges[stage] for i in range(start, end)}
    s2 = float(shape.seq_len) ** 2 * sc.act_bytes
    if sc.document_mask:
        return in_flight * sc.micro_batch * s2 * len(kinds)
    return s2 * sum(1 for w in kinds if w is not None)


def in_flight_micro_batches(sc: Scenario, stage: int) -> float:
    """Micro-batches of activations stage `stage` holds at its peak, in units of its layers.

    1F1B: stage i keeps min(m, p - i) in flight. Interleaving (v chunks) raises the first
    stage to p * (1 + (p-1)/(p*v)) (Megatron's warm-up), when m >= p.
    """
    p, v, m = sc.layout.pp, sc.layout.virtual_stages, sc.micro_batches
    base = float(min(m, p - stage))
    if v > 1 and m >= p:
        warmup_chunks = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
        return warmup_chunks / v
    return base


def _stage_params(shape: ModelShape, sc: Scenario, stage: int) -> float:
    """Parameters on one rank of `stage`: its blocks and end pieces as Megatron splits them
    over tp (`ModelShape.rank_params`: the largest TP rank's, the built-in trainer's count)."""
    p = sc.layout.pp
    return float(shape.rank_params(sc.layout.tp, sc.stage_blocks[stage], first=stage == 0,
                                   last=stage == p - 1, pp=p))


def model_state_bytes(sc: Scenario) -> tuple[float, float, float, float, float]:
    """(param_full, param_shard, grad_full, grad_shard, opt_shard) bytes per parameter for
    the stack's optimizer layout, precision and ZeRO stage."""
    layout = sc.stack_constants.optimizer_layout
    if sc.precision == "fp32":
        return _FP32[sc.layout.zero]
    if layout == "megatron":
        return _MEGATRON[sc.layout.zero]
    if layout == "bf16_optimizer" and sc.precision == "bf16":
        return _BF16_OPTIMIZER[sc.layout.zero]
    if layout == "fsdp":
        return _FSDP[sc.layout.zero]
    # Megatron-DeepSpeed in fp16 runs DeepSpeed's ZeRO optimizer, not BF16_Optimizer (the
    # engine picks that for bf16 weights only: engine.py _do_optimizer_sanity_check).
    # DeepSpeed 0.19's stage 1 does not keep the ZeRO paper's full 16-bit gradients: with
    # or without gradient accumulation it reduces into partitions as stage 2 does (measured,
    # tests/test_planner_deepspeed.py::test_zero1_with_accumulation_holds_no_full_gradients).
    return _MIXED[sc.layout.zero]


def stage_memory(sc: Scenario, stage: int) -> MemoryBreakdown:
    lay = sc.layout
    shape = sc.shape if sc.stack_constants.dropout else replace(sc.shape, dropout=False)
    n = lay.dp
    w = sc.act_bytes
    pr = _stage_params(shape, sc, stage)
    p_full, p_shard, g_full, g_shard, o_shard = model_state_bytes(sc)
    params = pr * (p_full + p_shard / n)
    grads = pr * (g_full + g_shard / n)
    optimizer = pr * o_shard / (n if lay.zero >= 1 else 1)  # ZeRO-0 shards nothing
    optimizer += zero_buffers.step_counter_bytes(sc, stage) if optimizer else 0.0
    host_params = host_grads = host_optimizer = 0.0
    if lay.offload != "none":
        # Optimizer states (with the step counters) and the gradient partitions the step
        # reads live in host memory (ZeRO-1/2: the fp32 partition, 4/N; ZeRO-3: its 16-bit
        # and fp32 partitions); the device keeps the weights, gradients go to the host as
        # reduced (offload.py lists DeepSpeed's tensors).
        host_optimizer, optimizer = optimizer, 0.0
        host_grads, grads = pr * g_shard / n, pr * g_full
    if lay.offload == "optimizer+params":
        host_params, params = params, 0.0
    offload_buffers = offload.host_buffer_bytes(sc, stage)
    host = HOST_BUFFER_FACTOR * (host_params + host_grads + host_optimizer + offload_buffers)
    checkpoint_copy = checkpoint_copy_bytes(sc, pr, optimizer + host_optimizer)
    host += checkpoint_copy

    # Activations and logits.
    layers = sc.stage_blocks[stage]
    per_layer = layer_activation_bytes(
        shape, micro_batch=sc.micro_batch, tp=lay.tp, sequence_parallel=lay.sequence_parallel,
        recompute=sc.recompute, act_bytes=w, flash=sc.flash)
    in_flight = in_flight_micro_batches(sc, stage)
    activations = per_layer * layers * in_flight
    sbh = shape.seq_len * sc.micro_batch * shape.hidden
    if sc.recompute in ("full", "op"):
        # Backward re-runs one layer at a time: its whole activation set is live once (under
        # the op-level policy, besides the outputs it kept).
        activations += layer_activation_bytes(
            shape, micro_batch=sc.micro_batch, tp=lay.tp,
            sequence_parallel=lay.sequence_parallel, recompute="none", act_bytes=w,
            flash=sc.flash) - (per_layer if sc.recompute == "op" else 0.0)
    if stage == 0 and sc.stack_constants.dropout:
        # The embedding's output (with dropout: its dropout output) and mask, per in-flight
        # micro-batch. A stack whose model has no dropout (`trident`) keeps nothing more: the
        # embedding's output is the first block's norm input, counted with the block
        # (measured, tests/test_plan_agreement.py). The published runs' stacks keep the term
        # as fitted (service/planner/data/fitted.json).
        activations += in_flight * sbh * (w + (1 if shape.dropout else 0)) / (
            lay.tp if lay.sequence_parallel else 1)
    activations += attention_mask_bytes(sc, stage, in_flight)
    logits = 0.0
    if stage == lay.pp - 1:
        # Vocab-parallel logits and the loss's fp32 buffers, as the stack's loss holds them.
        logits = shape.seq_len * sc.micro_batch * shape.vocab / lay.tp * loss_bytes_per_logit(
            sc.loss_kind, w)

    # DeepSpeed buffers.
    if sc.stack_constants.optimizer_layout == "fsdp":
        gathered, buckets = _fsdp_buffers(shape, sc, pr), 0.0
    else:
        gathered = zero_buffers.gathered_bytes(sc, stage, pr)
        buckets = zero_buffers.bucket_bytes(sc, pr) + offload.device_buffer_bytes(sc, stage)
    buffers = gathered + buckets

    allocated = params + grads + optimizer + activations + logits + buffers
    context, nccl, framework, slack = _non_tensor_bytes(sc, allocated)
    reserved = context + nccl + framework + slack
    ranks_per_node = min(sc.gpus_per_node, sc.dims.world_size)
    host_process = sc.profile.host_process_bytes
    total_device = allocated + reserved
    host_node = ranks_per_node * (host + host_process)
    if sc.profile.device_is_host:
        host_node += ranks_per_node * total_device
    return MemoryBreakdown(
        params=params, grads=grads, optimizer=optimizer, activations=activations,
        logits=logits, zero_buffers=buffers, gathered=gathered, buckets=buckets,
        reserved=reserved, stage=stage,
        in_flight=in_flight, host_per_rank=host, host_per_node=host_node, params_per_rank=pr,
        host_params=host_params, host_grads=host_grads, host_optimizer=host_optimizer,
        offload_buffers=offload_buffers, checkpoint_copy=checkpoint_copy,
        cuda_context=context, nccl_buffers=nccl, framework=framework, allocator_slack=slack)


def checkpoint_copy_bytes(sc: Scenario, params: float, optimizer: float) -> float:
    """The host copy of a save in the background (`MemoryBreakdown.checkpoint_copy`): the
    rank's optimizer states (`optimizer`, device and host) and, below ZeRO-3, the module's
    weights of its `params` in the precision computed, which its DP group's first rank writes
    (ZeRO-3's module files hold no weights; in fp32 under ZeRO 0 the weights are the master
    and the optimizer holds only the moments)."""
    if not sc.async_save:
        return 0.0
    weights = 0.0 if sc.layout.zero == 3 else params * (4 if sc.precision == "fp32" else 2)
    return optimizer + weights


def _fsdp_buffers(shape: ModelShape, sc: Scenario, pr: float) -> float:
    """FSDP's unsharded 16-bit parameters and gradients of the running and the prefetched
    block (FULL_SHARD), or DDP's gradient buckets (25 MB, twice) for ZeRO 0 and 1."""
    if sc.layout.zero <= 1:
        return 2 * 25 * MIB_
    block = min(max(shape.layer_params, shape.vocab * shape.hidden) / sc.layout.tp, pr)
    return 2 * block * 2 * sc.act_bytes if sc.layout.zero == 3 else 0.0


def _non_tensor_bytes(sc: Scenario, allocated: float) -> tuple[float, float, float, float]:
    """(CUDA context, NCCL buffers, framework buffers, allocator slack) of one rank.

    The CUDA context and kernel images are the profile's `reserved_bytes`; NCCL keeps
    channels x peers x NCCL_BUFFSIZE per communicator (one per TP, DP and PP group); the
    framework its own buffers; the caching allocator reserves `allocator_slack` over what it
    hands out. A CPU rank has no CUDA context: its `reserved_bytes` is the framework's
    resident memory, measured (`bench/plan_agreement.py`).
    """
    prof, lay, st = sc.profile, sc.layout, sc.stack_constants
    if prof.device_is_host:
        return 0.0, 0.0, prof.reserved_bytes, 0.0
    nccl = nccl_buffer_bytes([lay.tp, lay.dp, min(lay.pp, 2)], prof.nccl_channels)
    return prof.reserved_bytes, nccl, st.framework_bytes, st.allocator_slack * allocated


def loaded_stage_candidates(sc: Scenario) -> list[int]:
    """Stages that can be the most loaded: the first and the last, and a middle stage only
    when it holds more blocks than the first (the first of each such count: in-flight
    micro-batches fall with the stage index, and the first also holds the embedding)."""
    p = sc.layout.pp
    out = [0] + ([p - 1] if p > 1 else [])
    blocks = sc.stage_blocks
    if p > 2 and max(blocks[1:-1]) > blocks[0]:
        seen: set[int] = set()
        for s in range(1, p - 1):
            n = blocks[s]
            if n > blocks[0] and n not in seen:
                seen.add(n)
                out.append(s)
    return out


def memory(sc: Scenario) -> MemoryBreakdown:
    """The most loaded rank: whichever pipeline stage holds the most bytes (the lowest
    stage among equals)."""
    best = stage_memory(sc, 0)
    if sc.layout.pp == 1:
        return best
    for s in loaded_stage_candidates(sc)[1:]:
        m = stage_memory(sc, s)
        if m.total > best.total:
            best = m
    return best
