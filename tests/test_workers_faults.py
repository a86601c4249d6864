"""Fault injection rides on the CommTimer's before-collective hook: a hang or slow fault sleeps
once per step, before the step's first blocking collective, outside the timed region and
outside the heartbeat's "in a collective" (so the stall reads as compute)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from service.contract.parallel import ParallelDims
from service.contract.spec import FaultSpec
from workers.monitor import comm_timer
from workers.monitor.comm_timer import CommTimer
from workers.rank import faults
from workers.rank.faults import FaultInjector
from workers.runtime.heartbeat import Heartbeat


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_a_hang_sleeps_before_the_first_collective_and_counts_as_compute(world_of_one,
                                                                        monkeypatch):
    clock = [0.0]  # a fake clock that only the injected sleep advances
    seen: list[tuple[float, object]] = []
    hb = Heartbeat(0)

    def fake_sleep(seconds: float) -> None:
        seen.append((seconds, hb.read().collective))
        clock[0] += seconds

    monkeypatch.setattr(comm_timer.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(faults.time, "sleep", fake_sleep)
    timer = CommTimer(0, ParallelDims(), heartbeat=hb, cuda=False)
    injector = FaultInjector(0, 1, [FaultSpec(kind="hang", rank=0, step=2, seconds=100)])
    timer.install()
    injector.arm(timer)
    try:
        comm = []
        for step in (1, 2, 3):
            timer.begin_step(step)
            injector.begin(step)
            for _ in range(2):
                dist.all_reduce(torch.ones(4))
            comm.append(timer.step_summary()["world"]["all_reduce"])
    finally:
        timer.uninstall()
    assert seen == [(100, None)], "one sleep, at step 2, outside the heartbeat's collective"
    assert [c["calls"] for c in comm] == [2, 2, 2]
    assert all(c["time_s"] == 0.0 for c in comm), "the sleep is not collective time"
    assert clock[0] == 100


def test_only_hang_and_slow_faults_hook_the_timer():
    timer = CommTimer(0, ParallelDims(), cuda=False)
    FaultInjector(0, 1, [FaultSpec(kind="fail", rank=0, step=2)]).arm(timer)
    FaultInjector(0, 1, [FaultSpec(kind="slow", rank=1, step=2, seconds=1)]).arm(timer)
    assert timer._before == []
    FaultInjector(0, 1, [FaultSpec(kind="slow", rank=0, step=2, seconds=1)]).arm(timer)
    assert len(timer._before) == 1
    timer.uninstall()
    assert timer._before == []
