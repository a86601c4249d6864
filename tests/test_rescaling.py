"""`Rescaling` alone, beside a recording loop (`FakeLoop`, the controller's hands as `Loop`
states them): a move up is judged once per room and never while admission waits for room, and
a job moving up ends as its ranks do (saved and stopped or past the grace: RESTARTING on the
larger layout, the attempt `moved`; failed while saving: the failure policy). The controller's
whole choreography is in tests/test_elastic.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from service.cluster.data_plane import NodeCapacity, PollResult
from service.contract.states import JobState
from service.control.control_pass import StepResult
from service.control.rescaling import Move, Rescaling
from service.control.teardown import Teardowns
from service.policy.elastic_replan import ElasticState, replan, submitted
from service.store import AttemptStatus, Job, Store
from service.store.elastic import ElasticMoves
from tests.fakes import FakeGroup, FakeLoop, FakeNodesLauncher, live, submit

ELASTIC: dict[str, Any] = {"min_ranks": 1, "wait_s": 0, "scale_up": True}
ONE_CPU: dict[str, Any] = {"gpus_per_worker": 0, "cpus_per_worker": 1}


def shrunk(store: Store, loop: FakeLoop, group: FakeGroup) -> Job:
    """A scale_up job submitted on 4 ranks, re-planned onto 1 (on n0) and RUNNING there."""
    job_id = submit(store, parallel={"dp": 4, "zero": 1}, elastic=ELASTIC, resources=ONE_CPU,
                    checkpoint={"every_steps": 1}, max_retries=1)
    job = store.get_job(job_id=job_id)
    got = replan(job.spec, ElasticState.of(job), [NodeCapacity("n0", 1, 0)], min_ranks=1)
    assert not isinstance(got, str), got
    ElasticMoves(store).relayout(job_id=job_id, expect=JobState.QUEUED, spec=got.spec,
                                 plan=got.plan, world_size=got.world_size,
                                 elastic=ElasticState.of(job).to_json(), message="re-planned",
                                 data={"direction": "down"})
    return live(store, loop, group, job_id, {"ranks": [{"rank": 0, "node_id": "n0"}]})


def test_a_move_up_is_judged_once_per_room_and_never_while_admission_waits(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def planner(*args: Any, **kw: Any) -> str:  # the planner finds no faster layout
        asked.append(kw["min_ranks"])
        return "no layout is predicted faster"

    monkeypatch.setattr("service.control.rescaling.replan", planner)
    loop = FakeLoop(store, Teardowns(0.1))
    group = FakeGroup([PollResult(state="running")])
    job = shrunk(store, loop, group)
    launcher = FakeNodesLauncher([], {"n0": 0, "n1": 0})  # its own rank's room only
    r = Rescaling(loop, store, launcher, grace_s=300, poll_timeout_s=0)  # type: ignore[arg-type]

    def up(blocked: int | None = None) -> None:
        r.up(store.active_jobs(), blocked)

    up()
    assert not asked and not r.moving  # room for its one rank: nothing to judge
    launcher.nodes["n1"] = 1
    up(blocked=job.id + 1)  # a queued job waits for room: that room is its
    assert not asked and not group.preempted
    up()
    up()  # the same room: the planner is not asked again
    assert asked == [2]
    launcher.nodes["n1"] = 2
    up()  # room for 3: asked again
    assert asked == [2, 2] and not group.preempted
    launcher.nodes["n1"] = 3  # room for its submitted 4 ranks: moved back to them
    up()
    assert asked == [2, 2] and group.preempted and ("fenced", 0) in loop.calls
    assert r.moving[job.id].to.world_size == 4
    said = [e for e in store.list_events(job_id=job.id) if e.kind == "elastic"][-1]
    assert said.data["direction"] == "up" and said.data["asked"] is True
    assert said.message.startswith("elastic: the room of 4 rank(s) is free again; moving to")
    up()
    assert asked == [2, 2]  # a job moving up is not judged again


def moving(store: Store, loop: FakeLoop, after: PollResult, *,
           asked_s_ago: float = 0.0) -> tuple[Job, Rescaling]:
    group = FakeGroup([PollResult(state="running")], after_cancel=after)
    job = shrunk(store, loop, group)
    launcher = FakeNodesLauncher([], {"n0": 4})
    r = Rescaling(loop, store, launcher, grace_s=300, poll_timeout_s=0)  # type: ignore[arg-type]
    group.preempt()
    r.moving[job.id] = Move(to=submitted(job.spec, ElasticState.of(job)),
                            asked=time.monotonic() - asked_s_ago)
    return job, r


@pytest.mark.parametrize(("after", "asked_s_ago", "why"), [
    (PollResult(state="stopped"), 0.0, "its ranks saved a checkpoint and stopped"),
    (PollResult(state="running"), 301.0, "its ranks did not stop within 300 s")],
    ids=["stopped", "past-the-grace"])
def test_a_job_moving_up_restarts_on_the_larger_layout_without_a_retry(
        store: Store, tmp_path: Path, after: PollResult, asked_s_ago: float, why: str) -> None:
    loop = FakeLoop(store, Teardowns(0.1))
    job, r = moving(store, loop, after, asked_s_ago=asked_s_ago)
    result = StepResult()
    r.watch(job, loop.running[job.id], result)
    assert not r.moving and job.id not in loop.running and ("record", job.id) in loop.calls
    [attempt] = store.list_attempts(job_id=job.id)
    assert attempt.status == AttemptStatus.MOVED
    assert attempt.error == f"moved to a larger layout: {why}"
    moved = store.get_job(job_id=job.id)
    assert moved.state == JobState.RESTARTING and moved.world_size == 4 and moved.moves_up == 1
    assert [(c.job_id, c.to) for c in result.changes] == [(job.id, JobState.RESTARTING)]
    assert result.changes[0].message.endswith(f"{why}; no retry spent")
    up = [e for e in store.list_events(job_id=job.id) if e.kind == "elastic"][-1]
    assert up.data["direction"] == "up" and up.data["to"]["world_size"] == 4
    assert loop.teardowns.wait(30)


def test_a_job_moving_up_that_is_still_saving_waits_and_one_that_failed_fails(
        store: Store) -> None:
    loop = FakeLoop(store, Teardowns(0.1))
    job, r = moving(store, loop, PollResult(state="running"))
    r.watch(job, loop.running[job.id], StepResult())  # saving, within the grace
    assert job.id in r.moving and job.id in loop.running
    assert store.get_job(job_id=job.id).state == JobState.RUNNING

    failed, r = moving(store, loop, PollResult(state="failed", error="rank 0: disk full"))
    r.watch(failed, loop.running[failed.id], StepResult())
    assert not r.moving and failed.id not in loop.running
    assert ("fail", failed.id) in loop.calls
    assert loop.errors[failed.id] == "attempt 1: failed while saving to move up: rank 0: disk full"
    assert loop.teardowns.wait(30)
