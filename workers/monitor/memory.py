"""Memory this rank really holds, measured, for the step reports.

- Model states: bytes of parameters, gradients and optimizer states, summed over the storages
  the DeepSpeed engine holds (each storage counted once, so flat buffers and the parameter
  views into them are not counted twice). Taken right after the inner optimizer's step, when
  gradients, optimizer states and master weights all exist; with ZeRO this is the rank's shard.
  ZeRO steps its inner optimizer once per parameter group (decayed / not decayed), giving
  each group its fp32 gradient partition for that call only and freeing it after:
  `ModelStateMeter` adds the gradients of the groups stepped earlier in the same step, so
  that the reading counts every group's gradient, as with one group.
- Activations: peak bytes of tensors saved for backward, through saved-tensor hooks
  (parameters saved by matmuls are excluded, they are counted as parameters).
- Process: peak RSS on CPU, `torch.cuda.max_memory_allocated` on GPU.

The first two cost a step time (a hook on every saved activation, a walk of the whole
optimizer state after the step): `MemoryMonitor` measures them only on the steps it samples
(every `monitor.memory_every` steps) and on those it must watch: the attempt's first step
(the first of a run, and the first after a resume or a change of layout, which starts a new
attempt), its last, and every step once the process's peak comes near the plan's device
capacity or the plan predicts it near there. The process peak is one system call and is read
every step: it decides the watch. The other steps report those fields as not measured (None).

Called by `workers.trainer.train`.
"""

from __future__ import annotations

import resource
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from service.contract.reports import MemoryReport

WATCH_FRACTION = 0.9
"""A process peak (or the plan's prediction) above this fraction of the plan's device capacity
is near an out-of-memory: every step is measured from then on."""


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


class ModelStateMeter:
    """`model_state_bytes` of the last optimizer step, with every parameter group's gradient.

    Reads after each call of the inner optimizer's `step` (a post-step hook). DeepSpeed's ZeRO
    optimizers call it once per parameter group with `param_groups` narrowed to that group
    (`_optimizer_step`), and free the group's gradient partition after its call: a reading
    taken after the last call sees only the last group's. The meter remembers, per optimizer
    parameter, the gradient bytes it held when its group stepped, and adds those freed since.
    `read()` returns the step's bytes and starts the next step's tally.
    """

    def __init__(self, module: nn.Module, optimizer: Any) -> None:
        self.module, self.optimizer = module, optimizer
        self.inner = innermost_optimizer(optimizer)
        self._stepped: dict[int, tuple[torch.Tensor, int]] = {}
        self._latest: dict[str, int] = {}
        self._freed = 0
        self.armed = True
        """Read after the inner optimizer's steps while armed (`MemoryMonitor` disarms it on
        the steps it does not measure: the hook then returns at once)."""
        self.inner.register_step_post_hook(self._after_step)

    def _after_step(self, *_: Any) -> None:
        if not self.armed:
            return
        seen: set[int] = set()
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ptr = _storage(p.grad)[0]
                    if ptr not in seen:
                        seen.add(ptr)
                        # The gradient's own bytes: it may be a view of a larger buffer (a
                        # reduction bucket), which the reading counts whole while it lives.
                        self._stepped[id(p)] = (p, p.grad.numel() * p.grad.element_size())
        self._latest = model_state_bytes(self.module, self.optimizer)
        self._freed = sum(n for p, n in self._stepped.values() if p.grad is None)

    def read(self) -> dict[str, int]:
        """{"params", "grads", "optimizer"} bytes of the last step (empty before any)."""
        out = dict(self._latest)
        if out:
            # The freed groups' gradients, unless the last reading still counted them: a
            # group's gradient let go by its parameter may live on in a copy ZeRO keeps
            # (seen on one rank of two under ZeRO-2), and is held once.
            stepped = sum(n for _, n in self._stepped.values())
            out["grads"] = max(out["grads"], min(out["grads"] + self._freed, stepped))
        self._stepped.clear()
        self._freed = 0
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


class MemoryMonitor:
    """The step's memory readings, taken on the steps that are due (see the module)."""

    def __init__(self, module: nn.Module, optimizer: Any, device: torch.device, every: int,
                 first_step: int, last_step: int, capacity: float | None,
                 predicted: float | None) -> None:
        self.states = ModelStateMeter(module, optimizer)
        self.acts = ActivationMeter(module)
        self.device, self.every = device, every
        self.first_step, self.last_step = first_step, last_step
        self.capacity = capacity  # the plan's device memory, and its prediction for the rank
        self.watching = bool(self.capacity and predicted
                             and predicted >= WATCH_FRACTION * self.capacity)
        self._measuring = False

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) is measured."""
        return (self.watching or step in (self.first_step, self.last_step)
                or step % self.every == 0)

    def track(self, step: int):
        """Around step `step`'s forward and backward passes: arms the meters when it is due."""
        self._measuring = self.states.armed = self.due(step)
        return self.acts.track() if self._measuring else nullcontext()

    def report(self) -> MemoryReport:
        """The step's readings (after its optimizer step): every field when it was measured,
        else the process peak only; the peak near the capacity starts the watch."""
        peak = process_peak_bytes(self.device)
        if self.capacity and peak >= WATCH_FRACTION * self.capacity:
            self.watching = True
        source = "cuda_max_allocated" if self.device.type == "cuda" else "rss_peak"
        if not self._measuring:
            return MemoryReport(process_peak_bytes=peak, process_peak_source=source)
        states = self.states.read()
        return MemoryReport(params_bytes=states.get("params", 0),
                            grads_bytes=states.get("grads", 0),
                            optimizer_bytes=states.get("optimizer", 0),
                            activations_peak_bytes=self.acts.peak,
                            process_peak_bytes=peak, process_peak_source=source)


def process_peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
