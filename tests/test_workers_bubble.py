"""The pipeline bubble measured on the rank (`workers.monitor.bubble`): what counts as waiting, and
a
real pp 2 run on gloo against a pp 1 run."""

from __future__ import annotations

import pytest

from service.contract.spec import JobSpec
from tests.workers_spawn import run_ranks
from workers.monitor import bubble as bubble_mod
from workers.monitor.bubble import BubbleMeter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_waits_are_what_an_exchange_took_beyond_the_fastest_of_its_kind(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(bubble_mod.time, "perf_counter", clock)
    meter = BubbleMeter()

    def step(number: int, exchanges: list[tuple[str, float]]) -> float | None:
        meter.begin_step(number)
        for kind, seconds in exchanges:
            with meter.exchange(kind):
                clock.now += seconds
        return meter.end_step()

    # The fastest receive (1 s) is the transfer; the other took 2 s more: a wait.
    assert step(1, [("recv_grad", 3.0), ("recv_grad", 1.0), ("loss", 2.0)]) == 2.0
    # A faster receive lowers the transfer time: every receive beyond it waited.
    assert step(2, [("recv_grad", 0.5), ("recv_grad", 1.5), ("loss", 2.5)]) == 1.0 + 0.5
    assert step(3, []) == 0.0


def test_gpu_steps_between_samples_are_not_timed() -> None:
    meter = BubbleMeter(cuda=True, sample_every=10)
    meter.begin_step(3)
    with meter.exchange("recv_activation"):
        pass
    assert meter.end_step() is None


def spec(**parallel: int) -> JobSpec:
    return JobSpec(name="bubble", model={"preset": "gpt-tiny"}, parallel=parallel,
                   train={"steps": 3, "global_batch": 8, "micro_batch": 2, "lr": 1e-3})


@pytest.mark.slow
def test_a_pipeline_waits_for_its_neighbours_and_a_single_stage_does_not() -> None:
    rows = run_ranks(spec(pp=2))[0]
    assert {(r["rank"], r["step"]) for r in rows} == {(r, s) for r in (0, 1) for s in (1, 2, 3)}
    for r in rows:
        assert 0 <= r["bubble_s"] <= r["step_time_s"], r
    for rank in (0, 1):  # 1F1B over 4 micro-batches: each stage waits in fill or drain
        assert sum(r["bubble_s"] for r in rows if r["rank"] == rank) > 0, rank
    single = run_ranks(spec(dp=2))[0]
    assert len(single) == 6 and all(r["bubble_s"] == 0 for r in single)
