"""One running attempt's health: heartbeats, compute times, stragglers, the bandwidth probe,
TP placement and hangs.

The controller creates an `AttemptHealth` when it starts an attempt and feeds it each poll:
the placement once known, every validated report, the ranks' heartbeats. It records its
findings as events of the attempt (`probe`, `warning`, `straggler`, `hang`, `stacks`,
`slow_link`, `link_ok`) and stores the job's probes (and a slow link on its node); `hung`
tells the controller when to stop the group.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from service.cluster.profiles import profile_for
from service.contract.parallel import Dim
from service.contract.reports import HeartbeatReport, ProbeReport, StepReport
from service.contract.spec import JobSpec
from service.monitor.bandwidth import expected_busbw
from service.monitor.hang import Diagnosis, diagnose_hang
from service.monitor.links import LinkVerdict, comm_s_by_host, judge_links, slow_link_message
from service.monitor.placement import tp_placement_warnings
from service.monitor.probe import annotate_expected, flag_slow_groups
from service.monitor.stragglers import compute_s, find_stragglers
from service.store import Job, ProbeStatus, Store
from service.store.heartbeats import HeartbeatLog, HeartbeatThrottle

COMPUTE_WINDOW = 50
"""Compute times kept per rank for straggler detection (steps)."""
COMM_WINDOW = 5
"""Collective times kept per rank, the evidence a slow-link event carries (steps)."""


class AttemptHealth:
    """The health state of one attempt of one job."""

    def __init__(self, store: Store, job: Job, attempt: int, spec: JobSpec) -> None:
        self.store = store
        self.job_id = job.id
        self.world_size = job.world_size
        self.attempt = attempt
        self.spec = spec
        self.stage_of_rank = job.plan.stage_of()
        self.heartbeats: dict[int, HeartbeatReport] = {}
        self.compute: dict[int, deque[float]] = {}
        self.stragglers: set[int] = set()
        self.probe_rounds: dict[int, tuple[list[dict[str, Any]], set[int]]] = {}
        """Each probe round's rows and the ranks whose rows are in, until all are."""
        self.slow_hosts: set[str] = set()
        """The nodes this attempt's probes named as having a slow link, until healthy again."""
        self.comm: dict[int, deque[float]] = {}
        """Each rank's seconds a step in collectives, its newest `COMM_WINDOW` steps."""
        self.node_of_rank: dict[int, str] = {}
        self.beats = HeartbeatThrottle(HeartbeatLog(store), job.id, attempt)
        """The heartbeat times the API reads (`GET /metrics`, the ranks grid)."""

    def _event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.store.add_event(job_id=self.job_id, attempt=self.attempt, kind=kind,
                             message=message, data=data)

    # --- fed by the controller's poll -----------------------------------------------------------

    def placed(self, placement: Mapping[str, Any]) -> None:
        """Where the ranks landed: remember their nodes and warn about TP groups that span
        nodes or, by the node's link matrix, cross PCIe."""
        ranks = placement.get("ranks", [])
        self.node_of_rank = {r["rank"]: r["node_id"] for r in ranks}
        gpu_of = {r["rank"]: int(r["gpu_ids"][0]) for r in ranks
                  if r.get("gpu_ids") and str(r["gpu_ids"][0]).isdigit()}
        inventory = {n.node_id: n.info for n in self.store.list_nodes()}
        groups = [g for g in self.spec.layout.dims.groups(Dim.TP)
                  if len(g) > 1 and all(r in self.node_of_rank for r in g)]
        for warning in tp_placement_warnings(groups, self.node_of_rank, gpu_of or None,
                                             inventory):
            self._event("warning", warning)

    def step_report(self, report: StepReport) -> None:
        compute = compute_s(report)
        if compute is not None:
            self.compute.setdefault(report.rank, deque(maxlen=COMPUTE_WINDOW)).append(compute)
            comm = sum(o["time_s"] for ops in (report.comm or {}).values() for o in ops.values())
            self.comm.setdefault(report.rank, deque(maxlen=COMM_WINDOW)).append(comm)

    def probe_report(self, report: ProbeReport) -> None:
        """Collect every rank's rows of a probe round; when all are in, store them and judge
        them against the profile this cluster plans with (calibrated if `trident probe` ran):
        slow groups (warnings, the probe before training only) and slow links between hosts
        (`service.monitor.links`, every round)."""
        rows, ranks = self.probe_rounds.setdefault(report.round, ([], set()))
        rows.extend(r.model_dump() for r in report.rows)
        ranks.add(report.rank)
        if len(ranks) < self.world_size:
            return
        del self.probe_rounds[report.round]
        monitor = self.spec.monitor
        profile = profile_for(self.store, self.spec.target.gpu)
        nodes = self.node_of_rank or None
        annotated = annotate_expected(rows, profile, nodes)
        first = report.round == 0
        slow = flag_slow_groups(rows, profile, monitor.slow_group_threshold, nodes) \
            if first else []
        probe = self.store.create_probe(scope="job", job_id=self.job_id, attempt=self.attempt,
                                        status=ProbeStatus.RUNNING,
                                        request={"max_bytes": monitor.probe_max_bytes,
                                                 "round": report.round, "step": report.step})
        verdict = judge_links(rows, self.node_of_rank, threshold=monitor.slow_group_threshold,
                              expected_bw=lambda n: expected_busbw("send_recv", 2, n, profile,
                                                                   cross_node=True))
        self.store.finish_probe(probe_id=probe.id, status=ProbeStatus.DONE, results=annotated,
                                summary={"slow_groups": slow, "profile": profile.name,
                                         "round": report.round, "step": report.step,
                                         "slow_hosts": [s.node_id for s in verdict.slow],
                                         "host_pairs": [{"nodes": list(k), "bw": bw} for k, bw
                                                        in sorted(verdict.pairs.items())]})
        if first:
            self._event("probe", f"bandwidth probe: {len(annotated)} measurements, {len(slow)}"
                        " slow group(s)", {"probe_id": probe.id})
            for w in slow:
                self._event("warning", str(w.get("message", w)), w)
        self._links(verdict, probe.id, report.step)

    def _links(self, verdict: LinkVerdict, probe_id: int, step: int | None) -> None:
        """Name each host a probe round found slow (a `slow_link` event of the job, once
        while it stays slow, and on the node), and clear those found healthy again."""
        address = {n.node_id: str(n.info.get("address") or n.hostname)
                   for n in self.store.list_nodes()}
        by = f"job {self.job_id}"
        comm = {r: list(t) for r, t in self.comm.items()}
        for host in verdict.slow:
            where = address.get(host.node_id, host.node_id[:12])
            message = slow_link_message(host, where)
            data = {"node_id": host.node_id, "address": where, "bw": host.bw,
                    "reference_bw": host.reference_bw, "ratio": host.ratio,
                    "either_end": host.either_end, "pairs": host.pairs, "probe_id": probe_id,
                    "step": step, "job_id": self.job_id,
                    **comm_s_by_host(comm, self.node_of_rank, host.node_id)}
            marked = self.store.mark_slow_link(node_id=host.node_id, slow=True, by=by,
                                               message=message, data=data)
            if marked or host.node_id not in self.slow_hosts:
                self.slow_hosts.add(host.node_id)
                self._event("slow_link", message, data)
        for node_id in verdict.healthy:
            where = address.get(node_id, node_id[:12])
            message = f"link healthy again: host {where} (node {node_id[:12]})"
            cleared = self.store.mark_slow_link(node_id=node_id, slow=False, by=by,
                                                message=message,
                                                data={"probe_id": probe_id, "step": step})
            if cleared or node_id in self.slow_hosts:
                self.slow_hosts.discard(node_id)
                self._event("link_ok", message, {"node_id": node_id, "address": where,
                                                 "probe_id": probe_id, "step": step})

    def polled(self, heartbeats: Mapping[int, HeartbeatReport],
               received: float | None = None) -> None:
        """After each poll: take the ranks' heartbeats (stored for the API at most once a
        second) and name new stragglers (once each)."""
        received = time.time() if received is None else received
        for rank, hb in heartbeats.items():
            # Judge by this clock: the rank's own clock may differ from ours.
            self.heartbeats[rank] = hb.model_copy(update={"time": received - hb.age_s})
        self.beats.offer({r: hb.time for r, hb in self.heartbeats.items()})
        monitor = self.spec.monitor
        found = find_stragglers(
            {r: list(t) for r, t in self.compute.items() if r in self.stage_of_rank},
            self.stage_of_rank, monitor.straggler_threshold, monitor.straggler_min_steps,
            self.node_of_rank or None)
        for s in found:
            if s.rank not in self.stragglers:
                self.stragglers.add(s.rank)
                ev = s.to_event()
                self._event("straggler", ev.pop("message"), ev)

    def hung(self, now: float | None = None) -> Diagnosis | None:
        """The diagnosis (recorded as a `hang` event) when no rank made progress within
        `monitor.hang_timeout_s`; else None. The ranks' stacks are taken where the group is
        stopped, beside the controller's loop (`record_stacks`)."""
        if not self.heartbeats:
            return None
        diagnosis = diagnose_hang(self.heartbeats, time.time() if now is None else now,
                                  self.spec.monitor.hang_timeout_s, self.spec.layout.dims)
        if diagnosis is not None:
            self._event("hang", diagnosis.summary, diagnosis.to_dict())
        return diagnosis


def record_stacks(store: Store, job_id: int, attempt: int | None,
                  stacks: Mapping[int, str]) -> None:
    """A hung group's ranks' Python stacks, one `stacks` event per rank."""
    for rank, text in stacks.items():
        store.add_event(job_id=job_id, attempt=attempt, kind="stacks",
                        message=f"rank {rank} Python stacks at the hang",
                        data={"rank": rank, "stacks": text[:100_000]})
