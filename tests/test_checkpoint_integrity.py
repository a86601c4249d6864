"""Damaged checkpoints and non-finite runs are not successes, on real DeepSpeed ranks (gloo,
the worker path of a Ray rank, `tests.workers_spawn`): a job whose weights are NaN (a
Hugging Face folder through `init.from_hf`) trains to its last step with every loss NaN, and
the controller ends it FAILED, naming the losses, where it used to end SUCCEEDED."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from service import hf_config
from service.jobs import submit as submit_job
from service.protocols import PollResult
from service.spec import JobSpec
from service.states import JobState
from service.store import AttemptStatus, Store
from tests.fakes import FakeLauncher, make
from tests.waiting import drive
from tests.workers_spawn import run_ranks

SEQ = 16


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
