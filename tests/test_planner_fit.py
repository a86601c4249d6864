"""The planner against published runs it was not tuned on (service/planner/data).

Recomputes the leave-one-source-out errors from the data file and holds them under the
figures documented in docs/planner.md, so that a change that makes the planner worse on runs
it never saw fails here. Pure Python, about a second.
"""

from __future__ import annotations

import json

import pytest

from service.contract.hardware import get_profile
from service.planner.fit import (
    GOALS,
    fit_gemm_curve,
    leave_one_source_out,
    means,
    oom_agreement,
    uncertainty,
)
from service.planner.published import is_tuning, load_data
from service.planner.software_stacks import FITTED_PATH

# docs/planner.md, "Published runs": mean over held-out sources of each source's mean
# absolute error. Lower them when the model improves; never raise them to make this pass.
DOCUMENTED = {"time_error": 0.073, "memory_error": 0.072}


@pytest.fixture(scope="module")
def loso():
    return leave_one_source_out()


def test_every_run_cites_a_source_with_a_citation_and_a_year():
    sources, runs = load_data()
    assert len(runs) >= 40 and len(sources) >= 6
    for key, src in sources.items():
        assert src["citation"] and 2019 <= src["year"] <= 2025, key
    for run in runs:
        assert run.step_s or run.memory_bytes or run.oom, run.id


def test_leave_one_source_out_errors_stay_under_the_documented_figures(loso):
    table, _ = loso
    got = means(table)
    for what, limit in DOCUMENTED.items():
        assert got[what] <= limit + 5e-4, (what, got[what], limit)
    held_out = [s for s in table if not s.tuning]
    assert len({s.source for s in held_out if s.mean("time_error") is not None}) >= 5
    assert any(s.mean("memory_error") is not None for s in held_out)


def test_the_tuning_source_is_never_fitted_and_table5_stays_within_10_percent(loso):
    table, _ = loso
    korth = next(s for s in table if s.source == "korthikanti2022")
    assert korth.tuning and is_tuning("korthikanti2022")
    assert all(abs(r.time_error) < 0.10 for r in korth.runs), [
        (r.run.id, r.time_error) for r in korth.runs]


def test_published_out_of_memory_runs_are_predicted_not_to_fit(loso):
    table, _ = loso
    ooms = [r for s in table for r in s.runs if r.run.oom]
    assert len(ooms) >= 2
    assert not any(r.fits for r in ooms), [r.run.id for r in ooms if r.fits]


def test_the_shipped_constants_are_the_fit_of_the_data_file(loso):
    """fitted.json is what `python -m service.planner.fit --write` writes, not hand-edited."""
    table, full = loso
    shipped = json.loads(FITTED_PATH.read_text())
    fresh = full.to_json()
    assert shipped["stacks"] == fresh["stacks"]
    assert shipped["profiles"] == fresh["profiles"]
    assert shipped["uncertainty"] == uncertainty(table)
    assert shipped["leave_one_source_out"] == {k: round(v, 4) for k, v in means(table).items()}


def test_held_out_memory_meets_the_goal_on_every_source(loso):
    """Issue 46: held-out memory within 10 % (mean absolute error), and no source with memory
    rows above it either."""
    table, _ = loso
    assert means(table)["memory_error"] <= GOALS["memory_error"]
    for s in table:
        m = s.mean("memory_error")
        assert m is None or m <= GOALS["memory_error"], (s.source, m)


def test_out_of_memory_agreement_both_ways(loso):
    """Published out-of-memory runs predicted not to fit, every run that trained predicted
    to fit, each with the constants that held its source out."""
    table, _ = loso
    oom_ok, oom_n, fit_ok, fit_n = oom_agreement(table)
    assert oom_n >= 2 and oom_ok == oom_n
    assert fit_n >= 50 and fit_ok == fit_n


def test_no_constant_is_fitted_to_a_single_source(loso):
    """The allocator slack is one constant for every stack, fitted on every source with memory
    rows (a slack per stack was Megatron-DeepSpeed's fitted on BLOOM alone)."""
    _, full = loso
    slacks = {v["allocator_slack"] for v in full.to_json()["stacks"].values()}
    assert len(slacks) == 1
    memory_sources = {r.source for r in load_data()[1] if r.memory_bytes is not None}
    assert len(memory_sources) >= 2


def test_the_gemm_curve_is_the_least_squares_fit_of_the_tuning_source():
    """The profiles' gemm_eff_max and gemm_half_width are `python -m service.planner.fit
    --curve` rounded: fitted on every Table 5 row with the time model as it is, not carried
    over from a model with other terms."""
    emax, half = fit_gemm_curve()
    prof = get_profile("a100-80gb")
    assert prof.gemm_eff_max == pytest.approx(emax, abs=6e-4)
    assert prof.gemm_half_width == pytest.approx(half, abs=0.6)


def test_held_out_step_time_meets_the_goal(loso):
    """Issue 46: held-out step time within 8 % (mean over held-out sources)."""
    table, _ = loso
    assert means(table)["time_error"] <= GOALS["time_error"]
