"""Which host has a slow link: a probe's host pairs compared, and the ranks' collective times.

Callers: the controller's per-attempt health (`service.monitor.attempt`) after each round of
a job's bandwidth probe (before training, and every `monitor.probe_every_s` at a step
boundary). The ranks measure each link between hosts with send/recv ping-pongs
(`workers.monitor.comm_probe.host_pairs`: one rank of each host to one rank of the next, in a
ring, so that each host's link is crossed by two pairs from three hosts on). Rows of
dim `host`, op `send_recv`.

The rule, peer-relative (a link is judged against the other links of the same cluster, not
against a hardware profile, which a CPU cluster on a bridge or a mixed fabric matches badly):

- each host pair's bandwidth is its row at the largest probed size, when that is 1 MiB or more
  (`MIN_JUDGED_BYTES`: bandwidth-bound);
- a pair is slow below `threshold` times the fastest pair of the round;
- a host is named when every pair it is in is slow and some pair without it is healthy: the
  host common to the slow pairs. With two hosts there is one pair and nothing to compare it
  with; it is judged against the profile's inter-node bandwidth at that size (`expected_bw`),
  and both ends are named, since either may be the slow one.

The ranks' collective times (the step reports' `comm`, seconds a step) go with the verdict as
evidence: those of the named host's ranks against the others'. In a ring all-reduce every rank
waits for the slowest link, so they show that the job is slowed, not where.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

HOST_DIM = "host"
"""The probe rows' dim of the send/recv pairs between hosts."""


@dataclass(frozen=True)
class SlowHost:
    """A host whose links measured slow."""

    node_id: str
    bw: float
    """Median bandwidth (bytes/s, one way) of the pairs it is in."""
    reference_bw: float
    """What it is judged against: the median of the healthy pairs, or the profile's
    inter-node bandwidth where no pair is healthy."""
    pairs: list[dict[str, Any]]
    """Its pairs: `{"peer": node id, "ranks": [src, dst], "bw": bytes/s}`."""
    either_end: bool = False
    """Two hosts only: the slow link is between them, and either end may be the slow one."""

    @property
    def ratio(self) -> float:
        return self.bw / self.reference_bw if self.reference_bw else 0.0


@dataclass(frozen=True)
class LinkVerdict:
    """One probe round's verdict on the hosts it measured."""

    slow: list[SlowHost] = field(default_factory=list)
    healthy: list[str] = field(default_factory=list)
    """Hosts probed whose links measured healthy (a slow link there is cleared)."""
    pairs: dict[tuple[str, str], float] = field(default_factory=dict)
    """Each host pair's bandwidth (bytes/s), its node ids sorted."""


MIN_JUDGED_BYTES = 1 << 20
"""Pairs are judged at their largest probed size only when it is at least this (1 MiB): below,
a round trip's latency weighs as much as the link's rate, and a pair slower than another by
noise alone would name a host. A job probing smaller messages (`monitor.probe_max_bytes`) is
not judged for slow links."""


def host_pair_bw(rows: Sequence[Mapping[str, Any]], node_of_rank: Mapping[int, str],
                 min_bytes: int = MIN_JUDGED_BYTES
                 ) -> dict[tuple[str, str], tuple[float, list[int], int]]:
    """Each pair of hosts' send/recv bandwidth at its largest probed size (algbw: one way),
    with the ranks that measured it and that size. Rows of other dims, pairs on one host, and
    pairs whose largest size is below `min_bytes` are left out; two pairs of the same hosts
    keep the slower."""
    largest: dict[tuple[int, ...], Mapping[str, Any]] = {}
    for row in rows:
        if row.get("dim") != HOST_DIM or row.get("op") != "send_recv":
            continue
        key = tuple(row["group"])
        if key not in largest or row["bytes"] > largest[key]["bytes"]:
            largest[key] = row
    out: dict[tuple[str, str], tuple[float, list[int], int]] = {}
    for ranks, row in largest.items():
        if len(ranks) != 2 or any(r not in node_of_rank for r in ranks) or \
                row["bytes"] < min_bytes:
            continue
        a, b = (node_of_rank[r] for r in ranks)
        if a == b:
            continue
        key = (a, b) if a < b else (b, a)
        bw = float(row["algbw"])
        if key not in out or bw < out[key][0]:
            out[key] = (bw, list(ranks), int(row["bytes"]))
    return out


def judge_links(rows: Sequence[Mapping[str, Any]], node_of_rank: Mapping[int, str], *,
                threshold: float = 0.5,
                expected_bw: Callable[[int], float] | None = None,
                min_bytes: int = MIN_JUDGED_BYTES) -> LinkVerdict:
    """The hosts whose links are slow in one probe round (see the module's rule).
    `expected_bw(nbytes)`: the profile's one-way bandwidth between two hosts for a message of
    that size (alpha-beta: `service.monitor.bandwidth.expected_busbw` of send_recv), which
    judges the one pair of two hosts."""
    pairs = host_pair_bw(rows, node_of_rank, min_bytes)
    if not pairs:
        return LinkVerdict()
    hosts = sorted({h for key in pairs for h in key})
    best = max(bw for bw, _, _ in pairs.values())
    slow_pairs = {key for key, (bw, _, _) in pairs.items() if bw < threshold * best}
    healthy_bw = [bw for key, (bw, _, _) in pairs.items() if key not in slow_pairs]

    def of(host: str) -> list[dict[str, Any]]:
        return [{"peer": key[1] if key[0] == host else key[0], "ranks": ranks, "bw": bw,
                 "bytes": nbytes}
                for key, (bw, ranks, nbytes) in sorted(pairs.items()) if host in key]

    slow: list[SlowHost] = []
    if len(hosts) == 2:
        [(key, (bw, _, nbytes))] = pairs.items()
        expected = expected_bw(nbytes) if expected_bw is not None else 0.0
        if expected and bw < threshold * expected:
            slow = [SlowHost(h, bw, expected, of(h), either_end=True) for h in key]
    elif healthy_bw:
        reference = statistics.median(healthy_bw)
        for h in hosts:
            mine = [key for key in pairs if h in key]
            others_healthy = any(h not in key for key in pairs if key not in slow_pairs)
            if mine and all(key in slow_pairs for key in mine) and others_healthy:
                bws = [pairs[key][0] for key in mine]
                slow.append(SlowHost(h, statistics.median(bws), reference, of(h)))
    named = {s.node_id for s in slow}
    return LinkVerdict(slow=slow, healthy=[h for h in hosts if h not in named],
                       pairs={key: bw for key, (bw, _, _) in pairs.items()})


def comm_s_by_host(comm_s: Mapping[int, Sequence[float]], node_of_rank: Mapping[int, str],
                   host: str) -> dict[str, float | None]:
    """The median seconds a step the ranks on `host` and the other ranks spent in
    collectives (over the steps given per rank): the verdict's evidence from the steps."""
    here = [t for r, ts in comm_s.items() if node_of_rank.get(r) == host for t in ts]
    rest = [t for r, ts in comm_s.items() if node_of_rank.get(r) != host for t in ts]
    return {"host_comm_s": statistics.median(here) if here else None,
            "others_comm_s": statistics.median(rest) if rest else None}


def _bw(x: float) -> str:
    return f"{x / 1e6:.3g} MB/s"


def slow_link_message(host: SlowHost, address: str) -> str:
    """The event's one line: the host, what its links measured, against what."""
    where = f"host {address} (node {host.node_id[:12]})"
    if host.either_end:
        return (f"slow link: {where} or its one peer: {_bw(host.bw)} between them, below the"
                f" profile's inter-node {_bw(host.reference_bw)} ({host.ratio:.2g}x)")
    return (f"slow link: {where} measured {_bw(host.bw)} to its peers, against"
            f" {_bw(host.reference_bw)} between the other hosts ({host.ratio:.2g}x)")
