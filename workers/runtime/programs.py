"""What a rank runs: the programs a rank actor can run, and which one a job's spec asks for.

A program is an object with a name and `run(spec, ctx, report, stop, started)` (torchtitan's
`TrainSpec` is the model: the loop looks the program up, never the module behind it). Its module
is imported only when a rank runs it, so that a rank pays for what its program needs: the
built-in trainer and a custom entrypoint import torch.distributed, DeepSpeed and the data
(`workers.trainer.train`); the cluster probe imports torch alone
(`workers.monitor.cluster_probe_rank`); the light program imports neither
(`workers.rank.light`: steps on the clock, for the tests of the control plane, on servers that
allow it); a `command` job's program imports neither: its process brings its own
(`workers.rank.command`). The rank actor (`workers.rank.actor.RankActor`) resolves a job's
program from its spec (`for_spec`) and runs it inside the health monitor it puts around every
program (heartbeat, collective timer, faults); `trident probe`'s ranks run `CLUSTER_PROBE`.

Also here, because every program and its callers share them without importing the trainer:
`RankContext` (where a rank sits and how to reach the others) and the `Report` callback.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.contract.reports import StepReport
from service.files.checkpoint_dirs import CheckpointWriter
from service.files.order_cache import ServerData
from service.planner.stored import RankPlan

if TYPE_CHECKING:
    from service.contract.spec import JobSpec
    from workers.runtime.command_env import NodePlace
    from workers.runtime.heartbeat import Heartbeat

Report = Callable[[StepReport], None]
"""Called once per optimizer step on every rank with a `service.contract.reports.StepReport`."""

StepStarted = Callable[[int], None]
"""Called by a program that marks where each step's own work starts (`RankProgram.marks_steps`),
just before the step's clock starts."""


@dataclass
class RankContext:
    """Where this rank sits and how to reach the others (given by the worker group)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    checkpoint_dir: str | None
    """The job's checkpoint directory (None: no checkpoints)."""
    plan: RankPlan
    """This rank's row of the job's plan: its stage, the layers it builds, its groups."""
    attempt: int = 0
    writer: CheckpointWriter | None = None
    """The job `checkpoint_dir` must belong to, checked before any rank resumes (None: not
    checked, as under torchrun)."""
    save_now: threading.Event | None = None
    """Set with `stop` when the job is preempted: the ranks save a checkpoint at the step
    boundary where they stop (`workers.trainer.train`), so that its next attempt loses nothing."""
    pending: Callable[[], list[dict[str, Any]]] | None = None
    """The step reports this rank holds that the controller has not acknowledged
    (`workers.rank.actor`): each tag the rank saves carries them
    (`workers.trainer.train.steps_writer`);
    None without a controller."""
    server: ServerData | None = None
    """The server's data rules: its sample-order cache and data roots (None: those of this
    environment's `TRIDENT_*` settings, as under torchrun)."""
    heartbeat: Heartbeat | None = None
    """The rank's heartbeat, for a program without torch collectives (`RankProgram.torch`
    False): the collective timer beats it for the others."""
    stall_before_collective: Callable[[], None] | None = None
    """Called by a program without torch collectives before each of its own: the job's hang
    and slow faults sleep there (`workers.rank.faults`); the collective timer calls it for
    the others."""
    loss_factor: Callable[[int], float] | None = None
    """What the job's nan and spike faults multiply this rank's loss by at step `step` (1.0:
    none; `workers.rank.faults.FaultInjector.loss_factor`); None where faults are not given."""
    node: NodePlace | None = None
    """Where this rank's node sits among the group's (torchrun's `LOCAL_WORLD_SIZE`,
    `GROUP_RANK`: a command's environment); None: one node."""
    log_dir: str | None = None
    """The attempt's rank log folder (None: not captured): a command's report file is kept
    there."""


@dataclass(frozen=True)
class ProbeContext:
    """What a rank of `trident probe` needs: it runs no job, so it has no spec and no plan."""

    rank: int
    world_size: int
    master_addr: str
    port: int
    ranks_per_node: int
    max_bytes: int
    heartbeat: Heartbeat | None = None


@dataclass(frozen=True)
class RankProgram:
    """One program a rank can run: `target` ("module:function") is imported when it runs."""

    name: str
    target: str
    marks_steps: bool = False
    """Whether it calls `started(step)` where a step's own work starts (the built-in trainer);
    the actor's monitor then counts a step's communication and arms its faults there, and
    otherwise when the previous step reports."""
    torch: bool = True
    """Whether it runs torch collectives: the actor's monitor then times them (the collective
    timer, which imports torch, installed before the program runs) and probes the job's
    groups first when its spec asks; a program without (the light program) beats the
    heartbeat and stalls for the faults itself (`RankContext.heartbeat`,
    `RankContext.stall_before_collective`) and is not probed."""

    def run(self, spec: JobSpec | None, ctx: Any, report: Callable[[Any], None],
            stop: threading.Event, started: StepStarted | None = None) -> None:
        module, function = self.target.split(":")
        getattr(importlib.import_module(module), function)(spec, ctx, report, stop, started)


TRAINER = RankProgram("trainer", "workers.trainer.train:train_rank", marks_steps=True)
"""The built-in GPT trainer, for every TP x PP x DP x ZeRO layout."""

ENTRYPOINT = RankProgram("entrypoint", "workers.trainer.train:entrypoint_rank")
"""A spec's custom `entrypoint` function, after the trainer's set-up (torch.distributed,
DeepSpeed, the groups, the data) and before its tear-down."""

CLUSTER_PROBE = RankProgram("cluster-probe", "workers.monitor.cluster_probe_rank:probe_program")
"""`trident probe`: matmul FLOP/s of the rank and bandwidth inside and across nodes; its
context is a `ProbeContext` and its report the probe's rows."""

LIGHT = RankProgram("light", "workers.rank.light:light_rank", marks_steps=True, torch=False)
"""A spec's `program: light` (a server with `TRIDENT_LIGHT_RANKS` only): the job's steps on
the clock, no model, no torch, no DeepSpeed; reports, heartbeats, prints and faults as the
trainer's, with numbers that are not measured (`workers.rank.light`)."""

LIGHT_ENTRYPOINT = RankProgram("light-entrypoint", "workers.rank.light:light_entrypoint",
                               torch=False)
"""A spec's custom `entrypoint` under `program: light`: the function with a context that has
no device, groups nor data (`workers.rank.light.LightContext`)."""

COMMAND = RankProgram("command", "workers.rank.command:command_rank", torch=False)
"""A spec's `command`: the program run once per rank in a process of its own, with torchrun's
environment (`workers.rank.command`); the actor imports no torch for it, the process brings
its own."""

PROGRAMS: dict[str, RankProgram] = {p.name: p for p in (TRAINER, ENTRYPOINT, CLUSTER_PROBE,
                                                        LIGHT, LIGHT_ENTRYPOINT, COMMAND)}
"""Every program a rank can run, by name."""


def for_spec(spec: JobSpec) -> RankProgram:
    """The program a job's ranks run: its `command`; under `program: light` the light
    program (or its entrypoint with the light context); else its custom entrypoint, else the
    built-in trainer."""
    if spec.command is not None:
        return COMMAND
    if spec.program == "light":
        return LIGHT_ENTRYPOINT if spec.entrypoint else LIGHT
    return ENTRYPOINT if spec.entrypoint else TRAINER
