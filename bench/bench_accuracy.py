"""Planner accuracy against published iteration times (Korthikanti et al. 2022, Table 5).

Run: python bench/bench_accuracy.py   (prints predicted vs published seconds and the error)
The measured errors are quoted in docs/planner.md.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.contract.spec import JobSpec, ParallelSpec  # noqa: E402
from service.planner import evaluate  # noqa: E402

TABLE5 = [  # name, L, h, a, pp, v, B, full recompute s, SP + selective s
    ("22B", 48, 6144, 64, 1, 1, 4, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 3, 64, 18.13, 13.75),
    ("530B", 105, 20480, 128, 35, 3, 280, 49.05, 37.83),
    ("1T", 128, 25600, 160, 64, 1, 512, 94.42, 71.49),
]


def main() -> None:
    print(f"{'model':<6} {'variant':<18} {'published':>9} {'predicted':>9} {'error':>7}  "
          f"{'MFU':>6} {'GB/GPU':>7}")
    for name, L, h, a, pp, v, B, t_full, t_sel in TABLE5:
        spec = JobSpec(name=name, model={"layers": L, "hidden": h, "heads": a, "vocab": 51200,
                                         "seq_len": 2048},
                       train={"global_batch": B, "micro_batch": 1},
                       parallel=ParallelSpec(tp=8, pp=pp),
                       cluster={"gpu": "a100-80gb", "nodes": pp, "gpus_per_node": 8})
        for variant, lay, pub in [
                ("full recompute", ParallelSpec(tp=8, pp=pp, virtual_stages=v,
                                                recompute="full"), t_full),
                ("SP + selective", ParallelSpec(tp=8, pp=pp, virtual_stages=v,
                                                recompute="selective",
                                                sequence_parallel=True), t_sel)]:
            p = evaluate(spec, lay)
            print(f"{name:<6} {variant:<18} {pub:9.2f} {p.time.step_s:9.2f} "
                  f"{p.time.step_s / pub - 1:+7.1%}  {p.mfu:6.1%} {p.memory.total / 1e9:7.1f}")


if __name__ == "__main__":
    main()
