"""The planner's search time and the monitor's overhead, as `bench/bench_planner.py` and
`bench/bench_monitor_overhead.py` measure them (the latter run as it is, its figures parsed)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import Section, dist, fmt_dist

ROOT = Path(__file__).resolve().parent.parent
SEARCH_GOAL_S = 10.0
MONITOR_GOAL = 1.02


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ()) -> None:
    from service.contract.spec import JobSpec
    from service.planner import search

    nodes = 16 if quick else 128
    spec = JobSpec(name="gpt3-175b", model={"preset": "gpt3-175b"},
                   train={"global_batch": 1536, "micro_batch": 1}, parallel="auto",
                   cluster={"gpu": "a100-80gb", "nodes": nodes, "gpus_per_node": 8})
    times = []
    res = None
    for _ in range(1 if quick else 3):
        t0 = time.perf_counter()
        res = search(spec)
        times.append(time.perf_counter() - t0)
    assert res is not None and res.best is not None
    d = dist(times)
    sec.figures["planner"] = {"gpus": res.world_size, "considered": res.considered,
                              "fitting": len(res.ranked), "search_s": d}
    sec.row(f"planner: GPT-3 175B on {res.world_size} A100", fmt_dist(d),
            f"{res.considered} layouts evaluated, {len(res.ranked)} fit")
    sec.goal("planner search median (s)", d["median"], f"< {SEARCH_GOAL_S:g}",
             d["median"] < SEARCH_GOAL_S)

    args = ["--blocks", "2", "--steps", "8"] if quick else ["--blocks", "20", "--steps", "10"]
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_monitor_overhead.py"),
                          *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        raise RuntimeError(f"bench_monitor_overhead failed: {out.stderr[-2000:]}")
    ratios = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"^\s*(wall|cpu):.*ratio of medians ([0-9.]+)", out.stdout, re.M)}
    cost = re.search(r"-> ([0-9.]+) us per step = ([0-9.]+)%", out.stdout)
    sec.figures["monitor"] = {"ratios": ratios, "output": out.stdout,
                              "instrumentation_share": float(cost.group(2)) / 100 if cost else None}
    sec.row("monitor on / off, step time", f"wall {ratios.get('wall', float('nan')):.4f}, cpu "
            f"{ratios.get('cpu', float('nan')):.4f}",
            f"instrumentation alone: {cost.group(2) if cost else '?'}% of a step "
            "(2 gloo ranks, ABBA)")
    wall = ratios.get("wall")
    sec.goal("monitor overhead, wall ratio", wall, f"< {MONITOR_GOAL}",
             None if wall is None else wall < MONITOR_GOAL,
             "noisy on a shared machine; the instrumentation share is the stable figure")
