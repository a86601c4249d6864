"""`trident probe` runs: started when requested, collected, and turned into a calibrated profile.

`POST /api/v1/probes` stores a pending cluster probe; the controller calls `ClusterProbes.step()`
once per pass, which starts pending probes on the launcher, polls the running ones, and on
success stores the annotated rows and the calibrated profile (`service.monitor.calibration`) that
planning and probe judgement then use (`service.cluster.profiles.profile_for`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from service.cluster.data_plane import Launcher, PollResult, WorkerGroup
from service.control.teardown import Teardowns
from service.monitor.calibration import calibrate
from service.store import Fence, ProbeStatus, Store


@dataclass
class _Probe:
    """One running `trident probe`: its group, request, and the reports so far."""

    group: WorkerGroup
    request: dict[str, Any]
    started: float
    reports: list[dict[str, Any]] = field(default_factory=list)


class ClusterProbes:
    """The cluster probes this controller runs."""

    def __init__(self, store: Store, launcher: Launcher, *, start_timeout_s: float,
                 poll_timeout_s: float, teardowns: Teardowns, fence: Fence | None = None) -> None:
        self.store = store
        self.fence = fence
        """The controller's lease: probes are claimed, and their groups (whose polls launch
        the ranks) polled, only while it is held (NotHolder otherwise)."""
        self.launcher = launcher
        self.start_timeout_s = start_timeout_s
        self.teardowns = teardowns
        self.poll_timeout_s = poll_timeout_s
        self.running: dict[int, _Probe] = {}

    def step(self) -> None:
        """Start requested probes and turn finished ones into a profile."""
        for p in self.store.claim_probes(scope="cluster", fence=self.fence):
            req = p.request
            try:
                group = self.launcher.start_cluster_probe(
                    probe_id=p.id, ranks_per_node=int(req["ranks_per_node"]),
                    max_bytes=int(req["max_bytes"]))
            except Exception as exc:
                self._failed(p.id, repr(exc))
                continue
            self.running[p.id] = _Probe(group=group, request=req, started=time.monotonic())
        if self.running and self.fence is not None:
            self.store.check_fence(self.fence)
        for probe_id, probe in list(self.running.items()):
            poll = probe.group.poll(self.poll_timeout_s)
            probe.reports.extend(poll.reports)
            if poll.state == "starting" and \
                    time.monotonic() - probe.started > self.start_timeout_s:
                poll = PollResult(state="failed", error="probe group did not start within"
                                  f" {self.start_timeout_s:g} s")
            if poll.state not in ("succeeded", "failed", "stopped"):
                continue
            self.teardowns.start(("probe", probe_id), probe.group)
            del self.running[probe_id]
            if poll.state != "succeeded":
                self._failed(probe_id, poll.error or poll.state)
                continue
            self._done(probe_id, probe)

    def _done(self, probe_id: int, probe: _Probe) -> None:
        try:
            results, summary = calibrate({**probe.request, "probe_id": probe_id}, probe.reports)
        except (ValidationError, ValueError) as exc:
            self._failed(probe_id, f"bad probe reports: {exc}")
            return
        self.store.finish_probe(probe_id=probe_id, status=ProbeStatus.DONE, results=results,
                                summary=summary)
        self.store.save_profile(name=summary["profile"]["name"], profile=summary["profile"],
                                probe_id=probe_id)

    def _failed(self, probe_id: int, error: str) -> None:
        self.store.finish_probe(probe_id=probe_id, status=ProbeStatus.FAILED, results=[],
                                summary={}, error=error)
