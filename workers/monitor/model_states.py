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


class Tally:
    """Bytes per category, each byte of a storage counted once (the first category to claim
    a range keeps it)."""

    def __init__(self) -> None:
        self.ranges: dict[int, list[tuple[int, int, str]]] = {}
        self.out = {"params": 0, "grads": 0, "optimizer": 0}

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
    """{"params", "grads", "optimizer"} bytes held by this rank now."""
    return model_state_tally(module, optimizer).out


def model_state_tally(module: nn.Module, optimizer: Any) -> Tally:
    """The ranges of the model states this rank holds now, by category."""
    tally = Tally()
    add = tally.add
    params = list(module.parameters())
    for p in params:  # with ZeRO-3 a parameter holds its partition in ds_tensor
        add("params", p.ds_tensor if hasattr(p, "ds_tensor") else p)
    for p in params:
        add("grads", p.grad)
    inner = innermost_optimizer(optimizer)
    holders = [optimizer] if optimizer is not inner else []
    for holder in holders:  # DeepSpeed's ZeRO/bf16 wrappers: flat buffers, masters, gradients
        for name, value in vars(holder).items():
            if "bucket" in name or name.startswith("ipg"):
                continue  # reduction buckets: a category of their own
            for t in tensors_in(value):
                if t.dim() == 0:  # bookkeeping scalars such as the global grad norm
                    continue
                if "grad" in name:
                    add("grads", t)
                elif any(key in name for key in ("fp32", "master", "single_partition")):
                    add("optimizer", t)
                    add("grads", t.grad)
                elif any(key in name for key in ("bit16", "fp16", "bf16")):
                    add("params", t)
    for group in inner.param_groups:
        for p in group["params"]:
            add("grads", p.grad)
    for state in inner.state.values():
        for t in tensors_in(state):
            add("optimizer", t)
    return tally
