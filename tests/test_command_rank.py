"""A command job's rank program (`workers.rank.command.command_rank`) on real processes,
without Ray: the progress rank's matching lines and every rank's report file become step
reports (a step said twice counts once, the first carries `resumed_from`) and beat the
heartbeat; a non-zero exit fails the rank with its code and last lines; a stop sends SIGTERM
to the process group and SIGKILL once the grace is over, to what the command started too."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from service.contract.reports import StepReport
from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import CheckpointWriter
from service.planner.stored import RankPlan
from tests.conftest import tiny_spec
from workers.rank.command import LIVE, CommandFailed, command_rank
from workers.runtime.heartbeat import Heartbeat
from workers.runtime.programs import RankContext

PLAN = RankPlan(rank=0, pp=0, dp=0, tp=0, layers=[(0, 1)], stages=[[(0, 1)]],
                groups={"tp": [0], "pp": [0], "dp": [0]})


LINES = {"regex": r"^step (?P<step>\d+) loss (?P<loss>\S+)", "rank": 0}


def run(tmp_path: Path, script: str, *, stop: threading.Event | None = None,
        checkpoint_dir: str | None = None,
        progress: dict[str, Any] | None = None) -> tuple[list[StepReport], Heartbeat]:
    (tmp_path / "train.py").write_text(script)
    spec = JobSpec.model_validate(tiny_spec(
        command=[sys.executable, "train.py"], workdir=str(tmp_path), parallel={"dp": 1},
        train={"steps": 4, "global_batch": 2, "micro_batch": 2}, progress=progress or LINES))
    beat = Heartbeat(0)
    ctx = RankContext(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                      master_port=29500, checkpoint_dir=checkpoint_dir, plan=PLAN, attempt=2,
                      writer=CheckpointWriter(job_id=5, owner="alice"), heartbeat=beat,
                      log_dir=str(tmp_path / "logs"))
    os.makedirs(tmp_path / "logs", exist_ok=True)
    got: list[StepReport] = []
    command_rank(spec, ctx, got.append, stop or threading.Event())
    return got, beat


REPORTS = """
import json, os
print("step 1 loss 2.5")
print("step 2 loss 2.0")
with open(os.environ["TRIDENT_REPORT"], "a") as f:
    f.write(json.dumps({"step": 2, "loss": 9.0}) + "\\n")  # said by its line already
    f.write(json.dumps({"step": 3, "loss": 1.5, "tokens_per_s": 100.0}) + "\\n")
print("restart", os.environ["TORCHELASTIC_RESTART_COUNT"], "resume",
      os.environ.get("TRIDENT_RESUME_STEP"), "job", os.environ["TRIDENT_JOB_ID"])
"""


def test_lines_and_report_file_become_step_reports(tmp_path: Path,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "step2").mkdir(parents=True)
    (ckpt / "step2" / "COMPLETE").write_text("2\n")
    (ckpt / "step4").mkdir()  # no marker: not a tag to resume from
    got, beat = run(tmp_path, REPORTS, checkpoint_dir=str(ckpt))
    assert [(r.step, r.loss) for r in got] == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert got[0].resumed_from == 2 and got[1].resumed_from is None
    assert got[2].tokens_per_s == 100.0 and all(r.rank == 0 and r.attempt == 2 for r in got)
    # Not said: the spec's tokens per step (global_batch 2 x seq_len 32) over its time.
    assert got[1].tokens_per_s == pytest.approx(2 * 32 / got[1].step_time_s)
    assert beat.read().step == 3
    out = capfd.readouterr().out  # the rank's stdout: its log under a rank actor
    assert "step 2 loss 2.0" in out and "restart 1 resume 2 job 5" in out
    assert "the command exited with code 0" in out


def test_a_preset_that_counts_its_lines_counts_on_from_the_step_resumed_at(
        tmp_path: Path) -> None:
    """The Hugging Face Trainer's log lines carry no step: the n-th line after a resume from
    step 2 is step 2 + n (`logging_steps` 1), not step n again."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step2").mkdir(parents=True)
    (ckpt / "step2" / "COMPLETE").write_text("2\n")
    line = "{'loss': %s, 'grad_norm': 0.5, 'learning_rate': 5e-05, 'epoch': %s}"
    script = "".join(f"print({line % (loss, epoch)!r})\n"
                     for loss, epoch in (("1.25", "0.5"), ("1.125", "1.0")))
    got, _ = run(tmp_path, script, checkpoint_dir=str(ckpt),
                 progress={"preset": "hf-trainer", "rank": 0})
    assert [(r.step, r.loss) for r in got] == [(3, 1.25), (4, 1.125)]
    assert got[0].resumed_from == 2


def test_a_non_zero_exit_fails_with_its_code_and_last_lines(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed) as failed:
        run(tmp_path, "import sys\nprint('out of memory, giving up')\nsys.exit(3)\n")
    assert "exited with code 3" in str(failed.value)
    assert "out of memory, giving up" in str(failed.value)


STUBBORN = """
import signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "1000"])
open("child.pid", "w").write(str(child.pid))
signal.signal(signal.SIGTERM, lambda *a: print("got SIGTERM, ignoring it", flush=True))
print("step 1 loss 1.0", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_stop_terminates_then_kills_the_process_group(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    stop = threading.Event()
    done: dict[str, Any] = {}

    def rank() -> None:
        try:
            done["reports"] = run(tmp_path, STUBBORN, stop=stop)[0]
        except BaseException as exc:  # noqa: BLE001 - reported below
            done["error"] = exc

    t = threading.Thread(target=rank)
    t.start()
    pid_file = tmp_path / "child.pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        t.join(0.1)
    child = int(pid_file.read_text())
    stop.set()  # a cancel: SIGTERM now, SIGKILL after the grace
    LIVE.stop_within(1.0)
    t.join(120)
    assert not t.is_alive() and "error" not in done, done
    assert [r.step for r in done["reports"]] == [1]
    out = capfd.readouterr().out
    assert "got SIGTERM, ignoring it" in out and "was killed by SIGKILL" in out
    for _ in range(100):  # what it started went with it (gone, or a zombie left to reap)
        if not alive(child):
            break
        t.join(0.1)
    assert not alive(child)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
