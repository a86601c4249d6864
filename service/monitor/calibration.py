"""`trident probe` results into a calibrated hardware profile.

The controller calls `calibrate` with every rank's `ClusterProbeReport`; the store keeps the
profile under the name of the profile it calibrates, and the planner prefers it to the
built-in one of that name for jobs on this cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from service.contract.hardware import HardwareProfile, get_profile
from service.contract.reports import ClusterProbeReport
from service.monitor.probe import annotate_expected, measured_link_bw
from service.planner.calibrate import profile_from_measurements


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
