"""The per-rank trainer end to end on gloo: the demo job, stop, and the report's contents."""

from __future__ import annotations

import pytest

from service.contract.spec import JobSpec
from tests.workers_spawn import losses, run_ranks

STEP_KEYS = {"kind", "rank", "step", "loss", "step_time_s", "tokens_per_s", "memory"}
MEMORY_KEYS = {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_peak_bytes",
               "process_peak_bytes"}


def demo_spec(**train) -> JobSpec:
    return JobSpec(name="demo", model={"preset": "gpt-tiny"},
                   parallel={"dp": 2, "zero": 2},
                   train={"steps": 20, "global_batch": 8, "micro_batch": 2, **train})


@pytest.mark.slow
def test_demo_job_trains_and_reports_every_step_on_every_rank():
    rows = run_ranks(demo_spec())[0]
    assert sorted((r["rank"], r["step"]) for r in rows) == [
        (rank, step) for rank in range(2) for step in range(1, 21)]
    for row in rows:
        assert row.keys() >= STEP_KEYS and row["memory"].keys() >= MEMORY_KEYS
        assert row["memory"]["process_peak_source"] == "rss_peak"
        assert row["kind"] == "step" and row["step_time_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(8 * 32 / row["step_time_s"])
    first, last = losses(rows, 0), losses(rows, 1)
    assert first == last, "the reported loss is the global-batch mean, equal on every rank"
    assert first[-1] < first[0] - 0.3, first


@pytest.mark.slow
def test_stop_reaching_one_rank_stops_every_rank_at_the_same_step_boundary():
    # Only rank 0's event is set (after its step-2 report); rank 1 must not run step 3 alone.
    first, second = run_ranks(demo_spec(steps=6), attempts=[2, None], stop_ranks=[0])
    assert sorted((r["rank"], r["step"]) for r in first) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert sorted(r["step"] for r in second if r["rank"] == 1) == list(range(1, 7))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_demo_job_on_two_gpus_with_nccl(precision):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    spec = JobSpec(name="demo-gpu", model={"preset": "gpt-tiny"},
                   parallel={"tp": 2, "zero": 1}, resources={"gpus_per_worker": 1},
                   train={"steps": 20, "global_batch": 8, "micro_batch": 2,
                          "precision": precision})
    rows = run_ranks(spec)[0]
    got = losses(rows)
    assert losses(rows, 1) == got and got[-1] < got[0] - 0.3
    assert {r["memory"]["process_peak_source"] for r in rows} == {"cuda_max_allocated"}
