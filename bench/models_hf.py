"""Trident's trainer against a `transformers` model under DeepSpeed (issue 22's benchmark).

The same Llama-style config (RMSNorm, SwiGLU, rotary, untied head) is trained on the same 2 CPU
ranks (gloo), the same ZeRO stage, precision, batch and data, with the same DeepSpeed config
(`service.contract.ds_config`, as the ranks pass it to `deepspeed.initialize`) and the same AdamW
groups: once as Trident's model (`workers.trainer.train.build_engine`: shard-only construction),
once as `transformers`' `LlamaForCausalLM` of that config (SDPA attention), built as
`transformers` builds it and wrapped by `deepspeed.initialize`. Each side runs in its own
processes, one after the other, alternated A B B A (`bench/_hf_rank.py`). Reported, each
side's best run: tokens per second (median step, the first left out; the slower rank),
tokens per CPU second (the rank's own CPU time per step: what the side computes, less moved
by other processes on a shared machine than the wall time; the slower rank), each run's
figures with the load average after it,
construction time (the slower rank) and the construction's peak resident memory (model and
engine, over the rank's resident set before it; the larger rank).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bench.harness import Section, cpu_ranks, fmt_s

ROOT = Path(__file__).resolve().parent.parent
SPEED_GOAL = 1.0


def spec_for(quick: bool, compile: bool = False):
    """The config; `compile`: Trident's blocks compiled (`train.compile`; `python -m
    bench.models_hf --compile`), `transformers`' model run as it is."""
    from service.contract.spec import JobSpec
    model = ({"layers": 2, "hidden": 128, "heads": 4, "vocab": 2048, "seq_len": 64,
              "activation": "swiglu"} if quick else
             {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 8192,
              "seq_len": 128, "activation": "swiglu"})
    return JobSpec(name="hf-bench", model=model, parallel={"dp": 2, "zero": 2},
                   train={"precision": "fp32", "global_batch": 8, "micro_batch": 2,
                          "steps": 4 if quick else 6, "compile": compile})


def _ranks(which: str, spec, world: int = 2) -> list[dict]:
    return cpu_ranks(ROOT / "bench" / "_hf_rank.py",
                     lambda rank, port: [which, spec.model_dump_json(), str(spec.train.steps),
                                         str(rank), str(world), str(port)],
                     world, ROOT, which)


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = (), compile: bool = False) -> None:
    spec = spec_for(quick, compile)
    # Alternated (A B B A in the full run) so that both sides see the machine's load alike;
    # each side's figures are its best run's (the least disturbed).
    order = ("trident", "hf") if quick else ("trident", "hf", "hf", "trident")
    runs: dict[str, list[list[dict]]] = {"trident": [], "hf": []}
    loads: list[tuple[str, float, float]] = []
    for which in order:
        ranks = _ranks(which, spec)
        runs[which].append(ranks)
        loads.append((which, min(r["tokens_per_s"] for r in ranks), os.getloadavg()[0]))
    summary = {}
    for which, side in runs.items():
        summary[which] = {
            "params": side[0][0]["params"],
            "tokens_per_s": max(min(r["tokens_per_s"] for r in ranks) for ranks in side),
            "tokens_per_cpu_s": max(min(spec.train.global_batch * spec.model.seq_len
                                        / r["cpu_step_s"] for r in ranks) for ranks in side),
            "construction_s": min(max(r["construction_s"] for r in ranks) for ranks in side),
            "construction_peak_bytes": min(max(r["construction_peak_bytes"] for r in ranks)
                                           for ranks in side),
            "runs": side}
    sec.figures.update(spec=json.loads(spec.model_dump_json()), **summary)
    tr, hf = summary["trident"], summary["hf"]
    assert tr["params"] == hf["params"], (tr["params"], hf["params"])
    speed = tr["tokens_per_s"] / hf["tokens_per_s"]
    sec.row("tokens/s, Trident / transformers + DeepSpeed",
            f"{tr['tokens_per_s']:.0f} / {hf['tokens_per_s']:.0f} = {speed:.2f}x",
            f"{tr['params']:,} parameters, 2 CPU ranks, ZeRO-{spec.layout.zero},"
            f" {spec.train.precision}, global batch {spec.train.global_batch}"
            + (", Trident's blocks compiled (train.compile)" if spec.train.compile else ""))
    cpu = tr["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"]
    sec.row("tokens per CPU second, Trident / transformers + DeepSpeed",
            f"{tr['tokens_per_cpu_s']:.0f} / {hf['tokens_per_cpu_s']:.0f} = {cpu:.2f}x",
            "each rank's own CPU time per step (slower rank)")
    sec.row("every run: tokens/s (slower rank), load average (1 min) after it",
            ", ".join(f"{w} {tps:.0f} (load {load:.1f})" for w, tps, load in loads),
            "in the order run")
    sec.figures["loads"] = loads
    sec.row("construction time, Trident / transformers",
            f"{fmt_s(tr['construction_s'])} / {fmt_s(hf['construction_s'])}",
            "model and deepspeed.initialize, slowest rank")
    sec.row("construction peak RSS, Trident / transformers",
            f"{tr['construction_peak_bytes'] / 2**20:.0f} / "
            f"{hf['construction_peak_bytes'] / 2**20:.0f} MiB", "largest rank")
    sec.goal("tokens/s against transformers + DeepSpeed", speed, f">= {SPEED_GOAL:g}",
             speed >= SPEED_GOAL, "same config, ranks, ZeRO stage, precision and batch")


if __name__ == "__main__":
    s = Section("models_hf", "Trident's trainer against transformers under DeepSpeed")
    run(s, "--quick" in sys.argv, compile="--compile" in sys.argv)
    print(json.dumps({"rows": s.rows, "goals": [g.__dict__ for g in s.goals]}, indent=2))
