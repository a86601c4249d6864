"""Health-monitor judgements: bandwidth arithmetic, slow groups, stragglers, hangs, comm summaries.

Pure Python (no torch, ray or workers): the workers measure, this module decides. Callers:
- the probe step (`workers.comm_probe` rows) and `trident probe`: `annotate_expected`,
  `flag_slow_groups`;
- the controller's poll loop: `diagnose_hang` on the ranks' heartbeats, `find_stragglers` on
  their per-step compute times;
- the placement step: `tp_placement_warnings` on the node inventory;
- `GET /api/v1/jobs/{id}/comm`: `summarize_comm` over the stored per-rank step reports.

Byte counts follow nccl-tests: the size S of an all-gather is the gathered (output) tensor, of
a reduce-scatter the full input tensor, of an all-reduce / broadcast / send / recv the tensor.
algbw = S / time; busbw = algbw * factor(op, n) (see reference/planner-model.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from service.hardware import HardwareProfile
from service.parallel import Dim, ParallelDims

P2P_OPS = frozenset({"send", "recv", "send_recv"})
"""Point-to-point operations: a pair of ranks, busbw = algbw."""


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of `op` over `n` ranks."""
    if n < 1:
        raise ValueError(f"group size {n} must be positive")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce") or op in P2P_OPS:
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def algbw(nbytes: float, time_s: float) -> float:
    """Algorithm bandwidth in bytes/s (nccl-tests: size / time)."""
    if time_s <= 0:
        raise ValueError(f"time {time_s} s must be positive")
    return nbytes / time_s


def busbw(op: str, n: int, nbytes: float, time_s: float) -> float:
    """Bus bandwidth in bytes/s, comparable across ops and group sizes."""
    return algbw(nbytes, time_s) * busbw_factor(op, n)


def _latency_steps(op: str, n: int) -> int:
    """Sequential latency terms of the ring algorithm (alpha count of the alpha-beta model)."""
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in P2P_OPS:
        return 1
    return n - 1


def expected_busbw(op: str, n: int, nbytes: float, profile: HardwareProfile, *,
                   cross_node: bool) -> float:
    """busbw the ring alpha-beta model predicts for `op` of `nbytes` over `n` ranks.

    time = steps * alpha + factor * S / BW, so busbw = factor * S / time: latency-bound at small
    sizes, tending to the link bandwidth BW at large ones.
    """
    bw = profile.inter_node_bw if cross_node else profile.intra_node_bw
    alpha = profile.inter_node_latency_s if cross_node else profile.intra_node_latency_s
    factor = busbw_factor(op, n)
    if factor == 0:  # a group of one moves nothing
        return 0.0
    time_s = _latency_steps(op, n) * alpha + factor * nbytes / bw
    return factor * nbytes / time_s


def _cross_node(group: Sequence[int], node_of_rank: Mapping[int, str] | None) -> bool:
    if node_of_rank is None:
        return False
    return len({node_of_rank[r] for r in group}) > 1


def annotate_expected(rows: Sequence[Mapping[str, Any]], profile: HardwareProfile,
                      node_of_rank: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """Probe rows with `expected_busbw` and `ratio` (measured / expected) added."""
    out = []
    for row in rows:
        group = list(row["group"])
        exp = expected_busbw(row["op"], len(group), row["bytes"], profile,
                             cross_node=_cross_node(group, node_of_rank))
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
        cross = _cross_node(group, node_of_rank)
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
    intra = [r["busbw"] for g, r in largest.items() if not _cross_node(g, node_of_rank)]
    inter = [r["busbw"] for g, r in largest.items() if _cross_node(g, node_of_rank)]
    return {"intra_node_bw": statistics.median(intra) if intra else None,
            "inter_node_bw": statistics.median(inter) if inter else None}


# ---------------------------------------------------------------- stragglers


def compute_s(step_report: Mapping[str, Any]) -> float | None:
    """Compute time of one step report: step time less the time in collectives (None when
    the step's collectives were not timed). Feeds `find_stragglers`."""
    if not step_report.get("timed", True):
        return None
    comm = sum(o["time_s"] for ops in step_report["comm"].values() for o in ops.values())
    return max(0.0, step_report["step_s"] - comm)


@dataclass(frozen=True)
class Straggler:
    """A rank whose compute time per step stayed beyond its pipeline-stage peers'."""

    rank: int
    node: str | None
    stage: int
    rank_s: float
    """Median compute time per step of this rank over the window."""
    peers_s: float
    """Median compute time per step of its peers (same stage) over the window."""
    ratio: float
    steps: int

    def to_event(self) -> dict[str, Any]:
        d = asdict(self)
        d["message"] = (f"rank {self.rank} (node {self.node}, stage {self.stage}) computes "
                        f"{self.rank_s:.4g} s/step, {self.ratio:.2f}x its stage peers' "
                        f"{self.peers_s:.4g} s over the last {self.steps} steps")
        return d


def find_stragglers(per_rank_compute_times: Mapping[int, Sequence[float]],
                    stage_of_rank: Mapping[int, int], threshold: float = 1.25,
                    min_steps: int = 5,
                    node_of_rank: Mapping[int, str] | None = None) -> list[Straggler]:
    """Ranks slower than `threshold` x the median of their stage peers in each of the last
    `min_steps` steps.

    Pipeline stages own different layers (and the first / last the embedding / head), so a
    rank is compared only with ranks of its own stage; a stage of one rank has no peers and
    is not judged. Time lists are per step, aligned at their ends (latest step last); build
    them with `compute_s` over timed step reports (skip its None).
    """
    if threshold <= 1:
        raise ValueError(f"threshold {threshold} must be above 1")
    stages: dict[int, list[int]] = {}
    for rank in per_rank_compute_times:
        stages.setdefault(stage_of_rank[rank], []).append(rank)
    out = []
    for stage, ranks in sorted(stages.items()):
        if len(ranks) < 2:
            continue
        window = min(len(per_rank_compute_times[r]) for r in ranks)
        if window < min_steps:
            continue
        recent = {r: list(per_rank_compute_times[r])[-min_steps:] for r in ranks}
        for rank in sorted(ranks):
            peers = [p for p in ranks if p != rank]
            peer_med = [statistics.median(recent[p][i] for p in peers) for i in range(min_steps)]
            if all(recent[rank][i] > threshold * peer_med[i] for i in range(min_steps)):
                mine, theirs = statistics.median(recent[rank]), statistics.median(peer_med)
                out.append(Straggler(
                    rank=rank, node=node_of_rank.get(rank) if node_of_rank else None,
                    stage=stage, rank_s=mine, peers_s=theirs,
                    ratio=mine / theirs if theirs > 0 else float("inf"), steps=min_steps))
    return out


# ---------------------------------------------------------------- hangs


@dataclass
class WaitingGroup:
    """Ranks blocked in one collective of one group, and the members that never joined."""

    dim: str | None
    group: list[int]
    collective: str
    step: int
    waiting: list[int]
    missing: list[int]
    """Group members not in this collective at this step (what each is doing: `Diagnosis.ranks`)."""


@dataclass
class Diagnosis:
    """Why a job stopped making progress."""

    stalled_s: float
    """Seconds since the last heartbeat change of any rank."""
    never_arrived: list[int]
    """Root-cause ranks: absent from a collective others wait in, and not blocked themselves
    in another collective (or silent: no heartbeat at all)."""
    waiting: list[WaitingGroup] = field(default_factory=list)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Last heartbeat of every rank (step, phase, collective, dim, group)."""
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _wait_key(hb: Mapping[str, Any]) -> tuple[int, str, tuple[int, ...]]:
    coll = "p2p" if hb["collective"] in P2P_OPS else hb["collective"]
    return (hb["step"], coll, tuple(sorted(hb["group"] or ())))


def diagnose_hang(heartbeats: Mapping[int, Mapping[str, Any]], now: float, timeout: float,
                  dims: ParallelDims | None = None) -> Diagnosis | None:
    """A diagnosis when no rank made progress within `timeout` seconds, else None.

    `heartbeats[rank]` is `workers.heartbeat.Heartbeat.read()`: step, phase, collective (None
    outside collectives), dim, group (rank list), time (wall clock of the last change). Ranks
    of `dims` without any heartbeat count as never arrived. Across nodes with unsynchronised
    clocks the controller may set `time = its own receive time - age_s` before calling.
    """
    expected = range(dims.world_size) if dims else sorted(heartbeats)
    silent = [r for r in expected if r not in heartbeats]
    if not heartbeats:
        return None
    last = max(hb["time"] for hb in heartbeats.values())
    stalled = now - last
    if stalled < timeout:
        return None

    # Ranks in a collective, grouped by (step, collective, group): each such set waits for the
    # group members that are not in it.
    sets: dict[tuple[int, str, tuple[int, ...]], list[int]] = {}
    for rank, hb in sorted(heartbeats.items()):
        if hb.get("collective") and hb.get("group"):
            sets.setdefault(_wait_key(hb), []).append(rank)
    waiting: list[WaitingGroup] = []
    missing_all: set[int] = set()
    for (step, _, group), ranks in sorted(sets.items()):
        missing = [r for r in group if r not in ranks]
        if not missing:
            continue  # everyone arrived: stuck inside the transport, not waiting on a peer
        dim = heartbeats[ranks[0]].get("dim")
        name = heartbeats[ranks[0]]["collective"]
        waiting.append(WaitingGroup(dim=dim, group=list(group), collective=name, step=step,
                                    waiting=ranks, missing=missing))
        missing_all.update(missing)
    in_collective = {r for r, hb in heartbeats.items() if hb.get("collective")}
    culprits = sorted((missing_all - in_collective) | set(silent))
    if not culprits and not in_collective:
        # Nobody is in a collective: the stall is in compute; the ranks furthest behind are it.
        low = min(hb["step"] for hb in heartbeats.values())
        culprits = sorted(r for r, hb in heartbeats.items() if hb["step"] == low)
    state = {r: {k: hb.get(k) for k in ("step", "phase", "collective", "dim", "group")}
             for r, hb in sorted(heartbeats.items())}
    lines = [f"no progress for {stalled:.1f} s (timeout {timeout:g} s)"]
    if not culprits:
        lines.append("every rank arrived in its collective: stuck inside the transport")
    for w in waiting:
        lines.append(f"ranks {w.waiting} wait in {w.collective} of {w.dim} group {w.group} "
                     f"(step {w.step}); missing {w.missing}")
    for r in culprits:
        if r in heartbeats:
            hb = heartbeats[r]
            where = (f"in {hb['collective']}" if hb.get("collective")
                     else f"in {hb['phase']} (not in a collective)")
            lines.append(f"rank {r} never arrived: at step {hb['step']} {where}")
        else:
            lines.append(f"rank {r} never arrived: no heartbeat")
    return Diagnosis(stalled_s=stalled, never_arrived=culprits, waiting=waiting, ranks=state,
                     summary="; ".join(lines))


# ---------------------------------------------------------------- TP placement


FAST_LINK_PREFIXES = ("NV", "X")
"""`nvidia-smi topo -m` link kinds counted as fast: NVLink (NV#) and self (X)."""


def tp_placement_warnings(tp_groups: Sequence[Sequence[int]], node_of_rank: Mapping[int, str],
                          gpu_of_rank: Mapping[int, int] | None = None,
                          inventory: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Warnings for TP groups placed across a slow link.

    A TP group spanning nodes always warns (TP collectives sit on the critical path). Inside a
    GPU node whose inventory carries a topology matrix (`workers.inventory`), a pair of the
    group's GPUs joined by PCIe or the inter-socket bus (PIX, PXB, PHB, NODE, SYS) warns.
    """
    out = []
    for group in tp_groups:
        nodes = sorted({node_of_rank[r] for r in group})
        if len(nodes) > 1:
            out.append(f"TP group {list(group)} spans nodes {nodes}: TP traffic crosses the "
                       f"inter-node network")
            continue
        if gpu_of_rank is None or inventory is None:
            continue
        matrix = (inventory.get(nodes[0], {}).get("topology") or {})
        slow = []
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                ga, gb = f"GPU{gpu_of_rank[a]}", f"GPU{gpu_of_rank[b]}"
                link = matrix.get(ga, {}).get(gb)
                if link and not link.startswith(FAST_LINK_PREFIXES):
                    slow.append(f"{ga}-{gb} {link}")
        if slow:
            out.append(f"TP group {list(group)} on node {nodes[0]} crosses slow links: "
                       + ", ".join(slow))
    return out


# ---------------------------------------------------------------- /comm summary


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize_comm(rank_reports: Mapping[int, Sequence[Mapping[str, Any]]],
                   group_size: Mapping[str, int] | ParallelDims,
                   plan: Mapping[str, Any] | None = None,
                   probe: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The `/comm` view: per dimension time per step, fraction of step, bytes, achieved busbw
    and the plan's predicted share, plus the per-rank breakdown and the probe rows.

    `rank_reports[rank]` is a list of step reports `{"step", "step_s", "comm"}` where `comm` is
    `workers.comm_timer.CommTimer.step_summary()`: `{dim: {op: {"time_s", "bytes", "calls"}}}`.
    Steps whose comm was not timed (GPU steps between CUDA-event samples) carry
    `"timed": False` and count toward bytes but not toward time.
    """
    sizes = ({d.value: getattr(group_size, d.value) for d in Dim}
             if isinstance(group_size, ParallelDims) else dict(group_size))
    plan_time = (plan or {}).get("time", {})
    per_rank = []
    dim_acc: dict[str, dict[str, list[float]]] = {}
    step_times = []
    for rank, reports in sorted(rank_reports.items()):
        if not reports:
            continue
        timed = [r for r in reports if r.get("timed", True)]
        rank_step_s = _mean([r["step_s"] for r in reports])
        step_times.append(rank_step_s)
        row: dict[str, Any] = {"rank": rank, "step_s": rank_step_s, "steps": len(reports),
                               "dims": {}}
        for dim in sorted({d for r in reports for d in r["comm"]}):
            ops: dict[str, dict[str, float]] = {}
            for r in reports:
                for op, s in r["comm"].get(dim, {}).items():
                    o = ops.setdefault(op, {"time_s": 0.0, "bytes": 0.0, "calls": 0.0})
                    o["bytes"] += s["bytes"]
                    o["calls"] += s["calls"]
                    if r.get("timed", True):
                        o["time_s"] += s["time_s"]
            n = sizes.get(dim, 2)
            t_step = sum(o["time_s"] for o in ops.values()) / max(len(timed), 1)
            b_step = sum(o["bytes"] for o in ops.values()) / len(reports)
            t_total = sum(o["time_s"] for o in ops.values())
            bus_bytes = sum(_bus_bytes(op, n, o, len(timed), len(reports)) for op, o in ops.items())
            row["dims"][dim] = {
                "time_s": t_step, "fraction": t_step / rank_step_s if rank_step_s else 0.0,
                "bytes": b_step, "busbw": bus_bytes / t_total if t_total else None,
                "ops": {op: {"time_s": o["time_s"] / max(len(timed), 1),
                             "bytes": o["bytes"] / len(reports),
                             "calls": o["calls"] / len(reports)} for op, o in ops.items()},
            }
            into = dim_acc.setdefault(dim, {"time_s": [], "bytes": [], "bus": [], "t": []})
            into["time_s"].append(t_step)
            into["bytes"].append(b_step)
            into["bus"].append(bus_bytes)
            into["t"].append(t_total)
        per_rank.append(row)
    step_s = _mean(step_times)
    pred_step = plan_time.get("step_s")
    dims_out = {}
    for dim in [d.value for d in Dim] + sorted(set(dim_acc) - {d.value for d in Dim}):
        acc = dim_acc.get(dim)
        pred = plan_time.get(f"{dim}_comm_s")
        if acc is None and pred is None:
            continue
        t = _mean(acc["time_s"]) if acc else 0.0
        dims_out[dim] = {
            "time_s_per_step": t,
            "max_rank_time_s_per_step": max(acc["time_s"]) if acc else 0.0,
            "fraction": t / step_s if step_s else 0.0,
            "bytes_per_step": _mean(acc["bytes"]) if acc else 0.0,
            "busbw": (sum(acc["bus"]) / sum(acc["t"])) if acc and sum(acc["t"]) else None,
            "predicted_time_s_per_step": pred,
            "predicted_fraction": pred / pred_step if pred is not None and pred_step else None,
        }
    return {"step_s": step_s, "predicted_step_s": pred_step, "dims": dims_out,
            "ranks": per_rank, "probe": list(probe or [])}


def comm_series_rows(rank: int, step_report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One step report flattened into time-series rows (one per dim and op) for the store:
    `{step, rank, dim, op, time_s, bytes, calls, timed}`; the step itself is
    `{step, rank, dim: "step", op: "step", time_s: step_s, ...}` so the fraction can be
    recomputed from the series alone."""
    step, timed = step_report["step"], step_report.get("timed", True)
    rows = [{"step": step, "rank": rank, "dim": "step", "op": "step",
             "time_s": step_report["step_s"], "bytes": 0, "calls": 1, "timed": timed}]
    for dim, ops in sorted(step_report["comm"].items()):
        for op, o in sorted(ops.items()):
            rows.append({"step": step, "rank": rank, "dim": dim, "op": op,
                         "time_s": o["time_s"], "bytes": o["bytes"], "calls": o["calls"],
                         "timed": timed})
    return rows


def _bus_bytes(op: str, n: int, o: Mapping[str, float], timed: int, total: int) -> float:
    """Bytes of `op` on timed steps, times its busbw factor (unknown ops count as factor 1)."""
    try:
        factor = busbw_factor(op, n)
    except ValueError:
        factor = 1.0
    return o["bytes"] * (timed / total if total else 0.0) * factor
