"""Software stacks (`train.stack`): what the same layout costs under each training framework.

The hardware profile says what a GPU can do; the stack says how much of it a framework's
kernels reach and which bytes the framework keeps besides the model's tensors. Each constant
names its source. Two kinds of constant:

- Read from the framework's code or documentation (flash attention, the bytes per parameter
  its optimizer layout keeps, NCCL's buffer size): fixed here.
- Fitted to published runs (`efficiency`, the fraction of the Megatron-fitted GEMM rate the
  stack reaches, and `allocator_slack`, the caching allocator's reserve over what it hands
  out): the priors are here, the fitted values are `service/planner/data/fitted.json`, which
  `python -m service.planner.fit --write` recomputes from `published_runs.yaml`
  (docs/planner.md has the table and the leave-one-source-out errors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

FITTED_PATH = Path(__file__).with_name("data") / "fitted.json"

MIB = 1 << 20
NCCL_BUFFSIZE = 4 * MIB
"""NCCL's default `NCCL_BUFFSIZE` (NCCL environment-variable documentation): the buffer of
the Simple protocol per channel per peer."""
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
"""LL128's buffer per channel per peer: NCCL_LL128_ELEMS_PER_THREAD (120) x
NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS (8) x 8 bytes (NCCL src/include/device.h,
DEFAULT_LL128_BUFFSIZE), 4.7 MiB."""
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
"""LL's: NCCL_LL_LINES_PER_THREAD (8) x NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS (8) x a
16-byte line (DEFAULT_LL_BUFFSIZE), 0.5 MiB."""
NCCL_CONNECTION_BYTES = NCCL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE
"""NCCL connects every peer of every channel with a buffer per protocol (Simple, LL128, LL),
about 9.2 MiB."""
NCCL_PEERS = 2
"""Ring collectives talk to the previous and the next rank on every channel."""

GradLayout = Literal["deepspeed", "megatron", "bf16_optimizer", "fsdp"]
Selective = Literal["attention", "op"]
Loss = Literal["megatron", "pytorch", "fused"]


@dataclass(frozen=True)
class Stack:
    name: str
    flash_attention: bool
    """Attention through a fused kernel that never stores the s x s scores (FlashAttention,
    Dao et al. 2022): the 5 a s / h activation term is gone."""
    optimizer_layout: GradLayout
    """Which bytes per parameter the framework keeps (memory.py `model_state_bytes`)."""
    efficiency: float
    """Fraction of the profile's (Megatron-fitted) GEMM rate this stack reaches."""
    allocator_slack: float
    """Caching allocator's reserve over the bytes it hands out (fragmentation, cached blocks):
    reserved = allocated x (1 + slack)."""
    framework_bytes: float
    """Device bytes the framework itself keeps per process (workspaces, fused-kernel state)."""
    source: str
    dp_overlap: float | None = None
    """Share of data-parallel traffic hidden behind compute; None = the profile's (0.5)."""
    selective: Selective = "attention"
    """What `recompute: selective` means on this stack: Korthikanti et al.'s recompute of
    the attention core (`attention`), or torchtitan's op-level policy (`op`, sac.py)."""
    loss: Loss = "megatron"
    """How the loss holds the logits (LOSS_BYTES)."""
    dropout: bool = True
    """Whether the stack's model applies the shape's dropout; False: it has no dropout layers
    (Trident's trainer), whatever the published model had: no masks, no dropout outputs."""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "flash_attention": self.flash_attention,
                "optimizer_layout": self.optimizer_layout, "efficiency": self.efficiency,
                "allocator_slack": self.allocator_slack,
                "framework_bytes": self.framework_bytes, "dp_overlap": self.dp_overlap,
                "selective": self.selective, "loss": self.loss, "dropout": self.dropout,
                "source": self.source}


PRIORS: dict[str, Stack] = {s.name: s for s in [
    Stack("trident", True, "deepspeed", 1.0, 0.05, 0.25 * (1 << 30),
          "Trident's trainer (workers/modeling/model.py): torch scaled_dot_product_attention"
          " (a flash kernel on GPUs), unfused layers, DeepSpeed 0.19 engine for ZeRO and pipelines;"
          " efficiency shared with `deepspeed` (no published runs of its own); loss"
          " F.cross_entropy on fp32 logits; no dropout layers", loss="pytorch",
          dropout=False),
    Stack("megatron-lm", True, "megatron", 1.0, 0.03, 0.5 * (1 << 30),
          "Megatron-LM (megatron/core): fused kernels, TransformerEngine flash attention,"
          " fp32 main gradients in a contiguous buffer, distributed optimizer"
          " (megatron/training/theoretical_memory_usage.py: 18 bytes/param, 6 + 12/d with"
          " the distributed optimizer); the profile's GEMM curve is fitted on its runs"),
    Stack("megatron-deepspeed", False, "bf16_optimizer", 1.0, 0.05, 0.5 * (1 << 30),
          "Megatron-DeepSpeed (BLOOM, MT-NLG): Megatron's fused kernels without flash"
          " attention by default, DeepSpeed's pipeline engine; bf16 with ZeRO-1 runs"
          " DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py), which keeps"
          " full fp32 gradient accumulation buffers, and DeepSpeed's pipeline engine copies"
          " the 16-bit gradients into them with update_hp_grads(clear_lp_grads=False), so the"
          " 16-bit gradients stay allocated (zeroed, not freed): 2 + 2 + 4 + 12/N bytes per"
          " parameter"),
    Stack("deepspeed", True, "deepspeed", 1.0, 0.05, 0.25 * (1 << 30),
          "DeepSpeed ZeRO on a PyTorch model (Hugging Face style), SDPA flash attention;"
          " bytes per parameter measured on DeepSpeed 0.19 engines"
          " (tests/test_planner_deepspeed.py); PyTorch's cross entropy on fp32 logits",
          loss="pytorch"),
    Stack("fsdp", True, "fsdp", 1.0, 0.05, 0.25 * (1 << 30),
          "PyTorch FSDP (Zhao et al. 2023, VLDB): full sharding of fp32 parameters,"
          " gradients and Adam states (16/N bytes per parameter with bf16 mixed precision),"
          " unsharded bf16 parameters of the running and the prefetched block; SDPA flash"
          " attention; all-gathers prefetched ahead of the block that needs them (forward and"
          " backward prefetch), so dp_overlap 0.9 (an assumption, not fitted); selective"
          " recompute is torchtitan's op-level policy (sac.py), PyTorch's cross entropy on"
          " fp32 logits (torchtitan's loss)", 0.9, "op", "pytorch"),
]}
STACK_NAMES = tuple(PRIORS)


@cache
def _fitted() -> dict[str, Any]:
    try:
        return dict(json.loads(FITTED_PATH.read_text()))
    except FileNotFoundError:
        return {}


def fitted_constants() -> dict[str, Any]:
    """The fitted file as loaded (empty when absent): stacks, profiles, errors."""
    return _fitted()


@cache
def get_stack(name: str, *, fitted: bool = True) -> Stack:
    """The stack's constants: priors overridden by the fitted values (unless fitted=False)."""
    try:
        base = PRIORS[name]
    except KeyError:
        raise ValueError(f"unknown stack {name!r}; known: {list(PRIORS)}") from None
    if not fitted:
        return base
    over = _fitted().get("stacks", {}).get(name, {})
    return replace(base, efficiency=float(over.get("efficiency", base.efficiency)),
                   allocator_slack=float(over.get("allocator_slack", base.allocator_slack)))


@cache
def profile_efficiency(profile: str, *, fitted: bool = True) -> float:
    """Fitted factor on a GPU type's GEMM rate (1 when not fitted: Megatron's A100 curve)."""
    if not fitted:
        return 1.0
    return float(_fitted().get("profiles", {}).get(profile, {}).get("efficiency", 1.0))


def nccl_buffer_bytes(group_sizes: list[int], channels: int) -> float:
    """NCCL's device buffers: one communicator per group of more than one rank, each with
    `channels` x peers x one buffer per protocol (`NCCL_CONNECTION_BYTES`; a point-to-point
    pipeline pair has one peer)."""
    total = 0.0
    for n in group_sizes:
        if n > 1:
            total += channels * min(NCCL_PEERS, n - 1) * NCCL_CONNECTION_BYTES
    return total


def loss_bytes_per_logit(loss: Loss, act_bytes: int) -> float:
    """Bytes per logit at the loss's peak (the start of backward).

    Megatron's vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py)
    computes the fp32 softmax in place and writes the gradient over it: one fp32 buffer next
    to the logits in the training precision. PyTorch's `F.cross_entropy(logits.float(), ...)`
    (torchtitan, Trident's workers/modeling/model.py, Hugging Face models) saves log_softmax's fp32
    output; backward makes nll_loss's dense fp32 gradient and log_softmax's fp32 input
    gradient while it is alive: three fp32 tensors (torchtitan deletes the 16-bit logits
    before backward, and the fp32 copy is not saved). flash-attn's fused Triton cross
    entropy (`flash_attn.losses.cross_entropy`, LLM Foundry's default `loss_fn:
    fused_crossentropy`) keeps the logits in the training precision (and one fp32 log-sum-exp
    per row) and writes their gradient in the same precision: two tensors.
    """
    if loss == "megatron":
        return act_bytes + 4.0
    return 2.0 * act_bytes if loss == "fused" else 12.0
