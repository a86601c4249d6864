"""`Preemptions` alone, beside a recording loop (`FakeLoop`, the controller's hands as `Loop`
states them): one preemption at a time until every victim's room is given back, jobs moving up
never chosen, a victim that finished meanwhile succeeds, and a requeue after a new controller
names no preempting job. The controller's whole choreography is in tests/test_preemption.py."""

from __future__ import annotations

import threading
from typing import Any

from service.cluster.data_plane import NodeCapacity, PollResult
from service.contract.states import JobState
from service.control.control_pass import StepResult
from service.control.preempting import Preemptions
from service.control.teardown import Teardowns
from service.store import AttemptStatus, Job, Store
from service.store.quota_waits import QuotaNotes
from tests.fakes import FakeGroup, FakeLoop, live, submit

PLACED = {"ranks": [{"rank": 0, "node_id": "n0"}, {"rank": 1, "node_id": "n0"}]}


class Full:
    """A one-node cluster with no free room."""

    def free_capacity(self) -> list[NodeCapacity]:
        return [NodeCapacity("n0", 0, 0)]


def running(store: Store, hands: FakeLoop, group: FakeGroup, **over: Any) -> Job:
    return live(store, hands, group, submit(store, **over), PLACED)


def preemptions(store: Store, hands: FakeLoop, *, grace_s: float = 300.0) -> Preemptions:
    return Preemptions(hands, store, Full(), hands.teardowns,  # type: ignore[arg-type]
                       QuotaNotes(store), grace_s=grace_s, poll_timeout_s=0)


def test_one_preemption_at_a_time_until_the_victims_room_is_given_back(store: Store) -> None:
    hands = FakeLoop(store, Teardowns(0.1))
    release = threading.Event()
    low = running(store, hands, FakeGroup([PollResult(state="running")], release=release,
                                          after_cancel=PollResult(state="stopped")),
                  name="low")
    p = preemptions(store, hands)
    high = store.get_job(job_id=submit(store, name="high", priority=10))
    result = StepResult()
    p.start(high, store.active_jobs(), result)
    assert hands.running[low.id].group.preempted and ("fenced", 0) in hands.calls
    assert [(c.job_id, c.to) for c in result.changes] == [(low.id, JobState.PREEMPTED)]
    assert set(p.victims) == {low.id} and p.victims[low.id].by == high.id
    [took] = [e for e in store.list_events(job_id=high.id) if e.kind == "preempting"]
    assert took.data == {"victims": [low.id]}

    p.watch(store.get_job(job_id=low.id), hands.running[low.id], result)  # saved, stopped
    job = store.get_job(job_id=low.id)
    assert job.state == JobState.QUEUED and job.preemptions == 1
    assert low.id not in hands.running and ("record", low.id) in hands.calls
    [attempt] = store.list_attempts(job_id=low.id)
    assert attempt.status == AttemptStatus.PREEMPTED
    assert attempt.error == f"preempted by job {high.id}: its ranks saved and stopped"
    assert job.waiting == f"preempted by job {high.id}; resumes from its checkpoint when there" \
        " is room"

    # Its group is still stopping: its room is not back, so another running job is not
    # preempted for a second blocked job yet.
    other = running(store, hands, FakeGroup([PollResult(state="running")]), name="other")
    higher = store.get_job(job_id=submit(store, name="higher", priority=20))
    p.start(higher, store.active_jobs(), StepResult())
    assert not hands.running[other.id].group.preempted and set(p.victims) == {low.id}
    release.set()
    assert hands.teardowns.wait(30)
    p.start(higher, store.active_jobs(), StepResult())  # its room is back: the next one
    assert hands.running[other.id].group.preempted and set(p.victims) == {other.id}


def test_a_job_that_is_stopping_already_is_never_chosen(store: Store) -> None:
    hands = FakeLoop(store, Teardowns(0.1))
    moving = running(store, hands, FakeGroup([PollResult(state="running")]), name="moving")
    p = preemptions(store, hands)
    high = store.get_job(job_id=submit(store, name="high", priority=10))
    p.start(high, store.active_jobs(), StepResult(), stopping={moving.id})
    assert not hands.running[moving.id].group.preempted and not p.victims
    assert store.get_job(job_id=moving.id).state == JobState.RUNNING
    assert not [e for e in store.list_events(job_id=high.id) if e.kind == "preempting"]
    p.start(high, store.active_jobs(), StepResult())
    assert hands.running[moving.id].group.preempted


def test_a_victim_that_finished_meanwhile_succeeds_and_one_past_the_grace_is_requeued(
        store: Store) -> None:
    hands = FakeLoop(store, Teardowns(0.1))
    done = running(store, hands, FakeGroup([PollResult(state="running")],
                                           after_cancel=PollResult(state="succeeded")),
                   name="done")
    p = preemptions(store, hands, grace_s=0)
    high = store.get_job(job_id=submit(store, name="high", priority=10))
    p.start(high, store.active_jobs(), StepResult())
    p.watch(store.get_job(job_id=done.id), hands.running[done.id], StepResult())
    assert ("succeed", done.id) in hands.calls
    assert store.get_job(job_id=done.id).state == JobState.PREEMPTED  # the loop ends it

    slow = running(store, hands, FakeGroup([PollResult(state="running")],
                                           after_cancel=PollResult(state="running")),
                   name="slow")
    p.victims.clear()
    hands.running.pop(done.id)
    store.transition(job_id=done.id, to=JobState.SUCCEEDED, message="finished")
    p.start(high, store.active_jobs(), StepResult())
    p.watch(store.get_job(job_id=slow.id), hands.running[slow.id], StepResult())
    assert store.get_job(job_id=slow.id).state == JobState.QUEUED
    assert store.list_attempts(job_id=slow.id)[0].error == \
        f"preempted by job {high.id}: its ranks did not stop within 0 s"
    assert hands.teardowns.wait(30)


def test_a_requeue_after_a_new_controller_names_no_preempting_job(store: Store) -> None:
    hands = FakeLoop(store, Teardowns(0.1))
    gone = running(store, hands, FakeGroup([PollResult(state="running")]), name="gone")
    store.transition(job_id=gone.id, to=JobState.PREEMPTED, message="preempted", attempt=1)
    hands.running.clear()  # a new controller: its group is gone, no victim known
    p = preemptions(store, hands)
    p.requeue(store.get_job(job_id=gone.id), 1, "its worker group is gone", StepResult())
    job = store.get_job(job_id=gone.id)
    assert job.state == JobState.QUEUED
    assert store.list_attempts(job_id=gone.id)[0].error == \
        "preempted by a job of higher priority: its worker group is gone"
    [note] = [e for e in store.list_events(job_id=gone.id) if e.kind == "preempted"]
    assert note.data["preempted_by"] is None
