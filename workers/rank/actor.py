"""One Ray actor per rank: runs the rank's work on a thread and answers polls.

The work runs on a thread so that the actor always answers `poll`, `cancel` and `stacks`,
even in the middle of a long step or a stuck collective. Training actors are detached and
named (`workers.launch.group`), so they train on while no controller is there; their reports wait in
a bounded buffer until a controller acknowledges that it stored them (`poll(ack)`), so a
controller that restarts and re-attaches misses none, and each checkpoint tag a rank saves
carries them (`service.files.tag_steps`), so an attempt that ends before they are polled loses none
of the steps its tags hold. Around the trainer the actor puts the health monitor: a
heartbeat, the collective timer (installed before DeepSpeed builds its communication backend)
and, before training, a bandwidth probe of the rank's TP, DP and PP groups and of the links
between hosts on a process group of its own, again every `monitor.probe_every_s` at a step
boundary (`workers.monitor.probe_rounds`). A program without torch collectives (the light
program, `workers.rank.light`) gets the heartbeat and the faults' stall instead, and the
actor imports no torch for it.
Created by `workers.launch.group.RayWorkerGroup`. One module because each of its methods is one
call of the control plane (poll, cancel, stacks, profile, preempt) on the same rank's state: its
work thread, heartbeat and report buffer.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any

import ray

from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointWriter
from service.files.order_cache import ServerData
from service.planner.stored import RankPlan
from workers.monitor.profiler import Busy, StepProfiler
from workers.runtime.heartbeat import Heartbeat, dump_stacks, thread_stacks

if TYPE_CHECKING:
    from workers.runtime.programs import RankProgram

NICENESS_VAR = "RAY_worker_niceness"
"""Ray's setting of its workers' niceness (`worker_niceness`), read from the environment."""

RANK_RUNTIME_ENV = {"env_vars": {NICENESS_VAR: "0"}}
"""Ray starts its worker processes at niceness 15 (`worker_niceness`), as background work;
a rank is the job's work: at 15 it loses the CPU to every other process of a shared node
(`make bench` measured a CPU job at 0.42 of torchrun's speed on a loaded machine). Ray Jobs
starts its drivers at 0 the same way.

Not needed on a Ray whose workers all start at 0 (`rank_runtime_env`): the Ray that Trident
starts (`service.cluster.rayhead.WORKER_NICENESS_ENV`, set on its nodes and on the controller, its
driver). There the ranks take no runtime environment: an actor with one waits for a worker
process started for that environment, where one without takes a worker Ray started ahead
(seconds of the time to a job's first step on a loaded machine)."""


def rank_runtime_env() -> dict[str, dict[str, str]] | None:
    """The ranks' runtime environment: none when this driver's Ray starts its workers at
    niceness 0 already (its environment says so: the Ray that Trident starts), else
    `RANK_RUNTIME_ENV`."""
    return None if os.environ.get(NICENESS_VAR) == "0" else RANK_RUNTIME_ENV

REPORT_BUFFER = 50_000
"""Reports a rank keeps unacknowledged (about 14 hours at a step a second); beyond that the
oldest are dropped and the next poll says how many."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@ray.remote
class RankActor:
    def __init__(self, rank: int, world_size: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.rank = rank
        self.world_size = world_size
        self.heartbeat = Heartbeat(rank)
        self._reports: deque[tuple[int, dict[str, Any]]] = deque()
        self._seq = itertools.count(1)
        self._dropped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._save_now = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._finished = False
        self._profiler: StepProfiler | None = None
        self._not_profiled = "not profiled: the rank has not started training"
        """Why `profile` is refused while there is no `_profiler` (`trident profile`)."""
        self._command = False
        """Whether the rank runs a `command` (`workers.rank.command`) in a process of its own."""

    def info(self) -> dict[str, Any]:
        """Where this rank landed, and free ports in case it is the rendezvous rank."""
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "nice": os.nice(0),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "free_ports": [_free_port(), _free_port()],
        }

    def start(self, spec: JobSpec, plan: RankPlan, master_addr: str, ports: list[int],
              local_rank: int, checkpoint_dir: str | None, attempt: int,
              log: tuple[str, int] | None = None,
              writer: dict[str, Any] | None = None,
              server: dict[str, Any] | None = None,
              node: dict[str, int] | None = None) -> None:
        """Probe (if asked), then run the job's rank program (`workers.runtime.programs.for_spec`:
        the built-in trainer or its entrypoint, imported only now), on a thread: the job's
        stored spec and this rank's row of its stored plan, as the controller's launcher
        sends them; `ports`: [training, probe]; `log`: the directory and size cap of the
        rank logs (`workers.runtime.ranklog`);
        `writer`: the job the checkpoint folder must belong to
        (`service.files.checkpoint_dirs.CheckpointWriter`); `server`: the server's data rules
        (`service.files.order_cache.ServerData`); `node`: where the rank's node sits among
        the group's (`workers.runtime.command_env.NodePlace`)."""
        from workers.runtime.command_env import NodePlace
        from workers.runtime.programs import RankContext, for_spec
        from workers.runtime.ranklog import capture

        self._log = capture(log[0], self.rank, log[1]) if log else None

        ctx = RankContext(rank=self.rank, world_size=self.world_size, local_rank=local_rank,
                          master_addr=master_addr, master_port=ports[0],
                          checkpoint_dir=checkpoint_dir, plan=plan, attempt=attempt,
                          writer=CheckpointWriter.from_json(writer) if writer else None,
                          save_now=self._save_now, pending=self._unacknowledged,
                          server=ServerData.from_json(server) if server else None,
                          node=NodePlace(**node) if node else None,
                          log_dir=log[0] if log else None)
        program = for_spec(spec)
        self._command = spec.command is not None

        def work() -> None:
            if spec.monitor.probe and self.world_size > 1 and program.torch:
                self._probe(spec, master_addr, ports[1], local_rank)
            if program.torch:
                self._train(spec, ctx, program)
            else:
                self._train_light(spec, ctx, program)

        self._run(work)

    def start_cluster_probe(self, master_addr: str, port: int, ranks_per_node: int,
                            max_bytes: int) -> None:
        """`trident probe`: matmul FLOP/s of this rank and bandwidth inside and across nodes
        (the rank program `workers.runtime.programs.CLUSTER_PROBE`)."""
        from workers.runtime.programs import CLUSTER_PROBE, ProbeContext

        ctx = ProbeContext(rank=self.rank, world_size=self.world_size, master_addr=master_addr,
                           port=port, ranks_per_node=ranks_per_node, max_bytes=max_bytes,
                           heartbeat=self.heartbeat)
        self._run(lambda: CLUSTER_PROBE.run(None, ctx, self._put, self._stop))

    def _run(self, work: Any) -> None:
        def run() -> None:
            try:
                work()
            except BaseException:  # reported as data; the controller applies the policy
                self._error = traceback.format_exc()
                print(self._error, file=sys.stderr, flush=True)  # into the rank's log
            finally:
                self._finished = True
                self.heartbeat.beat(self.heartbeat.read().step, "done")

        self._thread = threading.Thread(target=run, name=f"rank{self.rank}", daemon=True)
        self._thread.start()

    # --- the monitor around the trainer -------------------------------------------------------

    def _probe(self, spec: Any, master_addr: str, port: int, local_rank: int) -> None:
        import torch
        import torch.distributed as dist

        from workers.monitor.comm_probe import (
            JOB_PROBE_POINT_S,
            job_sizes,
            node_ids,
            probe_hosts,
            probe_layout,
        )
        from workers.runtime import rendezvous
        from workers.runtime.nccl_env import pg_timeout

        on_gpu = torch.cuda.is_available()
        if on_gpu:
            # Ray shows each rank only its own GPU(s): index within what is visible.
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        rendezvous.init_process_group("nccl" if on_gpu else "gloo", rank=self.rank,
                                      world_size=self.world_size, master_addr=master_addr,
                                      port=port, timeout=pg_timeout(spec.monitor.hang_timeout_s))
        try:
            sizes = job_sizes(spec.monitor.probe_max_bytes)
            rows = probe_layout(spec.layout.dims, self.rank, sizes=sizes,
                                point_s=JOB_PROBE_POINT_S, heartbeat=self.heartbeat)
            rows += probe_hosts(node_ids(ray.get_runtime_context().get_node_id()), self.rank,
                                sizes=sizes, point_s=JOB_PROBE_POINT_S,
                                heartbeat=self.heartbeat)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        self._put({"kind": "probe", "rank": self.rank, "rows": rows})

    def _train(self, spec: Any, ctx: Any, program: RankProgram) -> None:
        from service.contract.reports import StepReport
        from workers.monitor.comm_timer import CommTimer
        from workers.rank.faults import FaultInjector

        timer = CommTimer(self.rank, spec.layout.dims, heartbeat=self.heartbeat,
                          sample_every=spec.monitor.comm_sample_every)
        faults = FaultInjector(self.rank, ctx.attempt, spec.faults)
        if any(f.kind in ("nan", "spike") for f in faults.faults):
            from dataclasses import replace
            ctx = replace(ctx, loss_factor=faults.loss_factor)
        monitor = spec.monitor
        rounds = None
        if monitor.probe and monitor.probe_every_s and self.world_size > 1 and \
                program.marks_steps:  # the built-in trainer: every rank reports every step
            from workers.monitor.probe_rounds import ProbeRounds

            rounds = ProbeRounds(spec.layout.dims, self.rank, every_s=monitor.probe_every_s,
                                 max_bytes=monitor.probe_max_bytes,
                                 node_id=ray.get_runtime_context().get_node_id(),
                                 put=self._put, heartbeat=self.heartbeat)

        # The built-in trainer says where each step's own work starts (`step_started`, just
        # before the step's clock starts): the step's communication is counted from there, and
        # an injected fault is armed there, so that a slow rank's stall falls inside its step
        # (compute, as a slow GPU's would) rather than in the stop check between steps. A
        # program without such a call (a custom entrypoint) has its faults armed when the last
        # step reports.
        arm_at_report = not program.marks_steps
        # `trident profile`: the profiled steps are those the trainer marks, whole.
        profiler = StepProfiler(self.rank) if program.marks_steps else None
        if profiler is None:
            self._not_profiled = "not profiled: the job's program marks no step starts"
        self._profiler = profiler

        def begin(step: int) -> None:
            timer.begin_step(step)
            self.heartbeat.beat(step, "forward")
            if arm_at_report:
                faults.begin(step)

        def started(step: int) -> None:
            if profiler is not None:
                profiler.step_started(step)
            timer.step_started(step)
            faults.begin(step)

        def report(r: StepReport) -> None:
            summary = timer.step_report(r.step, r.step_time_s)
            # Plain dicts across Ray; the controller validates them back into a StepReport.
            self._put(r.model_copy(update={"comm": summary["comm"],
                                           "timed": summary["timed"]}).model_dump())
            if profiler is not None:
                profiler.step_ended(r.step)
            if rounds is not None:  # between steps: the next step's start drops its counts
                rounds.at_boundary(r.step, self._stop.is_set())
            begin(r.step + 1)

        # Before deepspeed.initialize, which caches the collectives it calls.
        timer.install()
        faults.arm(timer)
        try:
            begin(1)
            program.run(spec, ctx, report, self._stop, started)
        finally:
            timer.uninstall()
            if profiler is not None:
                profiler.close("training ended")

    def _train_light(self, spec: Any, ctx: Any, program: RankProgram) -> None:
        """A program without torch collectives (the light program, `workers.rank.light`): no
        collective timer (it would import torch), no probe; the program beats the heartbeat
        and stalls for the job's faults before its own collectives
        (`RankContext.stall_before_collective`), and its reports carry their own `comm`."""
        from dataclasses import replace

        from service.contract.reports import StepReport
        from workers.rank.faults import FaultInjector

        faults = FaultInjector(self.rank, ctx.attempt, spec.faults)
        arm_at_report = not program.marks_steps
        self._not_profiled = ("not profiled: the rank runs a command, in a process of its own"
                              if self._command else "not profiled: light rank (no torch)")

        def begin(step: int) -> None:
            self.heartbeat.beat(step, "forward")
            if arm_at_report:
                faults.begin(step)

        def report(r: StepReport) -> None:
            self._put(r.model_dump())  # plain dicts across Ray, as `_train`'s
            begin(r.step + 1)

        ctx = replace(ctx, heartbeat=self.heartbeat,
                      stall_before_collective=faults.stall_before_collective)
        begin(1)
        program.run(spec, ctx, report, self._stop, faults.begin)

    # --- polled by the group --------------------------------------------------------------------

    def _put(self, report: dict[str, Any]) -> None:
        with self._lock:
            self._reports.append((next(self._seq), report))
            while len(self._reports) > REPORT_BUFFER:
                self._reports.popleft()
                self._dropped += 1

    def _unacknowledged(self) -> list[dict[str, Any]]:
        """The step reports held until the controller acknowledges them: each tag this rank
        saves carries them (`workers.trainer.train.steps_writer`), so that an attempt that ends
        before
        they are polled loses none of the steps its tags hold."""
        with self._lock:
            return [r for _, r in self._reports if r.get("kind") == "step"]

    def poll(self, ack: int = 0) -> dict[str, Any]:
        """Forget the reports up to `ack` (stored by the controller) and send the rest, each
        with its sequence number; the controller acknowledges them once stored."""
        with self._lock:
            while self._reports and self._reports[0][0] <= ack:
                self._reports.popleft()
            reports = [{**r, "seq": seq} for seq, r in self._reports]
            dropped, self._dropped = self._dropped, 0
        if not self._finished:
            state = "running"
        elif self._error:
            state = "failed"
        else:
            state = "stopped" if self._stop.is_set() else "succeeded"
        # Plain dicts across Ray; the group validates the heartbeat back into its model.
        return {"rank": self.rank, "state": state, "reports": reports, "error": self._error,
                "heartbeat": self.heartbeat.read().model_dump(), "dropped": dropped}

    def started(self) -> bool:
        """Whether this rank's work was started (a controller that re-attaches needs it)."""
        return self._thread is not None

    def _command_stacks(self) -> str | None:
        """With a command running, its process's stacks (`py-spy dump`,
        `workers.rank.command.LIVE`)."""
        if not self._command:
            return None
        from workers.rank.command import LIVE

        return LIVE.stacks()

    def stacks(self) -> str:
        """Python stacks of this process's threads; with a command, its process's first."""
        if (theirs := self._command_stacks()) is not None:
            return f"{theirs}\n\nthe rank actor's threads:\n{dump_stacks()}"
        return dump_stacks()

    def thread_stacks(self, max_bytes: int) -> list[dict[str, str]]:
        """`trident stacks`: every thread's stack, the rank's work thread named `train`; with
        a command, its process's stacks first, as the thread `command`."""
        work = {self._thread.ident: "train"} if self._thread and self._thread.ident else {}
        theirs = self._command_stacks()
        return ([{"thread": "command", "stack": theirs[-max_bytes:]}] if theirs else []) + \
            thread_stacks(work, max_bytes)

    def step(self) -> int:
        """The step this rank is at (its heartbeat's): `trident profile` starts past it."""
        return self.heartbeat.read().step

    def profile(self, request_id: int, steps: int, memory: bool, start: int,
                max_bytes: int) -> str | None:
        """`trident profile`: run torch.profiler over `steps` steps from step `start` (or the
        next to start after it; `workers.monitor.profiler`); None once armed, else why not (a
        light rank, a program that marks no steps, a profile for another request running)."""
        if self._profiler is None:
            return self._not_profiled
        try:
            self._profiler.arm(request_id, steps=steps, memory=memory, start=start,
                               max_bytes=max_bytes)
        except Busy as exc:
            return f"not profiled: {exc}"
        if self._finished:
            self._profiler.close("training ended")
        return None

    def profile_result(self, request_id: int) -> dict[str, Any] | None:
        """The armed request's trace files once its steps ended (`StepProfiler.result`)."""
        return self._profiler.result(request_id) if self._profiler is not None else None

    def cancel(self, grace_s: float | None = None) -> None:
        """Stop at the next step boundary; a command gets SIGTERM now and SIGKILL once
        `grace_s` is over (`workers.rank.command.Live.stop_within`)."""
        self._stop.set()
        if self._command:
            from workers.rank.command import LIVE

            LIVE.stop_within(grace_s)

    def preempt(self) -> None:
        """Save a checkpoint at the next step boundary, then stop (`RankContext.save_now`)."""
        self._save_now.set()
        self._stop.set()
