"""The example scripts of `command:` jobs run on their own, on CPU, and what they print and
write is read as Trident reads it (`workers.command.progress`).

- A real Hugging Face `Trainer` (transformers, `PrinterCallback`) trains 3 steps in this
  process: the `hf-trainer` preset reads its printed lines into the losses of its own
  log history.
- `examples/command/hf_trainer.py` on 2 ranks (2 processes with torchrun's environment,
  gloo), as a command job's ranks run it: rank 0's progress bar and log dicts give its steps,
  each rank's `TRIDENT_REPORT` file the same steps with its memory; its save is a complete
  tag for Trident, and a second run given `TRIDENT_RESUME_STEP` resumes from it.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.contract.command import ProgressSpec
from service.files.checkpoint_tags import complete_steps
from tests.servers import free_port
from workers.command.progress import ProgressReader, read_report_lines

ROOT = Path(__file__).resolve().parent.parent
HF_SCRIPT = ROOT / "examples" / "command" / "hf_trainer.py"


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
"""What makes a `Trainer` (through accelerate) start a process group: a test worker may carry
them from a test of ranks run in its process."""


def test_hf_trainer_lines_are_read_by_the_preset(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    for name in TORCHRUN_ENV:  # one process, no process group
        monkeypatch.delenv(name, raising=False)

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, logging_steps=1,
                             per_device_train_batch_size=4, save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)  # type: ignore[arg-type]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # PrinterCallback prints the log dicts
        trainer.train()
    reader = ProgressReader(ProgressSpec(preset="hf-trainer"))
    steps = [s for s in map(reader.feed, out.getvalue().splitlines()) if s is not None]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [s["step"] for s in steps] == [h["step"] for h in logged] == [1, 2, 3]
    for s, h in zip(steps, logged, strict=True):  # printed as f"{v:.4g}"
        assert s["loss"] == float(f"{h['loss']:.4g}")
        assert s["lr"] == float(f"{h['learning_rate']:.4g}")
        assert s["grad_norm"] == float(f"{h['grad_norm']:.4g}")


def run_two_ranks(tmp_path: Path, *args: str, resume: int = 0) -> list[str]:
    """`examples/command/hf_trainer.py` on 2 ranks, each a process with torchrun's and
    Trident's environment as a command job's rank has it; each rank's output (stdout and
    stderr together, as in its rank log)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "ROLE_RANK": str(rank),
               "TORCHELASTIC_RESTART_COUNT": "1" if resume else "0", "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "TRIDENT_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
               "TRIDENT_REPORT": str(tmp_path / f"report-{rank}-{resume}.jsonl")}
        if resume:
            env["TRIDENT_RESUME_STEP"] = str(resume)
        procs.append(subprocess.Popen(
            [sys.executable, str(HF_SCRIPT), *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    return logs


def test_hf_trainer_script_on_two_ranks_and_resumed(tmp_path: Path) -> None:
    logs = run_two_ranks(tmp_path, "--steps", "3", "--save-steps", "2", "--report")
    # Rank 0's output: tqdm's bar and the log dicts it writes between redraws.
    reader = ProgressReader(ProgressSpec(preset="hf-trainer", rank=0))
    steps = [s for s in map(reader.feed, logs[0].splitlines()) if s is not None]
    assert [s["step"] for s in steps] == [1, 2, 3], logs[0]
    assert all(4.0 < s["loss"] < 7.0 for s in steps)  # ~ln(256) from a random init
    assert steps[0]["lr"] == 1e-3 and steps[0]["lr"] > steps[-1]["lr"]  # linear decay
    assert all(s["grad_norm"] > 0 for s in steps)

    # Each rank's report file: the same steps and losses, with its memory.
    for rank in range(2):
        errors: list[str] = []
        reports, _ = read_report_lines(tmp_path / f"report-{rank}-0.jsonl", 0, errors)
        assert errors == []
        assert [r["step"] for r in reports] == [1, 2, 3]
        for r, s in zip(reports, steps, strict=True):
            assert float(f"{r['loss']:.4g}") == s["loss"]  # the DDP mean, on every rank
            assert r["memory"]["process_peak_bytes"] > 50 << 20

    # Its saves (every 2 steps, and the last) are complete tags for Trident: a retry resumes
    # from the newest, and the preset counts its lines from there.
    assert complete_steps(tmp_path / "ckpt") == [2, 3]
    logs = run_two_ranks(tmp_path, "--steps", "5", "--save-steps", "2", "--report", resume=3)
    reader = ProgressReader(ProgressSpec(preset="hf-trainer"), resume_step=3)
    again = [s for s in map(reader.feed, logs[0].splitlines()) if s is not None]
    assert [s["step"] for s in again] == [4, 5], logs[0]
    reports, _ = read_report_lines(tmp_path / "report-1-3.jsonl", 0)
    assert [r["step"] for r in reports] == [4, 5]  # the Trainer's own count agrees
    assert complete_steps(tmp_path / "ckpt") == [2, 3, 4, 5]
