"""Damaged checkpoints and non-finite runs are not successes, on real DeepSpeed ranks (gloo,
the worker path of a Ray rank, `tests.workers_spawn`): every file of a tag has its size and
SHA-256 in the tag's `COMPLETE` marker; a tag with a shard overwritten after it was saved is
not resumed from (the one before is, and the job gets a `checkpoint` event naming the file),
while a tag of before checksums still loads; a job whose weights are NaN (a Hugging Face
folder through `init.from_hf`) trains to its last step with every loss NaN, and the
controller ends it FAILED, naming the losses, where it used to end SUCCEEDED."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from service.cluster.data_plane import PollResult
from service.contract import hf_config
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.worker_reports import store_poll
from service.files.checkpoint_tags import DAMAGED, MARKER, file_digest, recorded, tag_files
from service.store import AttemptStatus, Store
from service.store.metrics import MetricsIngest
from service.submission.intake import submit as submit_job
from tests.fakes import FakeLauncher, make
from tests.waiting import drive
from tests.workers_spawn import run_ranks

SEQ = 16


def dp2(steps: int) -> JobSpec:
    return JobSpec(name="sums", model={"preset": "gpt-tiny"}, parallel={"dp": 2, "zero": 2},
                   train={"steps": steps, "global_batch": 8, "micro_batch": 2,
                          "precision": "fp32"},
                   checkpoint={"every_steps": 2})


def overwrite_middle(path: Path) -> None:
    """Bytes in the middle of the file replaced by as many others: its size stays."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        old = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in old))


@pytest.mark.slow
def test_a_tag_whose_shard_was_overwritten_is_not_resumed_from(
        sqlite_store: Store, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(dp2(4), checkpoint_dir=str(ckpt))
    step4 = ckpt / "step4"
    sums = recorded(step4)
    assert sums is not None and set(sums) == set(tag_files(step4))
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert sums[shard] == file_digest(step4 / shard)
    overwrite_middle(step4 / shard)

    (reports,) = run_ranks(dp2(6), checkpoint_dir=str(ckpt))
    first = min((r for r in reports if r["rank"] == 0), key=lambda r: r["step"])
    assert first["step"] == 3 and first["resumed_from"] == 2
    assert first["resume_skipped"] == [
        f"step 4: {shard}: its SHA-256 differs from the one recorded"
        f" ({sums[shard][0]} bytes)"]
    # Passed over, it was a partial tag, which the run saved anew at its step 4.
    assert (step4 / DAMAGED).exists() and recorded(step4) != sums

    # What the controller stores of that report: an event naming the tag and the file.
    job_id = submit_job(sqlite_store, dp2(6)).id
    store_poll(sqlite_store, MetricsIngest(sqlite_store), job_id=job_id, attempt=1,
               world_size=2, poll=PollResult(state="running", reports=reports), health=None)
    [event] = [e for e in sqlite_store.list_events(job_id=job_id) if e.kind == "checkpoint"]
    assert event.message.startswith(f"not resumed from the checkpoint of step 4: {shard}")
    assert "resumed from step 2 instead" in event.message
    assert event.data == {"damaged": first["resume_skipped"][0], "resumed_from": 2}


@pytest.mark.slow
def test_a_tag_of_before_checksums_still_loads(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(dp2(4), checkpoint_dir=str(ckpt))
    (ckpt / "step4" / MARKER).write_text("4\n")  # the marker as it was: the step alone
    assert recorded(ckpt / "step4") is None
    (reports,) = run_ranks(dp2(6), checkpoint_dir=str(ckpt))
    first = min((r for r in reports if r["rank"] == 0), key=lambda r: r["step"])
    assert first["resumed_from"] == 4 and first["resume_skipped"] is None


def nan_llama(where: Path) -> Path:
    """A tiny Llama-style model whose weights are all NaN, saved as safetensors."""
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=SEQ,
        tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.save_pretrained(where)
    return where


@pytest.mark.slow
def test_a_run_whose_losses_are_all_nan_ends_failed(sqlite_store: Store, tmp_path: Path) -> None:
    folder = nan_llama(tmp_path / "nan-hf")
    with hf_config.reading(hf_config.local_reader):
        spec = JobSpec.model_validate({
            "name": "nan", "model": {"hf_config": str(folder), "seq_len": SEQ},
            "init": {"from_hf": str(folder)},
            "train": {"steps": 3, "global_batch": 4, "micro_batch": 2, "precision": "fp32"},
            "parallel": {"dp": 2, "zero": 1},
            "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}})
    (reports,) = run_ranks(spec)  # the ranks train to the end: nothing stops them
    assert sorted(r["step"] for r in reports if r["rank"] == 0) == [1, 2, 3]
    assert all(r["loss"] is None for r in reports)  # NaN, which JSON cannot carry

    # The controller is given what those ranks reported, then that they finished.
    job_id = submit_job(sqlite_store, spec).id
    launcher = FakeLauncher([[PollResult(state="running", reports=reports),
                              PollResult(state="succeeded")]])
    c = make(sqlite_store, launcher, tmp_path, poll_timeout_s=0)
    assert drive(c, sqlite_store, job_id, {JobState.SUCCEEDED, JobState.FAILED},
                 timeout=60) == JobState.FAILED
    job = sqlite_store.get_job(job_id=job_id)
    assert job.error is not None and job.error.startswith(
        "the last 3 losses (steps 1-3 of attempt 1) were not finite (NaN or infinite)")
    assert job.attempts == 1  # not retried: a restart resumes from the same weights
    [attempt] = sqlite_store.list_attempts(job_id=job_id)
    assert attempt.status == AttemptStatus.FAILED
