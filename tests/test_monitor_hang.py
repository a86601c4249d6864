"""Hang diagnosis end to end: one of two gloo ranks sleeps mid-step before an all-reduce; a
controller-like loop in the test process reads the live heartbeats (written by each rank's
poll thread, as the Ray actor's poll would ship them) and must name the sleeping rank within
the timeout plus 10 seconds, with every rank's Python stack."""

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from service.contract.parallel import ParallelDims
from service.contract.reports import HeartbeatReport
from service.monitor.hang import diagnose_hang
from tests import forked
from tests._monitor_dist import free_port
from workers.monitor.comm_timer import CommTimer
from workers.runtime.heartbeat import Heartbeat, dump_stacks

TIMEOUT_S = 3.0
SLEEPY_RANK, SLEEPY_STEP = 1, 2


def _poll_thread(hb: Heartbeat, out: Path) -> None:
    """Stands in for the Ray actor's poll: publish the heartbeat, dump stacks on request."""
    beat_file, stack_req = out / f"hb{hb.rank}.json", out / "dump"
    while True:
        tmp = beat_file.with_suffix(".tmp")
        tmp.write_text(hb.read().model_dump_json())
        os.replace(tmp, beat_file)
        if stack_req.exists() and not (out / f"stacks{hb.rank}.txt").exists():
            (out / f"stacks{hb.rank}.txt").write_text(dump_stacks())
        time.sleep(0.1)


def sleepy_compute(seconds: float) -> None:
    time.sleep(seconds)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hb = Heartbeat(rank)
    threading.Thread(target=_poll_thread, args=(hb, Path(out)), daemon=True).start()
    timer = CommTimer(rank, ParallelDims(dp=world), heartbeat=hb, cuda=False)
    grad = torch.ones(1024)
    for step in range(10):
        timer.begin_step(step)
        hb.beat(step, "forward")
        if rank == SLEEPY_RANK and step == SLEEPY_STEP:
            sleepy_compute(120)
        hb.beat(step, "backward")
        with timer.collective("dp", "all_reduce", grad):
            dist.all_reduce(grad)
        hb.beat(step, "optimizer")
        timer.step_summary()
        time.sleep(0.05)


@pytest.mark.slow
def test_sleeping_rank_is_named_within_timeout(tmp_path):
    ctx = forked.context()
    port = free_port()
    procs = [forked.process(ctx, _rank, (r, 2, port, str(tmp_path)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        diagnosis, deadline = None, time.time() + 120
        while diagnosis is None and time.time() < deadline:
            time.sleep(0.25)
            try:
                beats = {r: HeartbeatReport.model_validate_json(
                    (tmp_path / f"hb{r}.json").read_text()) for r in range(2)}
            except (FileNotFoundError, ValidationError):
                continue
            # Judge once the scene is set (rank 1 asleep in its step, rank 0 waiting in the
            # all-reduce): before that, a loaded machine may starve both ranks for the timeout.
            if not (beats[SLEEPY_RANK].step == SLEEPY_STEP == beats[0].step
                    and beats[0].collective):
                continue
            diagnosis = diagnose_hang(beats, time.time(), TIMEOUT_S, ParallelDims(dp=2))
        assert diagnosis is not None, "no hang diagnosed"
        detected_at = time.time()
        last_progress = max(b.time for b in beats.values())
        assert detected_at - last_progress <= TIMEOUT_S + 10

        assert diagnosis.never_arrived == [SLEEPY_RANK]
        [w] = diagnosis.waiting
        assert (w.collective, w.dim, w.group, w.waiting, w.missing, w.step) == (
            "all_reduce", "dp", [0, 1], [0], [1], SLEEPY_STEP)
        assert diagnosis.ranks[1]["phase"] == "forward"
        assert "rank 1 never arrived: at step 2 in forward" in diagnosis.summary

        (tmp_path / "dump").write_text("")
        stacks, deadline = {}, time.time() + 60
        while len(stacks) < 2 and time.time() < deadline:
            time.sleep(0.2)
            stacks = {r: (tmp_path / f"stacks{r}.txt").read_text() for r in range(2)
                      if (tmp_path / f"stacks{r}.txt").exists()}
        assert len(stacks) == 2, f"stacks of ranks {sorted(stacks)} only"
        assert "sleepy_compute" in stacks[1]
        assert "all_reduce" in stacks[0] and "sleepy_compute" not in stacks[0]
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
