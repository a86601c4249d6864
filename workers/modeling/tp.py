"""Tensor parallelism by hand: the Megatron column/row-parallel linear layers, the rank's
process groups, and every collective the trainer itself issues.

Why by hand: DeepSpeed AutoTP cannot run inside DeepSpeed's pipeline engine (it builds its own
groups and trips `dp_world_size == grid.data_parallel_size`), so for tp x pp we split the
attention and MLP matrices ourselves over the topology's TP group, as Megatron-DeepSpeed does.
One code path then serves pp = 1 and pp > 1 alike.

Sequence parallelism (Megatron): LayerNorm and residual regions hold 1/tp of the sequence;
the all-reduce of each TP region becomes an all-gather before it and a reduce-scatter after.

Every collective of ours goes through one small function per kind (`tp_all_reduce`,
`tp_all_gather_seq`, `tp_reduce_scatter_seq`, `dp_all_reduce`, `pp_broadcast`) so the monitor
can time them per parallel dimension (`set_collective_observer`). The pipeline's
point-to-point sends and ZeRO's DP collectives are DeepSpeed's (or, for interleaved stages,
torch's) own: this observer does not see them.

Called by `workers.modeling.model` (layers) and `workers.trainer.train` (groups, loss averaging).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from service.contract.parallel import Dim, ParallelDims
from service.planner.shape import ModelShape
from workers.modeling.seeded_init import SeededInit, stacked

TP_SPLIT = "tp_split"
"""Attribute set (True) on a parameter split over the TP group: each TP rank holds a different
part of it (`workers.trainer.recipe` counts it on every TP rank in the gradient norm)."""
TIED_COPY = "tied_copy"
"""Attribute set (True) on a pipeline's last-stage copy of a tied embedding matrix: DeepSpeed
keeps it equal to the first stage's (`TiedLayerSpec`); the gradient norm counts it there."""


@dataclass
class RankGroups:
    """This rank's coordinates and its TP/PP/DP process groups (None when world size is 1)."""

    dims: ParallelDims
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None

    @property
    def tp_size(self) -> int:
        return self.dims.tp


def build_groups(dims: ParallelDims, rank: int) -> RankGroups:
    """Create every TP, PP and DP group (all ranks call new_group for all, in one order)."""
    c = dims.coord(rank)
    mine: dict[Dim, dist.ProcessGroup | None] = {Dim.TP: None, Dim.PP: None, Dim.DP: None}
    if dist.is_initialized():
        for dim in (Dim.TP, Dim.PP, Dim.DP):
            for ranks in dims.groups(dim):
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[dim] = group
    return RankGroups(dims=dims, rank=rank, tp_rank=c.tp, pp_rank=c.pp, dp_rank=c.dp,
                      tp=mine[Dim.TP], pp=mine[Dim.PP], dp=mine[Dim.DP])


class DeepSpeedMpu:
    """The `mpu` object DeepSpeed asks for its groups: model parallel = our TP group.

    With pp = 1 this tells the engine and ZeRO to reduce and shard over the DP group only.
    (With pp > 1 the pipeline engine builds its own grid from the same topology.)
    """

    def __init__(self, groups: RankGroups) -> None:
        self.g = groups

    def get_model_parallel_group(self):
        return self.g.tp

    def get_model_parallel_rank(self) -> int:
        return self.g.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.g.dims.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.g.rank - self.g.tp_rank

    def get_data_parallel_group(self):
        return self.g.dp

    def get_data_parallel_rank(self) -> int:
        return self.g.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.g.dims.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.g.dims.group_of(self.g.rank, Dim.DP)

    def get_pipeline_model_parallel_group(self):
        return self.g.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.g.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.g.dims.pp


# --- collectives: one function per kind -------------------------------------------------------

CollectiveObserver = Callable[[str, str, int], AbstractContextManager[object]]
"""`observer(dim, op, nbytes)` returns a context manager around one collective call."""
_observer: CollectiveObserver | None = None


def set_collective_observer(observer: CollectiveObserver | None) -> None:
    """Let a monitor time every collective issued here, by dimension ("tp", "dp", "pp")."""
    global _observer
    _observer = observer


def _observe(dim: str, op: str, x: torch.Tensor) -> AbstractContextManager[object]:
    if _observer is None:
        return nullcontext()
    return _observer(dim, op, x.numel() * x.element_size())


def tp_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None,
                  op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum `x` over the TP group in place (the one TP collective of the Megatron split; the
    vocabulary-parallel cross entropy also takes a max)."""
    if group is not None and dist.get_world_size(group) > 1:
        with _observe("tp", "all_reduce", x):
            dist.all_reduce(x, op=op, group=group)
    return x


def dp_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `x` over the DP group in place (the reported loss; interleaved stages' gradients)."""
    if group is not None and dist.get_world_size(group) > 1:
        with _observe("dp", "all_reduce", x):
            dist.all_reduce(x, group=group)
    return x


def pp_broadcast(x: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Broadcast `x` from global rank `src` over the PP group (the loss, from the last stage)."""
    if group is not None and dist.get_world_size(group) > 1:
        with _observe("pp", "broadcast", x):
            dist.broadcast(x, src=src, group=group)
    return x


def world_any(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any rank (one tiny all-reduce over the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    x = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    with _observe("world", "all_reduce", x):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return bool(x.item())


def tp_all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the TP ranks' sequence chunks (dim 1): sequence parallelism's gather."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    with _observe("tp", "all_gather", x):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def tp_reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the TP group and keep this rank's sequence chunk (dim 1).

    NCCL does it in one reduce-scatter; gloo has no reduce-scatter of its own, so there it is
    an all-reduce and a slice (same result, more bytes on the wire).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        chunks = [c.contiguous() for c in x.chunk(size, dim=1)]
        out = torch.empty_like(chunks[rank])
        with _observe("tp", "reduce_scatter", x):
            dist.reduce_scatter(out, chunks, group=group)
        return out
    x = x.contiguous()
    with _observe("tp", "reduce_scatter", x):
        dist.all_reduce(x, group=group)
    return x.chunk(size, dim=1)[rank].contiguous()


class _GatherSeq(torch.autograd.Function):
    """Sequence parallel -> tensor parallel region: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tp_all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return tp_reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Tensor parallel -> sequence parallel region: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tp_reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return tp_all_gather_seq(grad.contiguous(), ctx.group), None


def gather_seq(x, group):
    return _GatherSeq.apply(x, group)


def reduce_scatter_seq(x, group):
    return _ReduceScatterSeq.apply(x, group)


def all_reduce_grads_over_tp(params, group: dist.ProcessGroup) -> None:
    """With sequence parallelism a LayerNorm sees only this rank's tokens: sum its replicated
    parameters' gradients over the TP group (a hook per parameter, as Megatron does)."""
    for p in params:
        p.register_hook(lambda g: tp_all_reduce(g.clone(), group))


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient in backward (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return tp_all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's `g`)."""

    @staticmethod
    def forward(ctx, x, group):
        return tp_all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group is not None else x


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group is not None else x


# --- layers ------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y = x W_i^T with W split by output rows; the input is replicated over the TP group.

    Each rank draws only its rows [tp_rank*out/tp, ...) of the seeded weight `init`
    (`workers.modeling.seeded_init`: the same numbers whatever the layout), i.e. whole heads of
    q/k/v and whole columns of the MLP's inner dimension; the whole matrix never exists.
    """

    def __init__(self, init: SeededInit, out_features: int, in_features: int, tp_rank: int,
                 tp_size: int, bias: bool = False) -> None:
        super().__init__()
        assert out_features % tp_size == 0, \
            f"tp({tp_size}) does not divide out features({out_features})"
        per = out_features // tp_size
        self.weight = nn.Parameter(init.rows(tp_rank * per, (tp_rank + 1) * per, in_features))
        setattr(self.weight, TP_SPLIT, True)
        # The bias splits with the output rows (GPT-2 initialises biases to zero).
        self.bias = nn.Parameter(torch.zeros(per)) if bias else None
        if self.bias is not None:
            setattr(self.bias, TP_SPLIT, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def fused_parts(shape: ModelShape) -> dict[str, tuple[tuple[str, int], ...]]:
    """The block's fused column-parallel projections: fused name -> (projection, full rows)
    in the order their rows stack on every TP rank. `qkv` is q, k and v (GQA: k and v have
    kv_dim rows); a SwiGLU MLP's `gate_up` is gate and up (a GELU MLP has `up` alone)."""
    q, kv, f = shape.q_dim, shape.kv_dim, shape.ffn_hidden
    out: dict[str, tuple[tuple[str, int], ...]] = {"qkv": (("q", q), ("k", kv), ("v", kv))}
    if shape.swiglu:
        out["gate_up"] = (("gate", f), ("up", f))
    return out


class FusedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of one input as one matmul, split after (q, k, v;
    gate, up).

    On TP rank r the weight is each projection's own rank-r rows stacked, [q_r; k_r; v_r]
    (Megatron's per-rank layout), each drawn from that projection's own seeded init
    (`workers.modeling.seeded_init`): the same numbers as separate layers would hold, whatever
    the layout. `parts` is (projection name, rows on this rank) in that order; the full,
    per-projection tensors (`workers.checkpoint.full_state`) are cut from it by those rows.
    """

    def __init__(self, inits: Sequence[tuple[str, SeededInit, int]], in_features: int,
                 tp_rank: int, tp_size: int, bias: bool = False) -> None:
        super().__init__()
        for name, _init, rows in inits:
            assert rows % tp_size == 0, f"tp({tp_size}) does not divide {name}'s rows({rows})"
        self.parts = tuple((name, rows // tp_size) for name, _init, rows in inits)
        self.weight = nn.Parameter(stacked(
            [(init, tp_rank * per, (tp_rank + 1) * per)
             for (_, init, _rows), (_, per) in zip(inits, self.parts, strict=True)],
            in_features))
        setattr(self.weight, TP_SPLIT, True)
        self.bias = nn.Parameter(torch.zeros(self.weight.shape[0])) if bias else None
        if self.bias is not None:
            setattr(self.bias, TP_SPLIT, True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each projection of `x` (views of the one matmul's output, in `parts` order)."""
        y = nn.functional.linear(x, self.weight, self.bias)
        return y.split([n for _, n in self.parts], dim=-1)

    def part(self, name: str) -> torch.Tensor:
        """This rank's weight rows of projection `name` (a view)."""
        start = 0
        for part, n in self.parts:
            if part == name:
                return self.weight[start:start + n]
            start += n
        raise KeyError(name)


class RowParallelLinear(nn.Module):
    """y = sum_i x_i W_i^T with W split by input columns; the caller all-reduces the sum.

    Each rank draws only its columns of the seeded weight (drawn in its transpose's order, so
    that a column range is contiguous in the draw: `workers.modeling.seeded_init`)."""

    def __init__(self, init: SeededInit, out_features: int, in_features: int, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        assert in_features % tp_size == 0, \
            f"tp({tp_size}) does not divide in features({in_features})"
        per = in_features // tp_size
        self.weight = nn.Parameter(init.columns(out_features, tp_rank * per, (tp_rank + 1) * per))
        setattr(self.weight, TP_SPLIT, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)
