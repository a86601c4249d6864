"""`trident probe` on one rank: achieved matmul FLOP/s and collective bandwidth.

Ranks are laid out as ParallelDims(tp=ranks_per_node, dp=nodes), one placement bundle per
node, so TP groups measure the links inside a node and DP groups the network between nodes.
Run as the rank program `workers.runtime.programs.CLUSTER_PROBE` (`probe_program`) by
`workers.rank.actor.RankActor.start_cluster_probe`; the controller turns the rows into a
calibrated hardware profile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
import torch.distributed as dist

from service.contract.parallel import ParallelDims
from workers.monitor.comm_probe import DEFAULT_SIZES, probe_layout
from workers.runtime import rendezvous
from workers.runtime.heartbeat import Heartbeat
from workers.runtime.programs import ProbeContext


def matmul_flops(dtype: torch.dtype, *, n: int, device: torch.device, seconds: float = 0.5,
                 ) -> float:
    """Achieved FLOP/s of an n x n x n matmul, repeated for about `seconds`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up (kernel choice, page faults)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        iters += 1
        if iters % 4 == 0:
            sync()
            if time.perf_counter() - t0 >= seconds:
                break
    return 2.0 * n**3 * iters / (time.perf_counter() - t0)


def probe_cluster_rank(*, rank: int, world_size: int, master_addr: str, port: int,
                       ranks_per_node: int, max_bytes: int,
                       heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    flops = {"fp32": matmul_flops(torch.float32, n=4096 if on_gpu else 1024, device=device)}
    if on_gpu:
        flops["bf16"] = matmul_flops(torch.bfloat16, n=8192, device=device)
    rows: list[dict[str, Any]] = []
    if world_size > 1:
        rendezvous.init_process_group("nccl" if on_gpu else "gloo", rank=rank,
                                      world_size=world_size, master_addr=master_addr,
                                      port=port)
        try:
            dims = ParallelDims(tp=ranks_per_node, dp=world_size // ranks_per_node)
            rows = probe_layout(dims, rank, sizes=[s for s in DEFAULT_SIZES if s <= max_bytes],
                                ops=("all_reduce",), heartbeat=heartbeat)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    return {"kind": "cluster_probe", "rank": rank, "node_id":
            ray.get_runtime_context().get_node_id(), "matmul_flops": flops, "rows": rows}


def probe_program(spec: None, ctx: ProbeContext, report: Callable[[dict[str, Any]], None],
                  stop: threading.Event, started: Callable[[int], None] | None = None) -> None:
    """The cluster probe as a rank program (`workers.runtime.programs.CLUSTER_PROBE`): probe, then
    report the rows once. It runs no job (`spec` is None) and cannot be stopped midway."""
    report(probe_cluster_rank(rank=ctx.rank, world_size=ctx.world_size,
                              master_addr=ctx.master_addr, port=ctx.port,
                              ranks_per_node=ctx.ranks_per_node, max_bytes=ctx.max_bytes,
                              heartbeat=ctx.heartbeat))
