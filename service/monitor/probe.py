"""A bandwidth probe's rows judged against a hardware profile.

Callers: the controller's per-attempt health (`service.monitor.attempt`) on a job's probe,
`service.monitor.calibration` on a `trident probe`, and `bench/bench_probe.py`. A row is one
`service.contract.reports.ProbeRowModel` dumped: dim, group, op, bytes, time_s, algbw, busbw.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from service.contract.hardware import HardwareProfile
from service.monitor.bandwidth import crosses_nodes, expected_busbw


def annotate_expected(rows: Sequence[Mapping[str, Any]], profile: HardwareProfile,
                      node_of_rank: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """Probe rows with `expected_busbw` and `ratio` (measured / expected) added."""
    out = []
    for row in rows:
        group = list(row["group"])
        exp = expected_busbw(row["op"], len(group), row["bytes"], profile,
                             cross_node=crosses_nodes(group, node_of_rank))
        out.append({**row, "expected_busbw": exp, "ratio": row["busbw"] / exp if exp else None})
    return out


JUDGED_OPS = ("all_reduce", "send_recv")
"""Ops judged against the profile by default. Profiles are calibrated on all-reduce busbw;
gloo's all-gather and reduce-scatter reach only about a quarter to a half of its all-reduce
busbw at 16-64 MiB on loopback (bench/bench_probe.py), so judging them by default would flag
every CPU group. Pass `ops=None` to judge every op (sensible on NCCL)."""


def flag_slow_groups(rows: Sequence[Mapping[str, Any]], profile: HardwareProfile,
                     threshold: float = 0.5,
                     node_of_rank: Mapping[int, str] | None = None,
                     ops: Sequence[str] | None = JUDGED_OPS) -> list[dict[str, Any]]:
    """Groups whose measured busbw is below `threshold` times the profile's expectation.

    Judged per (dim, group, op) at the largest probed size, where bandwidth rather than latency
    dominates; small sizes only report. Returns one warning dict per slow (group, op).
    """
    largest: dict[tuple[str, tuple[int, ...], str], Mapping[str, Any]] = {}
    for row in rows:
        if ops is not None and row["op"] not in ops:
            continue
        key = (row["dim"], tuple(row["group"]), row["op"])
        if key not in largest or row["bytes"] > largest[key]["bytes"]:
            largest[key] = row
    flags = []
    for (dim, group, op), row in sorted(largest.items()):
        cross = crosses_nodes(group, node_of_rank)
        exp = expected_busbw(op, len(group), row["bytes"], profile, cross_node=cross)
        if exp > 0 and row["busbw"] < threshold * exp:
            flags.append({
                "dim": dim, "group": list(group), "op": op, "bytes": row["bytes"],
                "busbw": row["busbw"], "expected_busbw": exp, "ratio": row["busbw"] / exp,
                "message": (f"{dim} group {list(group)} {op} at {row['bytes']} B: busbw "
                            f"{row['busbw'] / 1e9:.3g} GB/s < {threshold} x expected "
                            f"{exp / 1e9:.3g} GB/s ({'inter' if cross else 'intra'}-node, "
                            f"profile {profile.name})"),
            })
    return flags


def measured_link_bw(rows: Sequence[Mapping[str, Any]],
                     node_of_rank: Mapping[int, str]) -> dict[str, float | None]:
    """Link bandwidths a probe measured, for `trident probe` to calibrate a profile.

    Median over groups of the all-reduce busbw at each group's largest size, split into groups
    inside one node (`intra_node_bw`) and groups spanning nodes (`inter_node_bw`). `trident
    probe` lays ranks out as ParallelDims(tp=devices per node, dp=nodes), so its TP groups
    measure the node and its DP groups the network.
    """
    largest: dict[tuple[int, ...], Mapping[str, Any]] = {}
    for row in rows:
        key = tuple(row["group"])
        if row["op"] == "all_reduce" and (key not in largest
                                          or row["bytes"] > largest[key]["bytes"]):
            largest[key] = row
    intra = [r["busbw"] for g, r in largest.items() if not crosses_nodes(g, node_of_rank)]
    inter = [r["busbw"] for g, r in largest.items() if crosses_nodes(g, node_of_rank)]
    return {"intra_node_bw": statistics.median(intra) if intra else None,
            "inter_node_bw": statistics.median(inter) if inter else None}
