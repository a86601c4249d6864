"""The GPU check's steps that run on the GPU, each in a child process of its own
(`python bench/gpu_check.py --step NAME`, which prints one result line): the torch build and
NCCL version, the built-in trainer on one GPU against the plan, its training guard, the
profiler, and the NCCL probe."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

TRAIN_STEPS = 20
MODEL_1B = {"layers": 22, "hidden": 2048, "heads": 32, "kv_heads": 4, "ffn_hidden": 5632,
            "vocab": 32000, "seq_len": 2048, "activation": "swiglu"}
"""A 1.1B Llama-style GPT (TinyLlama's shape), which the built-in trainer builds as planned."""
MODEL_SMALL = {"layers": 12, "hidden": 768, "heads": 12, "ffn_hidden": 2048, "vocab": 32000,
               "seq_len": 512, "activation": "swiglu"}
"""The two-GPU jobs' model (~110M parameters)."""


# --- children: run with `--step NAME`, print one RESULT line ---

def step_build() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                           "build": "cuda" if torch.version.cuda else "cpu",
                           "cuda_available": torch.cuda.is_available(),
                           "device_count": torch.cuda.device_count()}
    if torch.cuda.is_available():
        out["devices"] = [{"name": torch.cuda.get_device_name(i),
                           "capability": list(torch.cuda.get_device_capability(i)),
                           "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                          for i in range(torch.cuda.device_count())]
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        out["cudnn"] = torch.backends.cudnn.version()
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
    return out


def gpu_profile_name(device_name: str) -> str:
    """The hardware profile (`service.contract.hardware`) of a CUDA device, by its marketing
    name."""
    n = device_name.upper()
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100-80gb"
    if "A100" in n:
        return "a100-40gb" if "40GB" in n else "a100-80gb"
    if "V100" in n:
        return "v100-32gb"
    return "a100-80gb"


def train_spec(precision: str, profile: str) -> dict[str, Any]:
    return {"name": f"gpu-check-{precision}", "model": MODEL_1B,
            "train": {"steps": TRAIN_STEPS, "global_batch": 8, "micro_batch": 2,
                      "precision": precision, "lr": 1e-4},
            "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0},
            "resources": {"gpus_per_worker": 1, "cpus_per_worker": 1},
            "cluster": {"gpu": profile, "nodes": 1, "gpus_per_node": 1}}


def step_train(precision: str) -> dict[str, Any]:
    """The built-in trainer on GPU 0, 20 steps; measured against the plan for the same spec."""
    import torch

    from service.contract.reports import StepReport
    from service.contract.spec import JobSpec
    from service.submission.intake import prepare
    from workers.trainer.train import RankContext, train_rank

    profile = gpu_profile_name(torch.cuda.get_device_name(0))
    spec = JobSpec.model_validate(train_spec(precision, profile))
    plan = prepare(spec).plan
    reports: list[StepReport] = []
    torch.cuda.reset_peak_memory_stats()
    ctx = RankContext(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                      master_port=_free_port(), checkpoint_dir=None, plan=plan.rank_plan(0))
    t0 = time.perf_counter()
    train_rank(spec, ctx, reports.append, threading.Event())
    wall = time.perf_counter() - t0
    steady = [r.step_time_s for r in reports[len(reports) // 4:]]  # past warm-up
    step_s = statistics.median(steady)
    predicted_step = float(plan.time.step_s)
    hardware_flops = float(plan.time.hardware_flops)
    from service.contract.hardware import get_profile
    peak = get_profile(profile).peak_flops_bf16
    return {
        "profile": profile, "precision": precision, "params": spec.model.model_dump(),
        "steps": len(reports), "wall_s": wall, "step_time_s": step_s,
        "step_time_p10_s": _pct(steady, 10), "step_time_p90_s": _pct(steady, 90),
        "tokens_per_s": statistics.median(r.tokens_per_s for r in reports[len(reports) // 4:]),
        "mfu": hardware_flops / step_s / peak if hardware_flops else None,
        "losses": [r.loss for r in reports],
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "predicted": {"step_time_s": predicted_step, "tokens_per_s": float(plan.tokens_per_s),
                      "memory_total": float(plan.memory.total),
                      "model_states": float(plan.memory.model_states),
                      "mfu": hardware_flops / predicted_step / peak if hardware_flops else None},
        "measured_over_predicted": {
            "step_time": step_s / predicted_step,
            "memory_allocated": torch.cuda.max_memory_allocated() / float(plan.memory.total),
            "memory_reserved": torch.cuda.max_memory_reserved() / float(plan.memory.total)},
    }


def _nccl_rank(rank: int, world: int, port: int, q: Any) -> None:
    import torch
    import torch.distributed as dist

    from service.contract.parallel import ParallelDims
    from workers.monitor.comm_probe import probe_layout

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows = probe_layout(ParallelDims(dp=world), rank, iters=10)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def step_nccl_probe() -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=240)
    for p in procs:
        p.join(30)
    best = max((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["bytes"])
    return {"world": world, "rows": rows, "all_reduce_busbw_largest": best["busbw"],
            "largest_bytes": best["bytes"]}


def step_profile() -> dict[str, Any]:
    """`trident profile --memory` on one GPU (`workers.monitor.profiler`): the trace's CUDA
    kernels inside the profiled steps, the memory timeline and the CUDA memory snapshot."""
    import gzip
    import json
    import pickle

    import torch

    from workers.monitor.profiler import StepProfiler

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    p = StepProfiler(0)
    p.arm(1, steps=2, memory=True, start=2, max_bytes=64 << 20)
    for step in range(1, 5):
        p.step_started(step)
        loss = model(torch.randn(64, 1024, device="cuda")).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        p.step_ended(step)
    answer = p.result(1)
    assert answer is not None and answer["error"] is None, answer
    files = answer["files"]
    events = json.loads(gzip.decompress(files["rank-0.pt.trace.json.gz"]))["traceEvents"]
    snapshot = pickle.loads(gzip.decompress(files["rank-0.cuda-memory-snapshot.pickle.gz"]))
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    return {"steps": answer["steps"], "bytes": {k: len(v) for k, v in files.items()},
            "kernels": len(kernels), "snapshot_segments": len(snapshot.get("segments", []))}


def guard_run(*, cuda: bool = True) -> dict[str, Any]:
    """The training guard (docs/guards.md) on one rank of the built-in trainer, bf16 on GPU 0
    (fp32 on a CPU rank with `cuda=False`): a NaN loss at step 3 is skipped; NaN at steps 5-7
    with `max_skips: 2` rolls back to the newest checkpoint (every 2 steps) and passes over
    those batches."""
    import tempfile

    from service.contract.spec import JobSpec
    from service.submission.intake import prepare
    from workers.rank.faults import FaultInjector
    from workers.trainer.train import RankContext, train_rank

    model = MODEL_SMALL if cuda else {"preset": "gpt-tiny"}
    spec = JobSpec.model_validate({
        "name": "gpu-check-guards", "model": model,
        "train": {"steps": 10, "global_batch": 8, "micro_batch": 2,
                  "precision": "bf16" if cuda else "fp32", "guard": {"max_skips": 2}},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0},
        "resources": {"gpus_per_worker": 1 if cuda else 0, "cpus_per_worker": 1},
        "cluster": {"gpu": "a100-80gb" if cuda else "cpu", "nodes": 1, "gpus_per_node": 1},
        "checkpoint": {"every_steps": 2},
        "faults": [{"kind": "nan", "rank": 0, "step": s} for s in (3, 5, 6, 7)]})
    plan = prepare(spec).plan
    faults = FaultInjector(0, 1, spec.faults)
    reports: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-guards-") as ckpt:
        ctx = RankContext(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                          master_port=_free_port(), checkpoint_dir=ckpt, attempt=1,
                          plan=plan.rank_plan(0), loss_factor=faults.loss_factor)
        train_rank(spec, ctx, reports.append, threading.Event())
    rows = [{"step": r.step, "loss": r.loss, "skipped": r.skipped, "guard": r.guard,
             "rollback": r.rollback.model_dump() if r.rollback else None} for r in reports]
    skipped = [r["step"] for r in rows if r["skipped"]]
    rollbacks = [r for r in rows if r["rollback"]]
    if 3 not in skipped or not rollbacks:
        raise RuntimeError(f"the guard did not skip step 3 and roll back: {rows}")
    return {"steps": len(rows), "skipped": skipped, "rollback": rollbacks[0]["rollback"],
            "last_loss": rows[-1]["loss"], "rows": rows}


CHILD_STEPS: dict[str, Callable[[], dict[str, Any]]] = {
    "build": step_build,
    "guards": guard_run,
    "profile": step_profile,
    "train_bf16": lambda: step_train("bf16"),
    "train_fp16": lambda: step_train("fp16"),
    "nccl_probe": step_nccl_probe,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]
