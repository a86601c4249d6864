"""Stragglers: ranks whose compute time per step stays beyond their pipeline-stage peers'.

Called by the per-attempt health (`service.monitor.attempt`): `compute_s` on every step report,
`find_stragglers` on the recent compute times of every rank after each poll.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from service.contract.reports import StepReport


def compute_s(report: StepReport) -> float | None:
    """Compute time of one step: step time less the time in collectives (None when the step's
    collectives were not counted or not timed). Feeds `find_stragglers`."""
    if report.comm is None or not report.timed:
        return None
    comm = sum(o["time_s"] for ops in report.comm.values() for o in ops.values())
    return max(0.0, report.step_time_s - comm)


MIN_COMPUTE_S = 1e-3
"""Peers' compute time below which the ratio is taken against this instead (peers that only
wait in collectives compute about nothing; the ratio must stay finite)."""


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
                    ratio=mine / max(theirs, MIN_COMPUTE_S), steps=min_steps))
    return out
