"""Measure the `cpu` profile's constants on this machine and compare predicted with measured.

Runs a real DeepSpeed job like the demo's (GPT of the planner's GPT conventions, 2 ranks,
gloo, ZeRO-2, fp32, global batch 8, micro-batch 2) for several depths, times its steps,
fits the per-layer and per-step overheads (`service.planner.calibrate.fit_overheads`), and
prints predicted against measured step time with the profile in service/contract/hardware.py.

Run: python bench/bench_cpu_constants.py [layers ...]     (a minute or two on 2 cores)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.contract.hardware import get_profile  # noqa: E402
from service.contract.spec import JobSpec, ParallelSpec  # noqa: E402
from service.planner import evaluate  # noqa: E402
from service.planner.calibrate import fit_overheads  # noqa: E402

STEPS, WARMUP = 30, 5


def worker(rank: int, port: int, layers: int, zero: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2")
    import torch

    from tests._planner_ds_probe import GPT
    from workers.runtime.deepspeed_import import deepspeed
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(layers, 64, 256, 32)  # gpt-tiny: hidden 64, 4 heads, vocab 256, seq 32
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
           "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": zero}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    times = []
    for step in range(STEPS + WARMUP):
        t0 = time.perf_counter()
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(torch.randint(0, 256, (2, 32)))
            engine.backward(loss)
            engine.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    times.sort()
    q.put((rank, times[len(times) // 2]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(layers: int, zero: int = 2) -> float:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, layers, zero, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = [q.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return max(t for _, t in out)


def spec(layers: int, zero: int = 2) -> JobSpec:
    return JobSpec(name="cpu-bench", model={"preset": "gpt-tiny", "layers": layers},
                   train={"global_batch": 8, "micro_batch": 2, "precision": "fp32"},
                   parallel=ParallelSpec(dp=2, zero=zero),
                   cluster={"gpu": "cpu", "nodes": 1, "gpus_per_node": 2})


def main() -> None:
    depths = [int(a) for a in sys.argv[1:]] or [2, 4, 8]
    prof = get_profile("cpu")
    samples = []
    for layers in depths:
        measured = measure(layers)
        plan = evaluate(spec(layers), profile=prof)
        samples.append((plan, measured))
        print(f"layers {layers}: measured {measured * 1e3:.1f} ms/step, predicted "
              f"{plan.time.step_s * 1e3:.1f} ms ({plan.time.step_s / measured - 1:+.1%})")
    fitted = fit_overheads(samples)
    print(f"fitted layer_overhead_s={fitted.layer_overhead_s:.3g} "
          f"step_overhead_s={fitted.step_overhead_s:.3g} (profile: "
          f"{prof.layer_overhead_s:.3g}, {prof.step_overhead_s:.3g})")


if __name__ == "__main__":
    main()
