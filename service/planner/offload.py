"""DeepSpeed's CPU offload, tensor by tensor: the model states it moves to host memory and the
staging buffers it allocates for the moves (docs/planner-model.md, "What each category
means"; counted from DeepSpeed 0.19's runtime/zero/stage_1_and_2.py and stage3.py, and
measured: tests/test_plan_agreement.py).

ZeRO-1/2 with optimizer offload (`DeepSpeedZeroOptimizer`, `cpu_offload`) allocates, besides
the fp32 partition, its gradient and Adam's moments:

- `param_buffer_of_bit16_for_cpu_offload_groups`: a copy of the rank's partition of each
  parameter group in the training precision (the updated weights travel through it);
- `temp_grad_buffer_for_cpu_offload` (host) and `temp_grad_buffer_for_gpu_offload` (device):
  one buffer each of the largest parameter's elements in the training precision;
- with gradient accumulation (more than one micro-batch per step), `accumulated_grads_in_cpu`:
  a host buffer per parameter that touches the rank's partition, the whole parameter's
  elements in its dtype (a parameter straddling two partitions is held whole by both ranks).

The partition of a parameter group is DeepSpeed's: the group's parameters flattened in
order, padded to a multiple of 2 x dp elements, cut in dp equal parts. ZeRO-3's offload keeps
both its gradient partitions and (with parameter offload) its weight partition in host
memory and allocates no staging buffer besides them.

Called by `service.planner.memory`.
"""

from __future__ import annotations

from functools import lru_cache

from service.planner.scenario import Scenario
from service.planner.shape import ModelShape

NCCL_START_ALIGNMENT = 2
"""DeepSpeed pads a flat parameter group to a multiple of this times dp elements."""


def _rows(n: int, tp: int) -> int:
    """The largest TP rank's share of `n` rows (the first `n % tp` ranks one more)."""
    return -(-n // tp)


def stage_tensors(shape: ModelShape, sc: Scenario, stage: int) -> list[tuple[int, bool]]:
    """(elements, decayed) of each parameter of the largest TP rank of `stage`, in the order of
    the built-in trainer's `named_parameters` (`workers.modeling.model`: an embedding, blocks,
    a head); decayed by default are the matrices but the embedding tables and a tied copy
    (`workers.trainer.recipe.no_decay_names`)."""
    p = sc.layout.pp
    return list(_tensors(shape, sc.layout.tp, sc.stage_blocks[stage], stage == 0,
                         stage == p - 1, p > 1))


@lru_cache(maxsize=1024)
def _tensors(shape: ModelShape, t: int, blocks: int, first: bool, last: bool,
             pipelined: bool) -> tuple[tuple[int, bool], ...]:
    h, f = shape.hidden, shape.ffn_hidden
    norm = [(h, False)] * (2 if shape.layer_norm else 1)
    out: list[tuple[int, bool]] = []
    if first:
        out.append((_rows(shape.vocab, t) * h, False))
        if shape.learned_positions:
            out.append((shape.seq_len * h, False))
    qkv = _rows(shape.q_dim + 2 * shape.kv_dim, t)
    up = _rows((2 if shape.swiglu else 1) * f, t)
    block: list[tuple[int, bool]] = []
    block += [(h, False)] if shape.o_biased else []  # the block's own biases come first
    block += [(h, False)] if shape.mlp_biased else []
    block += norm + [(qkv * h, True)] + ([(qkv, False)] if shape.qkv_biased else [])
    block += [(h * _rows(shape.q_dim, t), True)]
    block += [(shape.head_dim, False)] * (2 if shape.qk_norm else 0)
    block += norm + [(up * h, True)] + ([(up, False)] if shape.mlp_biased else [])
    block += [(h * _rows(f, t), True)]
    out += block * blocks
    if last:
        if not shape.tied:
            out.append((_rows(shape.vocab, t) * h, True))
        elif pipelined:  # a tied head's own copy on its stage: not decayed
            out.append((_rows(shape.vocab, t) * h, False))
        out += norm
    return tuple(out)


def partition_elements(group: tuple[int, ...], dp: int) -> int:
    """Elements of one rank's partition of a flat parameter group (padded as DeepSpeed pads)."""
    align = NCCL_START_ALIGNMENT * dp
    return -(-sum(group) // align) * align // dp


def touching_partitions(group: tuple[int, ...], dp: int) -> list[int]:
    """Per DP rank, the elements of the parameters of `group` that have any element in its
    partition, each parameter whole."""
    size = partition_elements(group, dp)
    out = [0] * dp
    start = 0
    for n in group:
        if n:
            for r in range(start // size, min(dp, (start + n - 1) // size + 1)):
                out[r] += n
        start += n
    return out


@lru_cache(maxsize=1024)
def _host_buffer_elements(shape: ModelShape, t: int, blocks: int, first: bool, last: bool,
                          pipelined: bool, one_group: bool, dp: int,
                          accumulate: bool) -> tuple[int, ...]:
    """Elements of the host staging buffers per DP rank (see `host_buffer_bytes`)."""
    tensors = _tensors(shape, t, blocks, first, last, pipelined)
    if one_group:
        groups = [tuple(n for n, _ in tensors)]
    else:
        groups = [g for g in (tuple(n for n, d in tensors if d),
                              tuple(n for n, d in tensors if not d)) if g]
    fixed = sum(partition_elements(g, dp) for g in groups) + max(max(g) for g in groups)
    if not accumulate:
        return (fixed,) * dp
    per_rank = [touching_partitions(g, dp) for g in groups]
    return tuple(fixed + sum(col) for col in zip(*per_rank, strict=True))


def host_buffer_bytes(sc: Scenario, stage: int, dp_rank: int | None = None) -> float:
    """Bytes of ZeRO-1/2's host staging buffers on `dp_rank` of `stage` (the module's list):
    the partition's copy, the largest parameter's gradient buffer and, with more than one
    micro-batch per step, the per-parameter accumulation buffers; the most loaded DP rank when
    `dp_rank` is None. 0 without offload and under ZeRO-3."""
    lay = sc.layout
    if lay.offload == "none" or lay.zero not in (1, 2):
        return 0.0
    p = lay.pp
    per_rank = _host_buffer_elements(sc.shape, lay.tp, sc.stage_blocks[stage], stage == 0,
                                     stage == p - 1, p > 1, sc.param_groups == 1, lay.dp,
                                     sc.micro_batches > 1)
    elements = max(per_rank) if dp_rank is None else per_rank[dp_rank]
    return float(elements * sc.act_bytes)


def device_buffer_bytes(sc: Scenario, stage: int) -> float:
    """ZeRO-1/2 offload's device gradient buffer (`temp_grad_buffer_for_gpu_offload`): the
    largest parameter's elements in the training precision; 0 otherwise."""
    lay = sc.layout
    if lay.offload == "none" or lay.zero not in (1, 2):
        return 0.0
    p = lay.pp
    return float(_largest(sc.shape, lay.tp, sc.stage_blocks[stage], stage == 0, stage == p - 1,
                          p > 1) * sc.act_bytes)


@lru_cache(maxsize=1024)
def _largest(shape: ModelShape, t: int, blocks: int, first: bool, last: bool,
             pipelined: bool) -> int:
    return max(n for n, _ in _tensors(shape, t, blocks, first, last, pipelined))
