"""The other ways into the per-rank trainer: resume from a checkpoint (also after saves a full
disk refused), a custom entrypoint, and torchrun without the control plane."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from service.contract.spec import JobSpec
from tests.smallfs import Filler, free_bytes, small_fs
from tests.workers_spawn import free_port, losses, run_ranks
from workers.checkpoint.saving import MARKER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize(("virtual_stages", "precision"), [(1, "fp32"), (2, "fp32"), (2, "bf16")],
                         ids=["deepspeed-pipeline", "interleaved", "interleaved-bf16"])
def test_a_new_attempt_resumes_from_the_newest_complete_checkpoint_with_the_same_losses(
        tmp_path, virtual_stages, precision):
    # bf16: the tag holds the fp32 masters beside the bf16 weights, so the resumed attempt
    # computes what the uninterrupted one does, bit for bit (a measured spread of 0).
    spec = JobSpec(name="resume", model={"preset": "gpt-tiny"},
                   parallel={"pp": 2, "zero": 1, "virtual_stages": virtual_stages},
                   train={"steps": 6, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
                          "precision": precision},
                   checkpoint={"every_steps": 2})
    # Attempt 0 is stopped after step 3 (checkpoint at step 2); attempt 1 runs in the same
    # processes, as a restarted Ray actor would, and must go on from step 2.
    first, second = run_ranks(spec, checkpoint_dir=str(tmp_path), attempts=[3, None])
    (uninterrupted,) = run_ranks(spec.model_copy(update={"checkpoint": spec.checkpoint}))
    # (A step whose save was waited for after it, at the stop or the end, is reported again
    # with its tag: saves are written in the background.)
    assert sorted({r["step"] for r in first if r["rank"] == 0}) == [1, 2, 3], "stop is honoured"
    assert os.path.exists(tmp_path / "step2" / "COMPLETE")
    assert sorted({r["step"] for r in second if r["rank"] == 0}) == [3, 4, 5, 6]
    assert {r["resumed_from"] for r in second} == {2}
    assert losses(first) == losses(uninterrupted)[:3]
    assert losses(second) == losses(uninterrupted)[2:], "bit-identical after resume"
    assert losses(second, rank=1) == losses(second)


@pytest.mark.slow
def test_a_custom_entrypoint_runs_on_every_rank_with_the_jobs_groups_and_config():
    spec = JobSpec(name="custom", model={"preset": "gpt-tiny"}, parallel={"dp": 2, "zero": 2},
                   train={"steps": 15, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
                   entrypoint="examples.custom_entrypoint:train")
    (rows,) = run_ranks(spec)
    for rank in range(2):
        mine = sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])
        assert [r["step"] for r in mine] == list(range(1, 16))
        assert {(r["dp_rank"], r["custom"]["world_size"], r["custom"]["zero"])
                for r in mine} == {(rank, 2, 2)}
        assert mine[-1]["loss"] < mine[0]["loss"] / 2


@pytest.mark.slow
def test_torchrun_runs_the_same_entry_point_without_the_control_plane():
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "workers.trainer.train",
         "--spec", "examples/gpt-tiny-dp2.yaml"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == list(range(1, 21)) and {r["rank"] for r in rows} == {0}
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "room_mb", "background"), [
    ({"dp": 2, "zero": 2}, 6, False), ({"dp": 2, "zero": 2}, 6, True),
    ({"pp": 2, "zero": 1}, 6, False), ({"pp": 2, "zero": 1, "virtual_stages": 2}, 4.5, False)],
    ids=["zero2", "zero2-async", "deepspeed-pipeline", "interleaved"])
def test_a_save_the_full_disk_refuses_costs_that_checkpoint_only(tmp_path, parallel, room_mb,
                                                                 background):
    """Real ranks saving to a small filesystem with room for one tag of two (a tag: 3.8 MB
    with DeepSpeed, 2.9 MB interleaved): the first save completes; the next ones fail
    mid-write (ENOSPC), every rank reports why at that step, the partial tags are removed,
    and training goes on to the end. Once the space is freed, a new attempt resumes from the
    complete tag, with the same losses the ranks had when they trained on past their failed
    saves, and saves again. Synchronous saves report a tag with its own step; saves in the
    background (`async`) with the step at which it was marked (`checkpoint_step`)."""
    spec = JobSpec(name="full-disk", model={"preset": "gpt-tiny"}, parallel=parallel,
                   train={"steps": 6, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
                          "precision": "fp32"},
                   checkpoint={"every_steps": 2, "async": background})
    with small_fs(tmp_path / "fs", 16) as fs:
        ckpt = fs / "checkpoints"
        filler = Filler(fs / "filler", leave_bytes=int(room_mb * 2**20)).start()
        (first,) = run_ranks(spec, checkpoint_dir=str(ckpt))
        assert free_bytes(fs) < room_mb * 2**20 / 2  # the second tag did not fit
        filler.free()
        (second,) = run_ranks(spec, checkpoint_dir=str(ckpt))
        done = sorted(p.parent.name for p in ckpt.glob(f"step*/{MARKER}"))
        tags = sorted(p.name for p in ckpt.glob("step*"))

    by_step = {(r["rank"], r["step"]): r for r in first}
    tagged = {(r["rank"], r.get("checkpoint_step") or r["step"]): r for r in first
              if r["checkpoint"] or r["checkpoint_error"]}  # the report of each tag
    for rank in (0, 1):
        assert [s for (r, s) in sorted(by_step) if r == rank] == [1, 2, 3, 4, 5, 6]
        assert sorted(s for (r, s) in tagged if r == rank) == [2, 4, 6]
        assert tagged[rank, 2]["checkpoint"] == str(ckpt / "step2")
        assert "checkpoint_error" not in tagged[rank, 2] or \
            tagged[rank, 2]["checkpoint_error"] is None
        for step in (4, 6):
            row = tagged[rank, step]
            assert row["checkpoint"] is None, row
            # torch's zip writer says `unexpected pos`, hence the free space beside it.
            assert re.search(r"No space left on device|\(0\.0 MiB free on its filesystem\)",
                             row["checkpoint_error"]), row
            assert row["checkpoint_error"] == tagged[0, step]["checkpoint_error"]
    assert {r["resumed_from"] for r in second} == {2}
    assert sorted({r["step"] for r in second}) == [3, 4, 5, 6]
    assert losses(second) == [by_step[0, s]["loss"] for s in (3, 4, 5, 6)], \
        "resumed from step 2 as if nothing had happened"
    assert all(r["checkpoint_error"] is None for r in second)
    assert done == tags == ["step2", "step4", "step6"]  # no partial tag was left
