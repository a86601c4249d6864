"""One rank of `bench.trainer_speed`: the built-in trainer (`workers.trainer.train.train_rank`,
as the worker group runs it, monitor included) on this host's CPU, timed from each step's
start to the next one's (the whole loop: the step, its meters, its report), wall and this
process's CPU time; prints one JSON line with every step's times and loss.

It imports only `workers` and `service`, found on PYTHONPATH: `bench.trainer_speed` points it
at the tree under test (a git worktree of an older revision, or the working tree).

Usage: python bench/_speed_rank.py SPEC_JSON RANK WORLD PORT
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> None:
    spec_json = sys.argv[1]
    rank, world, port = map(int, sys.argv[2:5])
    os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    torch.set_num_threads(1)  # the ranks share the cores
    from service.contract.spec import JobSpec
    from workers.runtime.programs import RankContext
    from workers.trainer import train

    spec = JobSpec.model_validate_json(spec_json)
    ctx = RankContext(rank=rank, world_size=world, local_rank=rank, master_addr="127.0.0.1",
                      master_port=port, checkpoint_dir=None,
                      plan=train.planned_row(spec, rank))
    starts: list[tuple[float, float]] = []  # (wall, cpu) at each step's start
    steps: list[dict] = []

    def started(step: int) -> None:
        starts.append((time.perf_counter(), time.process_time()))

    def report(r) -> None:
        steps.append({"step": r.step, "loss": r.loss, "end": (time.perf_counter(),
                                                              time.process_time()),
                      "compile_s": getattr(r, "compile_s", None)})

    train.train_rank(spec, ctx, report, threading.Event(), started)
    for i, s in enumerate(steps):  # start to the next start; the last: start to its report
        end = starts[i + 1] if i + 1 < len(starts) else s.pop("end")
        s.pop("end", None)
        s["wall_s"] = end[0] - starts[i][0]
        s["cpu_s"] = end[1] - starts[i][1]
    print(json.dumps({"rank": rank, "steps": steps}), flush=True)


if __name__ == "__main__":
    main()
