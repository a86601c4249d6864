"""Cordoned and drained nodes, and the lemon rule, beside the controller's loop.

A node is cordoned by `trident node cordon|drain` (`POST /api/v1/nodes/{host}/...`, stored on
its row) or by the lemon rule. Every pass, `Cordons.step` hands the cordoned nodes to the
launcher (`Launcher.cordon`: their room is not free to admission, and Ray's label selectors
keep each new placement group off them), asks every running job with ranks on a draining node
to move, and marks a drain done once no job's ranks are left there.

A drain moves a job the way a preemption does (`service.control.preempting`): the job is
PREEMPTED, its ranks are asked to save a checkpoint at their next step boundary and stop, and
once they stopped (or the drain's grace is over) it is requeued without spending a retry;
admission then places it on the nodes not cordoned, where it resumes from that checkpoint.

The lemon rule (`Settings.lemon_failures`, `lemon_window_s`; off by default): each attempt
whose ranks failed (an error, a rank or its node lost; not a hang, nor a group that did not
start in time) counts against the nodes of its failed ranks (every node of the attempt when
the failure names no rank); a node with that many failed attempts within the window is
cordoned by itself, with the reason on the node and an event on the job whose failure tipped
it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from datetime import datetime

from service.cluster.data_plane import Launcher
from service.contract.states import JobState
from service.control.control_pass import LiveAttempt, Loop, StepResult
from service.control.preempting import Preemptions
from service.control.teardown import Teardowns
from service.policy.preemption import Victim
from service.store import Job, Node, Store
from service.store.tables import utcnow

log = logging.getLogger(__name__)


def named(node: Node) -> str:
    """How events name a node: its id's first 12 characters and its host."""
    address = node.info.get("address")
    return f"node {node.node_id[:12]} ({node.hostname}{', ' + address if address else ''})"


def grace_left(deadline: datetime | None) -> float:
    """Seconds until a drain's deadline (none left: 0)."""
    if deadline is None:
        return 0.0
    return max(0.0, (deadline - utcnow()).total_seconds())


class Cordons:
    """What the controller does about cordoned, draining and lemon nodes."""

    def __init__(self, loop: Loop, store: Store, launcher: Launcher, teardowns: Teardowns,
                 preemptions: Preemptions, *, lemon_failures: int = 0,
                 lemon_window_s: float = 3600.0) -> None:
        self.loop = loop
        self.store = store
        self.launcher = launcher
        self.teardowns = teardowns
        self.preemptions = preemptions
        self.lemon_failures = lemon_failures
        """Failed attempts on a node within `lemon_window_s` that cordon it (0: never)."""
        self.lemon_window_s = lemon_window_s
        self.moved: dict[str, set[int]] = {}
        """Per draining node, the jobs asked to move off it."""

    def step(self, result: StepResult, *, stopping: Collection[int] = ()) -> None:
        """Keep new ranks off the cordoned nodes; move the jobs off the draining ones (not
        those of `stopping`, asked to stop already); a drain with no ranks left is done."""
        nodes = self.store.list_nodes()
        self.launcher.cordon(frozenset(n.node_id for n in nodes if n.cordon is not None))
        draining = [n for n in nodes if n.state == "draining"]
        self.moved = {n.node_id: self.moved.get(n.node_id, set()) for n in draining}
        for node in draining:
            there = [j for j, run in self.loop.running.items() if node.node_id in _nodes(run)]
            for job_id in there:
                run = self.loop.running[job_id]
                if job_id not in stopping:  # one asked already is PREEMPTED: not again
                    self._move(job_id, run, node, result)
            moved = self.moved[node.node_id]
            if not there and not any(self.teardowns.busy(("job", j)) for j in moved):
                self.store.node_drained(node_id=node.node_id, moved=sorted(moved))

    def _move(self, job_id: int, run: LiveAttempt, node: Node, result: StepResult) -> None:
        """Ask a running job with ranks on the draining `node` to save and move off it."""
        job = self.store.get_job(job_id=job_id)
        if job.state != JobState.RUNNING or job.cancel_requested:
            return  # placing: asked once it runs; cancelled: it stops anyway
        assert node.cordon is not None
        grace = grace_left(node.cordon.drain_deadline)
        self.loop.fenced()  # stopping a job's ranks is the leader's to do
        moved = self.loop.move(job, JobState.PREEMPTED, f"{named(node)} is drained by"
                               f" {node.cordon.by} ({node.cordon.reason}): its ranks save a"
                               " checkpoint at the next step boundary and stop (within"
                               f" {grace:g} s), then it resumes on the other nodes, without"
                               " spending a retry", result, attempt=run.attempt,
                               data={"drained_node": node.node_id})
        if moved is None:
            return
        run.group.preempt()
        self.preemptions.victims[job_id] = Victim(by=None, asked=time.monotonic(),
                                                  node=named(node), grace_s=grace)
        self.moved[node.node_id].add(job_id)

    def failed(self, job: Job, run: LiveAttempt, failed_ranks: Sequence[int]) -> None:
        """An attempt failed: the lemon rule counts it against the nodes of its failed ranks
        (all its nodes when none is named); a node it tips over is cordoned, and the job's
        events say so."""
        if self.lemon_failures <= 0 or run.placement is None:
            return
        ranks = run.placement.get("ranks", [])
        failed = set(failed_ranks)
        nodes = [str(r["node_id"]) for r in ranks if not failed or r.get("rank") in failed]
        if not nodes:
            return
        for node in self.store.note_node_failures(
                node_ids=nodes, job_id=job.id, attempt=run.attempt,
                threshold=self.lemon_failures, window_s=self.lemon_window_s):
            assert node.cordon is not None
            log.warning("%s cordoned: %s", named(node), node.cordon.reason)
            self.store.add_event(job_id=job.id, attempt=run.attempt, kind="node",
                                 message=f"{named(node)} cordoned by the lemon rule:"
                                 f" {node.cordon.reason}",
                                 data={"node_id": node.node_id, "cordoned": "lemon"})


def _nodes(run: LiveAttempt) -> set[str]:
    return {str(r.get("node_id")) for r in (run.placement or {}).get("ranks", [])}
