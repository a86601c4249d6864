"""Memory this rank really holds, measured, for the step reports.

- Model states: bytes of parameters, gradients and optimizer states, summed over the storages
  the DeepSpeed engine holds (each storage counted once, so flat buffers and the parameter
  views into them are not counted twice). Taken right after the inner optimizer's step, when
  gradients, optimizer states and master weights all exist; with ZeRO this is the rank's shard.
- Activations: peak bytes of tensors saved for backward, through saved-tensor hooks
  (parameters saved by matmuls are excluded, they are counted as parameters).
- Process: peak RSS on CPU, `torch.cuda.max_memory_allocated` on GPU.

Called by `workers.train`.
"""

from __future__ import annotations

import resource
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(obj: Any, depth: int = 0):
    """Tensors inside lists, tuples and dicts (a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, list | tuple):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that holds the Adam states, inside DeepSpeed's wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer") \
            or hasattr(optimizer, "optim"):  # DeepSpeed wrappers; torch's ZeroRedundancyOptimizer
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def model_state_bytes(module: nn.Module, optimizer: Any) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes held by this rank now."""
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.device.type == "meta":
            return
        ptr, nbytes = _storage(t)
        if nbytes and ptr not in seen:
            seen.add(ptr)
            out[kind] += nbytes

    params = list(module.parameters())
    for p in params:  # with ZeRO-3 a parameter holds its partition in ds_tensor
        add("params", p.ds_tensor if hasattr(p, "ds_tensor") else p)
    for p in params:
        add("grads", p.grad)
    inner = innermost_optimizer(optimizer)
    holders = [optimizer] if optimizer is not inner else []
    for holder in holders:  # DeepSpeed's ZeRO/bf16 wrappers: flat buffers, masters, grad buckets
        for name, value in vars(holder).items():
            for t in _tensors(value):
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
        for t in _tensors(state):
            add("optimizer", t)
    return out


class ActivationMeter:
    """Peak bytes of activations saved for backward, live-counted through saved-tensor hooks."""

    def __init__(self, module: nn.Module) -> None:
        self._param_ptrs = {_storage(p)[0] for p in module.parameters()}
        self._refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        ptr, nbytes = _storage(t)
        if ptr in self._param_ptrs or nbytes == 0:
            return t
        if self._refs.get(ptr, 0) == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        return _Saved(t, self, ptr, nbytes)

    def _release(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live -= nbytes

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.t if isinstance(saved, _Saved) else saved

    @contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class _Saved:
    __slots__ = ("t", "meter", "ptr", "nbytes")

    def __init__(self, t: torch.Tensor, meter: ActivationMeter, ptr: int, nbytes: int) -> None:
        self.t, self.meter, self.ptr, self.nbytes = t, meter, ptr, nbytes

    def __del__(self) -> None:
        self.meter._release(self.ptr, self.nbytes)


def process_peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
