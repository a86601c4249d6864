"""The trainer's own speed, one code version against another (issue 43, point 3).

The same 2-rank CPU training (gloo; the Llama-style config of `bench.models_hf`, fp32, ZeRO-2,
`--steps` steps) runs as the built-in trainer (`workers.trainer.train.train_rank`, monitor
included: `bench/_speed_rank.py`) from two trees: side A, `--before REV` (checked out into a
temporary `git worktree`, its ranks run with PYTHONPATH pointing at it; default `HEAD`), and
side B, the working tree. Spec overrides (`--train compile=true`, `--monitor memory_every=1`,
`--precision bf16`) apply to side B only, so that without `--before` the bench compares a spec
option against its absence on one tree. Runs alternate A B B A (`--rounds` repeats it), each
in its own processes, one after the other.

Reported for each side (the median over its runs): tokens/s from the median step (the first
left out: it builds and compiles; the slower rank), tokens per CPU second from the rank's own
CPU time per step (less moved by other processes on a shared machine; the slower rank), the
first step's time; every run's figures with the load average after it; the ratios B / A; and
the largest difference between the sides' losses at the same step (rank 0, first run of
each), against `--tolerance`.

Run: python -m bench.trainer_speed --before REV [--rounds N] [--steps N] [--train K=V ...]
     python -m bench.run --only trainer_speed     (HEAD against the working tree)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from bench.harness import Section, cpu_ranks

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = ROOT / "bench" / "_speed_rank.py"
STEPS = 30
LOSS_TOLERANCE = 1e-3
"""Largest absolute difference between the sides' losses at a step (the losses start near
ln(8192) = 9.0, fp32): a change of summation order (fused matmuls, compiled kernels) moves
them by about 1e-5; a change of what is computed moves them by far more."""


def spec_for(quick: bool, steps: int, overrides: dict[str, dict[str, Any]] | None = None):
    """`bench.models_hf`'s spec, `steps` steps, with `overrides` ({section: {key: value}})."""
    from bench.models_hf import spec_for as hf_spec
    data = json.loads(hf_spec(quick).model_dump_json(exclude_defaults=True))
    data["train"]["steps"] = steps
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    from service.contract.spec import JobSpec
    return JobSpec.model_validate(data)


@contextmanager
def tree_at(rev: str | None) -> Iterator[Path]:
    """The working tree (rev None), or `rev` checked out into a temporary git worktree,
    removed after."""
    if rev is None:
        yield ROOT
        return
    tmp = Path(tempfile.mkdtemp(prefix="trident-before-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                    str(tmp), rev], check=True)
    try:
        yield tmp
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp)],
                       check=False)


def run_ranks(tree: Path, spec_json: str, world: int = 2) -> list[dict]:
    """One run of the trainer from `tree`: every rank's steps."""
    return cpu_ranks(RANK_SCRIPT, lambda rank, port: [spec_json, str(rank), str(world),
                                                      str(port)], world, tree, str(tree))


def figures(ranks: list[dict], tokens: int) -> dict[str, Any]:
    """One run's figures: the slower rank's tokens/s and tokens per CPU second (median step,
    the first left out), its first step, rank 0's losses."""
    def med(steps: list[dict], key: str) -> float:
        return statistics.median(s[key] for s in (steps[1:] if len(steps) > 1 else steps))
    return {"tokens_per_s": min(tokens / med(r["steps"], "wall_s") for r in ranks),
            "tokens_per_cpu_s": min(tokens / med(r["steps"], "cpu_s") for r in ranks),
            "first_step_s": max(r["steps"][0]["wall_s"] for r in ranks),
            "compile_s": ranks[0]["steps"][0].get("compile_s"),
            "losses": [s["loss"] for s in ranks[0]["steps"]],
            "load": os.getloadavg()[0]}


def max_loss_diff(a: list[float | None], b: list[float | None]) -> float:
    """The largest |a - b| over the steps both ran (inf where one side's loss is missing)."""
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) if x is not None and y is not None else float("inf")
                for x, y in zip(a, b, strict=True)), default=0.0)


def compare(sec: Section, before: str | None, overrides: dict[str, dict[str, Any]],
            quick: bool = False, steps: int = STEPS, rounds: int = 1,
            tolerance: float = LOSS_TOLERANCE) -> None:
    base = spec_for(quick, steps)
    after = spec_for(quick, steps, overrides)
    tokens = base.train.global_batch * base.model.seq_len
    label_a = before or "working tree"
    label_b = "working tree" + "".join(f" {s}.{k}={v}" for s, kv in overrides.items()
                                       for k, v in kv.items())
    order = ("A", "B", "B", "A") * rounds
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    with tree_at(before) as tree_a:
        sides = {"A": (tree_a, base.model_dump_json(exclude_defaults=True)),
                 "B": (ROOT, after.model_dump_json(exclude_defaults=True))}
        for side in order:
            tree, spec_json = sides[side]
            runs[side].append(figures(run_ranks(tree, spec_json), tokens))
            print(f"[trainer_speed] {side}: {runs[side][-1]['tokens_per_s']:.0f} tokens/s"
                  f" (load {runs[side][-1]['load']:.1f})", file=sys.stderr, flush=True)
    summary = {side: {key: statistics.median(r[key] for r in rs)
                      for key in ("tokens_per_s", "tokens_per_cpu_s", "first_step_s")}
               for side, rs in runs.items()}
    diff = max_loss_diff(runs["A"][0]["losses"], runs["B"][0]["losses"])
    a, b = summary["A"], summary["B"]
    sec.figures.update(before=label_a, after=label_b, spec=json.loads(after.model_dump_json()),
                       order=order, runs=runs, summary=summary, max_loss_diff=diff,
                       tolerance=tolerance)
    what = (f"{label_b} / {label_a}; 2 CPU ranks, ZeRO-{base.layout.zero}, "
            f"{after.train.precision}, {steps} steps, runs alternated {' '.join(order)}")
    speed = b["tokens_per_s"] / a["tokens_per_s"]
    sec.row("tokens/s, B / A (median of runs; median step, slower rank)",
            f"{b['tokens_per_s']:.0f} / {a['tokens_per_s']:.0f} = {speed:.3f}x", what)
    cpu = b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"]
    sec.row("tokens per CPU second, B / A",
            f"{b['tokens_per_cpu_s']:.0f} / {a['tokens_per_cpu_s']:.0f} = {cpu:.3f}x",
            "each rank's own CPU time per step (slower rank)")
    sec.row("first step, B / A", f"{b['first_step_s']:.2f} s / {a['first_step_s']:.2f} s",
            "slower rank" + (f"; B's compile {runs['B'][0]['compile_s']:.2f} s"
                             if runs["B"][0]["compile_s"] is not None else ""))
    seen = {"A": 0, "B": 0}
    cells = []
    for side in order:
        r = runs[side][seen[side]]
        seen[side] += 1
        cells.append(f"{side} {r['tokens_per_s']:.0f} / {r['tokens_per_cpu_s']:.0f}"
                     f" (load {r['load']:.1f})")
    sec.row("every run: tokens/s / tokens per CPU s (load average, 1 min, after it)",
            ", ".join(cells), "in the order run")
    sec.goal("the same losses, B against A (largest |difference| at a step)", diff,
             f"<= {tolerance:g}", diff <= tolerance, f"{steps} steps, rank 0, first runs")


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ()) -> None:
    """`bench.run --only trainer_speed`: HEAD against the working tree (with nothing changed,
    the bench's own noise: the ratio one tree has against itself)."""
    compare(sec, "HEAD", {}, quick=quick, steps=6 if quick else STEPS)


def _pairs(section: str, items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--{section}: KEY=VALUE expected, got {item!r}")
        out[key] = yaml.safe_load(value)
    return {section: out} if out else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None,
                    help="side A: this git revision (default: the working tree, as side B"
                         " without the overrides)")
    ap.add_argument("--rounds", type=int, default=1, help="A B B A, this many times")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--quick", action="store_true", help="the small model of models_hf")
    ap.add_argument("--tolerance", type=float, default=LOSS_TOLERANCE)
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="side B's train.KEY (YAML value)")
    ap.add_argument("--monitor", action="append", default=[], metavar="KEY=VALUE",
                    help="side B's monitor.KEY")
    ap.add_argument("--parallel", action="append", default=[], metavar="KEY=VALUE",
                    help="side B's parallel.KEY")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                    help="side B's train.precision")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        ap.error("--rounds: at least 1; --steps: at least 2 (the first is left out)")
    overrides = {**_pairs("train", args.train), **_pairs("monitor", args.monitor),
                 **_pairs("parallel", args.parallel)}
    if args.precision:
        overrides.setdefault("train", {})["precision"] = args.precision
    if args.before is None and not overrides:
        ap.error("nothing to compare: give --before REV or a spec override")
    sec = Section("trainer_speed", "The trainer's own speed: one version against another")
    compare(sec, args.before, overrides, args.quick, args.steps, args.rounds, args.tolerance)
    print(json.dumps({"rows": sec.rows, "goals": [g.__dict__ for g in sec.goals]}, indent=2))
    return 0 if all(g.met for g in sec.goals) else 1


if __name__ == "__main__":
    sys.exit(main())
