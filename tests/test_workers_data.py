"""The trainer on corpora (gloo, several processes): the same samples, losses and validation
losses under every layout (DP, pipeline, interleaved pipeline), and a resumed run reads exactly
the samples the uninterrupted run read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.contract.spec import JobSpec
from tests.corpora import write_corpus
from tests.workers_spawn import run_ranks

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


def spec(corpora: tuple[str, str], steps: int = STEPS, **parallel) -> JobSpec:
    return JobSpec(name="data", model={"preset": "gpt-tiny"}, parallel=parallel,
                   train={"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
                          "precision": "fp32"},
                   data={"kind": "tokens", "valid_fraction": 0.1, "eval_every": 2,
                         "eval_batches": 2,
                         "train": [{"path": corpora[0], "weight": 0.75},
                                   {"path": corpora[1], "weight": 0.25}]})


def by_step(rows: list[dict], rank: int = 0) -> list[dict]:
    return sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"])


@pytest.fixture(scope="module")
def reference(corpora: tuple[str, str]) -> list[dict]:
    return by_step(run_ranks(spec(corpora))[0])


@pytest.mark.slow
def test_the_reference_run_reads_its_order_and_evaluates(reference: list[dict]) -> None:
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    assert [r["first_sample"] for r in reference] == [0, 8, 16, 24]
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
