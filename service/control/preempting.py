"""Preemptions being carried out, beside the controller's loop.

`service.policy.preemption` chooses the victims and words it; `Preemptions` asks them to save a
checkpoint and stop, keeps each victim until its room is given back (one preemption at a
time), watches them while they save, and requeues them (no retry spent). The controller
(`service.control.controller`) calls `start` with the job admission stopped at, `watch` for each
PREEMPTED job whose group it still polls, and `requeue` for one whose group is gone (a new
controller); every state change goes through its hands (`service.control.control_pass.Loop`).
"""

from __future__ import annotations

import time
from collections.abc import Collection

from service.cluster.data_plane import Launcher
from service.contract.states import JobState
from service.control.control_pass import LiveAttempt, Loop, StepResult
from service.control.teardown import Teardowns
from service.policy.preemption import Victim, asked_message, choose, preempting_message
from service.store import AttemptStatus, Job, Store
from service.store.quota_waits import QuotaNotes


class Preemptions:
    """The preempted jobs whose room is not given back yet, and what is done with them."""

    def __init__(self, loop: Loop, store: Store, launcher: Launcher, teardowns: Teardowns,
                 quota_notes: QuotaNotes, *, grace_s: float, poll_timeout_s: float) -> None:
        self.loop = loop
        self.store = store
        self.launcher = launcher
        self.teardowns = teardowns
        self.quota_notes = quota_notes
        self.grace_s = grace_s
        """How long a preempted job's ranks get to save their checkpoint and stop."""
        self.poll_timeout_s = poll_timeout_s
        self.victims: dict[int, Victim] = {}
        """Preempted jobs whose room is not given back yet: no other preemption starts."""

    def start(self, blocked: Job, active: list[Job], result: StepResult, *,
              stopping: Collection[int] = ()) -> None:
        """Ask the running jobs `service.policy.preemption` chooses for `blocked` to checkpoint and
        stop (one preemption at a time: none while a victim still holds its room). The
        `stopping` jobs (moving up: asked to stop already) are never chosen."""
        running = self.loop.running
        self.victims = {j: v for j, v in self.victims.items()
                        if j in running or self.teardowns.busy(("job", j))}
        if self.victims or any(j.state == JobState.PREEMPTED for j in active):
            return
        chosen = choose(self.store, blocked, active, self.launcher.free_capacity(),
                        {j: (run.started, run.placement) for j, run in running.items()
                         if j not in stopping})
        if not chosen:
            return
        self.loop.fenced()  # stopping another job's ranks is the leader's to do
        for victim in chosen:
            run = running[victim.job.id]
            moved = self.loop.move(victim.job, JobState.PREEMPTED,
                                   asked_message(victim, blocked), result, attempt=run.attempt,
                                   data={"preempted_by": blocked.id,
                                         "priority": blocked.priority})
            if moved is None:
                continue
            run.group.preempt()
            self.victims[victim.job.id] = Victim(by=blocked.id, asked=time.monotonic())
        self.store.add_event(job_id=blocked.id, kind="preempting",
                             message=preempting_message(chosen, blocked),
                             data={"victims": [v.job.id for v in chosen]})

    def watch(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        """A preempted job's ranks save and stop: what they report is stored; once they
        stopped (or the grace is over) it is requeued; one that finished meanwhile
        succeeded."""
        poll = run.group.poll(self.poll_timeout_s)
        result.metrics += self.loop.record(job, run, poll)
        victim = self.victims.get(job.id)
        grace_s = self.grace_s if victim is None or victim.grace_s is None else victim.grace_s
        late = victim is None or time.monotonic() - victim.asked > grace_s
        if poll.state == "succeeded":
            self.loop.succeed(job, run, result)
        elif poll.state in ("stopped", "failed") or late:
            self.loop.teardown(job.id, run)
            why = {"stopped": "its ranks saved and stopped",
                   "failed": f"its ranks stopped with an error: {run.redact(poll.error or '')}"
                   }.get(poll.state, f"its ranks did not stop within {grace_s:g} s")
            self.requeue(job, run.attempt, why, result)

    def requeue(self, job: Job, attempt: int, why: str, result: StepResult) -> None:
        """Back to the queue, by its priority, the attempt ended preempted (no retry spent);
        its quota note says by whom (or the drain of which node it moves off)."""
        victim = self.victims.get(job.id)
        if victim is not None and victim.node is not None:
            self.store.end_attempt(job_id=job.id, number=attempt,
                                   status=AttemptStatus.PREEMPTED,
                                   error=f"moved off {victim.node} (drained): {why}")
            moved = self.loop.move(job, JobState.QUEUED, f"requeued to move off {victim.node}"
                                   f" (drained; {why}); it resumes from its newest checkpoint on"
                                   " the other nodes, without spending a retry", result,
                                   attempt=attempt)
            if moved is not None:
                self.quota_notes.note(job.id, f"moved off {victim.node} (drained); resumes"
                                      " from its checkpoint when there is room", kind="drained",
                                      data={"node": victim.node})
            return
        by = f"job {victim.by}" if victim else "a job of higher priority"
        self.store.end_attempt(job_id=job.id, number=attempt, status=AttemptStatus.PREEMPTED,
                               error=f"preempted by {by}: {why}")
        moved = self.loop.move(job, JobState.QUEUED, f"requeued after its preemption by {by}"
                               f" ({why}); it resumes from its newest checkpoint when there is"
                               " room, without spending a retry", result, attempt=attempt)
        if moved is not None:
            self.quota_notes.note(job.id, f"preempted by {by}; resumes from its checkpoint"
                                  " when there is room", kind="preempted",
                                  data={"preempted_by": victim.by if victim else None})
