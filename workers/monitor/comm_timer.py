"""Per-step accounting of time in collectives, by parallel dimension (tp, pp, dp) and op.

Called by the trainer loop, one `CommTimer` per rank:

    timer = CommTimer(rank, dims, heartbeat=hb)
    timer.install()                    # before deepspeed.initialize: see below
    for step in ...:
        timer.begin_step(step)
        with timer.collective("tp", "all_reduce", x, group=tp_group): dist.all_reduce(x, ...)
        ...                            # DeepSpeed's own DP/ZeRO collectives are caught too
        report = timer.step_report(step, step_time_s)  # {"step", "step_time_s", "timed", "comm"}
    timer.uninstall()

Two ways in:
- `collective(dim, op, tensor_or_bytes)`: a context manager around the trainer's own TP/PP
  collectives (it knows the dimension best).
- `install()`: wraps the collective functions of `torch.distributed` so the collectives
  DeepSpeed issues inside the engine (ZeRO reduce-scatter / all-gather, gradient all-reduce,
  pipeline send/recv) are counted too, attributed by their process group's ranks: a group
  equal to this rank's TP / DP / PP group of `service.contract.parallel` is that dimension, a send
  or recv goes to the dimension its peer shares with this rank. DeepSpeed's backend looks these
  functions up on `torch.distributed` at call time, except all-gather-into-tensor and
  reduce-scatter-tensor, which it caches when its backend is built: install first.
  DeepSpeed's own comms logger (`"comms_logger"` in the DS config) was not used: it keys
  by op name and message size only (no process group, so no dimension) and synchronizes the
  device after every op, which costs more than the 2% budget.

`add_before_collective(fn)` runs `fn()` before each blocking collective, outside the timed
region and before the heartbeat says "in a collective": fault injection (`workers.rank.faults`)
sleeps there, so an injected stall counts as compute, as a slow GPU's would.

Inside `collective()` the wrappers stand aside, and nested library calls (a deprecated
torch function calling its successor) are counted once: only the outermost call records.

Timing: on CPU (gloo) wall time of every call. On GPU, CUDA events around each call on the
current stream, but only on every `sample_every`-th step (the conversion needs a device sync);
other steps count bytes and calls with `"timed": False`. Async ops (`async_op=True`, isend,
irecv) count bytes and calls; their time is spent in `wait()`, which is not seen here.

Bytes follow nccl-tests sizes (see `service.monitor.bandwidth`), so busbw can be derived per
dimension.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from service.contract.parallel import Dim, ParallelDims
from workers.runtime.heartbeat import Heartbeat


def _nbytes(t: Any) -> int:
    if isinstance(t, int):
        return t
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# name -> (op, index of the tensor that gives the nccl-tests size, name of that argument,
#          index of `group`, index of the peer argument or None)
_WRAPPED: dict[str, tuple[str, int, str, int, int | None]] = {
    "all_reduce": ("all_reduce", 0, "tensor", 2, None),
    "all_gather": ("all_gather", 0, "tensor_list", 2, None),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 2, None),
    "all_gather_single": ("all_gather", 0, "output_tensor", 2, None),
    "_all_gather_base": ("all_gather", 0, "output_tensor", 2, None),
    "reduce_scatter": ("reduce_scatter", 1, "input_list", 3, None),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3, None),
    "reduce_scatter_single": ("reduce_scatter", 1, "input", 3, None),
    "_reduce_scatter_base": ("reduce_scatter", 1, "input", 3, None),
    "broadcast": ("broadcast", 0, "tensor", 2, None),
    "reduce": ("reduce", 0, "tensor", 3, None),
    "all_to_all_single": ("all_to_all", 1, "input", 4, None),
    "send": ("send", 0, "tensor", 2, 1),
    "recv": ("recv", 0, "tensor", 2, 1),
    "isend": ("send", 0, "tensor", 2, 1),
    "irecv": ("recv", 0, "tensor", 2, 1),
}
_ASYNC_ALWAYS = frozenset({"isend", "irecv"})
_PEER_NAMES = {"send": "dst", "recv": "src", "isend": "dst", "irecv": "src"}


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], idx: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[idx] if idx < len(args) else None


class CommTimer:
    """One rank's collective accounting for the current step."""

    def __init__(self, rank: int, dims: ParallelDims | None = None, *,
                 heartbeat: Heartbeat | None = None, sample_every: int = 10,
                 cuda: bool | None = None) -> None:
        self.rank = rank
        self.dims = dims
        self.heartbeat = heartbeat
        self.sample_every = max(1, sample_every)
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._my_groups: dict[tuple[int, ...], str] = {}
        if dims is not None:
            for dim in Dim:
                g = tuple(dims.group_of(rank, dim))
                if len(g) > 1:
                    self._my_groups[g] = dim.value
        self._group_cache: dict[Any, tuple[str, list[int]]] = {}
        self._local = threading.local()
        self._originals: dict[tuple[Any, str], Callable[..., Any]] = {}
        self._stats: dict[str, dict[str, list[float]]] = {}
        self._events: list[tuple[str, str, Any, Any]] = []
        self._timing = True
        self._before: list[Callable[[], None]] = []
        self.step = -1

    # ------------------------------------------------------------ attribution

    def group_dim(self, group: Any) -> tuple[str, list[int]]:
        """(dimension, global ranks) of a process group; None is the default (world) group."""
        if group in self._group_cache:
            return self._group_cache[group]
        ranks = sorted(dist.get_process_group_ranks(group or c10d._get_default_group()))
        dim = self._my_groups.get(tuple(ranks))
        if dim is None:
            dim = "world" if len(ranks) == dist.get_world_size() else "other"
        self._group_cache[group] = (dim, ranks)
        return dim, ranks

    def peer_dim(self, peer: int) -> str:
        """Dimension of a point-to-point transfer with global rank `peer`."""
        for g, dim in self._my_groups.items():
            if peer in g:
                return dim
        return "other"

    # ------------------------------------------------------------ hooks

    def add_before_collective(self, fn: Callable[[], None]) -> None:
        """Call `fn()` before each blocking collective, outside its timing (see module)."""
        self._before.append(fn)

    def _before_collective(self) -> None:
        for fn in self._before:
            fn()

    # ------------------------------------------------------------ recording

    def begin_step(self, step: int) -> None:
        """Start accounting `step`; on GPU, decides whether this step is timed."""
        self.step = step
        self._timing = not self.cuda or step % self.sample_every == 0

    def step_started(self, step: int) -> None:
        """The trainer's step `step` starts its own work now: what was counted since the last
        report (the engine's construction before the first step, the stop check between
        steps, an evaluation, a save) is not this step's and is dropped, so that a step's
        communication is measured over the same interval as its `step_time_s`."""
        self.step = step
        self._stats = {}
        self._events.clear()

    def _add(self, dim: str, op: str, nbytes: int, seconds: float) -> None:
        s = self._stats.setdefault(dim, {}).setdefault(op, [0.0, 0, 0])
        s[0] += seconds
        s[1] += nbytes
        s[2] += 1

    @contextmanager
    def _timed(self, dim: str, op: str, nbytes: int, ranks: list[int],
               blocking: bool) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        hb = self.heartbeat if blocking else None
        if hb is not None:
            hb.entering(op, dim, ranks)
        try:
            if not (blocking and self._timing):
                yield
                self._add(dim, op, nbytes, 0.0)
            elif self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._events.append((dim, op, start, end))
                self._add(dim, op, nbytes, 0.0)
            else:
                t0 = time.perf_counter()
                yield
                self._add(dim, op, nbytes, time.perf_counter() - t0)
        finally:
            self._local.depth = depth
            if hb is not None:
                hb.left()

    @contextmanager
    def collective(self, dim: str, op: str, tensor: Any, *, group: Any = None,
                   group_ranks: list[int] | None = None) -> Iterator[None]:
        """Time one collective the caller issues on `dim`; `tensor` is the nccl-tests-size
        tensor (list of tensors, or a byte count). Group ranks default to this rank's group
        of `dim` (for the heartbeat)."""
        if group_ranks is None:
            if group is not None:
                group_ranks = self.group_dim(group)[1]
            elif self.dims is not None and dim in Dim.__members__.values():
                group_ranks = self.dims.group_of(self.rank, Dim(dim))
            else:
                group_ranks = [self.rank]
        self._before_collective()
        with self._timed(dim, op, _nbytes(tensor), group_ranks, blocking=True):
            yield

    def step_summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """`{dim: {op: {"time_s", "bytes", "calls"}}}` since the last call, then reset."""
        if self._events:
            self._events[-1][3].synchronize()
            for dim, op, start, end in self._events:
                self._stats[dim][op][0] += start.elapsed_time(end) / 1e3
            self._events.clear()
        out = {dim: {op: {"time_s": s[0], "bytes": s[1], "calls": s[2]}
                     for op, s in ops.items()} for dim, ops in self._stats.items()}
        self._stats = {}
        return out

    def step_report(self, step: int, step_time_s: float) -> dict[str, Any]:
        """The per-step record `service.monitor.comm.summarize_comm` reads; its `timed` and
        `comm` are the fields of `service.contract.reports.StepReport` the rank actor fills in."""
        timed = self._timing
        return {"step": step, "step_time_s": step_time_s, "timed": timed,
                "comm": self.step_summary()}

    # ------------------------------------------------------------ torch.distributed hooks

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        op, t_idx, t_name, g_idx, p_idx = _WRAPPED[name]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            group = _arg(args, kwargs, g_idx, "group")
            if p_idx is None:
                dim, ranks = self.group_dim(group)
            else:
                peer = _arg(args, kwargs, p_idx, _PEER_NAMES[name])
                if peer is None:  # group-relative peer: leave it to the library
                    return fn(*args, **kwargs)
                dim, ranks = self.peer_dim(peer), sorted({self.rank, peer})
            blocking = name not in _ASYNC_ALWAYS and not kwargs.get("async_op", False) and not (
                len(args) > g_idx + 1 and args[g_idx + 1] is True)
            if blocking:
                self._before_collective()
            with self._timed(dim, op, _nbytes(_arg(args, kwargs, t_idx, t_name)), ranks,
                             blocking):
                return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def install(self) -> None:
        """Route torch.distributed's collectives through this timer (idempotent)."""
        if self._originals:
            return
        for name in _WRAPPED:
            fn: Callable[..., Any] | None = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(name, fn)
            for mod in (dist, c10d):
                if id(getattr(mod, name, None)) == id(fn):  # not rebound by someone else
                    self._originals[(mod, name)] = fn
                    setattr(mod, name, wrapped)

    def uninstall(self) -> None:
        """Restore torch.distributed and drop the before-collective hooks."""
        for (mod, name), original in self._originals.items():
            setattr(mod, name, original)
        self._originals.clear()
        self._before.clear()
