"""The built-in decoder-only GPT, built as a list of pipeline layers from the planner's shape.

The model is `service.planner.shape.ModelShape`, the object the planner counts, so the two
cannot disagree: pre-norm blocks (LayerNorm or RMSNorm, as `layer_norm` says), causal attention
through `scaled_dot_product_attention` (GQA via `kv_heads`, any `head_dim`, Qwen3's per-head
q/k RMSNorms), a GELU or SwiGLU MLP, learned or rotary positions (with `linear`, `llama3` or
`yarn` scaling), biases where the shape has them, a tied or untied LM head.
q, k and v are one matmul, and so are a SwiGLU MLP's gate and up (`FusedColumnParallelLinear`:
on each TP rank its own rows of each projection, stacked), split after; the numbers are those
the separate projections were drawn with, and checkpoints name the projections apart
(`workers.checkpoint.full_state`).
`check_buildable` refuses, naming the trait, the shapes this model does not build (ALiBi).
Positions, their scalings and the attention masks are `workers.modeling.positions`'.
The model is a flat list [Embedding, Block 0 .. Block L-1, Head] so that the same layers
serve a single-stage `GPT` (pp = 1) and DeepSpeed's `PipelineModule` (pp > 1, embedding on
the first stage, head on the last).

Layout invariance and shard-only construction: every weight is a pure function of (seed,
layer, name), drawn in seeded blocks along the dimension TP splits it on
(`workers.modeling.seeded_init`), so each rank draws only its own shard, straight into its
parameter.
A layer therefore holds the same numbers whatever tp, pp or dp is, never needs the rest of the
model to exist, and no rank ever holds a whole weight it does not keep. `building` builds
directly on the training device in the training dtype, and under ZeRO-3 inside
`deepspeed.zero.Init`, which partitions each module's parameters over the DP group as soon as
the module is built (`workers.trainer.train`).

One module because it is one model: the embedding, the blocks and the head are built from the
same shape, TP groups and seeded initialisation, and `build_layers` assembles them for the
single-stage GPT and the pipeline alike.

Called by `workers.trainer.train`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from service.planner.shape import ModelShape
from workers.modeling.positions import Documents, bias_for, document_positions, rotary
from workers.modeling.seeded_init import SeededInit, full_weight
from workers.modeling.tp import (
    TIED_COPY,
    TP_SPLIT,
    ColumnParallelLinear,
    FusedColumnParallelLinear,
    RankGroups,
    RowParallelLinear,
    all_reduce_grads_over_tp,
    copy_to_tp,
    fused_parts,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
)
from workers.modeling.vocab import LossFn, local_lookup, make_loss, vocab_range
from workers.runtime.deepspeed_import import deepspeed

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
    if shape.layer_norm:
        return nn.LayerNorm(shape.hidden, eps=shape.norm_eps or 1e-5)
    return nn.RMSNorm(shape.hidden, eps=shape.norm_eps)


def init_weight(seed: int, layer: int, name: str, shape: tuple[int, int],
                std: float = INIT_STD, transposed: bool = False) -> torch.Tensor:
    """The full (unsharded) weight `name` of layer `layer` (`transposed`: a row-parallel
    one), fp32 on the CPU: what every layout's shards are slices of. For tests and
    references; the layers draw only their shards."""
    return full_weight(seed, layer, name, shape, std, transposed)


@contextmanager
def building(device: torch.device | str | None = None,
             dtype: torch.dtype | None = None) -> Iterator[None]:
    """Build layers directly on `device` in `dtype` (every parameter the layers and the
    norms create): no whole-stage copy on the host, no fp32 copy of a 16-bit model."""
    with ExitStack() as stack:
        if device is not None:
            stack.enter_context(torch.device(device))
        if dtype is not None and dtype != torch.get_default_dtype():
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        yield


def _sp_group(groups: RankGroups | None, sequence_parallel: bool):
    return groups.tp if sequence_parallel and groups and groups.tp_size > 1 else None


class Embedding(nn.Module):
    """Token embeddings split over TP by vocabulary rows (`workers.modeling.vocab`), and learned
    positions (replicated over TP); layer index -1.

    With sequence parallelism the output keeps only this TP rank's chunk of the sequence (the
    partial embeddings reduce-scattered, then that chunk's positions added).
    """

    embedding_table = True
    """Its parameters are tables (no weight decay by default: `workers.trainer.recipe`)."""

    def __init__(self, shape: ModelShape, seed: int, groups: RankGroups | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = _tp_group(groups)
        self.vocab_start, end = _vocab_slice(shape, groups)
        self.tok = nn.Parameter(
            SeededInit(seed, -1, "tok", INIT_STD, shape.vocab).rows(self.vocab_start, end,
                                                                     shape.hidden))
        setattr(self.tok, TP_SPLIT, True)
        self.pos = (nn.Parameter(SeededInit(seed, -1, "pos", INIT_STD, shape.seq_len).rows(
            0, shape.seq_len, shape.hidden)) if shape.learned_positions else None)
        self.sp_group = _sp_group(groups, sequence_parallel)
        if self.sp_group is not None and self.pos is not None:
            all_reduce_grads_over_tp([self.pos], self.sp_group)  # each rank adds its chunk's

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, Documents]
                ) -> torch.Tensor | tuple[torch.Tensor, Documents]:
        """Tokens (batch, seq), or (tokens, documents) with document masks: then the output
        is (hidden states, documents), which every block passes on."""
        tokens, documents = inputs if isinstance(inputs, tuple) else (inputs, None)
        s = tokens.shape[1]
        if self.group is None:
            x = F.embedding(tokens, self.tok)
        elif self.sp_group is not None:
            x = reduce_scatter_seq(local_lookup(tokens, self.tok, self.vocab_start),
                                   self.sp_group)
        else:
            x = reduce_from_tp(local_lookup(tokens, self.tok, self.vocab_start), self.group)
        if self.pos is not None:
            pos = self.pos[:s] if documents is None else self.pos[document_positions(documents)]
            if self.sp_group is not None:
                pos = pos.chunk(dist.get_world_size(self.sp_group), dim=-2)[
                    dist.get_rank(self.sp_group)]
            x = x + pos
        return x if documents is None else (x, documents)


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
        self.checkpoint = checkpoint or deepspeed.checkpointing.checkpoint
        tp = groups.tp_size if groups else 1
        r = groups.tp_rank if groups else 0
        self.group = groups.tp if groups and groups.tp_size > 1 else None
        self.index, self.shape, self.recompute = index, shape, recompute
        self.window = shape.window(index)
        """This block's sliding window (None: full causal attention)."""
        self.heads, self.kv_heads = shape.heads // tp, shape.kv_heads // tp
        h, d, f = shape.hidden, shape.head_dim, shape.ffn_hidden
        out_std = INIT_STD / math.sqrt(2 * shape.layers)  # GPT-2: scale residual projections

        def w(name: str, rows: int, std: float = INIT_STD) -> SeededInit:
            return SeededInit(seed, index, name, std, rows)  # rows of its draw order

        qkv_b, mlp_b = shape.qkv_biased, shape.mlp_biased
        fused = fused_parts(shape)

        def stack(name: str, bias: bool) -> FusedColumnParallelLinear:
            return FusedColumnParallelLinear([(part, w(part, rows), rows)
                                              for part, rows in fused[name]], h, r, tp, bias)

        self.ln1 = _norm(shape)
        self.qkv = stack("qkv", qkv_b)  # q, k and v: one matmul
        self.o = RowParallelLinear(w("o", shape.q_dim, out_std), h, shape.q_dim, r, tp)
        # Qwen3: an RMSNorm over each head of q and k (one head_dim weight each, whole on
        # every TP rank, which normalises its own heads: the gradients are summed over TP).
        self.q_norm = nn.RMSNorm(d, eps=shape.norm_eps) if shape.qk_norm else None
        self.k_norm = nn.RMSNorm(d, eps=shape.norm_eps) if shape.qk_norm else None
        self.ln2 = _norm(shape)
        # SwiGLU: gate and up as one matmul; GELU: up alone.
        self.gate_up = stack("gate_up", mlp_b) if "gate_up" in fused else None
        self.up = ColumnParallelLinear(w("up", f), f, h, r, tp, mlp_b) \
            if self.gate_up is None else None
        self.down = RowParallelLinear(w("down", f, out_std), h, f, r, tp)
        # A row-parallel layer's bias is added once, after the sum over TP: replicated.
        self.o_bias = nn.Parameter(torch.zeros(h)) if shape.o_biased else None
        self.down_bias = nn.Parameter(torch.zeros(h)) if mlp_b else None
        if self.sp_group is not None:  # each rank sees its chunk of the sequence there
            all_reduce_grads_over_tp([*self.ln1.parameters(), *self.ln2.parameters(),
                                      *[p for p in (self.o_bias, self.down_bias)
                                        if p is not None]], self.sp_group)
        if self.group is not None and self.q_norm is not None and self.k_norm is not None:
            all_reduce_grads_over_tp([*self.q_norm.parameters(), *self.k_norm.parameters()],
                                     self.group)

    def projection(self, name: str) -> torch.Tensor:
        """This rank's weight of projection `name` (`q`, `k`, `v`, `o`, `gate`, `up`,
        `down`): a fused one's own rows, as a view."""
        for fused in (self.qkv, self.gate_up):
            if fused is not None and name in dict(fused.parts):
                return fused.part(name)
        return getattr(self, name).weight

    def _enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            return gather_seq(x, self.sp_group)
        return copy_to_tp(x, self.group)

    def _leave_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp_group is not None:
            return reduce_scatter_seq(x, self.sp_group)
        return reduce_from_tp(x, self.group)

    def _attention_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention, masked by `bias` (`attention_bias`: a sliding window, document
        boundaries) when given."""
        gqa = self.heads != self.kv_heads
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)

    def _attention(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = self._enter_tp(self.ln1(x))
        b, s, _ = x.shape
        d = self.shape.head_dim
        q, k, v = self.qkv(x)
        q, k = q.view(b, s, self.heads, d), k.view(b, s, self.kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        if self.shape.positions == "rotary":
            positions = None if documents is None else document_positions(documents)
            base, scaling = self.shape.rope_theta, self.shape.rope
            q = rotary(q, base, positions, scaling)
            k = rotary(k, base, positions, scaling)
            if self.q_norm is None:
                # v alone would keep the whole fused output (raw q and k too) alive until
                # backward: kept apart, backward holds what separate projections held.
                v = v.contiguous()
        bias = bias_for(s, self.window, documents, x.device, q.dtype)
        if self.recompute == "selective":
            # Selective recompute (Korthikanti et al.): keep the projections, recompute only
            # the attention core, whose saved activations grow with s^2.
            y = self.checkpoint(self._attention_core, q, k, v, bias)
        else:
            y = self._attention_core(q, k, v, bias)
        y = y.transpose(1, 2).reshape(b, s, self.heads * d)
        out = self._leave_tp(self.o(y))
        return out if self.o_bias is None else out + self.o_bias

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        x = self._enter_tp(self.ln2(x))
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
            y = F.silu(gate) * up
        else:
            assert self.up is not None
            y = F.gelu(self.up(x), approximate="tanh" if self.shape.gelu_tanh else "none")
        out = self._leave_tp(self.down(y))
        return out if self.down_bias is None else out + self.down_bias

    def _block(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        x = x + self._attention(x, documents)
        return x + self._mlp(x)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, Documents]
                ) -> torch.Tensor | tuple[torch.Tensor, Documents]:
        """Hidden states, or (hidden states, documents) with document masks (passed on)."""
        x, documents = inputs if isinstance(inputs, tuple) else (inputs, None)
        if self.recompute == "full" and torch.is_grad_enabled():
            # Full recompute: keep only the block input, recompute the rest in backward.
            x = self.checkpoint(self._block, x, documents)
        else:
            x = self._block(x, documents)
        return x if documents is None else (x, documents)


class Head(nn.Module):
    """Final norm and the LM head, split over TP by vocabulary rows (layer index L): the
    output is this rank's slice of the logits, for `loss_for`'s cross entropy.

    The norm runs on the replicated input (with sequence parallelism, on this rank's chunk,
    its gradients then summed over TP), which then enters the TP region as a column-parallel
    layer's input does. A tied head (GPT-2, GPT-3) projects with the token embedding: the
    `table` module's own matrix when it is on this stage (not registered here, so the model
    holds it once; ZeRO-3 gathers it as an external parameter), else its own copy `tok`, which
    the pipeline ties to the first stage's (`workers.trainer.pipeline`).
    """

    def __init__(self, shape: ModelShape, seed: int, groups: RankGroups | None = None,
                 sequence_parallel: bool = False, table: Embedding | None = None) -> None:
        super().__init__()
        self.ln = _norm(shape)
        self.group = _tp_group(groups)
        start, end = _vocab_slice(shape, groups)
        self.weight: nn.Parameter | None = None
        self.tok: nn.Parameter | None = None
        self.__dict__["_table"] = table if shape.tied else None
        if not shape.tied:
            self.weight = nn.Parameter(SeededInit(seed, shape.layers, "lm_head", INIT_STD,
                                                           shape.vocab).rows(start, end,
                                                                             shape.hidden))
            setattr(self.weight, TP_SPLIT, True)
        elif table is None:
            self.tok = nn.Parameter(
                SeededInit(seed, -1, "tok", INIT_STD, shape.vocab).rows(start, end, shape.hidden))
            setattr(self.tok, TP_SPLIT, True)
            setattr(self.tok, TIED_COPY, True)
        self.sp_group = _sp_group(groups, sequence_parallel)
        if self.sp_group is not None:
            all_reduce_grads_over_tp(list(self.ln.parameters()), self.sp_group)

    def forward(self, inputs: torch.Tensor | tuple[torch.Tensor, Documents]) -> torch.Tensor:
        x = inputs[0] if isinstance(inputs, tuple) else inputs
        x = self.ln(x)
        x = gather_seq(x, self.sp_group) if self.sp_group is not None else \
            copy_to_tp(x, self.group)
        return F.linear(x, self.matrix())

    def matrix(self) -> torch.Tensor:
        """This rank's rows of the projection: the head's own, or the tied embedding's."""
        table = self.__dict__["_table"]
        matrix = table.tok if table is not None else \
            self.weight if self.weight is not None else self.tok
        assert matrix is not None
        return matrix


def _tp_group(groups: RankGroups | None):
    return groups.tp if groups and groups.tp_size > 1 else None


def _vocab_slice(shape: ModelShape, groups: RankGroups | None) -> tuple[int, int]:
    return vocab_range(shape.vocab, groups.tp_rank if groups else 0,
                       groups.tp_size if groups else 1)


def loss_for(shape: ModelShape, groups: RankGroups | None) -> LossFn:
    """The mean next-token cross entropy over a micro-batch, in fp32, from this TP rank's
    slice of the logits (`workers.modeling.vocab`: vocabulary-parallel over the TP group)."""
    return make_loss(_vocab_slice(shape, groups)[0], _tp_group(groups))


def full_logits(logits: torch.Tensor, groups: RankGroups | None) -> torch.Tensor:
    """The whole vocabulary's logits from every TP rank's slice (for evaluation and export
    checks; training never gathers them)."""
    group = _tp_group(groups)
    if group is None:
        return logits
    parts = [torch.empty(0)] * dist.get_world_size(group)
    dist.all_gather_object(parts, logits.detach().cpu(), group=group)
    return torch.cat(parts, dim=-1).to(logits.device)


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
    embedding = Embedding(shape, seed, groups, sp) if start == 0 else None
    if embedding is not None:
        layers.append(embedding)
    layers += [Block(i, shape, seed, groups, recompute, checkpoint, sp) for i in range(start, end)]
    if end == shape.layers:
        # A tied head without the embedding on this stage holds its own copy of the matrix,
        # which only DeepSpeed's pipeline ties to the first stage's (workers.trainer.pipeline).
        layers.append(Head(shape, seed, groups, sp, table=embedding))
    return layers


class GPT(nn.Module):
    """The whole model on one pipeline stage: tokens in, logits out."""

    def __init__(self, shape: ModelShape, seed: int, groups: RankGroups | None = None,
                 recompute: Recompute = "none", sequence_parallel: bool = False) -> None:
        super().__init__()
        self.layers = nn.Sequential(*build_layers(shape, seed, groups, recompute,
                                                  sequence_parallel=sequence_parallel))

    def forward(self, tokens: torch.Tensor | tuple[torch.Tensor, Documents]) -> torch.Tensor:
        """Logits of tokens (batch, seq), or of (tokens, documents) with document masks."""
        return self.layers(tokens)


def parameter_count(shape: ModelShape, tp: int = 1) -> int:
    """Parameters one TP rank holds with every layer on it (tp = 1: the whole model,
    `shape.total_params`): the planner's per-rank count, `ModelShape.rank_params`.
    Used by the tests of the memory report."""
    return shape.rank_params(tp, shape.layers, first=True, last=True)
