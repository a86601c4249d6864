"""Elastic jobs moved beside the controller's loop: re-planned down onto what is free, and
moved back up when the room returns.

`service.policy.elastic_replan` decides the layouts and words the moves; `Rescaling` carries them
out and owns what that needs between passes: the jobs asked to save and stop to move up (`moving`),
the reason each job was last not re-planned for (said once), and the room each move was last
judged on (a planner search each, so judged again only when it changed). The controller
(`service.control.controller`) calls `down` before admission (admission then places a re-planned
job in the same pass), `up` after it with the job admission stopped at (a move up never takes
its room), and `watch` for each job moving up whose group it polls; every state change goes
through its hands (`service.control.control_pass.Loop`), each layout change through the store's
`ElasticMoves` (`service.store.elastic`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from service.cluster.data_plane import Launcher, NodeCapacity
from service.cluster.profiles import profile_for
from service.contract.states import JobState, TransitionError
from service.control.control_pass import LiveAttempt, Loop, StepResult
from service.policy.elastic_replan import (
    ElasticState,
    Replan,
    describe,
    fitting_ranks,
    moved_message,
    replan,
    submitted,
)
from service.policy.preemption import holds
from service.policy.scheduler import bundles, pack, taken
from service.store import AttemptStatus, Job, Store
from service.store.checkpoints import CheckpointIndex
from service.store.elastic import ElasticMoves

log = logging.getLogger(__name__)

ELASTIC_SCAN = 256
"""Queued jobs that ran before a pass looks at for elastic re-plans (`Rescaling.down`)."""

Room = tuple[tuple[str, float, float], ...]
"""Free room as judged: (node id, CPUs, GPUs) of each node."""


@dataclass
class Move:
    """An elastic job asked to save and stop, to resume on a larger layout."""

    to: Replan
    asked: float
    """`time.monotonic()` when it was asked."""


class Rescaling:
    """The elastic jobs this controller re-plans and moves, and what it remembers of them."""

    def __init__(self, loop: Loop, store: Store, launcher: Launcher, *, grace_s: float,
                 poll_timeout_s: float) -> None:
        self.loop = loop
        self.store = store
        self.launcher = launcher
        self.grace_s = grace_s
        """How long a moving job's ranks get to save their checkpoint and stop."""
        self.poll_timeout_s = poll_timeout_s
        self.moves = ElasticMoves(store)
        """Elastic jobs' layouts in the store (`service.store.elastic`)."""
        self.moving: dict[int, Move] = {}
        """Elastic jobs asked to save and stop to resume on a larger layout."""
        self.said: dict[int, str] = {}
        """The last reason each elastic job was not re-planned for, said once."""
        self.up_judged: dict[int, Room] = {}
        """The room each running elastic job's move up was last judged on: judged again only
        when it changed (a search of the planner each)."""
        self.down_judged: dict[int, Room] = {}
        """Likewise, the free room a queued elastic job was last found no layout for."""

    def down(self) -> None:
        """Re-plan each queued elastic job whose ranks were lost (its last attempt failed, was
        lost, or moved up into room that was gone) and that the free room has not held for
        `wait_s` since: onto the best layout of what is free now
        (`service.policy.elastic_replan.replan`);
        admission then places it in this same pass. A job no layout fits is said once."""
        queued = [j for j in self.moves.requeued(limit=ELASTIC_SCAN)
                  if j.spec.elastic is not None]
        ids = {q.id for q in queued}
        self.said = {j: m for j, m in self.said.items() if j in ids}
        self.down_judged = {j: r for j, r in self.down_judged.items() if j in ids}
        if not queued:
            return
        free = self.launcher.free_capacity()
        for job in queued:
            elastic = job.spec.elastic
            assert elastic is not None
            last = self.store.list_attempts(job_id=job.id)[-1]
            if last.status not in (AttemptStatus.FAILED, AttemptStatus.LOST,
                                   AttemptStatus.MOVED) or last.ended_at is None:
                continue  # a preempted job waits for the room it gave
            if pack(bundles(job), free) is not None:
                continue  # it fits as it is: admission places it
            waited = time.time() - last.ended_at.timestamp()
            if waited < elastic.wait_s:
                continue
            seen = tuple((n.node_id, n.cpus, n.gpus) for n in free)
            if self.down_judged.get(job.id) == seen:
                continue  # no layout fitted this room: none does now
            state = ElasticState.of(job)
            got = replan(job.spec, state, free, min_ranks=elastic.min_ranks,
                         profile=profile_for(self.store, job.spec.target.gpu),
                         exclude_world=job.world_size)
            if isinstance(got, str):
                self.down_judged[job.id] = seen
                self._note(job, f"elastic: not re-planned: {got}; it waits for room"
                           f" for its {job.world_size} ranks")
                continue
            tags = CheckpointIndex(self.store).list(job_id=job.id)
            why = (f"attempt {last.number} lost its ranks and the free room has held"
                   f" {fitting_ranks(job.spec, free)} of its {job.world_size} for"
                   f" {waited:.0f} s, wait_s {elastic.wait_s:g}")
            try:
                self.moves.relayout(
                    job_id=job.id, expect=JobState.QUEUED, spec=got.spec, plan=got.plan,
                    world_size=got.world_size, elastic=state.to_json(),
                    message=moved_message(job, got, why=why,
                                          checkpoint=tags[-1].step if tags else None),
                    data={"direction": "down", "from": describe(job.plan, job.world_size),
                          "to": describe(got.plan, got.world_size),
                          "checkpoint_step": tags[-1].step if tags else None})
            except TransitionError as exc:  # cancelled meanwhile
                log.info("job %s: %s", job.id, exc)
                continue
            self.said.pop(job.id, None)
            free = _taken(free, got)

    def _note(self, job: Job, message: str) -> None:
        """Say why the job was not re-planned, once for each reason."""
        if self.said.get(job.id) != message:
            self.said[job.id] = message
            self.store.add_event(job_id=job.id, kind="elastic", message=message,
                                 data={"direction": None})

    def up(self, active: list[Job], blocked: int | None) -> None:
        """With `scale_up`: a running elastic job on fewer ranks than it was submitted with,
        whose room plus the free room now holds its submitted layout (or else a larger one
        predicted faster than its own) is asked to save a checkpoint now and stop
        (`watch` restarts it on that layout). Not while a queued job waits for room
        (admission's `blocked` job): that room is its."""
        self.moving = {j: m for j, m in self.moving.items() if j in self.loop.running}
        self.up_judged = {j: r for j, r in self.up_judged.items() if j in self.loop.running}
        if blocked is not None:
            return
        free: list[NodeCapacity] | None = None
        for job in active:
            elastic, run = job.spec.elastic, self.loop.running.get(job.id)
            if elastic is None or not elastic.scale_up or run is None or \
                    job.state != JobState.RUNNING or job.id in self.moving or \
                    job.elastic is None or run.placement is None:
                continue
            state = ElasticState.of(job)
            if job.world_size >= state.world_size:
                continue
            if free is None:
                free = self.launcher.free_capacity()
            room = _given_back(free, holds(run.placement, job))
            seen = tuple((n.node_id, n.cpus, n.gpus) for n in room)
            if self.up_judged.get(job.id) == seen:
                continue
            self.up_judged[job.id] = seen
            fits = fitting_ranks(job.spec, room)
            if fits <= job.world_size:
                continue
            got: Replan | str = submitted(job.spec, state) if fits >= state.world_size else \
                replan(job.spec, state, room, min_ranks=job.world_size + 1,
                       profile=profile_for(self.store, job.spec.target.gpu))
            if isinstance(got, str) or (got.world_size < state.world_size
                                        and got.step_s >= job.plan.planned_time.step_s):
                continue  # the submitted layout is moved back to as asked; others if faster
            self.loop.fenced()  # stopping ranks is the leader's to do
            run.group.preempt()
            self.moving[job.id] = Move(to=got, asked=time.monotonic())
            self.store.add_event(
                job_id=job.id, attempt=run.attempt, kind="elastic",
                message=f"elastic: the room of {fits} rank(s) is free again; moving to"
                f" {got.plan.layout.label} on {got.world_size} rank(s) (predicted"
                f" {got.step_s:.4g} s/step, now {job.plan.planned_time.step_s:.4g}): its ranks are"
                " asked to save a checkpoint now and stop",
                data={"direction": "up", "asked": True,
                      "from": describe(job.plan, job.world_size),
                      "to": describe(got.plan, got.world_size)})

    def watch(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        """An elastic job moving up: its ranks save and stop; then RESTARTING on the larger
        layout (the attempt ends `moved`, no retry spent). One that finished or failed
        meanwhile ends as it would have."""
        move = self.moving[job.id]
        poll = run.group.poll(self.poll_timeout_s)
        result.metrics += self.loop.record(job, run, poll)
        late = time.monotonic() - move.asked > self.grace_s
        if poll.state == "succeeded":
            self.moving.pop(job.id)
            self.loop.succeed(job, run, result)
            return
        if poll.state == "failed":
            self.moving.pop(job.id)
            self.loop.teardown(job.id, run)
            self.loop.fail_attempt(job, run.attempt, f"attempt {run.attempt}: failed while saving"
                               f" to move up: {run.redact(poll.error or 'a rank failed')}",
                               result)
            return
        if poll.state != "stopped" and not late:
            return
        self.moving.pop(job.id)
        self.loop.teardown(job.id, run)
        why = "its ranks saved a checkpoint and stopped" if poll.state == "stopped" else \
            f"its ranks did not stop within {self.grace_s:g} s"
        self.store.end_attempt(job_id=job.id, number=run.attempt, status=AttemptStatus.MOVED,
                               error=f"moved to a larger layout: {why}")
        moved = self.loop.move(job, JobState.RESTARTING, f"moving to {move.to.plan.layout.label} on"
                           f" {move.to.world_size} rank(s): {why}; no retry spent", result,
                           attempt=run.attempt)
        if moved is None:
            return
        tags = CheckpointIndex(self.store).list(job_id=job.id)
        try:
            self.moves.relayout(
                job_id=job.id, expect=JobState.RESTARTING, spec=move.to.spec,
                plan=move.to.plan, world_size=move.to.world_size,
                elastic=ElasticState.of(job).to_json(moved_up=True),
                message=moved_message(job, move.to, why="the room of a larger layout is free"
                                      " again (scale_up)",
                                      checkpoint=tags[-1].step if tags else None),
                data={"direction": "up", "from": describe(job.plan, job.world_size),
                      "to": describe(move.to.plan, move.to.world_size),
                      "checkpoint_step": tags[-1].step if tags else None},
                attempt=run.attempt)
        except TransitionError as exc:  # cancelled meanwhile: it ends where it is
            log.info("job %s: %s", job.id, exc)


def _taken(free: list[NodeCapacity], job: Replan) -> list[NodeCapacity]:
    """The free room once `job`'s ranks are placed in it (first fit, as admission packs)."""
    items = bundles(job)
    where = pack(items, free)
    return free if where is None else taken(free, items, where)


def _given_back(free: list[NodeCapacity],
                held: dict[str, tuple[float, float]]) -> list[NodeCapacity]:
    """The free room with what a job holds on each node added: the room it could move to."""
    return [NodeCapacity(n.node_id, n.cpus + held.get(n.node_id, (0.0, 0.0))[0],
                         n.gpus + held.get(n.node_id, (0.0, 0.0))[1]) for n in free]
