"""The light rank program: a job's steps on the clock, without a model, torch or DeepSpeed.

For the tests of the control plane (cancel, re-attach, views, logs, placement, ...), which
need ranks that exist, report, beat, print and fail on cue, not ranks that train: a spec's
`program: light` (`workers.runtime.programs.LIGHT`), which a server takes only with
`TRIDENT_LIGHT_RANKS` (never in prod: `service.settings`, the API and the launcher refuse it
otherwise). A light rank loads neither torch nor DeepSpeed (a second or two of CPU each
that a trained rank pays to start), and none of the trainer's modules.

Each step, as a trained step looks from outside: the actor's faults fire where it starts
(`started`: fail, kill, and the hang or slow stall armed), the heartbeat says `forward`, then
`backward`; the stall sleeps before the step's one collective (`LightLink.any`, a round trip
through rank 0 on the job's master address, which every rank waits in until all arrived,
and which ORs the ranks' stop flags, so that a stop ends every rank after the same step, as
the trainer's collective stop check does); then the rank reports the step and prints a line.

What is measured and what is not: the step time and the collective's time, calls and bytes
are measured (it is a real exchange, of one byte a rank), and so is the process's peak
resident memory; the loss, the gradient norm and the tokens are made up from the step number
(`made_up_loss`: a decreasing curve, the same on every rank), and no parameter, gradient,
optimizer or activation bytes are reported. Every line a rank prints says so. No checkpoint
is saved or resumed from (`checkpoint` is not honoured), no data is read and no bandwidth
probed. `TRIDENT_LIGHT_STEP_S` in the job's `env` sets the seconds of a step's pretended
compute (`STEP_S`).

With `entrypoint` the function runs with a `LightContext`: the fields of a trained rank's
context that need no torch (rank, plan, attempt, report, `should_stop`, which is this
program's collective), none of its device, groups or data.
"""

from __future__ import annotations

import importlib
import math
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.contract.parallel import Dim
from service.contract.reports import MemoryReport, StepReport

if TYPE_CHECKING:
    from service.contract.spec import JobSpec
    from service.planner.stored import RankPlan
    from workers.runtime.heartbeat import Heartbeat
    from workers.runtime.programs import RankContext, Report, StepStarted

STEP_S = 0.1
"""Seconds of pretended compute a step sleeps (`TRIDENT_LIGHT_STEP_S` in the job's env)."""
CONNECT_S = 300.0
"""How long the ranks wait for each other to connect at start."""
STEP_S_VAR = "TRIDENT_LIGHT_STEP_S"


def made_up_loss(step: int) -> float:
    """Not measured: a loss curve from the step number alone, falling from about 10.4 (the
    log of a 32k vocabulary) towards 3; the same on every rank, as a trained job's."""
    return 3.0 + 7.4 * math.exp(-step / 50)


def collective_dim(plan: RankPlan, world_size: int) -> str:
    """The name the light collective goes by: the rank's dimension whose group is the whole
    world (dp first: the gradients' reduction it stands for), else `world`."""
    for dim in (Dim.DP, Dim.TP, Dim.PP):
        if len(plan.groups.get(dim, [])) == world_size:
            return str(dim)
    return "world"


class LightLink:
    """The light ranks' one collective: every rank sends rank 0 a byte and waits for the OR of
    all of them; rank 0 listens on the job's master address (`master_addr:port`, bound there
    only, as the trainer's rendezvous is) and answers once every rank's byte arrived. A peer
    that ended or died closes its connection, and the ranks still waiting fail with it, as
    they would in a real collective."""

    def __init__(self, rank: int, world_size: int, master_addr: str, port: int,
                 stop: threading.Event, *, heartbeat: Heartbeat | None = None,
                 stall: Callable[[], None] | None = None, dim: str = "world",
                 connect_s: float = CONNECT_S) -> None:
        self.rank, self.world_size, self.dim = rank, world_size, dim
        self.heartbeat, self.stall = heartbeat, stall
        self.seconds = 0.0
        self.calls = 0
        self._peers: dict[int, socket.socket] = {}
        self._master: socket.socket | None = None
        if world_size > 1:
            deadline = time.monotonic() + connect_s
            if rank == 0:
                self._serve(master_addr, port, deadline, stop)
            else:
                self._connect(master_addr, port, deadline, stop)

    def _serve(self, addr: str, port: int, deadline: float, stop: threading.Event) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen()
            listener.settimeout(0.2)
            while len(self._peers) < self.world_size - 1:
                if stop.is_set():
                    raise Stopped
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(self._peers))
                    raise TimeoutError(f"light rank 0: ranks {missing} did not connect to"
                                       f" {addr}:{port}")
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                (peer,) = struct.unpack("!H", _recv(conn, 2, "a connecting rank"))
                self._peers[peer] = conn

    def _connect(self, addr: str, port: int, deadline: float, stop: threading.Event) -> None:
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=5)
                break
            except OSError:
                if stop.is_set():
                    raise Stopped from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"light rank {self.rank}: rank 0 did not listen on"
                                       f" {addr}:{port}") from None
                time.sleep(0.1)
        conn.settimeout(None)
        conn.sendall(struct.pack("!H", self.rank))
        self._master = conn

    def any(self, flag: bool) -> bool:
        """Collective: whether `flag` is set on any rank. The job's hang or slow fault stalls
        before it (outside its time), and the heartbeat says the rank is in it."""
        if self.stall is not None:
            self.stall()
        group = list(range(self.world_size))
        held = (self.heartbeat.in_collective("all_reduce", self.dim, group)
                if self.heartbeat is not None else nullcontext())
        start = time.perf_counter()
        with held:
            out = self._exchange(flag)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def _exchange(self, flag: bool) -> bool:
        if self._master is not None:
            self._master.sendall(bytes([flag]))
            return bool(_recv(self._master, 1, "rank 0")[0])
        out = flag
        for peer, conn in sorted(self._peers.items()):
            out |= bool(_recv(conn, 1, f"rank {peer}")[0])
        for conn in self._peers.values():
            conn.sendall(bytes([out]))
        return out

    def take_comm(self) -> dict[str, dict[str, Any]]:
        """This step's collectives as a step report's `comm` (then counted afresh)."""
        comm = {self.dim: {"all_reduce": {"time_s": self.seconds, "bytes": float(self.calls),
                                          "calls": float(self.calls)}}}
        self.seconds, self.calls = 0.0, 0
        return comm

    def close(self) -> None:
        for conn in [*self._peers.values(), *([self._master] if self._master else [])]:
            conn.close()


class Stopped(Exception):
    """The rank was asked to stop before the ranks had all connected."""


def _recv(conn: socket.socket, n: int, who: str) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"light rank: {who} closed its connection (it ended or"
                                  " died)")
        data += chunk
    return data


_LEFT_OPEN: list[LightLink] = []
"""The links of programs that raised, kept open until the process ends (`held_open`)."""


@contextmanager
def held_open(link: LightLink) -> Iterator[None]:
    """A program that raises keeps its connections open: its peers wait in their collective
    until the group is stopped, as a trained job's ranks wait in theirs (a rank whose
    process ends closes them, and its peers fail then, as they would)."""
    try:
        yield
    except BaseException:
        _LEFT_OPEN.append(link)
        raise


def _link(spec: JobSpec, ctx: RankContext, stop: threading.Event) -> LightLink:
    return LightLink(ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port, stop,
                     heartbeat=ctx.heartbeat, stall=ctx.stall_before_collective,
                     dim=collective_dim(ctx.plan, ctx.world_size))


def _peak_memory() -> MemoryReport:
    """The one memory figure a light rank has: its process's peak resident set."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return MemoryReport(process_peak_bytes=peak_kib * 1024, process_peak_source="rss_peak")


def light_rank(spec: JobSpec, ctx: RankContext, report: Report, stop: threading.Event,
               started: StepStarted | None = None) -> None:
    """`workers.runtime.programs.LIGHT`: `spec.train.steps` steps on the clock (see the module);
    returns early, after a step, once any rank was asked to stop."""
    step_s = float(os.environ.get(STEP_S_VAR, STEP_S))
    try:
        link = _link(spec, ctx, stop)
    except Stopped:
        return
    with held_open(link):
        _steps(spec, ctx, report, stop, started, link, step_s)
    link.close()


def _steps(spec: JobSpec, ctx: RankContext, report: Report, stop: threading.Event,
           started: StepStarted | None, link: LightLink, step_s: float) -> None:
    t = spec.train
    for step in range(1, t.steps + 1):
        if started is not None:
            started(step)  # the actor's faults: fail, kill, or a stall armed
        begun = time.perf_counter()
        if ctx.heartbeat is not None:
            ctx.heartbeat.beat(step, "forward")
        time.sleep(step_s / 2)
        if ctx.heartbeat is not None:
            ctx.heartbeat.beat(step, "backward")
        time.sleep(step_s / 2)
        stopping = link.any(stop.is_set())
        if ctx.heartbeat is not None:
            ctx.heartbeat.beat(step, "optimizer")
        step_time = time.perf_counter() - begun
        loss = made_up_loss(step)
        row = ctx.plan
        report(StepReport(
            rank=ctx.rank, step=step, loss=loss, step_time_s=step_time,
            tokens_per_s=t.global_batch * spec.planned_model.seq_len / max(step_time, 1e-9),
            lr=t.lr_at(step), grad_norm=1.0 / math.sqrt(step), memory=_peak_memory(),
            tp_rank=row.tp, pp_rank=row.pp, dp_rank=row.dp, attempt=ctx.attempt,
            resumed_from=0, comm=link.take_comm(), timed=True, ended_at=time.time(),
            tokens=step * t.global_batch * spec.planned_model.seq_len))
        print(f"light rank {ctx.rank} step {step}/{t.steps}: loss {loss:.4f} (made up,"
              f" not measured), {step_time:.3f} s", flush=True)
        if stopping:
            print(f"light rank {ctx.rank}: stopped after step {step}", flush=True)
            return


@dataclass
class LightContext:
    """What a custom `entrypoint` receives under `program: light`: the fields of
    `workers.trainer.train.TrainContext` that need no torch (no device, groups, DeepSpeed config or
    data; no checkpoint is resumed from: `resume_step` is 0)."""

    spec: JobSpec
    rank: int
    world_size: int
    local_rank: int
    report: Callable[[StepReport | dict[str, Any]], None]
    checkpoint_dir: str | None
    stop: threading.Event
    plan: RankPlan
    link: LightLink
    attempt: int = 0
    resume_step: int = 0

    def should_stop(self) -> bool:
        """Collective: whether any rank was asked to stop; call it on every rank each step."""
        return self.link.any(self.stop.is_set())

    def any(self, flag: bool) -> bool:
        """Collective: whether `flag` is set on any rank."""
        return self.link.any(flag)


def light_entrypoint(spec: JobSpec, ctx: RankContext, report: Report, stop: threading.Event,
                     started: StepStarted | None = None) -> None:
    """`workers.runtime.programs.LIGHT_ENTRYPOINT`: the spec's `entrypoint` with a `LightContext`;
    it marks no step starts (the actor arms the faults as each step reports)."""
    assert spec.entrypoint is not None
    module_name, func_name = spec.entrypoint.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        link = _link(spec, ctx, stop)
    except Stopped:
        return

    def validated(r: StepReport | dict[str, Any]) -> None:
        report(StepReport.model_validate(r))

    with held_open(link):
        func(LightContext(spec=spec, rank=ctx.rank, world_size=ctx.world_size,
                          local_rank=ctx.local_rank, report=validated,
                          checkpoint_dir=ctx.checkpoint_dir, stop=stop, plan=ctx.plan,
                          link=link, attempt=ctx.attempt))
    link.close()
