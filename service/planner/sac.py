"""torchtitan's op-level selective activation checkpointing (SAC), as its policy is written.

torchtitan (`selective_ac_option = "op"`, torchtitan/parallelisms/parallelize_llama.py, the
versions of 2024-04 and 2024-12 behind the published runs) wraps every transformer block in
a non-reentrant checkpoint whose policy saves the outputs of the ops in its `_save_list`
(`aten.mm`, the flash and memory-efficient scaled-dot-product attention kernels, the
functional reduce-scatter, and since late 2024 `abs` / `max` for float8 scaling, which a
bf16 Llama block does not call; `no_recompute_list` in April 2024) and recomputes every other
op in backward; of the `aten.mm` calls it keeps only the odd ones in forward order ("saves
output of all compute ops, except every second mm"). The checkpoint also holds the block's
input, from which the recomputation starts.

So, per token of one block, with the block's linears in forward order (Llama: wq, wk, wv, wo,
w1, w3, w2; a fused-QKV GPT block: qkv, out, fc1, fc2):

- kept: the block input, the outputs of the 1st, 3rd, 5th ... `mm` (Llama: wq, wv, w1, w2),
  the attention kernel's output and its fp32 log-sum-exp (one per head), and with sequence
  parallelism the two reduce-scatter outputs;
- recomputed in backward: the other matmuls (Llama: wk, wo, w3) and every element-wise op.

A linear with a bias runs as `aten.addmm`, which is not in the list and is not counted as an
`mm`: a biased block keeps none of its matmul outputs and recomputes them all (only the
attention output is kept). This is the `fsdp` stack's `selective` recompute
(service.planner.software_stacks): torchtitan is where FSDP's selective checkpointing is published.
"""

from __future__ import annotations

from service.planner.shape import ModelShape

LSE_BYTES = 4
"""The flash kernel's log-sum-exp: one fp32 value per head per token."""


def block_linears(shape: ModelShape) -> list[tuple[int, int, bool]]:
    """(out_features, in_features, column_parallel) of each linear of one block, in the
    order the forward calls them (torchtitan's Llama; a fused-QKV block for GPT shapes)."""
    h, f, kv, q = shape.hidden, shape.ffn_hidden, shape.kv_dim, shape.q_dim
    if shape.swiglu:
        return [(q, h, True), (kv, h, True), (kv, h, True), (h, q, False),
                (f, h, True), (f, h, True), (h, f, False)]
    return [(q + 2 * kv, h, True), (h, q, False), (f, h, True), (h, f, False)]


def _saved_linears(shape: ModelShape) -> list[bool]:
    """Whether each linear's output is kept: odd-numbered `aten.mm` calls; none if biased."""
    if shape.biases:
        return [False] * len(block_linears(shape))
    return [i % 2 == 0 for i in range(len(block_linears(shape)))]


def saved_bytes_per_token(shape: ModelShape, *, tp: int, sequence_parallel: bool,
                          act_bytes: int) -> float:
    """Bytes one block keeps per token on one rank under the op-level policy."""
    sp = sequence_parallel and tp > 1
    total = shape.hidden / (tp if sp else 1)  # the block input, held by the checkpoint
    for (out, _inp, column), saved in zip(block_linears(shape), _saved_linears(shape),
                                          strict=True):
        if saved:  # a row-parallel mm's output is the full-width partial sum
            total += out / tp if column else out
    total += shape.q_dim / tp  # the attention kernel's output
    if sp:
        total += 2 * shape.hidden / tp  # the two reduce-scatter outputs
    return total * act_bytes + LSE_BYTES * shape.heads / tp


def recompute_flops_per_token(shape: ModelShape, *, tp: int) -> float:
    """Forward FLOPs per token of one block that backward runs again: the matmuls whose
    outputs are not kept (2 per weight); the attention kernel's output is kept."""
    return sum(2.0 * out * inp / tp
               for (out, inp, _c), saved in zip(block_linears(shape), _saved_linears(shape),
                                                strict=True) if not saved)
