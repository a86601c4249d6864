"""Memory this rank really holds, measured, for the step reports.

The categories are the planner's (docs/planner-model.md, "What each category means"), read
with the same boundaries:

- Model states: bytes of parameters, gradients and optimizer states the DeepSpeed engine holds
  (`workers.monitor.model_states`: each tensor's own bytes, each byte once); with CPU offload
  those DeepSpeed keeps in host memory apart (`host_params`, `host_grads`, `host_optimizer`)
  and its offload staging buffers (`offload_buffers`). Taken right after
  the inner optimizer's step, when gradients, optimizer states and master weights all exist;
  with ZeRO this is the rank's shard. ZeRO steps its inner optimizer once per parameter group
  (decayed / not decayed), giving each group its fp32 gradient partition for that call only
  and freeing it after: `ModelStateMeter` adds the gradients of the groups stepped earlier in
  the same step, so that the reading counts every group's gradient, as with one group.
- Activations: peak bytes of tensors saved for backward, through saved-tensor hooks
  (parameters and views of them are excluded: they are parameters, or under ZeRO-3 gathered
  buffers).
- Gathered: ZeRO-3's whole weights (kept whole, gathered, prefetched), peak over the step.
- Buckets: DeepSpeed's communication buckets (offload's device gradient buffer included) on
  GPU; on CPU not measured (`not_measured` says why).
- Framework: on CPU, the anonymous memory before the model is built (imports, `torch._dynamo`
  included, and process group: `training_start`); on GPU not measured (the CUDA context is
  no tensor).
- Process: on CPU the peak of the process's own memory since `training_start` (what the
  process did before, such as the health monitor's bandwidth probe, is not the training's):
  its peak RSS less the library pages mapped now; on GPU `torch.cuda.max_memory_allocated`.

A CPU rank's own memory is its anonymous memory (`RssAnon` + `RssShmem`): what it allocated.
Its resident set also holds the pages of the libraries it maps (`RssFile`: libtorch's code and
read-only data), which are the page cache's, shared by every process that maps them and
dropped under pressure, and whose count depends on how the kernel holds the files rather than
on the training: ranks forked from one fork server, run alike, had 57-61 MiB of them at their
peak on the development checkout's virtual environment and 140-143 MiB on that of a fresh
clone's `.ci/run`, with their anonymous memory the same within 4 MiB (docs/planner.md).
The file pages only grow as code is first run, so the peak of the
anonymous memory is read as the peak RSS less the file pages at the report (`VmHWM` less
`RssFile`), too low by at most the file pages mapped after the peak.

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
from workers.monitor.model_states import (
    DEVICE_STAGING,
    Tally,
    innermost_optimizer,
    model_state_bytes,
    model_state_tally,
    storage,
    tensor_range,
    tensors_in,
)
from workers.monitor.proc_status import reset_peak, status_kib

__all__ = ["MemoryMonitor", "innermost_optimizer", "model_state_bytes", "anonymous_bytes",
           "training_start"]

WATCH_FRACTION = 0.9
"""A process peak (or the plan's prediction) above this fraction of the plan's device capacity
is near an out-of-memory: every step is measured from then on."""


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
        self._stepped: dict[int, tuple[torch.Tensor, tuple[int, int, int]]] = {}
        self._latest: Tally | None = None
        self.armed = True
        """Read after the inner optimizer's steps while armed (`MemoryMonitor` disarms it on
        the steps it does not measure: the hook then returns at once)."""
        self.inner.register_step_post_hook(self._after_step)

    def _after_step(self, *_: Any) -> None:
        if not self.armed:
            return
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    # The gradient's own bytes: it may be a view of a larger buffer (a
                    # reduction bucket), which is no gradient.
                    self._stepped[id(p)] = (p, tensor_range(p.grad))
        self._latest = model_state_tally(self.module, self.optimizer)

    def read(self) -> dict[str, int]:
        """Bytes per category (`model_states.CATEGORIES`) of the last step (empty before
        any)."""
        tally, self._latest = self._latest, None
        if tally is None:
            return {}
        # The freed groups' gradients, each byte once: a group's gradient let go by its
        # parameter may live on in a buffer ZeRO keeps, which the reading counted already.
        for p, rng in self._stepped.values():
            if p.grad is None:
                tally.add_range(tally.optimizer_grads, *rng)
        self._stepped.clear()
        return dict(tally.out)


HEAD_MODULES = ("Head",)
"""The built-in model's head (`workers.modeling.model.Head`: final norm, LM head; the loss
follows it): what it and the loss save is the `logits` category."""
BLOCK_MODULES = ("Embedding", "Block")
"""The modules whose forward starts the `activations` category again."""


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a matmul saves `weight` or its transpose): under ZeRO-3
    the gathered weights live in storages made at each gather, so the parameter is told by
    what it is, not by where it lives."""
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or hasattr(base, "ds_id")


class GatheredMeter:
    """ZeRO-3's gathered parameters: peak bytes of the whole (unpartitioned) weights the rank
    holds at once, the ones DeepSpeed keeps whole (under `stage3_param_persistence_threshold`)
    and the ones it gathers and prefetches around each module. Read at every saved tensor
    (the forward pass) and after the step; 0 without ZeRO-3."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if hasattr(p, "ds_tensor")]
        self.peak = 0

    def sample(self) -> None:
        if self.params:
            now = sum(p.data.numel() * p.data.element_size() for p in self.params)
            self.peak = max(self.peak, now)


class ActivationMeter:
    """Peak bytes of activations saved for backward, live-counted through saved-tensor hooks.
    Parameters saved by an op (a matmul's weight) are parameters, or ZeRO-3's gathered
    buffers (`GatheredMeter`), not activations. What the head and the loss save (from the
    head's forward until the next block's) is counted apart, as `logits`."""

    def __init__(self, module: nn.Module, gathered: GatheredMeter | None = None) -> None:
        self._param_ptrs = {storage(p)[0] for p in module.parameters()}
        self.gathered = gathered
        self._refs: dict[int, int] = {}
        self._kinds: dict[int, str] = {}
        self.live = {"activations": 0, "logits": 0}
        self.peaks = {"activations": 0, "logits": 0}
        self.kind = "activations"
        for m in module.modules():
            name = type(m).__name__
            if name in HEAD_MODULES:
                m.register_forward_pre_hook(lambda *_: self._enter("logits"))
            elif name in BLOCK_MODULES:
                m.register_forward_pre_hook(lambda *_: self._enter("activations"))

    def _enter(self, kind: str) -> None:
        self.kind = kind

    @property
    def peak(self) -> int:
        return self.peaks["activations"]

    def _pack(self, t: torch.Tensor) -> Any:
        if self.gathered is not None:
            self.gathered.sample()
        ptr, nbytes = storage(t)
        if ptr in self._param_ptrs or nbytes == 0 or _is_parameter(t):
            return t
        if self._refs.get(ptr, 0) == 0:
            kind = self._kinds[ptr] = self.kind
            self.live[kind] += nbytes
            self.peaks[kind] = max(self.peaks[kind], self.live[kind])
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        # Kept detached: an op that saves its own output (attention, a norm's statistics)
        # would otherwise hold the output, whose grad_fn holds this record, a reference cycle
        # that no backward breaks when the graph is dropped unused (torch's pipelining runs
        # one such forward to infer its stages' shapes): the graph, and every activation
        # upstream of that op, would stay alive until a full garbage collection. The
        # unpacked tensor gets its autograd edge back from the saved variable.
        return _Saved(t.detach(), self, ptr, nbytes)

    def _release(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live[self._kinds.pop(ptr)] -= nbytes

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


def bucket_bytes(optimizer: Any) -> int:
    """Bytes of the communication buckets DeepSpeed's ZeRO optimizers hold now (the reduction
    bucket of contiguous gradients, ZeRO-3's flat reduce bucket, offload's device gradient
    buffer), each storage once."""
    seen: set[int] = set()
    total = 0
    for name, value in vars(optimizer).items():
        if "bucket" not in name and not name.startswith("ipg") and name not in DEVICE_STAGING:
            continue
        for t in tensors_in(value):
            ptr, nbytes = storage(t)
            if nbytes and ptr not in seen:
                seen.add(ptr)
                total += nbytes
    return total


CPU_NOT_MEASURED = {
    "buckets": "a CPU rank's reduction buckets are virtual memory that becomes resident only"
               " as gradients are written into it; the bytes resident per tensor are not"
               " observable (their share is in the process peak)",
}
"""Categories a CPU rank cannot measure, with the reason (`MemoryReport.not_measured`)."""
GPU_NOT_MEASURED = {
    "framework": "the CUDA context and kernel images are not tensors: nvidia-smi shows them"
                 " (the process peak here is torch.cuda.max_memory_allocated)",
}


class MemoryMonitor:
    """The step's memory readings, taken on the steps that are due (see the module)."""

    def __init__(self, module: nn.Module, optimizer: Any, device: torch.device, every: int,
                 first_step: int, last_step: int, capacity: float | None,
                 predicted: float | None, framework: int | None = None) -> None:
        self.states = ModelStateMeter(module, optimizer)
        self.optimizer = optimizer
        self.gathered = GatheredMeter(module)
        self.acts = ActivationMeter(module, self.gathered)
        self.device, self.every = device, every
        self.framework = framework
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
        cpu = self.device.type != "cuda"
        source = "anon_peak" if cpu else "cuda_max_allocated"
        if not self._measuring:
            return MemoryReport(process_peak_bytes=peak, process_peak_source=source)
        states = self.states.read()
        self.gathered.sample()
        return MemoryReport(params_bytes=states.get("params", 0),
                            grads_bytes=states.get("grads", 0),
                            optimizer_bytes=states.get("optimizer", 0),
                            host_params_bytes=states.get("host_params", 0),
                            host_grads_bytes=states.get("host_grads", 0),
                            host_optimizer_bytes=states.get("host_optimizer", 0),
                            offload_buffers_bytes=states.get("offload_buffers", 0),
                            activations_peak_bytes=self.acts.peak,
                            logits_peak_bytes=self.acts.peaks["logits"],
                            gathered_peak_bytes=self.gathered.peak,
                            buckets_bytes=None if cpu else bucket_bytes(self.optimizer),
                            framework_bytes=self.framework if cpu else None,
                            not_measured=dict(CPU_NOT_MEASURED if cpu else GPU_NOT_MEASURED),
                            process_peak_bytes=peak, process_peak_source=source)


def process_peak_bytes(device: torch.device) -> int:
    """The process's peak: on CPU the peak of its own memory since `training_start` (`VmHWM`
    less `RssFile`, the module's docstring; the peak `getrusage` reports where /proc is
    absent)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = status_kib()
    if "VmHWM" in kib:
        return (kib["VmHWM"] - kib.get("RssFile", 0)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def training_start() -> int:
    """The framework's own bytes as training starts (imports and process group, before the
    model: `anonymous_bytes`), and the start of the process peak: the kernel's high-water mark
    is reset to the resident set now (Linux's clear_refs 5), so that the peak is the
    training's, not that of what the process did before (the health monitor's bandwidth
    probe, whose largest messages and their gloo buffers are freed before training; a peak of
    Ray's start-up)."""
    reset_peak()
    return anonymous_bytes()


def anonymous_bytes() -> int:
    """This process's own memory now: `RssAnon` + `RssShmem` (the module's docstring; the
    peak resident set where /proc is absent)."""
    kib = status_kib()
    if "RssAnon" in kib:
        return (kib["RssAnon"] + kib.get("RssShmem", 0)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
