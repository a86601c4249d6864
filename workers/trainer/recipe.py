"""The optimisation recipe every layout runs: AdamW's parameter groups, the learning-rate
schedule, and gradient clipping by the global norm over every TP, PP and DP rank.

- Weight decay (`train.weight_decay`) goes on the weight matrices only: norms, biases and
  embeddings (token and position tables) are not decayed unless `train.weight_decay_all`.
- The rate of each optimizer step is `TrainSpec.lr_at(step)`, a pure function of the step
  number, set on the optimizer's parameter groups before the step: a resumed attempt continues
  the schedule from the step it resumes at, with nothing else to restore.
- The global gradient norm counts every gradient once: a tensor split over the TP group on
  every TP rank, a replicated one (norms, biases of row-parallel layers) on TP rank 0 only;
  summed over the TP and PP groups; DP replicas hold the same averaged gradient (or, under
  ZeRO, DeepSpeed sums its partitions). Under DeepSpeed's engines with ZeRO or bf16/fp16,
  DeepSpeed's optimizer computes that norm and clips (`gradient_clipping`); it decides which
  tensors to count with `is_model_parallel_parameter(p) or model_parallel_rank == 0`, where
  the model-parallel rank of its pipeline grid spans TP and PP. `mark_norm_owners` therefore
  marks as `model_parallel` every split tensor and, on TP rank 0, every replicated one: each
  gradient is then counted exactly once by DeepSpeed's rule, with and without a pipeline.
  Where DeepSpeed keeps no norm (fp32 without ZeRO: its `clip_fp32_gradients` returns the norm
  to nobody) and on the interleaved path (torch's optimizers), `clip_before_step` computes it
  by the same rule and clips in a pre-step hook of the optimizer.

Called by `workers.trainer.train` and `workers.trainer.interleaved`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from service.contract.spec import TrainSpec
from workers.modeling.tp import TIED_COPY, TP_SPLIT, RankGroups


def no_decay_names(module: nn.Module) -> set[str]:
    """Names of the parameters not decayed by default: vectors (norms, biases) and the
    parameters of embedding tables (modules with `embedding_table = True`)."""
    names = set()
    for mod_name, mod in module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            # A ZeRO-3 parameter built inside deepspeed.zero.Init holds an empty partition
            # in `.data`: its real shape is `ds_shape`.
            if len(getattr(p, "ds_shape", p.shape)) < 2 or \
                    getattr(mod, "embedding_table", False) or \
                    getattr(p, TIED_COPY, False):
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def param_groups(module: nn.Module, train: TrainSpec) -> list[dict[str, Any]]:
    """AdamW's parameter groups: decayed weight matrices, then the rest at weight decay 0;
    one group when every parameter decays alike (`weight_decay_all`, or no weight decay), and
    no empty group."""
    uniform = train.weight_decay_all or train.weight_decay == 0
    skip = set() if uniform else no_decay_names(module)
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if id(p) in seen:  # a tied matrix is one parameter
            continue
        seen.add(id(p))
        (plain if name in skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def mark_norm_owners(module: nn.Module, groups: RankGroups) -> None:
    """Mark the parameters whose gradients this rank counts in the global norm (see module)."""
    for p in module.parameters():
        if getattr(p, TIED_COPY, False):
            continue  # counted where the tied matrix is first, on the first stage
        if getattr(p, TP_SPLIT, False) or groups.tp_rank == 0:
            p.model_parallel = True  # type: ignore[attr-defined]


def set_lr(optimizer: Any, lr: float) -> None:
    """Run the next step at `lr`: every parameter group of the optimizer and of each one it
    wraps (DeepSpeed's wrappers; torch's ZeroRedundancyOptimizer copies its own groups' rate
    onto its inner optimizer's at each step)."""
    while optimizer is not None:
        for group in getattr(optimizer, "param_groups", None) or []:
            group["lr"] = lr
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)


def mend_unfused_optimizer(optimizer: Any, params: list[nn.Parameter], groups: RankGroups,
                           clip: float) -> None:
    """Mend DeepSpeed's FP16_UnfusedOptimizer (16-bit ZeRO 0 around a torch optimizer: bf16 or
    fp16 at pp 1, fp16 on the pipeline) in two places; nothing for any other optimizer.

    - Its warm-up step: it creates Adam's states by stepping the inner optimizer once on zero
      gradients when it is built (`initialize_optimizer_states`), so AdamW's step count starts
      at 1 (every later bias correction one step late: the first update 0.74 of the rate) and
      the decoupled weight decay shrinks the fp32 masters once. A bf16 ZeRO 0 run drifted
      3.8e-3 from its fp32 run over 5 steps with it (tests/test_workers_layouts.py), 60 times
      the other layouts. Undone: the inner state emptied (AdamW creates it at the first real
      step, as under every other engine), the masters copied again from the 16-bit weights
      they were cloned from.
    - Its norm under TP: it passes the gradients to `get_weight_norm`, which asks each tensor
      whether it is a model-parallel parameter; a gradient never is, so TP ranks > 0 count
      nothing (1.13 for a global 1.39 at tp 2). Its clipping is turned off; before the inner
      step the global norm of `params`' 16-bit gradients (`global_grad_norm`, by the marks of
      `mark_norm_owners`) clips the fp32 masters' gradients by the same rule, and is the norm
      the wrapper, and so the engine, reports."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return
    inner = optimizer.optimizer
    inner.state.clear()
    masters = [m for group in optimizer.fp32_groups for m in group]
    with torch.no_grad():
        for m, w in zip(masters, [w for group in optimizer.fp16_groups for w in group],
                        strict=True):
            m.copy_(w)
    optimizer.clip_grad = 0.0

    def hook(*_: Any) -> None:
        norm = global_grad_norm(params, groups)
        optimizer._global_grad_norm = norm
        clip_grads(masters, norm, clip)
    inner.register_step_pre_hook(hook)


def global_grad_norm(params: list[nn.Parameter], groups: RankGroups) -> float:
    """The L2 norm of the whole model's gradient, on every rank (a collective over TP and PP):
    this rank's counted gradients (those `mark_norm_owners` marks) summed over both groups.
    DP replicas hold the same averaged gradients and are not summed."""
    sq = None
    for p in params:
        if p.grad is None or not getattr(p, "model_parallel", False):
            continue
        part = p.grad.detach().float().pow(2).sum()
        sq = part if sq is None else sq + part
    if sq is None:  # nothing counted here (a TP rank > 0 holding only replicated tensors)
        sq = torch.zeros((), device=params[0].device if params else None)
    total = sq.reshape(1).clone()
    for group in (groups.tp, groups.pp):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return math.sqrt(float(total.item()))


def clip_grads(params: list[nn.Parameter], norm: float, clip: float) -> None:
    """Scale the gradients so that their global norm `norm` is at most `clip` (0: no clip),
    with DeepSpeed's coefficient clip / (norm + 1e-6)."""
    if clip <= 0 or not math.isfinite(norm):
        return
    coef = clip / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def clip_before_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                     groups: RankGroups, clip: float) -> Any:
    """Before each step of `optimizer` (a torch optimizer holding full gradients): measure the
    global norm, keep it as `optimizer._global_grad_norm` (where DeepSpeed's engine reads its
    optimizers' norm), and clip to `clip`. Returns the hook's handle."""
    def hook(opt: torch.optim.Optimizer, *_: Any) -> None:
        norm = global_grad_norm(params, groups)
        opt._global_grad_norm = norm  # type: ignore[attr-defined]
        clip_grads(params, norm, clip)
    return optimizer.register_step_pre_hook(hook)
