"""The layout-free form's conversion without ranks (`workers.checkpoint.layout_free`): DeepSpeed's
parameter names to canonical ones, a ZeRO-3 tag's partitions joined, and the tags it refuses
by name (as the export does, each in its own words). The losses across layouts are
tests/test_layout_free.py's (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from service.contract.spec import JobSpec, ModelSpec
from service.files.checkpoint_dirs import ExportRefused
from service.planner.shape import ModelShape
from tests.conftest import tiny_spec
from workers.checkpoint.hf_export import consolidate
from workers.checkpoint.layout_free import FULL, LayoutRefused, canonical, convert
from workers.checkpoint.rank_form import read_full
from workers.checkpoint.relayout import how
from workers.checkpoint.saving import LAYOUT, tag


def test_deepspeed_names_map_to_canonical_ones() -> None:
    assert canonical("layers.0.tok", 0, 1, 4) == "embed.tok"
    assert canonical("layers.2.q.weight", 0, 1, 4) == "layers.1.q.weight"
    assert canonical("layers.5.weight", 0, 1, 4) == "head.weight"
    assert canonical("3.up.bias", 1, 2, 4) == "layers.2.up.bias"  # a pipeline's flat index
    assert canonical("tied_modules.tok.tok", 0, 2, 4) == "embed.tok"
    assert canonical("tied_modules.tok.tok", 1, 2, 4) is None  # the head's copy
    assert canonical("tied_modules.tok.ln.weight", 1, 2, 4) == "head.ln.weight"


def _shape(layers: int) -> ModelShape:
    return ModelShape.from_spec(ModelSpec(layers=layers, hidden=32, heads=4, vocab=40,
                                          seq_len=8))


def _tag(folder: Path, step: int, **layout: int) -> Path:
    path = folder / tag(step)
    path.mkdir(parents=True)
    (path / LAYOUT).write_text(json.dumps(
        {"tp": 1, "pp": 1, "dp": 1, "zero": 1, "virtual_stages": 1} | layout))
    return path


def test_tags_the_form_cannot_carry_are_refused_by_name(tmp_path: Path) -> None:
    _tag(tmp_path, 4, pp=2, virtual_stages=2)
    with pytest.raises(LayoutRefused, match="interleaved stages"):
        convert(str(tmp_path), 4, _shape(4))
    assert not (tmp_path / f"step4{FULL}").exists()
    (tmp_path / "step8").mkdir()  # no layout recorded
    with pytest.raises(LayoutRefused, match="unknown"):
        convert(str(tmp_path), 8, _shape(4))


def test_the_export_and_the_conversion_refuse_the_same_tags_each_in_its_own_words(
        tmp_path: Path) -> None:
    """One check (`workers.checkpoint.tag_forms.flat_layout`), each caller's exception and
    reason."""
    _tag(tmp_path, 4, pp=2, virtual_stages=2)
    (tmp_path / "step8").mkdir()
    shape = ModelShape.from_spec(ModelSpec(layers=2, hidden=32, heads=4, vocab=40, seq_len=8))
    with pytest.raises(LayoutRefused, match="interleaved stages.*pipelining's, not converted"):
        convert(str(tmp_path), 4, _shape(2))
    with pytest.raises(ExportRefused, match="interleaved stages.*not exported yet"):
        consolidate(str(tmp_path), 4, shape)
    with pytest.raises(LayoutRefused, match="step8: no trident-layout.json.*unknown"):
        convert(str(tmp_path), 8, _shape(2))
    with pytest.raises(ExportRefused, match="step8: no trident-layout.json.*unknown"):
        consolidate(str(tmp_path), 8, shape)


def test_a_zero3_tag_is_joined_from_its_partitions_once(tmp_path: Path) -> None:
    """Two DP ranks; each parameter ceil(numel / 2) elements of each rank's flat group."""
    path = _tag(tmp_path, 4, dp=2, zero=3)
    shapes = {"layers.0.pos": torch.Size([3]), "layers.1.ln1.weight": torch.Size([2, 2])}
    full = {k: torch.arange(s.numel(), dtype=torch.float32).view(s) + 10 * i
            for i, (k, s) in enumerate(shapes.items())}
    for d in range(2):
        parts = []
        for t in full.values():
            flat = torch.cat([t.reshape(-1), torch.zeros(1)])  # padded to an even length
            per = -(-t.numel() // 2)
            parts.append(flat[d * per:(d + 1) * per])
        flat = torch.cat(parts)
        torch.save({"optimizer_state_dict": {
            "fp32_flat_groups": [flat],
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(4.0),
                                                   "exp_avg": flat * 2,
                                                   "exp_avg_sq": flat * 3}}}}},
                   path / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")
        torch.save({"param_shapes": [shapes], "step": 4, "data_position": 4, "rng": None},
                   path / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt")
    out, took, size = convert(str(tmp_path), 4, _shape(4))
    got = dict(read_full(out, "exp_avg"))
    assert set(got) == {"embed.pos", "layers.0.ln1.weight"}
    assert torch.equal(got["embed.pos"], full["layers.0.pos"] * 2)
    assert torch.equal(dict(read_full(out, "fp32"))["layers.0.ln1.weight"],
                       full["layers.1.ln1.weight"])
    # Each DP rank's file became one part of the form: its runs, with their offsets.
    assert sorted(p.name for p in Path(out).glob("part-*")) == [
        "part-m00-d00.json", "part-m00-d00.safetensors", "part-m00-d01.json",
        "part-m00-d01.safetensors"]
    assert size > 0 and took >= 0
    assert convert(str(tmp_path), 4, _shape(4))[1] == 0.0  # cached


def test_a_tag_written_before_the_fused_projections_loads_through_the_form(
        tmp_path: Path) -> None:
    """Its layout file has no `projections` record: under its own layout too it goes through
    the layout-free form, which names q, k, v, gate and up apart as it does; with
    interleaved stages, whose files the form does not read, it is refused saying why."""
    _tag(tmp_path, 4)
    _tag(tmp_path, 8, pp=2, virtual_stages=2)
    same = JobSpec.model_validate(tiny_spec(parallel={"dp": 1, "zero": 1}))
    assert how(str(tmp_path), 4, same) == "layout-free"
    (tmp_path / "step4" / LAYOUT).write_text(json.dumps(
        {"tp": 1, "pp": 1, "dp": 1, "zero": 1, "virtual_stages": 1, "projections": "fused"}))
    assert how(str(tmp_path), 4, same) == "as-is"
    interleaved = JobSpec.model_validate(tiny_spec(parallel={"pp": 2, "dp": 1, "zero": 0,
                                                             "virtual_stages": 2}))
    with pytest.raises(LayoutRefused, match="before q, k, v and gate, up were fused"):
        how(str(tmp_path), 8, interleaved)


def test_a_form_of_before_reads_as_the_per_rank_form_does(tmp_path: Path) -> None:
    """A folder converted before the ranks wrote their parts (one file per kind, whole
    tensors, by rank 0) is read as it is: the same slices as the per-rank form's."""
    from safetensors.torch import save_file

    from workers.checkpoint.rank_form import FormSource

    test_a_zero3_tag_is_joined_from_its_partitions_once(tmp_path)
    new = tmp_path / f"step4{FULL}"
    old = tmp_path / "old"
    old.mkdir()
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        save_file(dict(read_full(str(new), kind)), str(old / f"{kind}.safetensors"))
    a, b = FormSource(str(new)), FormSource(str(old))
    assert not a.old and b.old
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        assert a.kind_names(kind) == sorted(b.kind_names(kind))
        for name in a.kind_names(kind):
            x, y = a.kind(kind)(name), b.kind(kind)(name)
            assert x.shape == y.shape
            index = tuple(slice(1, n) for n in x.shape)
            assert torch.equal(x[index], y[index]), (kind, name)
    assert a.kind("fp32")("head.weight") is None and b.kind("fp32")("head.weight") is None
