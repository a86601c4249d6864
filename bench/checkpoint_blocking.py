"""How long a checkpoint save keeps the step loop waiting, synchronous against
`checkpoint.async` (`workers.checkpoint.background`), on 2 CPU ranks (ZeRO-2, dp 2), runs
alternated: `python -m bench.checkpoint_blocking [--preset gpt3-125m] [--rounds 2]`.

Per run: 6 steps, a save every 3, rank 0's `save_s`: `at_save_step_s`, the mean over the
saves of what their own step waited (async: the snapshot to host memory); `in_loop_s`, the
mean per save of all the loop's waits (async: also marking at a later step boundary, and any
wait for the previous save); `end_s`, the wait after the last step for the last save to be
durable and marked (async only; a synchronous save's is in its step). Printed as JSON, one
line per run, then the medians."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

from service.contract.spec import JobSpec
from tests.workers_spawn import run_ranks

STEPS, EVERY = 6, 3
SAVES = STEPS // EVERY


def spec(preset: str, seq_len: int, background: bool, *, parallel: dict[str, int] | None = None,
         steps: int = STEPS, every: int = EVERY, model: dict[str, Any] | None = None
         ) -> JobSpec:
    """2 CPU ranks (dp 2, ZeRO-2 unless `parallel` says otherwise), fp32, a save every
    `every` of `steps` steps; the model `preset` at `seq_len`, or `model` if given."""
    return JobSpec.model_validate({
        "name": "save-blocking", "model": model or {"preset": preset, "seq_len": seq_len},
        "parallel": parallel or {"dp": 2, "zero": 2},
        "train": {"steps": steps, "global_batch": 2, "micro_batch": 1, "precision": "fp32"},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5},
        "monitor": {"probe": False},
        "checkpoint": {"every_steps": every, "async": background}})


def blocked(preset: str, seq_len: int, background: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        (reports,) = run_ranks(spec(preset, seq_len, background), checkpoint_dir=folder,
                               timeout=900)
    return waits(reports, background)


def waits(reports: list[dict[str, Any]], background: bool, every: int = EVERY,
          saves: int = SAVES) -> dict[str, Any]:
    """Rank 0's waits for saves in one run's reports (see the module)."""
    mine = [r for r in reports if r["rank"] == 0]
    # A step reported twice: the second time with the save waited for after the last step.
    seen: set[int] = set()
    loop: list[dict[str, Any]] = []
    end: list[dict[str, Any]] = []
    for r in mine:
        (end if r["step"] in seen else loop).append(r)
        seen.add(r["step"])
    at_save = [r["save_s"] for r in loop if r["step"] % every == 0]
    return {"async": background, "at_save_step_s": sum(at_save) / saves,
            "in_loop_s": sum(r["save_s"] or 0.0 for r in loop) / saves,
            "end_s": sum(r["save_s"] or 0.0 for r in end),
            "step_s": statistics.median(r["step_time_s"] for r in loop)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt3-125m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for background in (False, True):
            runs.append(blocked(args.preset, args.seq_len, background))
            print(json.dumps(runs[-1]), flush=True)
    for background in (False, True):
        mine = [r for r in runs if r["async"] == background]
        print(json.dumps({"async": background, **{
            k: statistics.median(r[k] for r in mine)
            for k in ("at_save_step_s", "in_loop_s", "end_s", "step_s")}}))


if __name__ == "__main__":
    main()
