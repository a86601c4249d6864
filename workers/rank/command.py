"""A command job's rank (`workers.runtime.programs.COMMAND`): the spec's `command` run once, in
a process of its own, under the rank's actor (`docs/command.md`).

The process starts in the job's `workdir`, in a session (and so a process group) of its own,
with torchrun's environment and Trident's (`workers.runtime.command_env`). Its stdout and stderr
come through one pipe: a pump thread writes every line to the actor's own stdout, which is the
rank log (`workers.runtime.ranklog`: capped, time-indexed, the job's secrets redacted), keeps
the last lines, and on the progress rank (`progress.rank`) turns the lines that match the
job's pattern into step reports (`workers.command.progress.ProgressReader`). Every rank's
`TRIDENT_REPORT` file is read beside it (`read_report_lines`). A step report goes the way a
built-in step's does (the `report` callback: the actor's buffer, the heartbeat); each progress
line or report is the progress the hang monitor watches.

Endings: an exit 0 is the rank's success; any other, while the rank was not asked to stop, is
its failure, with the exit code (or the signal) and the last lines of its output. Asked to
stop (cancel, preemption, a hang, the job's end), the runner sends SIGTERM to the process
group at once, and SIGKILL once the grace the actor was given (`stop_within`) is over; what
is left of the group when the process ends is killed too. Should the actor itself die first,
the kernel kills the process (`PR_SET_PDEATHSIG`). For the hang's stacks, `LIVE.stacks()`
runs `py-spy dump` on the process (the actor adds it to its own stacks).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

from pydantic import ValidationError

from service.contract.reports import StepReport
from service.contract.spec import JobSpec
from service.files.checkpoint_tags import newest_complete_step
from workers.runtime.command_env import NodePlace, command_env, report_path

LINE_MAX = 1 << 16
"""Bytes of one output line read at a time (a longer line comes in pieces)."""
TAIL_LINES = 20
"""Lines of the output a failure quotes."""
REPORT_EVERY_S = 0.5
"""How often the report file is read."""
DEFAULT_KILL_S = 30.0
"""How long a stopped command gets after SIGTERM when the actor was given no grace."""
PY_SPY_S = 8.0
"""How long `py-spy dump` may take."""
_PR_SET_PDEATHSIG = 1
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = (1 << 64) - 1
"""`(unsigned long)-1`: any process of the user may trace it."""


class CommandFailed(RuntimeError):
    """The command ended by itself with a non-zero exit code (or a signal)."""


class Live:
    """The command this actor process runs (one at a time: a rank actor runs one rank), for
    the actor's `cancel` and `stacks`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.kill_at: float | None = None
        self._lock = threading.Lock()

    def stop_within(self, grace_s: float | None) -> None:
        """Kill the process group `grace_s` after now (SIGTERM goes at once, with the stop);
        None: after `DEFAULT_KILL_S`. An earlier deadline stands."""
        at = time.monotonic() + (DEFAULT_KILL_S if grace_s is None else grace_s)
        with self._lock:
            self.kill_at = at if self.kill_at is None else min(self.kill_at, at)

    def stacks(self) -> str | None:
        """`py-spy dump` of the running command (None when none runs)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None
        return py_spy_dump(proc.pid)


LIVE = Live()


def py_spy_dump(pid: int) -> str:
    """The Python stacks of process `pid` and its children by `py-spy dump`, or why none."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return f"no stacks of the command (pid {pid}): py-spy is not installed on the workers"
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--subprocesses"],
                             capture_output=True, text=True, timeout=PY_SPY_S, check=False)
    except subprocess.TimeoutExpired:
        return f"no stacks of the command (pid {pid}): py-spy took over {PY_SPY_S:g} s"
    text = out.stdout.strip()
    if out.returncode != 0 or not text:
        return (f"no stacks of the command (pid {pid}): py-spy exited {out.returncode}:"
                f" {out.stderr.strip()[-2000:]}")
    return f"py-spy dump of the command (pid {pid}):\n{text}"


_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _in_child() -> None:  # between fork and exec: syscalls only
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # the actor dies: so does the command
    _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)  # py-spy may read it (Yama)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # ended meanwhile
        os.killpg(proc.pid, sig)


class Steps:
    """Turns what the command says into the rank's step reports: each a new step (a step
    reported again, by its line and its report, counts once), timed since the one before (the
    first since the process started: its start-up included); the first carries the step the
    attempt resumed from (`resumed_from`, 0: fresh), as a built-in attempt's does (the goodput
    ledger reads the work redone from it). Without its own `tokens_per_s`, a step's is the
    spec's tokens per step (`tokens_per_step`: train.global_batch x model.seq_len, what the
    plan counts) over its time, so that the plan's figure compares with it; a job without a
    model has no tokens per step, and its steps' rate is not known (None)."""

    def __init__(self, rank: int, attempt: int, report: Any, resumed_from: int = 0,
                 tokens_per_step: int = 0) -> None:
        self.rank, self.attempt, self._report = rank, attempt, report
        self.resumed_from = resumed_from
        self.tokens_per_step = tokens_per_step
        self.last_step = 0
        self.last_at = time.monotonic()
        self.bad = 0
        self._lock = threading.Lock()

    def offer(self, fields: dict[str, Any]) -> None:
        with self._lock:
            step = fields.get("step")
            if not isinstance(step, int) or step <= self.last_step:
                return
            now = time.monotonic()
            data = {"step_time_s": min(86400.0, now - self.last_at), "ended_at": time.time(),
                    **fields, "kind": "step", "rank": self.rank, "attempt": self.attempt}
            if data.get("tokens_per_s") is None:
                took = data["step_time_s"]
                data["tokens_per_s"] = (self.tokens_per_step / took if self.tokens_per_step
                                        and isinstance(took, int | float) and took > 0 else
                                        None)
            if self.last_step == 0:
                data.setdefault("resumed_from", self.resumed_from)
            try:
                report = StepReport.model_validate(data)
            except ValidationError as exc:
                self.bad += 1
                if self.bad <= 3:
                    print(f"[trident] step {step}'s report is not valid, dropped:"
                          f" {exc.errors()[0]['msg']}", flush=True)
                return
            self.last_step, self.last_at = step, now
        self._report(report)


def command_rank(spec: JobSpec, ctx: Any, report: Any, stop: threading.Event,
                 started: Any = None) -> None:
    """The program: run the spec's command for rank `ctx.rank` until it ends or is stopped."""
    from workers.command.progress import ProgressReader, read_report_lines

    assert spec.command is not None and spec.workdir is not None
    node = ctx.node if ctx.node is not None else NodePlace(ctx.world_size, 0, 1)
    job_id = ctx.writer.job_id if ctx.writer is not None else None
    resume = newest_complete_step(ctx.checkpoint_dir)
    reports = report_path(ctx.log_dir, ctx.rank, ctx.attempt)
    gpu_ids: list[str] = []
    if "ray" in sys.modules:  # not under Ray: the environment's devices
        import ray

        if ray.is_initialized():
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    env = command_env(os.environ, spec, rank=ctx.rank, world_size=ctx.world_size,
                      local_rank=ctx.local_rank, node=node, master_addr=ctx.master_addr,
                      master_port=ctx.master_port, job_id=job_id, attempt=ctx.attempt,
                      checkpoint_dir=ctx.checkpoint_dir, resume_step=resume,
                      report_path=reports, gpu_ids=gpu_ids)
    progress = spec.progress
    reader = (ProgressReader(progress, world_size=ctx.world_size, resume_step=resume or 0)
              if progress is not None and progress.rank == ctx.rank else None)
    steps = Steps(ctx.rank, ctx.attempt, report, resume,
                  tokens_per_step=(spec.train.global_batch * spec.model.seq_len
                                   if spec.model is not None else 0))
    heartbeat = ctx.heartbeat
    resumed = f", resuming from step {resume}" if resume else ""
    print(f"[trident] rank {ctx.rank}: {' '.join(spec.command)} (in {spec.workdir}{resumed})",
          flush=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(spec.command, cwd=spec.workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_in_child)
    LIVE.proc, LIVE.kill_at = proc, None

    def pump() -> None:
        assert proc.stdout is not None
        while chunk := proc.stdout.readline(LINE_MAX):
            _write_out(chunk)
            line = chunk.decode("utf-8", errors="replace").rstrip("\n")
            tail.append(line)
            if reader is not None and (fields := reader.feed(line)) is not None:
                if heartbeat is not None:
                    heartbeat.beat(fields["step"], "forward")
                steps.offer(fields)

    pumping = threading.Thread(target=pump, name="command-output", daemon=True)
    pumping.start()
    offset, errors = 0, list[str]()
    termed = False
    while True:
        ended = _wait(proc, REPORT_EVERY_S)
        found, offset = read_report_lines(reports, offset, errors)
        for fields in found:
            if heartbeat is not None:
                heartbeat.beat(fields["step"], "forward")
            steps.offer(fields)
        for why in errors[:3]:
            print(f"[trident] {reports}: {why}", flush=True)
        errors.clear()
        if ended:
            break
        if stop.is_set() and not termed:
            termed = True
            _signal_group(proc, signal.SIGTERM)
        if termed and LIVE.kill_at is not None and time.monotonic() >= LIVE.kill_at:
            _signal_group(proc, signal.SIGKILL)
    _signal_group(proc, signal.SIGKILL)  # what it started and left behind
    pumping.join(5.0)
    LIVE.proc = None
    code = proc.returncode
    if code == 0 or stop.is_set():
        print(f"[trident] rank {ctx.rank}: the command {_ended(code)}", flush=True)
        return
    raise CommandFailed(f"the command {_ended(code)}; its last lines:\n" + "\n".join(tail))


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _write_out(data: bytes) -> None:
    """Into the rank log (the actor's stdout); what the disk refuses is lost, not raised."""
    while data:
        try:
            n = os.write(1, data)
        except OSError:
            return
        data = data[n:]
