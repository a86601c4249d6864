"""Cost of the health monitor: steady-state step time with the comm timer and heartbeat on
against off, interleaved in one run (acceptance: ratio < 1.02).

`python bench/bench_monitor_overhead.py [--blocks 40 --steps 10]` (blocks x steps steps, half
on): two gloo ranks train a small MLP DDP-style (one all-reduce per gradient, issued through
torch.distributed so the installed hooks see every one, as they see DeepSpeed's). The monitor
is switched on and off step by step in ABBA order (on, off, off, on), outside the timed
region, so drift in the load of a shared machine falls equally on both; the ratio of the
median on-step to the median off-step is printed, for wall time and for the rank's CPU time.
The load-independent figure, the instrumentation's own cost per collective and per
heartbeat, is printed first with the step-time share it implies.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.contract.parallel import ParallelDims
from workers.monitor.comm_timer import CommTimer
from workers.runtime.heartbeat import Heartbeat


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(args.width, args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width)
    hb = Heartbeat(rank)
    timer = CommTimer(rank, ParallelDims(dp=world), heartbeat=hb, cuda=False)
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    warmup = 20
    for step in range(warmup + args.blocks * args.steps):
        # On and off alternate step by step in ABBA order, so drift in the load of a shared
        # machine and any after-switch effect fall equally on both.
        on = step % 4 in (0, 3)
        if on:
            timer.install()
        t0, c0 = time.perf_counter(), time.process_time()
        if on:
            timer.begin_step(step)
            hb.beat(step, "forward")
        loss = model(x).square().mean()
        if on:
            hb.beat(step, "backward")
        opt.zero_grad(set_to_none=False)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if on:
            hb.beat(step, "optimizer")
        opt.step()
        if on:
            timer.step_report(step, time.perf_counter() - t0)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        timer.uninstall()
        if step >= warmup:
            wall[on].append(dt)
            cpu[on].append(dc)
    if rank == 0:
        q.put({"wall": wall, "cpu": cpu, "cost": instrumentation_cost(timer, hb)})
    dist.destroy_process_group()


def instrumentation_cost(timer: CommTimer, hb: Heartbeat, n: int = 20000) -> tuple[float, float]:
    """Seconds the monitor adds per hooked collective (the installed torch.distributed wrapper
    with heartbeat and bookkeeping, around a no-op collective) and per heartbeat beat."""
    hooked = timer._wrap("all_reduce", lambda *args, **kwargs: None)
    t = torch.ones(16)
    t0 = time.perf_counter()
    for _ in range(n):
        hooked(t)
    per_call = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        hb.beat(i, "forward")
    return per_call, (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    result = q.get()
    for p in procs:
        p.join()
    per_call, per_beat = result.pop("cost")
    calls = 2 * args.layers
    off_wall = statistics.median(result["wall"][False])
    cost = calls * per_call + 3 * per_beat
    print(f"instrumentation: {per_call * 1e6:.2f} us per collective, {per_beat * 1e6:.2f} us per "
          f"beat -> {cost * 1e6:.1f} us per step = {cost / off_wall:.2%} of "
          f"{off_wall * 1e3:.2f} ms")
    n = len(result["wall"][True])
    print(f"collectives per step: {2 * args.layers}; {n} steps on and {n} off, interleaved ABBA")
    for kind in ("wall", "cpu"):
        on_s, off_s = result[kind][True], result[kind][False]
        ratio = statistics.median(on_s) / statistics.median(off_s)
        print(f"{kind:>4}: monitor off {statistics.median(off_s) * 1e3:7.3f} ms/step, on "
              f"{statistics.median(on_s) * 1e3:7.3f} ms/step, ratio of medians {ratio:.4f}"
              f" (target < 1.02)")


if __name__ == "__main__":
    main()
