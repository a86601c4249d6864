"""`trident probe` results into a calibrated hardware profile, and its calibration jobs into
the stack's measured constants.

The controller calls `calibrate` with every rank's `ClusterProbeReport`; the store keeps the
profile under the name of the profile it calibrates, and the planner prefers it to the
built-in one of that name for jobs on this cluster. `POST /calibrations` (`trident probe
--calibrate`, after the probe) calls `calibrate_stack` with the calibration jobs' ids: their
measured step times fit the stack's efficiency and overheads, stored with that profile.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from service.contract.hardware import HardwareProfile, get_profile
from service.contract.reports import ClusterProbeReport
from service.contract.states import JobState
from service.monitor.probe import annotate_expected, measured_link_bw
from service.planner import evaluate
from service.planner.calibrate import fit_stack, measured_step_s, profile_from_measurements
from service.store import CalibratedProfile, NotFound, Store
from service.store.metrics import MetricsIngest


def calibrate(request: dict[str, Any],
              reports: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(probe rows annotated with expectations, summary with the calibrated profile)."""
    parsed = [ClusterProbeReport.model_validate(r) for r in reports
              if r.get("kind") == "cluster_probe"]
    if not parsed:
        raise ValueError("no rank reported")
    base = get_profile(str(request.get("profile", "cpu")))
    node_of_rank = {p.rank: p.node_id for p in parsed}
    rows = [r.model_dump() for p in parsed for r in p.rows]
    flops = {kind: statistics.median(p.matmul_flops[kind] for p in parsed
                                     if kind in p.matmul_flops)
             for kind in {k for p in parsed for k in p.matmul_flops}}
    links = measured_link_bw(rows, node_of_rank) if rows else {}
    profile = calibrated_profile(base, flops=flops, intra_node_bw=links.get("intra_node_bw"),
                                 inter_node_bw=links.get("inter_node_bw"),
                                 probe_id=request.get("probe_id"))
    summary = {"profile": profile.to_json(), "matmul_flops": flops, "links": links,
               "ranks": len(parsed), "nodes": len(set(node_of_rank.values()))}
    return annotate_expected(rows, base, node_of_rank), summary


def calibrated_profile(base: HardwareProfile, *, flops: dict[str, float],
                       intra_node_bw: float | None, inter_node_bw: float | None,
                       probe_id: int | None = None) -> HardwareProfile:
    """`base` with the measured rates in place of the datasheet figures, under base's name
    (so that jobs planned for that profile on this cluster use it)."""
    at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    source = f"trident probe {probe_id} at {at}" if probe_id else f"trident probe at {at}"
    precision = "bf16" if "bf16" in flops else "fp32"
    profile = profile_from_measurements(
        base, matmul_flops=flops[precision], precision=precision,
        allreduce_busbw=intra_node_bw or inter_node_bw or base.intra_node_bw,
        inter_node_busbw=inter_node_bw, name=base.name, source=source)
    if precision == "bf16" and "fp32" in flops:
        profile = replace(profile, peak_flops_fp32=flops["fp32"] / base.gemm_eff_max)
    return profile


class CalibrationRefused(ValueError):
    """A calibration request the cluster cannot answer: `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def calibrate_stack(store: Store, *, profile: str, job_ids: Sequence[int],
                    at: str | None = None) -> CalibratedProfile:
    """Fit the stack constants to the calibration jobs `job_ids` (succeeded, on `profile`)
    and store them with the profile `trident probe` calibrated under that name; the stored
    profile. CalibrationRefused names the field of a request that cannot be answered."""
    probed = store.get_profile(name=profile)
    if probed is None:
        raise CalibrationRefused("profile", f"profile {profile!r} has not been probed on this"
                                 f" cluster; run `trident probe --profile {profile}` first")
    base = replace(probed.profile, calibration=None)
    samples = []
    for job_id in job_ids:
        try:
            job = store.get_job(job_id=job_id)
        except NotFound:
            raise CalibrationRefused("jobs", f"job {job_id} not found") from None
        if job.state != JobState.SUCCEEDED:
            raise CalibrationRefused("jobs", f"job {job_id} is {job.state.value}; a"
                                     " calibration job must have succeeded")
        if job.spec.target.gpu != profile or isinstance(job.spec.parallel, str):
            raise CalibrationRefused("jobs", f"job {job_id} ran on {job.spec.target.gpu!r}"
                                     f" with parallel {job.spec.parallel!r}; calibrating"
                                     f" {profile!r} needs its jobs with an explicit layout")
        times = [m.step_time_s for m in MetricsIngest(store).recent_metrics(job_id=job_id)]
        try:
            samples.append((replace(evaluate(job.spec, profile=base), job=job.name),
                            measured_step_s(times)))
        except ValueError as exc:
            raise CalibrationRefused("jobs", f"job {job_id}: {exc}") from None
    when = at or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        fitted = fit_stack(samples, jobs=job_ids, at=when)
    except ValueError as exc:
        raise CalibrationRefused("jobs", str(exc)) from None
    store.save_profile(name=profile, profile=fitted.to_json(), probe_id=probed.probe_id)
    saved = store.get_profile(name=profile)
    assert saved is not None
    return saved
