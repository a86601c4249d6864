"""Where a step of the built-in trainer goes on this CPU (issue 43, point 3: the limit of the
trainer's speed against `transformers` + DeepSpeed): the config of `bench.models_hf` on 2 CPU
ranks (gloo), rank 0 under torch.profiler for `--steps` steps after 3 unprofiled ones, its
CPU time split by operator: matrix products (`aten::mm`, `addmm`, `bmm`), attention
(`scaled_dot_product_attention`'s CPU kernels, forward and backward), the optimizer's step
(the AdamW step's own range, inclusive), collectives (gloo's calls; their waits fall outside
operators), copies (`copy_`, `cat`: DeepSpeed's flat buffers, splits and layouts), the step's
time in no operator (Python, DeepSpeed's bookkeeping, waits) and the other operators
(elementwise, norms, rotary, the loss). The profiler's times are wall times: on a loaded
machine every share takes its part of the waiting. `--train compile=true` profiles
the compiled blocks.

Run: python -m bench.step_split [--steps 5] [--train KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARM = 3


def rank_main(spec_json: str, rank: int, port: int, steps: int) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    from service.contract.spec import JobSpec
    from workers.runtime.programs import RankContext
    from workers.trainer import train

    spec = JobSpec.model_validate_json(spec_json)
    ctx = RankContext(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1",
                      master_port=port, checkpoint_dir=None, plan=train.planned_row(spec, rank))
    prof = profile(activities=[ProfilerActivity.CPU],
                   schedule=schedule(wait=WARM, warmup=1, active=steps, repeat=1))
    with prof:
        train.train_rank(spec, ctx, lambda r: None, threading.Event(),
                         lambda step: prof.step() if step > 1 else None)
    if rank:
        return
    split = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "collectives": 0.0,
             "copies": 0.0, "outside_ops": 0.0}
    total = 0.0
    for e in prof.key_averages():
        name, self_us = e.key, e.self_cpu_time_total
        total += self_us
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"):
            split["matmul"] += self_us
        elif "scaled_dot_product" in name or "flash_attention" in name:
            split["attention"] += self_us
        elif "gloo" in name or name.startswith("c10d::"):
            split["collectives"] += self_us
        elif name in ("aten::copy_", "aten::cat", "aten::contiguous", "aten::clone"):
            split["copies"] += self_us
        elif name.startswith("ProfilerStep"):  # the step's time in no operator
            split["outside_ops"] += self_us
        elif name.startswith("Optimizer.step#"):
            split["optimizer"] += e.cpu_time_total - self_us  # its ops, inclusive
    # (The optimizer's ops are also counted under their own names: taken out of `other`.)
    split["other"] = total - sum(split.values())  # what no category took
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print(json.dumps({"top": [(e.key, round(e.self_cpu_time_total / total, 4)) for e in top]}))
    print(json.dumps({"profiled_s_per_step": total / 1e6 / steps,
                      "share": {k: v / total for k, v in split.items()}}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    from bench.trainer_speed import _pairs, spec_for
    spec = spec_for(False, WARM + 1 + args.steps, _pairs("train", args.train))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    code = "import sys; from bench.step_split import rank_main; rank_main(*sys.argv[1:2], " \
           "int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, spec.model_dump_json(), str(r),
                               str(port), str(args.steps)], stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for r in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        return 1
    print("\n".join(line for line in outs[0].splitlines() if line.startswith("{")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
