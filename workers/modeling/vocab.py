"""Megatron's vocabulary-parallel embedding, LM head and cross entropy over the TP group.

TP rank r holds rows [start_r, end_r) of the token table and of the LM head (`vocab_range`:
the vocabulary in tp contiguous slices, the first `vocab % tp` one row longer), so neither the
tables nor the logits are ever whole on one rank; that is what the planner counts
(`service.planner.memory`: embedding, head and logits divided by tp).

- Embedding: each rank looks up the tokens inside its slice (zeros for the others) and the
  partial embeddings are summed over the TP group: an all-reduce, or with sequence parallelism
  a reduce-scatter that leaves each rank its chunk of the sequence (Megatron's
  `VocabParallelEmbedding` with `reduce_scatter_to_sequence_parallel_region`).
- Head: a column-parallel linear over the vocabulary; its input is entered as for any
  column-parallel layer (identity forward / all-reduce backward, or with sequence parallelism
  all-gather forward / reduce-scatter backward).
- Cross entropy from the local logit slices (Megatron's `_VocabParallelCrossEntropy`): the
  row max, the sum of exponentials and the target's logit are all-reduced over the TP group;
  the gradient is softmax minus the one-hot target, each rank on its own slice.

Called by `workers.modeling.model`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.modeling.tp import tp_all_reduce

IGNORE = -100
"""A label that takes no loss (cross_entropy's default `ignore_index`;
`workers.trainer.data.IGNORE`)."""
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`loss(logits, labels)`: the mean next-token cross entropy of a micro-batch."""


def vocab_range(vocab: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows TP rank `tp_rank` of `tp` holds."""
    base, extra = divmod(vocab, tp)
    start = tp_rank * base + min(tp_rank, extra)
    return start, start + base + (1 if tp_rank < extra else 0)


def local_lookup(tokens: torch.Tensor, table: torch.Tensor, start: int) -> torch.Tensor:
    """This rank's part of the embedding of `tokens`: the rows of its slice `table` (which
    starts at vocabulary row `start`), zeros for tokens outside it. Summed over the TP group
    the parts are the full embedding."""
    end = start + table.shape[0]
    outside = (tokens < start) | (tokens >= end)
    local = (tokens - start).masked_fill(outside, 0)
    return F.embedding(local, table).masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over the vocabulary (fp32, in place of
    Megatron's fused kernel): forward needs three all-reduces, backward none."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        if group is not None:
            tp_all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        end = start + logits.shape[-1]
        outside = (target < start) | (target >= end)
        local = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            tp_all_reduce(target_logit, group)
            tp_all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1),
                          -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                                 group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-token cross entropy, `logits` (..., V_r) holding vocabulary rows from `start` of
    the TP group `group` (None: the whole vocabulary, one rank)."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, group)


def make_loss(start: int, group: dist.ProcessGroup | None) -> LossFn:
    """The mean next-token cross entropy of a micro-batch from this rank's logit slice, over
    its labels but the IGNORE ones (`data.eod_loss_mask`)."""
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        if group is None:
            return F.cross_entropy(flat.float(), labels.reshape(-1), ignore_index=IGNORE)
        labels = labels.reshape(-1)
        kept = labels != IGNORE
        per_token = vocab_parallel_cross_entropy(flat, labels, start, group)
        # As cross_entropy's ignore_index: the mean over the labels that take a loss
        return (per_token * kept).sum() / kept.sum().clamp(min=1)
    return loss
