"""Admission reads the queue a page at a time (`Controller._admit`): a long queue costs a pass
no more than its head, and no job is skipped or admitted out of order. A restarting job keeps
its room while its old group is stopped, or goes back to the queue by its priority (and
preempts) when that room is gone, instead of starting where there is no room."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.control import controller as controller_mod
from service.store import AttemptStatus, Store
from tests.fakes import FakeLauncher, FakeRoomLauncher, make, submit
from tests.waiting import drive

PLACED = {"ranks": [{"rank": 0, "node_id": "n0"}, {"rank": 1, "node_id": "n0"}]}


def runs() -> list[PollResult]:
    return [PollResult(state="running", placement=PLACED)] + [PollResult(state="running")] * 50


def fails() -> list[PollResult]:
    return [PollResult(state="running", placement=PLACED),
            PollResult(state="failed", error="boom")]


def _pages(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, int]]:
    calls: list[tuple[int | None, int]] = []
    real = store.queued_jobs

    def spy(*, limit: int | None = None, offset: int = 0):  # type: ignore[no-untyped-def]
        calls.append((limit, offset))
        return real(limit=limit, offset=offset)

    monkeypatch.setattr(store, "queued_jobs", spy)
    return calls


def test_a_blocked_queue_reads_one_page(sqlite_store: Store, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_mod, "ADMIT_PAGE", 2)
    launcher = FakeLauncher([[PollResult(state="running")]] * 5, cpus=1)  # room for one job
    ids = [submit(sqlite_store, resources={"cpus_per_worker": 0.5}) for _ in range(5)]
    calls = _pages(sqlite_store, monkeypatch)
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert calls == [(2, 0)]
    assert [sqlite_store.get_job(job_id=i).state for i in ids] == [
        JobState.PLACING] + [JobState.QUEUED] * 4


def test_impossible_jobs_fill_a_page_and_the_next_page_is_admitted(
        sqlite_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_mod, "ADMIT_PAGE", 2)
    launcher = FakeLauncher([[PollResult(state="running")]] * 3, cpus=4)
    too_big = [submit(sqlite_store, resources={"cpus_per_worker": 3}) for _ in range(2)]
    fits = [submit(sqlite_store, resources={"cpus_per_worker": 0.5}) for _ in range(3)]
    calls = _pages(sqlite_store, monkeypatch)
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert [sqlite_store.get_job(job_id=i).state for i in too_big] == [JobState.FAILED] * 2
    # The first page was all impossible (failed): the next page is read in the same pass and
    # admitted in order; having admitted, the pass stops there.
    assert calls == [(2, 0), (2, 0)]
    assert [sqlite_store.get_job(job_id=i).state for i in fits] == [
        JobState.PLACING, JobState.PLACING, JobState.QUEUED]
    c.step()
    assert sqlite_store.get_job(job_id=fits[2]).state == JobState.PLACING


def _stopping_slowly(cpus: float, scripts: list[list[PollResult]]) -> FakeRoomLauncher:
    """One node whose groups' room is free as soon as they begin to stop, while their
    teardowns (beside the loop) wait for `release`: the gap a restarting job waits out."""
    launcher = FakeRoomLauncher(scripts, cpus=cpus)
    launcher.freed_early = True
    launcher.release = threading.Event()
    return launcher


def _no_start_timeout(store: Store, job_id: int) -> None:
    errors = [a.error or "" for a in store.list_attempts(job_id=job_id)]
    assert not any("did not start" in e for e in errors), errors


def test_a_restarting_job_keeps_its_room_from_a_job_of_lower_priority(
        sqlite_store: Store, tmp_path: Path) -> None:
    launcher = _stopping_slowly(1, [fails(), runs(), runs()])  # room for one job
    high = submit(sqlite_store, name="high", priority=5, max_retries=2)
    c = make(sqlite_store, launcher, tmp_path, poll_timeout_s=0)
    c.step(), c.step(), c.step()  # placed, running, failed: its group is being stopped
    assert sqlite_store.get_job(job_id=high).state == JobState.RESTARTING
    low = submit(sqlite_store, name="low", priority=0)
    c.step()  # the old group's room is free already, the teardown not done: it is high's
    assert sqlite_store.get_job(job_id=low).state == JobState.QUEUED
    assert c.teardowns.busy(("job", high)) and launcher.free_capacity()[0].cpus == 1
    assert launcher.release is not None
    launcher.release.set()
    assert c.teardowns.wait(30)
    c.step()  # high restarts into its room, the retry of its failure only
    c.step()
    job = sqlite_store.get_job(job_id=high)
    assert job.state == JobState.RUNNING and job.attempts == 2
    assert sqlite_store.get_job(job_id=low).state == JobState.QUEUED
    assert [s["spec"].name for s in launcher.started] == ["high", "high"]
    _no_start_timeout(sqlite_store, high)


def test_a_restart_without_room_goes_back_to_the_queue_by_its_priority_and_preempts(
        sqlite_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two jobs' room: high (5) and low (0) run; high fails, and while its group stops, top
    # (9) takes its room, as a job of higher priority may. high cannot be placed in the free
    # room then: it is queued ahead of low's priority and preempts low, spending no retry.
    launcher = _stopping_slowly(2, [fails(), runs(), runs(), runs()])
    high = submit(sqlite_store, name="high", priority=5, max_retries=1)
    low = submit(sqlite_store, name="low", priority=0)
    c = make(sqlite_store, launcher, tmp_path, poll_timeout_s=0)
    c.step(), c.step(), c.step()
    assert sqlite_store.get_job(job_id=high).state == JobState.RESTARTING
    top = submit(sqlite_store, name="top", priority=9)
    c.step()
    assert sqlite_store.get_job(job_id=top).state == JobState.PLACING
    assert not launcher.groups[1].preempted  # high's room was coming back: nothing preempted
    assert launcher.release is not None
    launcher.release.set()
    assert c.teardowns.wait(30)
    c.step()  # its group just stopped: its claim holds a moment (Ray frees room late)
    assert sqlite_store.get_job(job_id=high).state == JobState.RESTARTING
    assert not launcher.groups[1].preempted
    monkeypatch.setattr(controller_mod, "RESTART_SETTLE_S", 0.0)  # that moment is over
    c.step()  # high: no free room; queued by its priority, and low is asked to stop
    job = sqlite_store.get_job(job_id=high)
    assert job.state == JobState.QUEUED and job.priority == 5 and job.attempts == 1
    [requeued] = [e for e in sqlite_store.list_events(job_id=high)
                  if e.kind == "state" and e.message.startswith("waiting for room")]
    assert requeued.data["to"] == "QUEUED" and "keeps its priority (5)" in requeued.message
    assert launcher.groups[1].preempted
    assert sqlite_store.get_job(job_id=low).state == JobState.PREEMPTED
    drive(c, sqlite_store, high, {JobState.RUNNING, JobState.FAILED}, timeout=60)
    job = sqlite_store.get_job(job_id=high)
    assert job.state == JobState.RUNNING and job.attempts == 2
    assert [a.status for a in sqlite_store.list_attempts(job_id=high)] == [
        AttemptStatus.FAILED, AttemptStatus.RUNNING]
    assert [s["spec"].name for s in launcher.started] == ["high", "low", "top", "high"]
    _no_start_timeout(sqlite_store, high)
