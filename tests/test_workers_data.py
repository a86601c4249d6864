"""The trainer on corpora (gloo, several processes): the same samples, losses and validation
losses under every layout (DP, pipeline, interleaved pipeline), a resumed run reads exactly
the samples the uninterrupted run read, and a run resumed with another global batch reads on
from the next unread sample. The sample numbers compared are those the loaders returned
(`StepReport.first_sample` and `batch`, `workers.trainer.data.DataSource.read`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.contract.spec import JobSpec
from tests.corpora import write_corpus
from tests.workers_spawn import each_step, run_ranks

STEPS = 4


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two corpora of gpt-tiny's vocabulary (256): a learnable one (repeating phrases), and
    random tokens."""
    root = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 256, 12).tolist() for _ in range(6)]
    docs = [[t for _ in range(int(rng.integers(2, 8))) for t in phrases[int(rng.integers(6))]]
            + [255] for _ in range(120)]
    write_corpus(root / "phrases", docs)
    write_corpus(root / "noise", [rng.integers(0, 256, 70).tolist() for _ in range(40)])
    return str(root / "phrases"), str(root / "noise")


def spec(corpora: tuple[str, str], steps: int = STEPS, global_batch: int = 8,
         ramp: dict | None = None, every: int = 0, **parallel) -> JobSpec:
    return JobSpec(name="data", model={"preset": "gpt-tiny"}, parallel=parallel,
                   train={"steps": steps, "global_batch": global_batch, "micro_batch": 2,
                          "lr": 1e-3, "precision": "fp32", "batch_ramp": ramp},
                   checkpoint={"every_steps": every},
                   data={"kind": "tokens", "valid_fraction": 0.1, "eval_every": 2,
                         "eval_batches": 2,
                         "train": [{"path": corpora[0], "weight": 0.75},
                                   {"path": corpora[1], "weight": 0.25}]})


def by_step(rows: list[dict], rank: int = 0) -> list[dict]:
    return each_step(rows, rank)


@pytest.fixture(scope="module")
def reference(corpora: tuple[str, str]) -> list[dict]:
    return by_step(run_ranks(spec(corpora))[0])


@pytest.mark.slow
def test_the_reference_run_reads_its_order_and_evaluates(reference: list[dict]) -> None:
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    assert [r["first_sample"] for r in reference] == [0, 8, 16, 24]
    assert [r["batch"] for r in reference] == [8, 8, 8, 8]
    assert [r["tokens"] for r in reference] == [8 * 32 * s for s in (1, 2, 3, 4)]
    assert [r.get("eval_loss") is not None for r in reference] == [False, True, False, True]
    drawn = reference[-1]["drawn"]
    assert sum(drawn.values()) == 32 and list(drawn.values()) == [24, 8]
    assert 0 < reference[-1]["epoch"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"dp": 2, "zero": 1}, {"pp": 2},
                                      {"pp": 2, "virtual_stages": 2}])
def test_every_layout_reads_the_same_samples(corpora: tuple[str, str], reference: list[dict],
                                             parallel: dict) -> None:
    rows = run_ranks(spec(corpora, **parallel))[0]
    world = 2
    for rank in range(world):
        got = by_step(rows, rank)
        assert [r["first_sample"] for r in got] == [r["first_sample"] for r in reference]
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference],
                                                         rel=1e-4)
        evals = [r.get("eval_loss") for r in reference]
        assert [r.get("eval_loss") is None for r in got] == [e is None for e in evals]
        assert [r["eval_loss"] for r in got if r["eval_loss"] is not None] == pytest.approx(
            [e for e in evals if e is not None], rel=1e-4), (rank, parallel)


@pytest.mark.slow
def test_a_resumed_run_reads_what_the_straight_run_read(corpora: tuple[str, str],
                                                        tmp_path: Path) -> None:
    s = spec(corpora, steps=2 * STEPS, dp=2)
    s = s.model_copy(update={"checkpoint": s.checkpoint.model_copy(
        update={"every_steps": STEPS})})
    straight = by_step(run_ranks(s)[0])
    first, second = run_ranks(s, checkpoint_dir=str(tmp_path / "ck"), attempts=[STEPS, None])
    resumed = by_step(first)[:STEPS] + by_step(second)
    assert by_step(second)[0]["resumed_from"] == STEPS
    assert [r["step"] for r in resumed] == list(range(1, 2 * STEPS + 1))
    assert [r["first_sample"] for r in resumed] == [r["first_sample"] for r in straight]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # fp32: identical
    assert [r.get("eval_loss") for r in resumed] == [r.get("eval_loss") for r in straight]
    assert resumed[-1]["drawn"] == straight[-1]["drawn"]


def spans(rows: list[dict]) -> list[int]:
    """The global sample numbers the steps of `rows` read, step after step."""
    return [j for r in rows for j in range(r["first_sample"], r["first_sample"] + r["batch"])]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(8, 16), (16, 8)], ids=["8-to-16", "16-to-8"])
def test_a_run_resumed_with_another_global_batch_reads_the_samples_that_follow(
        corpora: tuple[str, str], tmp_path: Path, before: int, after: int) -> None:
    """32 samples at one global batch, saved; resumed at another: every DP rank of both runs
    read exactly the order's first samples, each once, in order (16 to 8 takes the order
    past the `steps * global_batch` samples the resumed spec alone would build)."""
    done = 32 // before
    first_spec = spec(corpora, steps=done, global_batch=before, dp=2)
    first_spec = first_spec.model_copy(update={"checkpoint": first_spec.checkpoint.model_copy(
        update={"every_steps": done})})
    steps = done + 48 // after
    (first,) = run_ranks(first_spec, checkpoint_dir=str(tmp_path / "ck"))
    (second,) = run_ranks(spec(corpora, steps=steps, global_batch=after, dp=2),
                          checkpoint_dir=str(tmp_path / "ck"))
    for rank in (0, 1):
        a, b = by_step(first, rank), by_step(second, rank)
        assert {r["resumed_from"] for r in b} == {done}
        assert [r["batch"] for r in a + b] == [before] * done + [after] * (steps - done)
        assert spans(a) + spans(b) == list(range(80))  # the union, in order, once each
        assert b[-1]["tokens"] == 80 * 32
    # The same samples as a straight run of the same numbers: drawn from the same corpora.
    straight = by_step(run_ranks(spec(corpora, steps=10, global_batch=8, dp=2))[0])
    assert by_step(second)[-1]["drawn"] == straight[-1]["drawn"]


RAMP = {"start": 8, "increment": 4, "samples": 32}
"""8, 8, 12, 12, then 16 (Megatron's ramp: an increment every 16 samples, 32 samples)."""


@pytest.mark.slow
def test_a_batch_ramp_is_read_from_the_loaders_and_honoured_across_a_resume(
        corpora: tuple[str, str], tmp_path: Path) -> None:
    ramped = spec(corpora, steps=6, global_batch=16, ramp=RAMP, every=3, dp=2, zero=1)
    straight = by_step(run_ranks(ramped)[0])
    first, second = run_ranks(ramped, checkpoint_dir=str(tmp_path / "ck"), attempts=[3, None])
    resumed = by_step(first)[:3] + by_step(second)
    assert by_step(second)[0]["resumed_from"] == 3
    assert [r["batch"] for r in straight] == [8, 8, 12, 12, 16, 16]
    assert spans(straight) == list(range(72))
    assert [r["batch"] for r in resumed] == [8, 8, 12, 12, 16, 16]
    assert spans(resumed) == list(range(72))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # fp32: identical
    # The first two steps train on a global batch of 8 as a job of 8 does: the same samples
    # and the same update (DeepSpeed accumulates 2 micro-batches a replica, not 4), at the
    # same rates (the schedule is a function of the step and `steps`).
    eight = by_step(run_ranks(spec(corpora, steps=6, global_batch=8, dp=2, zero=1))[0])[:2]
    assert [r["loss"] for r in straight[:2]] == [r["loss"] for r in eight]
    assert straight[-1]["tokens"] == 72 * 32
