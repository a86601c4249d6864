"""Saves in the background (`checkpoint.async`, `workers.checkpoint.background`) on real
DeepSpeed ranks (2 CPU ranks, gloo): a run saved asynchronously resumes with the losses of one
saved synchronously (fp32 ZeRO-2, bf16 ZeRO-3, fp32 PP 2), the tag reported with the step at
which it was complete, and the host copy the planner counts for it is the size of the files the
rank writes; a rank killed while its thread writes a tag leaves it without its marker, and the
job resumes from the tag before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.contract.spec import JobSpec
from service.planner import evaluate
from tests.conftest import tiny_spec
from tests.workers_spawn import run_ranks
from workers.checkpoint.background import DIE_WRITING
from workers.checkpoint.saving import MARKER


def spec(precision: str, background: bool,
         parallel: dict[str, int] | None = None) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(
        train={"steps": 5, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
               "precision": precision},
        parallel=parallel or {"dp": 2, "zero": 2},
        checkpoint={"every_steps": 2, "async": background}))


def test_the_spec_names_it_async_and_it_is_on_by_default() -> None:
    assert JobSpec.model_validate(tiny_spec()).checkpoint.background is True
    off = spec("fp32", False)
    assert off.checkpoint.background is False
    assert off.model_dump(mode="json")["checkpoint"]["async"] is False
    assert JobSpec.model_validate_json(off.model_dump_json()).checkpoint.background is False


def test_the_host_copy_keeps_the_types_a_synchronous_save_writes() -> None:
    """ZeRO-3's `param_shapes` are `torch.Size`s: DeepSpeed's `zero_to_fp32` calls their
    `numel`, so the copy queued for the writer keeps them (and any tuple's subclass) as
    they are; the tensors are copies."""
    from collections import OrderedDict

    import torch

    from workers.checkpoint.background import _to_host

    t = torch.ones(3)
    state = {"param_shapes": [OrderedDict([("w", torch.Size([2, 3]))])], "pair": (t, 1)}
    copied = _to_host(state)
    assert type(copied["param_shapes"][0]["w"]) is torch.Size
    assert copied["param_shapes"][0]["w"].numel() == 6
    assert type(copied["pair"]) is tuple and copied["pair"][0] is not t
    assert torch.equal(copied["pair"][0], t)


def per_step(rows: list[dict]) -> dict[int, float]:
    """Rank 0's loss of each step: a step whose save was waited for after it (a stop, the
    end of training) is reported again, with its tag."""
    return {r["step"]: r["loss"] for r in rows if r["rank"] == 0}


def first_ranks_files(tag: Path) -> int:
    """Bytes of the files rank 0 (DP rank 0, no pipeline) wrote into `tag`: its optimizer
    partition's and its model states (ZeRO-3's own, or the module's weights below it)."""
    return sum(f.stat().st_size for f in tag.glob("*.pt")
               if "pp_rank_0_" in f.name or f.name == "mp_rank_00_model_states.pt")


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "parallel"), [
    ("fp32", {"dp": 2, "zero": 2}), ("bf16", {"dp": 2, "zero": 3}),
    ("fp32", {"pp": 2, "zero": 1})], ids=["fp32-zero2", "bf16-zero3", "fp32-pp2"])
def test_an_async_save_resumes_with_the_losses_of_a_synchronous_one(
        precision: str, parallel: dict[str, int], tmp_path: Path) -> None:
    runs = {}
    for background in (False, True):
        folder = tmp_path / ("async" if background else "sync")
        runs[background] = run_ranks(spec(precision, background, parallel),
                                     checkpoint_dir=str(folder), attempts=[3, None])
        assert (folder / "step2" / MARKER).exists() and (folder / "step4" / MARKER).exists()
    (sync_first, sync_second), (async_first, async_second) = runs[False], runs[True]
    assert {r["resumed_from"] for r in async_second} == {2}
    assert per_step(async_first) == per_step(sync_first)
    assert per_step(async_second) == per_step(sync_second), \
        f"{precision}: the same losses on resume"
    # Synchronous: the tag goes with its own step. Async: with the step it was complete at
    # (a later one, or step 2 again when the stop after step 3 waited for it), named.
    [tagged] = [r for r in sync_first if r["rank"] == 0 and r["checkpoint"]]
    assert tagged["step"] == 2 and tagged.get("checkpoint_step") is None
    marked = [r for r in async_first if r["rank"] == 0 and r["checkpoint"]]
    assert [r["checkpoint_step"] for r in marked] == [2] and marked[0]["step"] >= 2
    assert marked[0]["checkpoint"].endswith("step2") and marked[0]["checkpoint_bytes"] > 0
    blocked = [r["save_s"] for r in async_first if r["rank"] == 0 and r["step"] == 2]
    assert blocked and all(b is not None for b in blocked)
    if "pp" not in parallel:
        # What the rank held in host memory is what it wrote: the plan's copy against its files.
        planned = evaluate(spec(precision, True, parallel)).memory.checkpoint_copy
        written = first_ranks_files(tmp_path / "async" / "step2")
        assert planned == pytest.approx(written, rel=0.05), (planned, written)


@pytest.mark.slow
def test_a_rank_killed_writing_in_the_background_leaves_no_complete_tag(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ck"
    monkeypatch.setenv(DIE_WRITING, "1:4")
    # Rank 1 gone, rank 0 fails in its next collective (or is found with its peer dead).
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died|rank 0 failed"):
        run_ranks(spec("fp32", True), checkpoint_dir=str(folder))
    monkeypatch.delenv(DIE_WRITING)
    assert (folder / "step2" / MARKER).exists()
    assert (folder / "step4").is_dir() and not (folder / "step4" / MARKER).exists()
    assert os.listdir(folder / "step4"), "the killed rank's thread had begun writing"
    (reports,) = run_ranks(spec("fp32", True), checkpoint_dir=str(folder))
    assert {r["resumed_from"] for r in reports} == {2}
    assert (folder / "step4" / MARKER).exists(), "saved anew, and marked this time"
