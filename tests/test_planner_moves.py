"""What a change of layout costs in the what-if (`service.planner.relayout`,
`trident plan --compare`): the tag's bytes, the path it loads by, and the seconds of the save,
the conversion and the resume from the measured rates."""

from __future__ import annotations

import pytest

from cli.whatif import Move, move_text
from service.contract.spec import ModelSpec, ParallelSpec
from service.planner import relayout
from service.planner.relayout import move_cost, path, tag_bytes
from service.planner.shape import ModelShape

SHAPE = ModelShape.from_spec(ModelSpec.model_validate({"preset": "gpt3-350m", "seq_len": 64}))


def layout(**kw: int) -> ParallelSpec:
    return ParallelSpec.model_validate(kw)


def test_a_tag_holds_the_optimizer_and_the_weights_in_their_precision() -> None:
    n = SHAPE.total_params
    assert 350e6 < n < 360e6
    assert tag_bytes(SHAPE, "fp32", layout(dp=2, zero=1)) == 16 * n
    assert tag_bytes(SHAPE, "bf16", layout(dp=2, zero=2)) == 14 * n
    assert tag_bytes(SHAPE, "bf16", layout(dp=2, zero=3)) == 12 * n  # fp32 partitions only
    assert tag_bytes(SHAPE, "fp32", layout(dp=2, zero=0)) == 12 * n  # the weights are the master


def test_the_path_follows_the_resume_rule() -> None:
    z1 = layout(dp=2, zero=1)
    assert path(z1, layout(dp=2, zero=1)) == "as-is"
    assert path(layout(dp=2), layout(dp=1)) == "as-is"  # ZeRO 0: every file holds everything
    assert path(z1, layout(dp=1, zero=2)) == "universal"
    assert path(z1, layout(dp=2, zero=3)) == "layout-free"
    assert path(layout(tp=2, zero=1), z1) == "layout-free"
    assert path(z1, layout(pp=2, zero=1)) == "layout-free"


def test_a_move_costs_its_save_conversion_and_resume_at_the_measured_rates() -> None:
    old, new = layout(dp=2, zero=1), layout(dp=2, zero=3)
    cost = move_cost(SHAPE, "fp32", old, new)
    b = 16 * SHAPE.total_params
    assert cost.path == "layout-free" and cost.tag_bytes == b
    assert cost.save_s == pytest.approx(b / 2 / relayout.SAVE_BYTES_PER_S)
    assert cost.convert_s == pytest.approx(b / 2 / relayout.CONVERT_BYTES_PER_S)  # per rank
    assert cost.resume_s == pytest.approx(b / 2 / relayout.LOAD_BYTES_PER_S)
    assert cost.total_s == pytest.approx(cost.save_s + cost.convert_s + cost.resume_s)
    assert "bench/checkpoint_scale.py" in cost.source
    # The same layout on other ranks converts nothing; a wider new layout loads faster.
    same = move_cost(SHAPE, "fp32", layout(dp=2), layout(dp=4))
    assert same.convert_s == 0.0 and same.resume_s < cost.resume_s


def test_the_what_if_names_the_moves_parts() -> None:
    cost = move_cost(SHAPE, "fp32", layout(tp=2, zero=1), layout(dp=2, zero=1))
    text = move_text(Move(path=cost.path, tag_bytes=cost.tag_bytes, save_s=cost.save_s,
                          convert_s=cost.convert_s, resume_s=cost.resume_s,
                          total_s=cost.total_s, source=cost.source))
    assert text.startswith(f"moving there costs about {cost.total_s:,.1f} s: save")
    assert "(layout-free)" in text and f"a {cost.tag_bytes / 1e9:,.2f} GB tag" in text
