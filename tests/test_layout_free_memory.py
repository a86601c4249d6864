"""The layout-free form's cost in memory per process (`workers.checkpoint.rank_form`): a tag
written by 4 ranks (TP 2 x DP 2, ZeRO-1) resumed by 2 ranks under ZeRO-3 DP 2; each rank
converts its files one at a time and loads only its slices, its peak resident growth (the
kernel's high-water mark, reset before, `workers.checkpoint.rss_peak`) at most twice its
shard plus the largest tensor. The form of before had rank 0 join the whole model: more than
that bound, which this model is large enough to tell apart (the losses across layouts are
tests/test_layout_free.py's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.contract.spec import JobSpec
from tests import rss_ranks
from tests.conftest import tiny_spec
from tests.workers_spawn import run_ranks
from workers.checkpoint.tag_forms import FULL

pytestmark = pytest.mark.slow

MODEL = {"layers": 4, "hidden": 384, "heads": 6, "vocab": 2048, "seq_len": 32}
"""About 8M parameters: 95 MB of fp32 weights and two moments, the files of the tag's 4
optimizer shards 24 MB each, well above what a process's resident memory moves by itself."""


def spec(steps: int, **parallel: Any) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(
        model=MODEL, parallel=parallel,
        train={"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
               "precision": "fp32", "decay_steps": 4},
        checkpoint={"every_steps": 2}))


def test_no_process_holds_more_than_twice_its_shard_and_a_tensor(tmp_path: Path) -> None:
    run_ranks(spec(2, tp=2, dp=2, zero=1), checkpoint_dir=str(tmp_path),
              target=rss_ranks.rank_main)
    (second,) = run_ranks(spec(3, dp=2, zero=3), checkpoint_dir=str(tmp_path),
                          target=rss_ranks.rank_main)
    assert {r["resumed_from"] for r in second} == {2}
    folder = tmp_path / f"step2{FULL}"
    meta = json.loads((folder / "meta.json").read_text())
    parts = {p.stem: p.stat().st_size for p in folder.glob("part-*.safetensors")}
    assert sorted(parts) == ["part-m00-d00", "part-m00-d01", "part-m01-d00", "part-m01-d01"]
    shard, whole = max(parts.values()), sum(parts.values())  # one tag shard's 12 B/parameter
    loads = [json.loads((folder / f"load-rank{r}.json").read_text()) for r in (0, 1)]
    tensor = loads[0]["tensor_bytes"]  # the largest full tensor of one kind (the embedding)
    bound = 2 * shard + tensor
    said = (meta["ranks"], loads, parts)
    # What the form of before held on rank 0 (every full tensor of the three kinds at once)
    # cannot pass the bound.
    assert whole > 1.5 * bound, said
    for r in meta["ranks"]:  # each rank converted two of the tag's files, one at a time
        assert len(r["units"]) == 2 and r["peak_growth"] is not None, said
        assert r["peak_growth"] <= bound, said
        assert r["peak_growth"] >= shard / 2, said  # the measure sees the file it read
    for load in loads:  # each rank read its slices only
        assert load["peak_growth"] is not None, said
        assert load["peak_growth"] <= 2 * load["shard_bytes"] + tensor, said
    print("conversion", [(r["rank"], r["peak_growth"]) for r in meta["ranks"]],
          "loads", [(x["peak_growth"], x["shard_bytes"]) for x in loads],
          "shard", shard, "tensor", tensor, "whole", whole)
