"""The built-in decoder-only GPT, built as a list of pipeline layers from the planner's shape.

The model is `service.planner.shape.ModelShape`, the object the planner counts, so the two
cannot disagree: pre-norm blocks (LayerNorm or RMSNorm, as `layer_norm` says), causal attention
through `scaled_dot_product_attention` (GQA via `kv_heads`), a GELU or SwiGLU MLP, learned or
rotary positions, an untied LM head, no linear biases. `check_buildable` refuses, naming the
trait, the shapes this model does not build (biases, a tied head, ALiBi). The model is a flat
list [Embedding, Block 0 .. Block L-1, Head] so that the same layers serve a single-stage `GPT`
(pp = 1) and DeepSpeed's `PipelineModule` (pp > 1, embedding on the first stage, head on the last).

Layout invariance: every weight is drawn from a generator seeded by (seed, layer, name) at its
full, unsharded shape, then sliced for this rank's TP shard. A layer therefore holds the same
numbers whatever tp, pp or dp is, and never needs the rest of the model to exist.

Called by `workers.train`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch import nn

from service.planner.shape import ModelShape
from workers.tp import (
    ColumnParallelLinear,
    RankGroups,
    RowParallelLinear,
    all_reduce_grads_over_tp,
    copy_to_tp,
    gather_seq,
    gather_seq_to_replicated,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_seq,
)

Recompute = Literal["none", "selective", "full"]
CheckpointFn = Callable[..., Any]
"""An activation-checkpoint function `f(function, *args)`: DeepSpeed's by default."""


def torch_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """torch's non-reentrant checkpoint, for torch.distributed.pipelining: its stages infer
    gradient shapes with `torch.autograd.grad`, which DeepSpeed's checkpointing refuses."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
INIT_STD = 0.02


def check_buildable(shape: ModelShape) -> None:
    """Refuse a shape this model would build differently from the planner's count."""
    refusal = shape.builtin_trainer_refusal()
    if refusal:
        raise ValueError(f"model: {refusal}")


def _norm(shape: ModelShape) -> nn.Module:
    return nn.LayerNorm(shape.hidden) if shape.layer_norm else nn.RMSNorm(shape.hidden)


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) queries or keys by their position (RoPE, with the
    halves of each head as the pairs, as Llama's Hugging Face port does)."""
    s, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angle = torch.outer(torch.arange(s, dtype=torch.float32, device=x.device), inv)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def init_weight(seed: int, layer: int, name: str, shape: tuple[int, ...],
                std: float = INIT_STD) -> torch.Tensor:
    """The full (unsharded) weight `name` of layer `layer`: a pure function of its arguments."""
    digest = hashlib.blake2b(f"{seed}/{layer}/{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _sp_group(groups: RankGroups | None, sequence_parallel: bool):
    return groups.tp if sequence_parallel and groups and groups.tp_size > 1 else None


class Embedding(nn.Module):
    """Token embeddings, and learned positions (replicated over TP; layer index -1).

    With sequence parallelism the output keeps only this TP rank's chunk of the sequence.
    """

    def __init__(self, shape: ModelShape, seed: int, groups: RankGroups | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tok = nn.Parameter(init_weight(seed, -1, "tok", (shape.vocab, shape.hidden)))
        self.pos = (nn.Parameter(init_weight(seed, -1, "pos", (shape.seq_len, shape.hidden)))
                    if shape.learned_positions else None)
        self.sp_group = _sp_group(groups, sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.tok)
        if self.pos is not None:
            x = x + self.pos[: tokens.shape[1]]
        return scatter_seq(x, self.sp_group) if self.sp_group is not None else x


class Block(nn.Module):
    """One transformer block, its attention and MLP split Megatron-style over the TP group.

    Per block and direction there is one TP all-reduce for attention and one for the MLP: the
    row-parallel output is summed in forward (`reduce_from_tp`), the replicated input's
    gradient in backward (`copy_to_tp`). With sequence parallelism each becomes an all-gather
    of the LayerNorm output and a reduce-scatter of the row-parallel output.
    """

    def __init__(self, index: int, shape: ModelShape, seed: int, groups: RankGroups | None,
                 recompute: Recompute = "none", checkpoint: CheckpointFn | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sp_group = _sp_group(groups, sequence_parallel)
        self.checkpoint = checkpoint or ds_checkpointing.checkpoint
        tp = groups.tp_size if groups else 1
        r = groups.tp_rank if groups else 0
        self.group = groups.tp if groups and groups.tp_size > 1 else None
        self.index, self.shape, self.recompute = index, shape, recompute
        self.heads, self.kv_heads = shape.heads // tp, shape.kv_heads // tp
        h, d, f = shape.hidden, shape.head_dim, shape.ffn_hidden
        out_std = INIT_STD / math.sqrt(2 * shape.layers)  # GPT-2: scale residual projections

        def w(name: str, shape: tuple[int, int], std: float = INIT_STD) -> torch.Tensor:
            return init_weight(seed, index, name, shape, std)

        self.ln1 = _norm(shape)
        self.q = ColumnParallelLinear(w("q", (shape.heads * d, h)), r, tp)
        self.k = ColumnParallelLinear(w("k", (shape.kv_heads * d, h)), r, tp)
        self.v = ColumnParallelLinear(w("v", (shape.kv_heads * d, h)), r, tp)
        self.o = RowParallelLinear(w("o", (h, shape.heads * d), out_std), r, tp)
        self.ln2 = _norm(shape)
        self.up = ColumnParallelLinear(w("up", (f, h)), r, tp)
        self.gate = (ColumnParallelLinear(w("gate", (f, h)), r, tp)
                     if shape.activation == "swiglu" else None)
        self.down = RowParallelLinear(w("down", (h, f), out_std), r, tp)
        if self.sp_group is not None:
            all_reduce_grads_over_tp([*self.ln1.parameters(), *self.ln2.parameters()],
                                     self.sp_group)

    def _enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            return gather_seq(x, self.sp_group)
        return copy_to_tp(x, self.group)

    def _leave_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            return reduce_scatter_seq(x, self.sp_group)
        return reduce_from_tp(x, self.group)

    def _attention_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.heads != self.kv_heads)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter_tp(self.ln1(x))
        b, s, _ = x.shape
        d = self.shape.head_dim
        q = self.q(x).view(b, s, self.heads, d).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        if self.shape.positions == "rotary":
            q, k = rotary(q), rotary(k)
        if self.recompute == "selective":
            # Selective recompute (Korthikanti et al.): keep the projections, recompute only
            # the attention core, whose saved activations grow with s^2.
            y = self.checkpoint(self._attention_core, q, k, v)
        else:
            y = self._attention_core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, self.heads * d)
        return self._leave_tp(self.o(y))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter_tp(self.ln2(x))
        y = F.silu(self.gate(x)) * self.up(x) if self.gate is not None else F.gelu(self.up(x))
        return self._leave_tp(self.down(y))

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(x)
        return x + self._mlp(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            # Full recompute: keep only the block input, recompute the rest in backward.
            return self.checkpoint(self._block, x)
        return self._block(x)


class Head(nn.Module):
    """Final norm and the LM head (replicated over TP; layer index L).

    With sequence parallelism the whole sequence is gathered first, so the norm and the
    head see every token and their gradients are the same on every TP rank.
    """

    def __init__(self, shape: ModelShape, seed: int, groups: RankGroups | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ln = _norm(shape)
        self.weight = nn.Parameter(init_weight(seed, shape.layers, "lm_head",
                                               (shape.vocab, shape.hidden)))
        self.sp_group = _sp_group(groups, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            x = gather_seq_to_replicated(x, self.sp_group)
        return F.linear(self.ln(x), self.weight)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the micro-batch, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_layers(shape: ModelShape, seed: int, groups: RankGroups | None,
                 recompute: Recompute = "none",
                 layer_range: tuple[int, int] | None = None,
                 checkpoint: CheckpointFn | None = None,
                 sequence_parallel: bool = False) -> list[nn.Module]:
    """The model as a flat layer list; only blocks in `layer_range` (default all) are built,
    plus the embedding when the range starts at 0 and the head when it ends at L."""
    check_buildable(shape)
    start, end = layer_range or (0, shape.layers)
    layers: list[nn.Module] = []
    sp = sequence_parallel
    if start == 0:
        layers.append(Embedding(shape, seed, groups, sp))
    layers += [Block(i, shape, seed, groups, recompute, checkpoint, sp) for i in range(start, end)]
    if end == shape.layers:
        layers.append(Head(shape, seed, groups, sp))
    return layers


class GPT(nn.Module):
    """The whole model on one pipeline stage: tokens in, logits out."""

    def __init__(self, shape: ModelShape, seed: int, groups: RankGroups | None = None,
                 recompute: Recompute = "none", sequence_parallel: bool = False) -> None:
        super().__init__()
        self.layers = nn.Sequential(*build_layers(shape, seed, groups, recompute,
                                                  sequence_parallel=sequence_parallel))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens)


def parameter_count(shape: ModelShape, tp: int = 1) -> int:
    """Parameters one TP rank holds (tp = 1: the whole model, `shape.total_params`).

    The blocks' matrices are split over tp; norms, embeddings and head are replicated.
    Used by the tests of the memory report.
    """
    split = shape.layers * shape.layer_matmul_params()
    return shape.total_params - split + split // tp
