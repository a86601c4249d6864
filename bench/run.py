"""`make bench`: every comparison in one process run, one report.

`python -m bench.run [--quick] [--only scale,control_plane,...] [--out var/bench]` writes
`report.json` and `report.md` (the Markdown table) under `--out`. `--quick` runs each
comparison on a small size (seconds to a minute; what the test smoke-runs); a comparison that
fails is reported as failed and the others still run.

Comparisons (see each module): `orchestration` (Trident against torchrun), `control_plane`
(Trident's submit against Ray Jobs), `scale` (store and controller with 100,000 jobs and 10
million metric rows; a 4,096-rank job's ingest), `planner_monitor` (the planner's search time,
the monitor's overhead), `tracking` (the exporter's throughput to TensorBoard and MLflow, and
a controller pass's cost while MLflow hangs), `models_hf` (Trident's trainer against the same
config as a `transformers` model under DeepSpeed: tokens/s, construction time and memory),
`trainer_speed` (the built-in trainer of HEAD against the working tree's, alternated; with
nothing changed, the bench's noise; `python -m bench.trainer_speed --before REV` compares
another revision or a spec option).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench.harness import Section, write

ROOT = Path(__file__).resolve().parent.parent


def _sections() -> dict[str, tuple[str, Callable[[Section, bool, tuple[str, ...]], None]]]:
    from bench import (
        api_cpu,
        control_plane,
        models_hf,
        orchestration,
        planner_monitor,
        scale,
        tracking,
        trainer_speed,
        viewers,
    )
    return {
        "orchestration": ("Orchestration cost: Trident against torchrun", orchestration.run),
        "control_plane": ("Control plane: Trident's submit against Ray Jobs", control_plane.run),
        "api_cpu": ("Control plane: server CPU per request of the common routes",
                    api_cpu.budgets),
        "viewers": ("Control plane: 100 dashboard viewers, 8 submitters and a 4,096-rank"
                    " job; 8 x 50 submissions", viewers.run),
        "scale": ("Store and controller at scale; ingest of a 4,096-rank job", scale.run),
        "planner_monitor": ("Planner search time and monitor overhead", planner_monitor.run),
        "tracking": ("Tracking: export throughput; a pass while a tracker hangs", tracking.run),
        "models_hf": ("Trident's trainer against transformers under DeepSpeed", models_hf.run),
        "trainer_speed": ("The trainer's own speed: HEAD against the working tree",
                          trainer_speed.run),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Trident benchmarks: one report.")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--only", default="", help="comma-separated comparisons to run")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench"))
    ap.add_argument("--db", default="sqlite,postgres",
                    help="databases for Trident's store (scale, control_plane)")
    args = ap.parse_args(argv)
    sections = _sections()
    names = [n for n in args.only.split(",") if n] or list(sections)
    unknown = [n for n in names if n not in sections]
    if unknown:
        ap.error(f"--only: unknown comparison(s) {unknown}; known: {sorted(sections)}")
    dbs = tuple(d for d in args.db.split(",") if d)
    if not dbs or set(dbs) - {"sqlite", "postgres"}:
        ap.error("--db: a comma-separated subset of sqlite,postgres")
    started = time.time()
    done: list[Section] = []
    for name in names:
        title, fn = sections[name]
        sec = Section(name, title)
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            fn(sec, args.quick, dbs)
        except Exception as exc:  # the others still run; the report says what failed
            sec.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        sec.seconds = time.perf_counter() - t0
        print(f"[bench] {name}: {sec.seconds:.1f} s" + (f" FAILED {sec.error}" if sec.error
                                                          else ""), file=sys.stderr, flush=True)
        done.append(sec)
        write(done, Path(args.out), vars(args), started)  # a partial report if later ones hang
    js, md = write(done, Path(args.out), vars(args), started)
    print(md.read_text())
    print(f"report: {js} and {md}", file=sys.stderr)
    return 1 if any(s.error for s in done) else 0


if __name__ == "__main__":
    sys.exit(main())
