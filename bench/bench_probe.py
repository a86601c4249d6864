"""Probe figures on this machine: `python bench/bench_probe.py [world]` runs the default probe
(1 KiB .. 64 MiB) over a pure-DP gloo layout and prints one line per (op, size) with the
profile's expectation and the slow-group verdict of `service.monitor.probe`."""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

from service.contract.hardware import get_profile
from service.contract.parallel import ParallelDims
from service.monitor.probe import annotate_expected, flag_slow_groups
from workers.monitor.comm_probe import probe_layout


def _rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    warnings.simplefilter("ignore", FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    q.put(probe_layout(ParallelDims(dp=world), rank, iters=10))
    dist.destroy_process_group()


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [row for _ in procs for row in q.get()]
    for p in procs:
        p.join()
    profile = get_profile("cpu")
    for r in annotate_expected(rows, profile):
        print(f"{r['dim']} {r['group']} {r['op']:<15} {r['bytes']:>9} B "
              f"{r['time_s'] * 1e3:8.3f} ms  algbw {r['algbw'] / 1e9:6.3f}"
              f"  busbw {r['busbw'] / 1e9:6.3f} GB/s  expected {r['expected_busbw'] / 1e9:6.3f}")
    print("slow groups:", flag_slow_groups(rows, profile) or "none")


if __name__ == "__main__":
    main()
