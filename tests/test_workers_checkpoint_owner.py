"""A job's ranks neither resume from nor write into a checkpoint folder another job wrote,
however they were started: rank 0 checks the folder's record before any rank reads it (real
torch.distributed ranks over gloo, the worker path of a Ray rank)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.contract.spec import JobSpec
from service.files.checkpoint_dirs import RECORD, RULE, CheckpointWriter, read_writer
from tests.smallfs import snapshot
from tests.workers_spawn import run_ranks

ALICE = CheckpointWriter(job_id=15, owner="alice")
BOB = CheckpointWriter(job_id=16, owner="bob")


@pytest.mark.slow
def test_a_job_never_resumes_from_or_writes_into_another_owners_checkpoint(
        tmp_path: Path) -> None:
    spec = JobSpec(name="owned", model={"preset": "gpt-tiny"}, parallel={"dp": 2, "zero": 2},
                   train={"steps": 4, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
                   checkpoint={"every_steps": 2})
    theirs = tmp_path / "job-15"
    # Alice's job writes its checkpoints; its first start records the folder as its own.
    (first,) = run_ranks(spec, checkpoint_dir=str(theirs), writer=ALICE)
    # (Under `checkpoint.async` the save due at the end is written in the background, and
    # step 4 is reported again once its tag is marked: counted once either way.)
    assert sorted({r["step"] for r in first if r["rank"] == 0}) == [1, 2, 3, 4]
    assert os.path.exists(theirs / "step4" / "COMPLETE")
    assert read_writer(theirs) == ALICE
    before = snapshot(theirs)
    assert RECORD in before and any(name.startswith("step4/") for name in before)

    # Bob's job is started on that folder (a spec stored before the rule, a folder changed
    # since): its ranks stop before any of them reads a tag, and write nothing there.
    longer = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 8})})
    with pytest.raises(RuntimeError) as failed:
        run_ranks(longer, checkpoint_dir=str(theirs), writer=BOB)
    error = str(failed.value)
    # Raised by the check train_rank makes first, before it builds the model or resumes.
    assert "in train_rank\n" in error and "in claim_folder\n" in error, error
    assert f"CheckpointRefused: {theirs} holds the checkpoints of job 15 (owner alice)" in error
    assert RULE in error
    assert snapshot(theirs) == before
