"""Bytes of the model states a rank holds: parameters, gradients, optimizer states, counted by
the tensors the DeepSpeed engine and its optimizer hold (docs/planner-model.md, "What each
category means", gives the boundaries; the planner counts the same ones).

A tensor counts its own bytes (elements x element size), not its whole storage: ZeRO's
gradients are views into reduction buckets and its flat buffers carry alignment padding; the
rest of such a storage is a bucket, not a gradient. Views of one storage are counted once per
byte (the union of their ranges), so flat buffers and the parameter views into them count once.

Called by `workers.monitor.memory`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def tensors_in(obj: Any, depth: int = 0):
    """Tensors inside lists, tuples and dicts (a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, list | tuple):
        for x in obj:
            yield from tensors_in(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x, depth + 1)


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that holds the Adam states, inside DeepSpeed's wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer") \
            or hasattr(optimizer, "optim"):  # DeepSpeed wrappers; torch's ZeroRedundancyOptimizer
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def tensor_range(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage pointer, first byte, end byte) of the bytes `t` spans in its storage."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    span = int(t.numel())
    if not t.is_contiguous():  # a strided view: the span it touches
        span = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return t.untyped_storage().data_ptr(), start, start + span * size


OFFLOAD_BUFFERS = ("param_buffer_of_bit16_for_cpu_offload_groups",
                   "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu")
"""ZeRO-1/2 offload's host staging buffers (`DeepSpeedZeroOptimizer`): the partition's copy in
the training precision, the largest parameter's gradient buffer, the per-parameter gradient
accumulation buffers: the `offload_buffers` category."""
DEVICE_STAGING = ("temp_grad_buffer_for_gpu_offload",)
"""ZeRO-1/2 offload's device gradient buffer: a communication buffer (`buckets`)."""
CATEGORIES = ("params", "grads", "optimizer", "host_params", "host_grads", "host_optimizer",
              "offload_buffers")


class Tally:
    """Bytes per category, each byte of a storage counted once (the first category to claim
    a range keeps it)."""

    def __init__(self) -> None:
        self.ranges: dict[int, list[tuple[int, int, str]]] = {}
        self.out = dict.fromkeys(CATEGORIES, 0)
        self.optimizer_grads = "grads"
        """The category of the gradients the inner optimizer steps: `host_grads` when
        DeepSpeed offloads the optimizer."""

    def add(self, kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.device.type == "meta" or t.numel() == 0:
            return
        self.add_range(kind, *tensor_range(t))

    def add_range(self, kind: str, ptr: int, start: int, end: int) -> None:
        new = [(start, end)]
        for a, b, _ in self.ranges.get(ptr, []):  # subtract what is counted already
            new = [piece for s, e in new for piece in ((s, min(e, a)), (max(s, b), e))
                   if piece[1] > piece[0]]
        for s, e in new:
            self.ranges.setdefault(ptr, []).append((s, e, kind))
            self.out[kind] += e - s


def model_state_bytes(module: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes per category (`CATEGORIES`) held by this rank now."""
    return model_state_tally(module, optimizer).out


def offloaded(optimizer: Any) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) by DeepSpeed's ZeRO wrapper: ZeRO-1/2's
    `cpu_offload`, ZeRO-3's `offload_optimizer` and `offload_param`."""
    opt = bool(getattr(optimizer, "cpu_offload", False)
               or getattr(optimizer, "offload_optimizer", False))
    return opt, bool(getattr(optimizer, "offload_param", False))


def model_state_tally(module: nn.Module, optimizer: Any) -> Tally:
    """The ranges of the model states this rank holds now, by category. With CPU offload the
    states DeepSpeed keeps in host memory are their `host_` categories, told by the role
    DeepSpeed gives them (on a CPU rank every tensor is in host memory): the optimizer's
    states and the gradients it steps, and ZeRO-3's weight partition under parameter
    offload; its staging buffers are `offload_buffers`."""
    tally = Tally()
    add = tally.add
    off_opt, off_params = offloaded(optimizer)
    params_kind = "host_params" if off_params else "params"
    opt_kind = "host_optimizer" if off_opt else "optimizer"
    tally.optimizer_grads = "host_grads" if off_opt else "grads"
    params = list(module.parameters())
    for p in params:  # with ZeRO-3 a parameter holds its partition in ds_tensor
        if hasattr(p, "ds_tensor"):
            add(params_kind, p.ds_tensor)
        else:
            add("params", p)
    for p in params:
        add("grads", p.grad)
    inner = innermost_optimizer(optimizer)
    holders = [optimizer] if optimizer is not inner else []
    for holder in holders:  # DeepSpeed's ZeRO/bf16 wrappers: flat buffers, masters, gradients
        for name, value in vars(holder).items():
            if "bucket" in name or name.startswith("ipg") or name in DEVICE_STAGING:
                continue  # communication buffers: a category of their own
            for t in tensors_in(value):
                if t.dim() == 0:  # bookkeeping scalars such as the global grad norm
                    continue
                if name in OFFLOAD_BUFFERS:
                    add("offload_buffers", t)
                elif "grad" in name:
                    add(tally.optimizer_grads, t)
                elif any(key in name for key in ("fp32", "master", "single_partition")):
                    add(opt_kind, t)
                    add(tally.optimizer_grads, t.grad)
                elif any(key in name for key in ("bit16", "fp16", "bf16")):
                    add(params_kind, t)
    for group in inner.param_groups:
        for p in group["params"]:
            add(tally.optimizer_grads, p.grad)
    for state in inner.state.values():
        for t in tensors_in(state):
            add(opt_kind, t)
    return tally
