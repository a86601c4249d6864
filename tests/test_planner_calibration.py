"""The `trident` stack's constants fitted to calibration jobs (`fit_stack`), and the plan JSON
saying which of its constants are measured and which assumed (`constants`).

The step times fitted here are the planner's own predictions under other constants (a
"true" efficiency and overheads unlike the profile's), so the fit must move every constant to
recover them; the calibration on real runs is tests/test_calibration_ray.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.contract.hardware import HardwareProfile, get_profile
from service.contract.spec import JobSpec
from service.planner import evaluate, plan_command
from service.planner.calibrate import calibration_specs, fit_stack, profile_from_measurements
from service.planner.plan import assess, scenario_for
from service.planner.software_stacks import get_stack

TRUE_EFFICIENCY, TRUE_LAYER_S, TRUE_STEP_S = 0.42, 3.7e-3, 6.0e-3


def _true_step_s(spec: JobSpec, profile: HardwareProfile) -> float:
    """The step time of `spec` under constants unlike the profile's and the stack's."""
    truth = replace(profile, layer_overhead_s=TRUE_LAYER_S, step_overhead_s=TRUE_STEP_S)
    sc = scenario_for(spec, spec.layout, profile=truth)
    sc = replace(sc, gpu_efficiency=1.0,
                 constants=replace(get_stack(sc.stack), efficiency=TRUE_EFFICIENCY))
    return assess(sc).time.step_s


@pytest.mark.parametrize("profile_name", ["cpu", "h100-80gb"])
def test_fit_recovers_the_constants_of_other_step_times(profile_name: str) -> None:
    base = get_profile(profile_name)
    specs = [JobSpec.model_validate(s) for s in calibration_specs(base)]
    samples = [(evaluate(s, profile=base), _true_step_s(s, base)) for s in specs]
    assert max(abs(p.time.step_s / m - 1) for p, m in samples) > 0.2  # the prior is off
    fitted = fit_stack(samples, jobs=[7, 8, 9, 10], at="2026-12-07T12:00:00Z")
    cal = fitted.calibration
    assert cal is not None and cal.stack == "trident" and cal.jobs == (7, 8, 9, 10)
    assert cal.efficiency == pytest.approx(TRUE_EFFICIENCY, rel=1e-6)
    assert fitted.layer_overhead_s == pytest.approx(TRUE_LAYER_S, rel=1e-6)
    assert fitted.step_overhead_s == pytest.approx(TRUE_STEP_S, rel=1e-6)
    assert cal.error < 1e-9 and cal.precision == ("fp32" if profile_name == "cpu" else "bf16")
    for spec, (_, measured) in zip(specs, samples, strict=True):
        assert evaluate(spec, profile=fitted).time.step_s == pytest.approx(measured, rel=1e-6)


def test_fit_refuses_shapes_that_do_not_separate_the_constants() -> None:
    base = get_profile("cpu")
    spec = JobSpec.model_validate(calibration_specs(base)[0])
    same = [(evaluate(spec, profile=base), _true_step_s(spec, base))] * 3
    with pytest.raises(ValueError, match="do not separate"):
        fit_stack(same, jobs=[1, 2, 3], at="now")
    with pytest.raises(ValueError, match="needs 3"):
        fit_stack(same[:2], jobs=[1, 2], at="now")


def test_a_negative_overhead_is_held_at_zero() -> None:
    base = get_profile("cpu")
    specs = [JobSpec.model_validate(s) for s in calibration_specs(base)]
    # No per-step overhead at all, and a little noise that would push it below zero.
    truth = replace(base, step_overhead_s=0.0, layer_overhead_s=TRUE_LAYER_S)
    samples = [(evaluate(s, profile=base), evaluate(s, profile=truth).time.step_s * f)
               for s, f in zip(specs, (0.97, 1.0, 1.0, 1.0), strict=True)]
    fitted = fit_stack(samples, jobs=[1, 2, 3], at="now")
    assert fitted.step_overhead_s == 0.0 and fitted.layer_overhead_s > 0
    assert fitted.calibration is not None and fitted.calibration.efficiency > 0


def test_plan_json_marks_each_constant_measured_or_assumed() -> None:
    base = get_profile("cpu")
    spec = JobSpec.model_validate(calibration_specs(base)[2])
    assumed = plan_command(spec, as_json=True)
    assert isinstance(assumed, dict)
    consts = assumed["constants"]
    assert set(consts) >= {"efficiency", "layer_overhead_s", "step_overhead_s", "peak_flops",
                           "intra_node_bw"}
    assert {c["status"] for c in consts.values()} == {"assumed"}
    assert "no published runs of its own" in consts["efficiency"]["source"]

    probed = profile_from_measurements(base, matmul_flops=70e9, allreduce_busbw=2e9,
                                       name="cpu", source="trident probe 4 at 2026-12-07")
    samples = [(evaluate(s, profile=probed), _true_step_s(s, probed))
               for s in map(JobSpec.model_validate, calibration_specs(probed))]
    fitted = fit_stack(samples, jobs=[11, 12, 13, 14], at="2026-12-07T12:30:00Z")
    measured = plan_command(spec, as_json=True, profile=fitted)
    assert isinstance(measured, dict)
    consts = measured["constants"]
    for name in ("efficiency", "layer_overhead_s", "step_overhead_s"):
        assert consts[name]["status"] == "measured", name
        assert consts[name]["source"] == ("trident probe --calibrate: trident jobs"
                                          " 11, 12, 13, 14 at 2026-12-07T12:30:00Z")
    assert consts["efficiency"]["value"] == pytest.approx(TRUE_EFFICIENCY)
    for name in ("peak_flops", "intra_node_bw"):
        assert consts[name] == {**consts[name], "status": "measured",
                                "source": "trident probe 4 at 2026-12-07"}
    assert consts["gemm_curve"] == {**consts["gemm_curve"], "status": "assumed",
                                    "source": base.source}  # the built-in figure's, not the probe's
    # Another stack, or the other peak, on the calibrated cluster: the efficiency is still the
    # published fit (the overheads, the profile's, are measured for every plan).
    for change in ({"stack": "megatron-lm"}, {"precision": "bf16"}):
        other = plan_command(spec.model_copy(update={"train": spec.train.model_copy(
            update=change)}), as_json=True, profile=fitted)
        assert isinstance(other, dict)
        consts = other["constants"]
        assert consts["efficiency"]["status"] == "assumed", change
        assert consts["efficiency"]["value"] != pytest.approx(TRUE_EFFICIENCY)
        assert consts["layer_overhead_s"]["status"] == "measured"
    assert consts["efficiency"]["source"].startswith("calibrated in fp32 only (trident probe")


def test_a_calibrated_profile_round_trips_through_json() -> None:
    base = get_profile("cpu")
    samples = [(evaluate(s, profile=base), _true_step_s(s, base))
               for s in map(JobSpec.model_validate, calibration_specs(base))]
    fitted = fit_stack(samples, jobs=[1, 2, 3], at="now")
    assert HardwareProfile.from_json(fitted.to_json()) == fitted
