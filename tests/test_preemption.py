"""Preemption by priority with the controller's fakes: the choice of victims (pure), a
queued job of higher priority taking a running job's room (asked to save, PREEMPTED, QUEUED,
resumed without spending a retry, events naming both), what is never preempted, and each
project's priority cap at submission (REST)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from service.cluster.data_plane import NodeCapacity, PollResult
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.controller import Controller
from service.policy.scheduler import Running, preemption_victims
from service.settings import Settings
from service.store import AttemptStatus, Store
from service.store.checkpoints import CheckpointIndex
from service.store.identity import Identity
from service.submission.intake import submit as submit_job
from tests.conftest import tiny_spec, user_token
from tests.fakes import FakeGroup, FakeRoomLauncher, step_report
from tests.fakes import job as make_job
from tests.waiting import drive

PLACED = {"ranks": [{"rank": 0, "node_id": "n0"}, {"rank": 1, "node_id": "n0"}]}


def running_script(*, steps: int = 50) -> list[PollResult]:
    return [PollResult(state="running", placement=PLACED)] + \
        [PollResult(state="running")] * steps


def submit(store: Store, **over: Any) -> int:
    return submit_job(store, JobSpec.model_validate(tiny_spec(**over))).id


def test_victims_are_the_fewest_gpu_hours_lost_and_no_more_than_needed() -> None:
    free = [NodeCapacity("n0", 0, 0), NodeCapacity("n1", 0, 0)]
    high = make_job(1, world=4, gpus=1, priority=10)

    def run(job_id: int, node: str, gpus: float, lost: float, priority: int = 0) -> Running:
        return Running(job=make_job(job_id, world=int(gpus), gpus=1, priority=priority),
                       holds={node: (gpus, gpus)}, lost_gpu_hours=lost, lost_cpu_hours=lost)

    a, b, c = run(2, "n0", 4, lost=3.0), run(3, "n1", 2, lost=1.0), run(4, "n1", 2, lost=2.0)
    # b (1.0) is taken first, then c (2.0): together they free n1's 4 GPUs, and a (3.0)
    # is never needed.
    assert [v.job.id for v in preemption_victims(high, free, [a, b, c]) or []] == [3, 4]
    # When a is cheapest it alone makes room: b, c stay.
    a = run(2, "n0", 4, lost=0.5)
    assert [v.job.id for v in preemption_victims(high, free, [a, b, c]) or []] == [2]
    # Taken early but needless once a later one is taken: dropped again.
    small = run(5, "n0", 1, lost=0.1)
    assert [v.job.id for v in preemption_victims(high, free, [small, a]) or []] == [2]
    # Equal priority never; not enough room even with all of them: none.
    equal = run(6, "n0", 4, lost=0.0, priority=10)
    assert preemption_victims(high, free, [equal]) is None
    assert preemption_victims(high, free, [run(7, "n0", 2, lost=0.0)]) is None


def test_a_high_priority_job_preempts_a_lower_one_which_resumes_without_spending_a_retry(
        store: Store, tmp_path: Path) -> None:
    low = submit(store, name="low", max_retries=1, checkpoint={"every_steps": 100})
    launcher = FakeRoomLauncher([
        running_script(),                                                     # low, attempt 1
        [PollResult(state="running", placement=PLACED), PollResult(state="succeeded")],  # high
        [PollResult(state="running", placement=PLACED), PollResult(state="failed",
                                                                   error="boom")],  # low, 2
        [PollResult(state="running", placement=PLACED), PollResult(state="succeeded")],  # 3
    ], cpus=1)
    c = Controller(store, launcher, checkpoint_root=tmp_path, poll_timeout_s=0)
    c.step()
    c.step()
    assert store.get_job(job_id=low).state == JobState.RUNNING
    saved = step_report(0, 7, 3.0) | {"checkpoint": "/c/step7", "checkpoint_bytes": 1234}
    launcher.groups[0].after_cancel = PollResult(state="stopped", reports=[saved])

    high = submit(store, name="high", priority=10)
    c.step()  # high cannot be placed: low is asked to save now and stop
    assert launcher.groups[0].preempted
    assert store.get_job(job_id=low).state == JobState.PREEMPTED
    c.step()  # low's ranks saved and stopped: requeued
    job = store.get_job(job_id=low)
    assert job.state == JobState.QUEUED and job.preemptions == 1
    assert job.waiting == f"preempted by job {high}; resumes from its checkpoint when there is room"
    assert [a.status for a in store.list_attempts(job_id=low)] == [AttemptStatus.PREEMPTED]
    assert [t.step for t in CheckpointIndex(store).list(job_id=low)] == [7]
    drive(c, store, low, {JobState.SUCCEEDED, JobState.FAILED}, timeout=120)
    assert store.get_job(job_id=high).state == JobState.SUCCEEDED
    job = store.get_job(job_id=low)
    # Attempt 2 failed and was retried (max_retries 1): the preempted attempt spent none.
    assert job.state == JobState.SUCCEEDED, store.list_events(job_id=low)
    assert [a.status for a in store.list_attempts(job_id=low)] == [
        AttemptStatus.PREEMPTED, AttemptStatus.FAILED, AttemptStatus.SUCCEEDED]
    # high started only once low's room was back, and before low's next attempt.
    assert [s["spec"].name for s in launcher.started] == ["low", "high", "low", "low"]

    events = store.list_events(job_id=low)
    [asked] = [e for e in events if e.data.get("to") == "PREEMPTED"]
    assert asked.data["preempted_by"] == high
    assert asked.message.startswith(f"preempted by job {high} (high, priority 10 > 0)")
    assert any(e.kind == "preempted" and e.data["preempted_by"] == high for e in events)
    [took] = [e for e in store.list_events(job_id=high) if e.kind == "preempting"]
    assert took.data == {"victims": [low]} and f"job {low} (priority 0)" in took.message


@pytest.mark.parametrize("over", [{"priority": 10}, {"preemptible": False}],
                         ids=["equal-priority", "not-preemptible"])
def test_what_is_never_preempted(store: Store, tmp_path: Path, over: dict[str, Any]) -> None:
    low = submit(store, name="low", **over)
    launcher = FakeRoomLauncher([running_script(), running_script()], cpus=1)
    c = Controller(store, launcher, checkpoint_root=tmp_path, poll_timeout_s=0)
    c.step()
    c.step()
    high = submit(store, name="high", priority=10)
    for _ in range(3):
        c.step()
    assert store.get_job(job_id=low).state == JobState.RUNNING
    assert store.get_job(job_id=high).state == JobState.QUEUED
    assert not launcher.groups[0].preempted and len(launcher.groups) == 1


def test_a_preempted_job_whose_ranks_do_not_stop_is_requeued_after_the_grace(
        store: Store, tmp_path: Path) -> None:
    low = submit(store, name="low")
    launcher = FakeRoomLauncher([running_script(), running_script()], cpus=1)
    c = Controller(store, launcher, checkpoint_root=tmp_path, poll_timeout_s=0,
                   preempt_grace_s=0)
    c.step()
    c.step()
    launcher.groups[0].after_cancel = PollResult(state="running")  # saving, slowly
    submit(store, name="high", priority=10)
    c.step()
    c.step()
    job = store.get_job(job_id=low)
    assert job.state == JobState.QUEUED
    assert "did not stop within 0 s" in (store.list_attempts(job_id=low)[0].error or "")
    assert isinstance(launcher.groups[0], FakeGroup)


def test_a_project_caps_the_priority_of_its_members_jobs(store: Store, tmp_path: Path) -> None:
    admin = user_token(store)
    member = user_token(store, "mia", "member", projects=("vision",))
    app = create_app(Settings(data_dir=tmp_path), store=store)
    with TestClient(app) as api:
        def as_(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        r = api.put("/api/v1/projects/vision/quota", json={"max_priority": 5},
                    headers=as_(admin))
        assert r.status_code == 200 and r.json()["max_priority"] == 5
        r = api.put("/api/v1/projects/vision/quota", json={"max_priority": 5000},
                    headers=as_(admin))
        assert r.status_code == 422 and "max_priority" in str(r.json())
        r = api.put("/api/v1/projects/vision/quota", json={"max_priority": 1},
                    headers=as_(member))
        assert r.status_code == 403

        def submit_as(token: str, **over: Any) -> Any:
            return api.post("/api/v1/jobs?project=vision", json=tiny_spec(**over),
                            headers=as_(token))

        r = submit_as(member, priority=6)
        assert r.status_code == 403
        assert r.json()["detail"].startswith(
            "priority: 6 is above project vision's cap (max_priority 5)")
        assert submit_as(member, priority=5).status_code == 201
        assert submit_as(admin, priority=6).status_code == 201  # admins are not capped
        r = submit_as(member, preemptible=False)
        assert r.status_code == 403 and r.json()["detail"].startswith("preemptible:")
        assert submit_as(admin, preemptible=False).status_code == 201
        # A resubmission is checked as a submission: the cap lowered since refuses it.
        mine = submit_as(member, priority=5).json()["id"]
        Identity(store).set_quota(name="vision", gpu_quota=None, cpu_quota=None,
                                  max_priority=2)
        r = api.post(f"/api/v1/jobs/{mine}/resubmit", headers=as_(member))
        assert r.status_code == 403 and "max_priority 2" in r.json()["detail"]
        # Lifted: a PUT without it.
        r = api.put("/api/v1/projects/vision/quota", json={}, headers=as_(admin))
        assert r.json()["max_priority"] is None
        assert submit_as(member, priority=1000).status_code == 201


@pytest.mark.slow
def test_preempted_ranks_save_where_they_stop_and_the_next_attempt_loses_nothing(
        tmp_path: Path) -> None:
    """Real ranks (PP 2, no periodic save due before the end) asked to save now and stop
    after step 3: tag step3 is written, reported once more with step 3's report, and the next
    attempt resumes there with the losses of an uninterrupted run."""
    from tests.workers_spawn import losses, run_ranks
    from workers.checkpoint.saving import MARKER

    spec = JobSpec.model_validate(tiny_spec(
        parallel={"pp": 2, "zero": 1}, train={"steps": 6, "global_batch": 8, "micro_batch": 2,
                                              "lr": 1e-3, "precision": "fp32"},
        checkpoint={"every_steps": 100}))
    first, second = run_ranks(spec, checkpoint_dir=str(tmp_path), attempts=[3, None],
                              preempt=True)
    (whole,) = run_ranks(spec)
    assert (tmp_path / "step3" / MARKER).exists()
    saved = [r for r in first if r["checkpoint"]]
    assert sorted(r["rank"] for r in saved) == [0, 1] and {r["step"] for r in saved} == {3}
    assert {r["loss"] for r in saved if r["rank"] == 0} == {losses(first)[2]}
    assert {r["resumed_from"] for r in second} == {3}
    assert losses(second) == losses(whole)[3:], "fp32: the same losses after the preemption"


@pytest.mark.slow
def test_a_preemption_after_a_save_in_the_background_saves_its_own_step(tmp_path: Path) -> None:
    """`checkpoint.async`: tag step2, written in the background, is marked at step 3's
    boundary and reported with step 3; asked to save now and stop after step 3, the ranks
    still save step 3 (an earlier tag in the last report is not the stopping step's), and the
    next attempt resumes there: no step redone."""
    from tests.workers_spawn import losses, run_ranks
    from workers.checkpoint.saving import MARKER

    spec = JobSpec.model_validate(tiny_spec(
        train={"steps": 6, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
               "precision": "fp32"},
        checkpoint={"every_steps": 2, "async": True}))
    first, second = run_ranks(spec, checkpoint_dir=str(tmp_path), attempts=[3, None],
                              preempt=True)
    (whole,) = run_ranks(spec)
    assert (tmp_path / "step2" / MARKER).exists() and (tmp_path / "step3" / MARKER).exists()
    tags = {(r["step"], r["checkpoint_step"], r["checkpoint"].rsplit("/", 1)[-1])
            for r in first if r["rank"] == 0 and r["checkpoint"]}
    assert (3, None, "step3") in tags, tags
    assert {r["resumed_from"] for r in second} == {3}
    assert losses(second) == losses(whole)[3:], "fp32: the same losses after the preemption"
