"""The pipeline bubble, measured on the rank: time a stage waits for its neighbouring stages.

The pipeline schedules the trainer runs are synchronous where it matters: DeepSpeed's 1F1B
engine sends and receives activations and gradients with blocking calls between its compute
instructions, and torch.distributed.pipelining's interleaved schedule posts its receives early
but blocks in `_wait_batch_p2p` right before the compute that needs them. The time a rank
spends in those exchanges is the transfer itself plus the wait for the neighbour to get there:
the bubble. At the end of a step every stage also waits for the last stage's loss (the
pipeline's cooldown, a bubble too).

`BubbleMeter` times every such exchange by kind (send or receive of activations or gradients,
a wait on posted receives, the step's loss) and counts as bubble what an exchange took beyond
the fastest exchange of its kind this rank has seen in the attempt: the same tensors cross
the same link every time, so the fastest one is the transfer alone, and the rest is waiting.
That is a lower bound: an exchange of a kind that always waited leaves its smallest wait
uncounted. The exchanges are what `workers.monitor.comm_timer` counts as PP time, so the bubble is
a part of it.

Timing: wall time on CPU; on GPU CUDA events on the current stream (which the exchanges make
wait) on every `sample_every`-th step only, as the comm timer does; other steps report None.

Used by `workers.trainer.train` (the built-in trainer; a custom entrypoint reports no bubble).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch


class BubbleMeter:
    """One rank's pipeline waits, per optimizer step."""

    def __init__(self, *, cuda: bool = False, sample_every: int = 1) -> None:
        self.cuda = cuda
        self.sample_every = max(1, sample_every)
        self._floor: dict[str, float] = {}
        self._times: list[tuple[str, float]] = []
        self._events: list[tuple[str, Any, Any]] = []
        self._timing = True
        self._undo: list[Callable[[], None]] = []

    def begin_step(self, step: int) -> None:
        self._times.clear()
        self._events.clear()
        self._timing = not self.cuda or step % self.sample_every == 0

    @contextmanager
    def exchange(self, kind: str) -> Iterator[None]:
        """Time one pipeline exchange of `kind` (transfer and wait)."""
        if not self._timing:
            yield
        elif self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._times.append((kind, time.perf_counter() - t0))

    def end_step(self) -> float | None:
        """Seconds of this step's exchanges beyond the fastest of their kind (None: a GPU step
        that was not timed)."""
        if not self._timing:
            return None
        if self._events:
            self._events[-1][2].synchronize()
            self._times.extend((k, s.elapsed_time(e) / 1e3) for k, s, e in self._events)
            self._events.clear()
        for kind, seconds in self._times:
            self._floor[kind] = min(seconds, self._floor.get(kind, seconds))
        return sum(seconds - self._floor[kind] for kind, seconds in self._times)

    # --- where the schedules exchange -----------------------------------------------------------

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.exchange(kind):
                return fn(*args, **kwargs)

        return timed

    def attach_deepspeed(self, engine: Any) -> None:
        """Time a DeepSpeed `PipelineEngine`'s send/receive instructions and its end-of-step
        loss exchange (on this engine only: its instruction map is copied)."""
        from deepspeed.runtime.pipe import schedule as s

        kinds = {s.SendActivation: "send_activation", s.RecvActivation: "recv_activation",
                 s.SendGrad: "send_grad", s.RecvGrad: "recv_grad"}
        table = dict(type(engine)._INSTRUCTION_MAP)
        for instr, kind in kinds.items():
            table[instr] = self._timed(kind, table[instr])  # called as fn(engine, **kwargs)
        engine._INSTRUCTION_MAP = table
        engine._aggregate_total_loss = MethodType(
            self._timed("loss", type(engine)._aggregate_total_loss), engine)

    def attach_pipelining(self) -> None:
        """Time torch.distributed.pipelining's waits on posted sends and receives (the
        schedules call the module's `_wait_batch_p2p`); `detach` puts it back."""
        from torch.distributed.pipelining import schedules

        original = schedules._wait_batch_p2p
        schedules._wait_batch_p2p = self._timed("p2p_wait", original)

        def undo() -> None:
            schedules._wait_batch_p2p = original

        self._undo.append(undo)

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()
