"""The optimisation recipe (`workers.trainer.recipe`, `TrainSpec.lr_at`): the schedule's rate is the
formula at chosen steps, weight decay skips norms, biases and embeddings, clipping bounds the
gradient the optimizer applies by the global norm, and a resumed run continues the schedule."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from pydantic import ValidationError
from torch.optim.optimizer import register_optimizer_step_post_hook

from service.contract.spec import JobSpec, ModelSpec, TrainSpec
from service.planner.shape import ModelShape
from tests.servers import free_port
from tests.workers_spawn import run_ranks
from workers.modeling.model import GPT
from workers.trainer import recipe


def test_warmup_then_cosine_to_min_lr_over_the_rest_of_the_run():
    t = TrainSpec(steps=110, lr=1e-3, min_lr=1e-4, warmup_steps=10, decay="cosine")
    assert t.lr_at(1) == pytest.approx(1e-3 * 1 / 10)
    assert t.lr_at(5) == pytest.approx(1e-3 * 5 / 10)
    assert t.lr_at(10) == pytest.approx(1e-3)  # the peak ends the warmup
    # decay_steps defaults to the rest of the run: 100 steps after the warmup
    for step in (11, 35, 60, 85, 110):
        progress = (step - 10) / 100
        expected = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))
        assert t.lr_at(step) == pytest.approx(expected, rel=1e-12), step
    assert t.lr_at(60) == pytest.approx((1e-3 + 1e-4) / 2)  # halfway: the mean
    assert t.lr_at(110) == pytest.approx(1e-4)


def test_linear_decay_over_decay_steps_then_min_lr_is_kept():
    t = TrainSpec(steps=100, lr=2e-3, min_lr=2e-4, warmup_steps=4, decay="linear",
                  decay_steps=20)
    assert t.lr_at(2) == pytest.approx(1e-3)
    for step in (5, 9, 14, 24):
        assert t.lr_at(step) == pytest.approx(2e-3 - 1.8e-3 * (step - 4) / 20), step
    assert t.lr_at(24) == pytest.approx(2e-4)
    assert t.lr_at(25) == t.lr_at(100) == pytest.approx(2e-4)


def test_constant_keeps_the_peak_after_the_warmup_and_without_warmup_the_decay_starts():
    t = TrainSpec(steps=50, lr=5e-4, warmup_steps=3, decay="constant", min_lr=1e-5)
    assert [t.lr_at(s) for s in (1, 2, 3, 4, 50)] == pytest.approx(
        [5e-4 / 3, 1e-3 / 3, 5e-4, 5e-4, 5e-4])
    # without warmup the decay starts at once: step n runs at progress n / decay_steps
    assert TrainSpec(steps=10, lr=1e-3).lr_at(1) == pytest.approx(
        1e-3 * 0.5 * (1 + math.cos(math.pi / 10)))


@pytest.mark.parametrize("train, field", [
    ({"lr": 1e-4, "min_lr": 1e-3}, "min_lr"),
    ({"betas": [0.9, 1.0]}, "betas"),
    ({"eps": 0}, "eps"),
    ({"grad_clip": -1}, "grad_clip"),
    ({"weight_decay": 11}, "weight_decay"),
    ({"decay": "exponential"}, "decay"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"decay_steps": 0}, "decay_steps"),
])
def test_the_recipe_fields_are_bounded_and_a_refusal_names_the_field(train, field):
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"name": "r", "model": {"preset": "gpt-tiny"}, "train": train})
    assert err.value.errors()[0]["loc"][:2] == ("train", field)


def test_weight_decay_skips_norms_biases_and_embeddings_unless_asked():
    model = GPT(ModelShape.from_spec(ModelSpec(preset="gpt-tiny")), seed=0)
    groups = recipe.param_groups(model, TrainSpec(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in groups[0]["params"])
    plain = sorted(names[id(p)] for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert "layers.0.tok" in plain and "layers.0.pos" in plain
    assert all(".ln" in n or n in ("layers.0.tok", "layers.0.pos") for n in plain), plain
    assert "layers.5.weight" in decayed  # the LM head is a weight matrix
    assert all(n.endswith("weight") and ".ln" not in n for n in decayed), decayed
    assert len(decayed) + len(plain) == len(names)
    (everything,) = recipe.param_groups(model, TrainSpec(weight_decay=0.1,
                                                         weight_decay_all=True))
    assert len(everything["params"]) == len(names) and everything["weight_decay"] == 0.1


def _applied_norms(spec: JobSpec) -> tuple[list[float], list]:
    """Run `spec` on one rank in this process; the norm of the gradient each optimizer step
    applied (read after the step, in torch's global post-step hook: ZeRO steps its inner
    optimizer once per parameter group, so the squares add up until the step's report) and
    the reports."""
    from workers.trainer.train import RankContext, planned_row, train_rank

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    applied: list[float] = []
    pending = [0.0]

    def after_step(opt: torch.optim.Optimizer, *_) -> None:
        pending[0] += sum(float(p.grad.float().pow(2).sum()) for g in opt.param_groups
                          for p in g["params"] if p.grad is not None)

    rows: list = []

    def report(row) -> None:
        rows.append(row)
        applied.append(math.sqrt(pending[0]))
        pending[0] = 0.0

    handle = register_optimizer_step_post_hook(after_step)
    try:
        ctx = RankContext(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                          master_port=free_port(), checkpoint_dir=None,
                          plan=planned_row(spec, 0))
        train_rank(spec, ctx, report, threading.Event())
    finally:
        handle.remove()
    return applied, rows


@pytest.mark.slow
@pytest.mark.parametrize("precision, zero", [("fp32", 0), ("bf16", 0), ("fp32", 1),
                                             ("fp32", 3)])
def test_with_clipping_on_the_applied_gradient_has_at_most_the_clip_norm(precision, zero):
    clip = 0.05
    spec = JobSpec(name="clip", model={"preset": "gpt-tiny"}, parallel={"zero": zero},
                   train={"steps": 3, "global_batch": 4, "micro_batch": 2, "lr": 1e-3,
                          "precision": precision, "grad_clip": clip})
    applied, rows = _applied_norms(spec)
    assert len(applied) == len(rows) == 3
    for norm, row in zip(applied, rows, strict=True):
        assert row.grad_norm > 10 * clip, "the norm before clipping is reported"
        assert norm <= clip * (1 + 1e-3), (norm, row.grad_norm)
        assert norm >= clip * 0.99, "clipped to the clip, not below it"
        assert row.lr == pytest.approx(spec.train.lr_at(row.step))


def spec2(steps: int = 6, **train) -> JobSpec:
    return JobSpec(name="recipe", model={"preset": "gpt-tiny"},
                   parallel={"tp": 2, "zero": 1},
                   train={"steps": steps, "global_batch": 4, "micro_batch": 2, "lr": 2e-3,
                          "precision": "fp32", "warmup_steps": 2, "min_lr": 2e-4,
                          "grad_clip": 0.5, **train},
                   checkpoint={"every_steps": 2})


@pytest.mark.slow
def test_a_resumed_run_continues_the_schedule_and_the_clipped_losses(tmp_path):
    spec = spec2()
    (straight,) = run_ranks(spec)
    first, second = run_ranks(spec, checkpoint_dir=str(tmp_path), attempts=[3, None])
    assert {r["resumed_from"] for r in second} == {2}

    def by_step(rows: list[dict]) -> dict[int, dict]:
        return {r["step"]: r for r in rows if r["rank"] == 0}

    want, got = by_step(straight), by_step(second)
    assert sorted(got) == [3, 4, 5, 6]
    for step, row in got.items():
        assert row["lr"] == pytest.approx(spec.train.lr_at(step)), step
        assert row["lr"] == pytest.approx(want[step]["lr"])
        assert row["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        assert row["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4), step
    assert all(r["grad_norm"] > 0.5 for r in straight), "clipping was on in every step"
    # both TP ranks report the same global norm
    assert {round(r["grad_norm"], 9) for r in straight if r["step"] == 1} == {
        round(want[1]["grad_norm"], 9)}
