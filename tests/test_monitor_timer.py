"""CommTimer: collectives attributed to the right parallel dimension, bytes exact."""

import pytest
import torch
import torch.distributed as dist

from service.contract.parallel import ParallelDims
from tests._monitor_dist import run_ranks
from workers.monitor.comm_timer import CommTimer
from workers.runtime.heartbeat import Heartbeat


def test_peer_dim_from_layout():
    t = CommTimer(rank=1, dims=ParallelDims(tp=2, pp=2), cuda=False)
    # rank 1: tp group [0, 1], pp group [1, 3]
    assert t.peer_dim(0) == "tp" and t.peer_dim(3) == "pp" and t.peer_dim(2) == "other"


def _timer_rank(rank, world):
    dims = ParallelDims(tp=2, dp=2)  # tp groups [0,1] [2,3]; dp groups [0,2] [1,3]
    tp_groups = [dist.new_group(g) for g in dims.groups("tp")]
    dp_groups = [dist.new_group(g) for g in dims.groups("dp")]
    tp = tp_groups[rank // 2]
    dp = dp_groups[rank % 2]
    hb = Heartbeat(rank)
    timer = CommTimer(rank, dims, heartbeat=hb, cuda=False)
    original = dist.all_reduce
    timer.install()
    installed = dist.all_reduce is not original
    try:
        timer.begin_step(0)
        x = torch.ones(1000)  # 4000 bytes
        with timer.collective("tp", "all_reduce", x, group=tp):
            dist.all_reduce(x, group=tp)  # counted once, by the explicit context
        ok = x[0].item() == 2.0
        # Issued "inside a library": caught by the installed hooks, attributed by group ranks.
        y = torch.ones(256)  # 1024 bytes
        dist.all_reduce(y, group=dp)
        out = torch.empty(512)  # all_gather size = gathered tensor: 2048 bytes
        dist.all_gather_into_tensor(out, torch.ones(256), group=dp)
        rs = torch.empty(128)  # reduce_scatter size = full input: 1024 bytes
        dist.reduce_scatter_tensor(rs, torch.ones(256), group=dp)
        peer = rank ^ 1  # tp neighbour
        if rank % 2 == 0:
            dist.send(torch.ones(10), dst=peer)
        else:
            dist.recv(torch.empty(10), src=peer)
        dist.barrier()  # not wrapped: no op named barrier
        summary = timer.step_summary()
        empty = timer.step_summary()
    finally:
        timer.uninstall()
    return {"ok": ok, "summary": summary, "empty": empty, "hb": hb.read().model_dump(),
            "restored": installed and dist.all_reduce is original}


@pytest.mark.slow
def test_timer_attributes_collectives_by_dimension(tmp_path):
    results = run_ranks(_timer_rank, 4, tmp_path)
    for rank, r in enumerate(results):
        s = r["summary"]
        assert r["ok"] and r["empty"] == {} and r["restored"]
        assert s["tp"]["all_reduce"]["bytes"] == 4000 and s["tp"]["all_reduce"]["calls"] == 1
        assert s["dp"]["all_reduce"]["bytes"] == 1024
        assert s["dp"]["all_gather"]["bytes"] == 2048
        assert s["dp"]["reduce_scatter"]["bytes"] == 1024
        p2p = "send" if rank % 2 == 0 else "recv"
        assert (s["tp"][p2p]["bytes"], s["tp"][p2p]["calls"]) == (40, 1)  # peer is tp
        assert set(s) == {"tp", "dp"}
        assert all(o["time_s"] > 0 for ops in s.values() for o in ops.values())
        assert r["hb"]["collective"] is None  # left() after every collective


def _deepspeed_rank(rank, world):
    from workers.runtime.deepspeed_import import deepspeed

    timer = CommTimer(rank, ParallelDims(dp=world), cuda=False)
    timer.install()  # before the engine: DeepSpeed caches some collectives when it is built
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8))
        nparams = sum(p.numel() for p in model.parameters())
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
        timer.step_summary()  # drop the set-up broadcasts
        timer.begin_step(0)
        engine.backward(engine(torch.randn(4, 64)).square().mean())
        engine.step()
        return {"nparams": nparams, "summary": timer.step_summary()}
    finally:
        timer.uninstall()


@pytest.mark.slow
def test_timer_catches_deepspeed_zero2_collectives(tmp_path):
    r = run_ranks(_deepspeed_rank, 2, tmp_path)[0]
    s, full = r["summary"], r["nparams"] * 4
    assert set(s) == {"dp"}  # the engine's DP group is recognised by its ranks
    # ZeRO-2 on gloo: gradients all-reduced, then the updated partitions all-gathered.
    assert s["dp"]["all_reduce"]["bytes"] >= full
    assert s["dp"]["all_gather"]["bytes"] == full
    assert s["dp"]["all_gather"]["time_s"] > 0


def test_a_steps_communication_starts_with_the_step():
    """What was counted before `step_started` (the engine's construction, the stop check,
    an evaluation or a save between steps) is not the step's: a step's comm time is measured
    over the same interval as its step time, so its share of the step is at most 1."""
    timer = CommTimer(rank=0, dims=ParallelDims(dp=2), cuda=False)
    timer.begin_step(1)
    with timer.collective("dp", "all_gather", 4096):  # construction's broadcast, say
        pass
    timer.step_started(1)
    with timer.collective("dp", "reduce_scatter", 1024):
        pass
    report = timer.step_report(1, 0.5)
    assert set(report["comm"]["dp"]) == {"reduce_scatter"}, report
    assert report["comm"]["dp"]["reduce_scatter"]["bytes"] == 1024 and timer.step == 1


@pytest.mark.slow
def test_the_built_in_trainer_starts_each_step_before_its_timed_work():
    """`train_rank` calls `step_started(n)` once per step, in order, before step n's report,
    on every rank."""
    from service.contract.spec import JobSpec
    from tests.conftest import tiny_spec
    from tests.workers_spawn import run_ranks

    spec = JobSpec.model_validate(tiny_spec(train={
        "steps": 3, "global_batch": 4, "micro_batch": 2, "precision": "fp32"}))
    seen: list[tuple[int, str, int]] = []
    run_ranks(spec, sequence=seen)
    for rank in (0, 1):
        assert [(k, s) for r, k, s in seen if r == rank] == [
            ("start", 1), ("report", 1), ("start", 2), ("report", 2), ("start", 3),
            ("report", 3)], seen
