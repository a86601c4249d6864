"""Layout-free resume: a tag written under one layout resumes under another through
DeepSpeed's universal form (per parameter: fp32 weights, both Adam moments, step), converted
once by rank 0 and kept beside the tag; the losses go on as if the layout had not changed."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from service.contract.spec import JobSpec, ModelSpec
from service.planner.shape import ModelShape
from tests import unfused
from tests.conftest import tiny_spec
from tests.workers_spawn import each_step, losses, run_ranks
from workers.checkpoint.hf_export import consolidate
from workers.checkpoint.rank_form import read_full
from workers.checkpoint.saving import FULL, LAYOUT, UNIVERSAL

pytestmark = pytest.mark.slow

RESUMED = {"fp32": 1e-5, "bf16": 5e-4}
"""Absolute difference of a resumed run's 4 losses (about 5.4) from the uninterrupted run's.
bf16: measured at most 1.4e-4 (ZeRO-3 dp2 -> tp2 1.4e-4, dp2 -> dp1 ZeRO-1 through the universal
form 6.9e-5, tp2 -> pp2 5.8e-5, pp2 -> interleaved 0.0: the interleaved engine in bf16 computes
as DeepSpeed's pipeline does) by this module's bf16 tests with max |a - b| printed; 3.6x
margin. The new layout rounds its bf16 sums at other points than the old one (2.5e-5 relative,
inside the spread of bf16 layouts in tests/test_workers_layouts.py), while the weights it starts
from are the tag's bit for bit."""


def spec(steps: int, precision: str = "fp32", **parallel: Any) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(
        parallel=parallel, train={"steps": steps, "global_batch": 8, "micro_batch": 2,
                                  "lr": 1e-3, "precision": precision,
                                  # the schedule of the whole run in both halves of it
                                  "decay_steps": 8},
        checkpoint={"every_steps": 4}))


def assert_goes_on(got: list[float], want: list[float], precision: str,
                   *said: object) -> None:
    """The resumed run's 4 losses: the uninterrupted run's, within RESUMED[precision]."""
    assert len(got) == 4 and all(abs(a - b) <= RESUMED[precision]
                                 for a, b in zip(got, want, strict=True)), (got, want, *said)


@pytest.mark.parametrize(("before", "after", "precision"), [
    ({"dp": 2, "zero": 1}, {"dp": 1, "zero": 1}, "fp32"),
    ({"dp": 2, "zero": 2}, {"dp": 1, "zero": 1}, "fp32"),
    ({"dp": 2, "zero": 0}, {"dp": 1, "zero": 0}, "fp32"),
    ({"dp": 2, "zero": 1}, {"dp": 1, "zero": 1}, "bf16"),
], ids=["dp2-to-dp1", "zero2-dp2-to-zero1-dp1", "zero0-dp2-to-dp1", "dp2-to-dp1-bf16"])
def test_a_tag_resumes_under_another_layout_with_the_same_losses(
        tmp_path: Path, before: dict[str, Any], after: dict[str, Any], precision: str) -> None:
    (first,) = run_ranks(spec(4, precision, **before), checkpoint_dir=str(tmp_path))
    assert (tmp_path / "step4" / LAYOUT).exists()
    started = time.monotonic()
    (second,) = run_ranks(spec(8, precision, **after), checkpoint_dir=str(tmp_path))
    took = time.monotonic() - started
    (whole,) = run_ranks(spec(8, precision, **before))
    assert {r["resumed_from"] for r in second} == {4}
    if before["zero"]:
        assert (tmp_path / f"step4{UNIVERSAL}" / "zero").is_dir()  # converted once, kept
    else:  # ZeRO 0 (fp32): the whole optimizer is in the model states file, read as it is
        assert not (tmp_path / f"step4{UNIVERSAL}").exists()
    assert losses(first) == losses(whole)[:4]
    assert_goes_on(losses(second), losses(whole)[4:], precision, took)


@pytest.mark.parametrize(("before", "after"), [
    ({"dp": 2, "zero": 3}, {"tp": 2, "dp": 1, "zero": 1}),
    ({"pp": 2, "dp": 1, "zero": 1}, {"dp": 2, "zero": 1}),
    ({"tp": 2, "dp": 1, "zero": 1}, {"pp": 2, "dp": 1, "zero": 1}),
    ({"tp": 2, "dp": 1, "zero": 0}, {"dp": 2, "zero": 0}),
    ({"pp": 2, "dp": 1, "zero": 1}, {"dp": 2, "zero": 3}),
    ({"tp": 2, "dp": 1, "zero": 1}, {"pp": 2, "dp": 1, "zero": 0, "virtual_stages": 2}),
    ({"pp": 2, "dp": 1, "zero": 0}, {"tp": 2, "dp": 1, "zero": 1}),
    # optimizer offload on either side (CPU ranks: torch's AdamW on the host-side partitions)
    ({"dp": 2, "zero": 2, "offload": "optimizer"}, {"tp": 2, "dp": 1, "zero": 1}),
    ({"tp": 2, "dp": 1, "zero": 1}, {"dp": 2, "zero": 3, "offload": "optimizer+params"}),
], ids=["zero3-dp2-to-tp2", "pp2-to-dp2", "tp2-to-pp2", "tp2-zero0-to-dp2", "pp2-to-zero3-dp2",
        "tp2-to-interleaved", "pp2-zero0-to-tp2", "zero2-offload-to-tp2",
        "tp2-to-zero3-offload"])
def test_a_tag_resumes_under_another_model_split_through_the_layout_free_form(
        tmp_path: Path, before: dict[str, Any], after: dict[str, Any]) -> None:
    """TP, PP and ZeRO-3 changes: the tag's fp32 weights, both Adam moments and Adam's step,
    joined into full tensors once (`step4.full`), sliced for the new layout's ranks."""
    resumes_through_the_full_form(tmp_path, before, after, "fp32")


@pytest.mark.parametrize(("before", "after"), [
    ({"dp": 2, "zero": 3}, {"tp": 2, "dp": 1, "zero": 1}),
    ({"tp": 2, "dp": 1, "zero": 1}, {"pp": 2, "dp": 1, "zero": 1}),
    ({"pp": 2, "dp": 1, "zero": 1}, {"pp": 2, "dp": 1, "zero": 1, "virtual_stages": 2}),
], ids=["zero3-dp2-to-tp2", "tp2-to-pp2", "pp2-to-interleaved"])
def test_a_bf16_tag_resumes_under_another_model_split_with_its_weights_bit_for_bit(
        tmp_path: Path, before: dict[str, Any], after: dict[str, Any]) -> None:
    """A bf16 tag carries its fp32 masters (ZeRO's fp32 partitions): the full form holds them
    whole, and rounded to bf16 they are the tag's own bf16 weights bit for bit (ZeRO-3's
    weights in the tag are the fp32 partitions themselves); a ZeRO-3, TP and PP change each
    (into the interleaved engine's masters too), the losses going on within RESUMED."""
    resumes_through_the_full_form(tmp_path, before, after, "bf16")
    full = dict(read_full(str(tmp_path / f"step4{FULL}"), "fp32"))
    tagged = consolidate(str(tmp_path), 4, ModelShape.from_spec(spec(4).model))
    assert sorted(full) == sorted(tagged)
    assert {t.dtype for t in tagged.values()} == {
        torch.float32 if before["zero"] == 3 else torch.bfloat16}
    for name, weights in tagged.items():
        assert torch.equal(full[name].to(weights.dtype), weights), name


def written_by_every_rank(folder: Path) -> None:
    """The form's parts, one per file of the tag, converted by both ranks of the resume."""
    meta = json.loads((folder / "meta.json").read_text())
    assert [r["rank"] for r in meta["ranks"]] == [0, 1], meta
    assert all(r["units"] and r["bytes"] > 0 for r in meta["ranks"]), meta
    parts = sorted(p.name for p in folder.glob("part-*.safetensors"))
    assert sorted(f"part-{u}.safetensors" for r in meta["ranks"] for u in r["units"]) == parts
    assert not (folder / "fp32.safetensors").exists()


def resumes_through_the_full_form(tmp_path: Path, before: dict[str, Any],
                                  after: dict[str, Any], precision: str) -> None:
    (first,) = run_ranks(spec(4, precision, **before), checkpoint_dir=str(tmp_path))
    (second,) = run_ranks(spec(8, precision, **after), checkpoint_dir=str(tmp_path))
    (whole,) = run_ranks(spec(8, precision, **before))
    assert {r["resumed_from"] for r in second} == {4}
    written_by_every_rank(tmp_path / f"step4{FULL}")  # converted, kept
    assert [r["first_sample"] for r in each_step(second)] == [  # the same samples
        r["first_sample"] for r in each_step(whole)][4:]
    assert losses(first) == losses(whole)[:4]
    assert_goes_on(losses(second), losses(whole)[4:], precision)


def test_a_tag_written_before_the_fused_projections_resumes_with_the_same_losses(
        tmp_path: Path) -> None:
    """A tag whose blocks held q, k, v, gate and up apart (`tests.unfused`: the trainer before
    the fusion, GQA and SwiGLU at tp 2 under ZeRO-1) resumes under the same layout through
    the layout-free form, which names the projections apart as such tags do; the fused
    model's losses go on as the unfused model's would have."""
    def llama(steps: int) -> JobSpec:
        return spec(steps, tp=2, dp=1, zero=1).model_copy(update={"model": ModelSpec(
            layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32,
            activation="swiglu")})

    (first,) = run_ranks(llama(4), checkpoint_dir=str(tmp_path), target=unfused.rank_main)
    assert "projections" not in json.loads((tmp_path / "step4" / LAYOUT).read_text())
    (second,) = run_ranks(llama(8), checkpoint_dir=str(tmp_path))
    (whole,) = run_ranks(llama(8))
    assert {r["resumed_from"] for r in second} == {4}
    written_by_every_rank(tmp_path / f"step4{FULL}")
    # One matmul or three: the same products, summed alike on this CPU.
    assert all(abs(a - b) <= 1e-6 for a, b in zip(losses(first), losses(whole)[:4],
                                                  strict=True)), (losses(first), losses(whole))
    got, want = losses(second), losses(whole)[4:]
    assert len(got) == 4 and all(abs(a - b) <= 1e-5 for a, b in zip(got, want, strict=True)), (
        got, want)


@pytest.mark.parametrize(("before", "after"), [
    ({"dp": 2, "zero": 3}, {"tp": 2, "dp": 1, "zero": 1}),
    ({"tp": 2, "dp": 1, "zero": 1}, {"pp": 2, "dp": 1, "zero": 1}),
    ({"pp": 2, "dp": 1, "zero": 1}, {"dp": 2, "zero": 3}),
], ids=["zero3-dp2-to-tp2", "tp2-to-pp2", "pp2-to-zero3-dp2"])
def test_the_per_rank_form_resumes_as_the_form_of_before(
        tmp_path: Path, before: dict[str, Any], after: dict[str, Any]) -> None:
    """A TP, a PP and a ZeRO-3 change: resumed from the form the ranks wrote, then again from
    the same tensors in the form of before (one whole file per kind, as rank 0 wrote it),
    the losses are the same bit for bit."""
    from safetensors.torch import save_file

    run_ranks(spec(4, **before), checkpoint_dir=str(tmp_path))
    (second,) = run_ranks(spec(8, **after), checkpoint_dir=str(tmp_path))
    folder = tmp_path / f"step4{FULL}"
    written_by_every_rank(folder)
    whole = {kind: dict(read_full(str(folder), kind)) for kind in ("fp32", "exp_avg",
                                                                   "exp_avg_sq")}
    for kind, tensors in whole.items():
        save_file(tensors, str(folder / f"{kind}.safetensors"))
    for part in folder.glob("part-*"):
        part.unlink()
    for later in tmp_path.glob("step8*"):  # the second run's own tag
        shutil.rmtree(later)
    (third,) = run_ranks(spec(8, **after), checkpoint_dir=str(tmp_path))
    assert {r["resumed_from"] for r in third} == {4}
    assert losses(third) == losses(second)
