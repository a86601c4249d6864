"""Interleaved pipeline stages (`virtual_stages` > 1) through `torch.distributed.pipelining`.

Why not DeepSpeed here: its pipeline engine has only the plain 1F1B schedule. torch's
`ScheduleInterleaved1F1B` runs several model chunks per pipeline rank; chunk k of pipeline rank
s holds virtual stage k * pp + s, i.e. exactly the ranges of the rank's row of the plan. ZeRO-1 is
torch's `ZeroRedundancyOptimizer` over the DP group. The DP gradient average is by hand (one
flat all-reduce after the schedule's last backward): `DistributedDataParallel` around the chunks
trips an internal assert in its bucket rebuilding under the interleaved schedule
("rebuilt parameter indices size is not same as original model parameters size").

bf16 is mixed precision as DeepSpeed's engine runs it on its own pipeline (`BF16_Optimizer`, or
ZeRO-1's fp32 partition): the chunks are built in bf16 (weights, activations and the stages'
messages in 16 bits, the loss in fp32 as `loss_for` computes it), the micro-batches' gradients
accumulate in bf16 in the parameters' `.grad` as DeepSpeed's pipeline accumulates them (its
`grad_accum_dtype` defaults to the parameters'), then each step moves them into an fp32 master
copy of every parameter (`_Masters`): the DP average, the global norm, the clip and AdamW run
on the masters, which are rounded back into the bf16 weights. Not torch autocast: autocast keeps
fp32 weights and casts them again for every matmul of every micro-batch, twice the weight
bytes, and its rounding points differ from those of DeepSpeed's pipeline, which this path is
compared against at the same layout (tests/test_workers_layouts.py). Under ZeRO-1 the
ZeroRedundancyOptimizer shards the Adam states of the masters over DP; the masters themselves
are whole on every DP rank (DeepSpeed's ZeRO-1 shards them too: 4 bytes per parameter more here
than there, counted as optimizer bytes by `workers.monitor.memory`).
ZeRO >= 2, CPU offload and fp16 (its loss scaling) are DeepSpeed-engine features that this
path does not offer; `check_supported` says so before anything starts.

`InterleavedEngine` offers the few engine methods the trainer's loop and `workers.checkpoint.saving`
use (`train_batch`, `eval_batch`, `save_checkpoint`, `load_checkpoint`, `module`, `optimizer`,
`destroy`), so the loop in `workers.trainer.train` is the same for every layout.

Called by `workers.trainer.train`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.pipelining.stage import _PipelineStageBase  # the schedule's element type

from service.contract.parallel import Dim
from service.contract.spec import JobSpec, TrainSpec
from service.planner.shape import ModelShape
from workers.checkpoint import hf_weights
from workers.modeling.model import build_layers, building, loss_for, torch_checkpoint
from workers.modeling.tp import RankGroups, dp_all_reduce, pp_broadcast
from workers.monitor.bubble import BubbleMeter
from workers.trainer import recipe


def check_supported(spec: JobSpec) -> None:
    p, t = spec.layout, spec.train
    if ModelShape.from_spec(spec.planned_model).tied:
        raise NotImplementedError(
            f"virtual_stages({p.virtual_stages}) > 1 runs on torch.distributed.pipelining,"
            " which does not tie the LM head to the embedding across stages: a tied model"
            " (GPT-2/GPT-3 style) needs virtual_stages 1")
    if p.zero > 1 or p.offload != "none" or t.precision == "fp16":
        raise NotImplementedError(
            f"virtual_stages({p.virtual_stages}) > 1 runs on torch.distributed.pipelining with"
            f" ZeroRedundancyOptimizer: it supports zero 0 or 1, no offload, fp32 or bf16; got"
            f" zero({p.zero}), offload={p.offload!r}, precision={t.precision!r}")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The chunks' parameter dtype per `train.precision` (fp16 refused by `check_supported`)."""


class _Masters:
    """bf16 training's fp32 master weights and the torch optimizer that steps them, in the
    place DeepSpeed's bf16 wrapper takes (`engine.optimizer`, the torch optimizer inside as
    `.optimizer`): `workers.monitor.memory` counts `fp32_masters` as optimizer bytes and their
    gradients as gradients, `recipe.set_lr` walks through to the inner optimizer."""

    def __init__(self, module: nn.Module, train: TrainSpec, make: Callable[..., Any]) -> None:
        self.names = [name for name, _ in module.named_parameters()]
        """The masters' names: the module's own (`named_parameters` order, tied once)."""
        self.params = [p for _, p in module.named_parameters()]
        self.fp32_masters: list[nn.Parameter] = []
        self.of: dict[int, nn.Parameter] = {}
        """id of a bf16 parameter -> its master."""
        for p in self.params:
            master = nn.Parameter(p.detach().float().clone())
            if getattr(p, "model_parallel", False):  # counted in the global norm
                master.model_parallel = True  # type: ignore[attr-defined]
            self.fp32_masters.append(master)
            self.of[id(p)] = master
        self.optimizer = make([{**g, "params": [self.of[id(p)] for p in g["params"]]}
                               for g in recipe.param_groups(module, train)])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def take_grads(self) -> None:
        """The bf16 gradients of the step into the masters' fp32 ones; the bf16 ones freed."""
        for p, master in zip(self.params, self.fp32_masters, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():  # rounded to nearest, as DeepSpeed copies its masters back
            for p, master in zip(self.params, self.fp32_masters, strict=True):
                p.copy_(master)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        for p in self.params:
            p.grad = None


class _Chunk(nn.Sequential):
    """A model chunk called as the schedule calls a stage: with the inputs as separate
    arguments (tokens and documents; hidden states and documents), which the layers take
    as one tuple (`workers.modeling.model.Documents`)."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x: torch.Tensor | tuple[torch.Tensor, ...] = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            x = layer(x)
        return x


def _joined(xs: tuple) -> tuple[torch.Tensor, ...]:
    """The schedule's arguments: the micro-batches' inputs joined along the batch (each
    input a tensor, or a tuple of tokens and documents)."""
    if isinstance(xs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*xs, strict=True))
    return (torch.cat(xs),)


class InterleavedEngine:
    """This rank's model chunks, their pipeline stages, the schedule and the optimizer."""

    def __init__(self, spec: JobSpec, shape: ModelShape, groups: RankGroups,
                 layers: list[tuple[int, int]], device: torch.device,
                 bubble: BubbleMeter | None = None) -> None:
        """`layers`: this rank's block range in each of its chunks (its row of the plan)."""
        check_supported(spec)
        self.bubble = bubble
        """Times the schedule's waits on its neighbours and the loss exchange."""
        if bubble is not None:
            bubble.attach_pipelining()
        p, t = spec.layout, spec.train
        self.groups, self.rank = groups, groups.rank
        self.pp, self.stages_total = p.pp, p.pp * p.virtual_stages
        # Each rank draws its shards on its device, in the training precision.
        with building(device, DTYPES[t.precision]):
            chunks = [_Chunk(*build_layers(shape, t.seed, groups, p.recompute, rng,
                                                  checkpoint=torch_checkpoint,
                                                  sequence_parallel=p.sequence_parallel))
                      for rng in layers]
        self.module = nn.ModuleList(chunks)
        hf_weights.load_init(self.module, spec, groups)  # init.from_hf: this rank's slices
        stage_ids = [k * p.pp + groups.pp_rank for k in range(p.virtual_stages)]
        self.has_first = 0 in stage_ids
        self.has_last = self.stages_total - 1 in stage_ids
        # Typed as the schedule's parameter: it takes a list of the stages' base class.
        self.stages: list[_PipelineStageBase] = [
            PipelineStage(mod, sid, self.stages_total, device, group=groups.pp)
            for mod, sid in zip(chunks, stage_ids, strict=True)]
        self.micro_batches = t.global_batch // (t.micro_batch * p.dp)
        self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches=self.micro_batches,
                                                loss_fn=loss_for(shape, groups))
        recipe.mark_norm_owners(self.module, groups)
        self.grad_clip = t.grad_clip
        self._grad_norm: float | None = None
        betas = (t.betas[0], t.betas[1])

        def optimizer(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            if p.zero == 1 and p.dp > 1:
                return ZeroRedundancyOptimizer(
                    param_groups, optimizer_class=torch.optim.AdamW, process_group=groups.dp,
                    lr=t.lr, betas=betas, eps=t.eps, weight_decay=t.weight_decay)
            return torch.optim.AdamW(param_groups, lr=t.lr, betas=betas, eps=t.eps,
                                     weight_decay=t.weight_decay)

        self.masters = _Masters(self.module, t, optimizer) if t.precision == "bf16" else None
        """bf16: the fp32 masters and their optimizer (`_Masters`); fp32: none."""
        self.optimizer: Any = self.masters or optimizer(recipe.param_groups(self.module, t))
        self.params: list[nn.Parameter] = (self.masters.fp32_masters if self.masters
                                           else list(self.module.parameters()))
        """What the DP average, the norm and the clip act on: the masters in bf16."""
        pp_ranks = groups.dims.group_of(self.rank, Dim.PP)
        self._last_stage_rank = pp_ranks[-1]

    def train_batch(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over this DP replica's micro-batches; the global-batch mean loss,
        the same on every rank."""
        xs, ys = zip(*data_iter, strict=True)
        assert len(xs) == self.micro_batches
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        args = _joined(xs) if self.has_first else ()
        target = torch.cat(ys) if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None)
        if self.masters is not None:
            self.masters.take_grads()
        self._average_gradients_over_dp()
        self._grad_norm = recipe.global_grad_norm(self.params, self.groups)
        recipe.clip_grads(self.params, self._grad_norm, self.grad_clip)
        self.optimizer.step()
        loss = torch.zeros((), dtype=torch.float32, device=ys[0].device)
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
            loss = dp_all_reduce(loss, self.groups.dp) / self.groups.dims.dp
        with self.bubble.exchange("loss") if self.bubble else nullcontext():
            return pp_broadcast(loss, self._last_stage_rank, self.groups.pp)

    def get_global_grad_norm(self) -> float | None:
        """The last step's global gradient norm, before clipping (as DeepSpeed's engine)."""
        return self._grad_norm
    def eval_batch(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The mean loss of this DP replica's micro-batches through the forward-only schedule,
        averaged over DP, the same on every rank (as DeepSpeed's `eval_batch`)."""
        xs, ys = zip(*data_iter, strict=True)
        losses: list[torch.Tensor] = []
        args = _joined(xs) if self.has_first else ()
        target = torch.cat(ys) if self.has_last else None
        with torch.no_grad():
            self.schedule.eval(*args, target=target, losses=losses if self.has_last else None)
        loss = torch.zeros((), dtype=torch.float32, device=ys[0].device)
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
            loss = dp_all_reduce(loss, self.groups.dp) / self.groups.dims.dp
        return pp_broadcast(loss, self._last_stage_rank, self.groups.pp)

    def _average_gradients_over_dp(self) -> None:
        dp = self.groups.dims.dp
        if dp == 1:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dp_all_reduce(flat, self.groups.dp).div_(dp)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _path(self, directory: str, tag: str) -> str:
        return os.path.join(directory, tag, f"interleaved_rank{self.rank:05d}.pt")

    def _local_optimizer(self) -> torch.optim.Optimizer:
        # ZeroRedundancyOptimizer's own state_dict gathers every shard on one rank; each rank
        # saves and restores its own shard instead (same layout on resume).
        opt = self.optimizer.optimizer if self.masters else self.optimizer
        return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt

    def master_of(self, p: nn.Parameter) -> nn.Parameter | None:
        """bf16: the fp32 master of the module's parameter `p` (its optimizer's parameter);
        fp32: None (the parameter is its own)."""
        return self.masters.of[id(p)] if self.masters else None

    def save_checkpoint(self, directory: str, tag: str, client_state: dict) -> None:
        path = self._path(directory, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        masters = (dict(zip(self.masters.names, self.masters.fp32_masters, strict=True))
                   if self.masters else None)
        torch.save({"module": self.module.state_dict(), "masters": masters,
                    "optimizer": self._local_optimizer().state_dict(),
                    "client_state": client_state}, path)

    def load_checkpoint(self, directory: str, tag: str) -> tuple[str | None, dict]:
        path = self._path(directory, tag)
        if not os.path.exists(path):
            return None, {}
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["module"])
        if self.masters is not None:
            if state.get("masters") is None:
                raise ValueError(f"{path}: written without fp32 master weights (an fp32 run);"
                                 " resume it in fp32")
            with torch.no_grad():
                for name, master in zip(self.masters.names, self.masters.fp32_masters,
                                        strict=True):
                    master.copy_(state["masters"][name])
        self._local_optimizer().load_state_dict(state["optimizer"])
        dist.barrier()
        return path, state["client_state"]

    def destroy(self) -> None:
        self.stages.clear()
        if self.bubble is not None:
            self.bubble.detach()
