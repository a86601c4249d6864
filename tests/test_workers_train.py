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
        assert row["memory"]["process_peak_source"] == "anon_peak"
        assert row["memory"]["process_peak_bytes"] > 0, "read every step"
        # monitor.memory_every 50: the first and the last step measured, the others not.
        measured = row["memory"]["optimizer_bytes"] is not None
        assert measured == (row["step"] in (1, 20)), row
        assert measured == (row["memory"]["activations_peak_bytes"] is not None)
        if measured:
            assert row["memory"]["optimizer_bytes"] > 0 and row["memory"]["params_bytes"] > 0
        assert row["kind"] == "step" and row["step_time_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(8 * 32 / row["step_time_s"])
    first, last = losses(rows, 0), losses(rows, 1)
    assert first == last, "the reported loss is the global-batch mean, equal on every rank"
    assert first[-1] < first[0] - 0.3, first


def test_memory_monitor_samples_and_watches_near_the_capacity():
    """Every `every` steps plus the first and last; once the process peak nears the plan's
    capacity, every step; the optimizer state is walked only on the steps measured."""
    import torch

    from workers.monitor.memory import MemoryMonitor, process_peak_bytes
    from workers.trainer.train import planned_row

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    row = planned_row(demo_spec(steps=20), 0)
    assert row.memory_capacity_bytes and row.memory_predicted_bytes
    meter = MemoryMonitor(model, opt, torch.device("cpu"), 4, 1, 20,
                          row.memory_capacity_bytes, row.memory_predicted_bytes)

    def step(n: int):
        with meter.track(n):
            model(torch.ones(2, 8)).sum().backward()
        opt.step()
        return meter.report()
    reports = {n: step(n) for n in range(1, 7)}
    assert [n for n, r in reports.items() if r.optimizer_bytes is not None] == [1, 4]
    assert reports[4].optimizer_bytes == 2 * 4 * (64 + 8) + 2 * 4  # exp_avg(_sq), 2 steps
    assert reports[4].activations_peak_bytes == 2 * 8 * 4  # the input saved for backward
    assert all(r.process_peak_bytes for r in reports.values())
    meter.capacity = process_peak_bytes(torch.device("cpu"))  # the peak is at the capacity
    assert step(7).optimizer_bytes is None and meter.watching  # the watch starts after it
    assert step(9).optimizer_bytes is not None and step(10).optimizer_bytes is not None


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
