"""Cost of the health monitor: steady-state step time with the comm timer and heartbeat on
against off, interleaved in one run (acceptance: ratio < 1.02).

`python bench/bench_monitor_overhead.py [--blocks 20 --steps 10]`: two gloo ranks train a small
MLP DDP-style (one all-reduce per gradient, issued through torch.distributed so the installed
hooks see every one, as they see DeepSpeed's). Blocks of steps alternate on / off; each
block's median step time is kept; each on block is compared with the mean of the off blocks
on either side of it (cancelling a linear drift in the load of a shared machine), and the
median of those ratios is printed, for wall time and for the rank's CPU time (less sensitive
to other processes on the machine). The first two blocks warm up and are dropped. On a loaded
machine both swing by several percent either way; the load-independent figure is the
instrumentation's own cost per collective and per heartbeat, printed first and turned into
the step-time share it implies.
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

from service.parallel import ParallelDims
from workers.comm_timer import CommTimer
from workers.heartbeat import Heartbeat


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
    wall: list[float] = []
    cpu: list[float] = []
    step = 0
    for block in range(args.blocks + 3):
        on = block % 2 == 1
        if on:
            timer.install()
        times, cpus = [], []
        for _ in range(args.steps):
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
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            step += 1
        timer.uninstall()
        if block >= 2:  # blocks 2, 4, ... are off, 3, 5, ... on; ends with an off block
            wall.append(statistics.median(times))
            cpu.append(statistics.median(cpus))
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
    off_wall = statistics.median(result["wall"][0::2])
    cost = calls * per_call + 3 * per_beat
    print(f"instrumentation: {per_call * 1e6:.2f} us per collective, {per_beat * 1e6:.2f} us per "
          f"beat -> {cost * 1e6:.1f} us per step = {cost / off_wall:.2%} of "
          f"{off_wall * 1e3:.2f} ms")
    print(f"collectives per step: {2 * args.layers}; {args.blocks // 2} on blocks of "
          f"{args.steps} steps between off blocks")
    for kind, blocks in result.items():
        off_b, on_b = blocks[0::2], blocks[1::2]
        ratios = [on_b[i] / ((off_b[i] + off_b[i + 1]) / 2) for i in range(len(on_b))]
        print(f"{kind:>4}: monitor off {statistics.median(off_b) * 1e3:7.3f} ms/step, on "
              f"{statistics.median(on_b) * 1e3:7.3f} ms/step, median ratio "
              f"{statistics.median(ratios):.4f} (target < 1.02)")


if __name__ == "__main__":
    main()
