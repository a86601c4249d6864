"""Hang diagnosis: when no rank made progress in time, which ranks never arrived.

Called by the per-attempt health (`service.monitor.attempt`) on every poll with the ranks'
heartbeats (`service.contract.reports.HeartbeatReport`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from service.contract.parallel import ParallelDims
from service.contract.reports import HeartbeatReport
from service.monitor.bandwidth import P2P_OPS


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


def _wait_key(hb: HeartbeatReport) -> tuple[int, str, tuple[int, ...]]:
    assert hb.collective is not None
    coll = "p2p" if hb.collective in P2P_OPS else hb.collective
    return (hb.step, coll, tuple(sorted(hb.group or ())))


def diagnose_hang(heartbeats: Mapping[int, HeartbeatReport], now: float, timeout: float,
                  dims: ParallelDims | None = None) -> Diagnosis | None:
    """A diagnosis when no rank made progress within `timeout` seconds, else None.

    `heartbeats[rank]`: step, phase, collective (None outside collectives), dim, group (rank
    list), time (wall clock of the last change). Ranks of `dims` without any heartbeat count
    as never arrived. Across nodes with unsynchronised clocks the controller sets `time = its
    own receive time - age_s` before calling.
    """
    expected = range(dims.world_size) if dims else sorted(heartbeats)
    silent = [r for r in expected if r not in heartbeats]
    if not heartbeats:
        return None
    last = max(hb.time for hb in heartbeats.values())
    stalled = now - last
    if stalled < timeout:
        return None

    # Ranks in a collective, grouped by (step, collective, group): each such set waits for the
    # group members that are not in it.
    sets: dict[tuple[int, str, tuple[int, ...]], list[int]] = {}
    for rank, hb in sorted(heartbeats.items()):
        if hb.collective and hb.group:
            sets.setdefault(_wait_key(hb), []).append(rank)
    waiting: list[WaitingGroup] = []
    missing_all: set[int] = set()
    for (step, _, group), ranks in sorted(sets.items()):
        missing = [r for r in group if r not in ranks]
        if not missing:
            continue  # everyone arrived: stuck inside the transport, not waiting on a peer
        dim = heartbeats[ranks[0]].dim
        name = heartbeats[ranks[0]].collective or ""
        waiting.append(WaitingGroup(dim=dim, group=list(group), collective=name, step=step,
                                    waiting=ranks, missing=missing))
        missing_all.update(missing)
    in_collective = {r for r, hb in heartbeats.items() if hb.collective}
    culprits = sorted((missing_all - in_collective) | set(silent))
    if not culprits and not in_collective:
        # Nobody is in a collective: the stall is in compute; the ranks furthest behind are it.
        low = min(hb.step for hb in heartbeats.values())
        culprits = sorted(r for r, hb in heartbeats.items() if hb.step == low)
    state = {r: hb.model_dump(include={"step", "phase", "collective", "dim", "group"})
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
            where = (f"in {hb.collective}" if hb.collective
                     else f"in {hb.phase} (not in a collective)")
            lines.append(f"rank {r} never arrived: at step {hb.step} {where}")
        else:
            lines.append(f"rank {r} never arrived: no heartbeat")
    return Diagnosis(stalled_s=stalled, never_arrived=culprits, waiting=waiting, ranks=state,
                     summary="; ".join(lines))
