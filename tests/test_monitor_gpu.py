"""GPU path of the comm timer: CUDA events on sampled steps only (skipped without a GPU)."""

import os

import pytest
import torch
import torch.distributed as dist

from service.contract.parallel import ParallelDims
from tests._monitor_dist import free_port
from workers.monitor.comm_timer import CommTimer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_events_time_sampled_steps_only():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        timer = CommTimer(0, ParallelDims(), sample_every=2)
        assert timer.cuda
        timer.install()
        x = torch.ones(16 << 20, device="cuda")  # 64 MiB
        reports = []
        for step in range(2):
            timer.begin_step(step)
            dist.all_reduce(x)
            reports.append(timer.step_report(step, 1.0))
        timer.uninstall()
    finally:
        dist.destroy_process_group()
    sampled, skipped = reports
    assert sampled["timed"] and not skipped["timed"]
    assert sampled["comm"]["world"]["all_reduce"]["time_s"] > 0
    assert skipped["comm"]["world"]["all_reduce"] == {"time_s": 0.0, "bytes": 64 << 20,
                                                      "calls": 1}
