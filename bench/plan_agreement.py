"""The plan against the built-in trainer's `memory` reports, category by category, and the CPU
framework's resident memory that the `cpu` profile's `reserved_bytes` is made of.

1. A fresh process imports the trainer (torch, DeepSpeed, `torch._dynamo` as the trainer
   does before it measures) and starts a one-rank gloo process group: its own (anonymous)
   memory, 251 MB; a rank that Ray runs holds more there (Ray's core worker), the `cpu`
   profile's `CPU_FRAMEWORK_START_BYTES` (307 MB, service/contract/hardware.py,
   `pytest -s tests/test_plan_agreement_ray.py` prints it).
2. gpt-tiny on 2 forked CPU ranks, fp32, 6 steps, for each layout given (default: the three
   of issue 46's table): each rank's last-step report against its stage's plan (the total
   with the framework's bytes each rank measured, `RankAgreement.planned_total_here`, against
   the peak of its own memory), and the framework's growth (that peak less the framework at
   start and the measured categories; 4-13 MB, `CPU_FRAMEWORK_GROWTH_BYTES` 8 MB).

Prints the tables of docs/planner.md ("Plan against the trainer's memory report"): the device
categories of every layout, then the host ones of the offload layouts.

Run: python bench/plan_agreement.py [--all]      (about a minute on 2 cores)
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.plan_agreement import agreement  # noqa: E402
from tests.servers import free_port  # noqa: E402

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2 ZeRO-1": {"dp": 2, "zero": 1}, "dp2 ZeRO-3": {"dp": 2, "zero": 3}, "tp2": {"tp": 2},
}
MORE: dict[str, dict[str, Any]] = {
    "dp2 ZeRO-0": {"dp": 2}, "dp2 ZeRO-2": {"dp": 2, "zero": 2}, "pp2 1F1B": {"pp": 2},
    "pp2 interleaved v2": {"pp": 2, "virtual_stages": 2},
    "dp2 ZeRO-2 offload": {"dp": 2, "zero": 2, "offload": "optimizer"},
    "dp2 ZeRO-3 offload": {"dp": 2, "zero": 3, "offload": "optimizer+params"},
}
HOST = ("host_params", "host_grads", "host_optimizer", "offload_buffers")
"""The categories in host memory under CPU offload (a second table)."""
FRESH = """
import os, torch.distributed as dist, workers.trainer.train, torch._dynamo
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from workers.monitor.memory import anonymous_bytes
print(anonymous_bytes())
"""


def framework_at_start() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", FRESH.format(port=free_port())], cwd=root,
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=root))
    return int(out.stdout.split()[-1])


def _cell(planned: float, measured: float | None) -> str:
    return f"{planned:,.0f} / " + ("n/a" if measured is None else f"{measured:,.0f}")


def main() -> None:
    start = framework_at_start()
    print(f"framework at start (fresh process, trainer imported, gloo group up): {start:,} B")
    layouts = LAYOUTS | (MORE if "--all" in sys.argv else {})
    print("\n| layout | rank (stage) | params planned / measured | grads | optimizer |"
          " activations | gathered | total planned / peak | framework growth |")
    print("|---|---|---|---|---|---|---|---|---|")
    host: list[str] = []
    for name, parallel in layouts.items():
        for a in agreement(**parallel):
            m = a.measured
            growth = m["process_peak_bytes"] - m["framework_bytes"] - sum(
                m.get(k) or 0 for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                        "activations_peak_bytes", "gathered_peak_bytes",
                                        *(f"{c}_bytes" for c in HOST)))
            cells = [_cell(*a.pair(c)) for c in
                     ("params", "grads", "optimizer", "activations", "gathered")]
            total = f"{a.planned_total_here / 1e6:.1f} MB / {m['process_peak_bytes'] / 1e6:.1f} MB"
            print(f"| {name} | {a.rank} ({a.stage}) | " + " | ".join(cells)
                  + f" | {total} | {growth / 1e6:.1f} MB |", flush=True)
            if parallel.get("offload", "none") != "none":
                host.append(f"| {name} | {a.rank} | " + " | ".join(
                    _cell(*a.pair(c)) for c in HOST) + " |")
    if host:
        print("\n| offload layout | rank | host params | host grads | host optimizer |"
              " offload buffers |\n|---|---|---|---|---|---|")
        print("\n".join(host))


if __name__ == "__main__":
    main()
