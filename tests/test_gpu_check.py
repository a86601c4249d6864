"""`bench/gpu_check.py` on this (CPU-only) machine: it runs, reports the torch build, skips
every GPU step with its reason, and a hung step is killed at its timeout and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_STEPS = {"topology", "stack", "probe", "calibrate", "train_bf16", "train_fp16", "guards",
             "profile", "nccl_probe", "job_tp2", "job_dp2_zero2"}


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report  # the same report printed, as one JSON document
    return report, proc.stderr


def test_cpu_machine_skips_gpu_steps(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        import pytest
        pytest.skip("a CUDA machine runs the GPU steps")
    report, stderr = _run(tmp_path)
    assert report["gpus"] == 0 and report["ok"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert set(steps) == {"build"} | GPU_STEPS
    build = steps["build"]
    assert build["status"] == "ok"
    assert build["result"]["torch"] == torch.__version__
    assert build["result"]["build"] == ("cuda" if torch.version.cuda else "cpu")
    assert build["result"]["cuda_available"] is False
    for name in GPU_STEPS:
        assert steps[name]["status"] == "skipped", steps[name]
        assert "GPU" in steps[name]["reason"]
    assert "two or more CUDA GPUs" in steps["job_tp2"]["reason"]
    assert report["summary"] == {"ok": 1, "skipped": len(GPU_STEPS), "failed": 0, "timeout": 0}
    assert "train_bf16: skipped" in stderr


def test_a_hung_step_is_killed_and_named(tmp_path: Path) -> None:
    report, stderr = _run(tmp_path, "--hang", "build", "--step-timeout-s", "3")
    build = report["steps"][0]
    assert build["name"] == "build" and build["status"] == "timeout"
    assert "hung: build did not finish within 3 s" in build["error"]
    assert report["ok"] is False and report["summary"]["timeout"] == 1
    assert "build: timeout" in stderr
