"""Planner search time: GPT-3 175B on 1024 A100-80GB (128 nodes x 8), global batch 1536.

Run: python bench/bench_planner.py   (prints seconds per search and the best layout)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time  # noqa: E402

from service.contract.spec import JobSpec  # noqa: E402
from service.planner import search  # noqa: E402
from service.planner.explain import layout_name  # noqa: E402


def main() -> None:
    spec = JobSpec(name="gpt3-175b", model={"preset": "gpt3-175b"},
                   train={"global_batch": 1536, "micro_batch": 1}, parallel="auto",
                   cluster={"gpu": "a100-80gb", "nodes": 128, "gpus_per_node": 8})
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        res = search(spec)
        times.append(time.perf_counter() - t0)
    best = res.best
    assert best is not None
    print(f"search 175B on {res.world_size} GPUs: best of 3 {min(times):.3f} s "
          f"(median {sorted(times)[1]:.3f} s); evaluated {res.considered}, fitting "
          f"{len(res.ranked)}, rejections {len(res.rejected)}")
    print(f"best: {layout_name(best)}: step {best.time.step_s:.2f} s, "
          f"{best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%}, "
          f"{best.memory.total / 1e9:.1f} GB per GPU")
    print(res.explanation())


if __name__ == "__main__":
    main()
