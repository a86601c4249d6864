"""Cancel and teardown never hold up the controller's pass: groups are stopped beside the loop
(fake worker groups whose shutdown blocks until the test lets it end)."""

from __future__ import annotations

import threading
from pathlib import Path

from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.store import AttemptStatus, Store
from tests.fakes import FakeLauncher, make, step_report, stopped, submit

RUNNING = PollResult(state="running")


def states(store: Store, job_id: int) -> list[str]:
    return [e.data["to"] for e in store.list_events(job_id=job_id) if e.kind == "state"]


def test_a_slow_teardown_does_not_block_the_pass(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[RUNNING], [RUNNING]], cpus=2)
    launcher.release = threading.Event()
    first = submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    sqlite_store.request_cancel(job_id=first)
    second = submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    # The pass that sees the cancel ends while the first group is still stopping, and it
    # goes on to admit the next job.
    changes = [(ch.job_id, ch.to) for ch in c.step().changes]
    assert changes == [(first, JobState.CANCELLED), (second, JobState.PLACING)]
    assert c.teardowns.busy(("job", first)) and not launcher.groups[0].shut
    assert [ch.to for ch in c.step().changes] == [JobState.RUNNING]
    assert sqlite_store.list_attempts(job_id=first)[0].status == AttemptStatus.CANCELLED

    launcher.release.set()
    assert stopped(c, launcher.groups[0]) and not launcher.groups[1].shut
    c.step()
    freed = [e for e in sqlite_store.list_events(job_id=first) if e.kind == "teardown"]
    assert len(freed) == 1 and freed[0].attempt == 1 and "resources freed" in freed[0].message
    assert not c.teardowns.busy(("job", first))


def test_cancel_while_placing_never_reaches_running(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="starting"), RUNNING]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    assert sqlite_store.get_job(job_id=job_id).state == JobState.PLACING
    sqlite_store.request_cancel(job_id=job_id)
    assert [ch.to for ch in c.step().changes] == [JobState.CANCELLED]
    group = launcher.groups[0]
    assert group.polls == 1  # not polled again after the cancel: it never starts
    assert group.cancelled and stopped(c, group)
    assert states(sqlite_store, job_id) == ["QUEUED", "PLACING", "CANCELLED"]
    assert not any("ranks running" in e.message for e in sqlite_store.list_events(job_id=job_id))


def test_cancel_that_races_the_start_is_not_reported_running(sqlite_store: Store,
                                                            tmp_path: Path) -> None:
    """The cancel arrives after the pass read the job, while its group reports running."""
    launcher = FakeLauncher([[RUNNING]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    launcher.groups[0].on_poll = lambda: sqlite_store.request_cancel(job_id=job_id)
    assert c.step().changes == []
    assert [ch.to for ch in c.step().changes] == [JobState.CANCELLED]
    assert states(sqlite_store, job_id) == ["QUEUED", "PLACING", "CANCELLED"]
    assert stopped(c, launcher.groups[0])


def test_four_cancels_in_one_pass(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[RUNNING] for _ in range(4)], cpus=4)
    launcher.release = threading.Event()
    jobs = [submit(sqlite_store, resources={"cpus_per_worker": 0.5}) for _ in range(4)]
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    assert all(sqlite_store.get_job(job_id=j).state == JobState.RUNNING for j in jobs)
    for j in jobs:
        sqlite_store.request_cancel(job_id=j)
    changes = c.step().changes
    assert sorted(ch.job_id for ch in changes if ch.to == JobState.CANCELLED) == jobs
    assert c.teardowns.pending == 4 and not c.running
    launcher.release.set()
    assert all(stopped(c, g) for g in launcher.groups)


def test_next_attempt_waits_for_the_last_group_to_stop(sqlite_store: Store,
                                                      tmp_path: Path) -> None:
    """A restart never shares the checkpoint directory or resources with the ranks of the
    attempt before it."""
    launcher = FakeLauncher([[RUNNING, PollResult(state="failed", error="x")], [RUNNING]])
    launcher.release = threading.Event()
    job_id = submit(sqlite_store, max_retries=1)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step(), c.step()
    assert sqlite_store.get_job(job_id=job_id).state == JobState.RESTARTING
    c.step(), c.step()
    assert len(launcher.groups) == 1
    assert sqlite_store.get_job(job_id=job_id).state == JobState.RESTARTING
    launcher.release.set()
    assert stopped(c, launcher.groups[0])
    c.step()
    assert len(launcher.groups) == 2 and launcher.groups[1].starts["attempt"] == 2
    assert sqlite_store.get_job(job_id=job_id).state == JobState.PLACING


def test_controller_shutdown_waits_for_the_teardowns(sqlite_store: Store,
                                                     tmp_path: Path) -> None:
    launcher = FakeLauncher([[RUNNING], [RUNNING]], cpus=2)
    launcher.release = threading.Event()
    cancelled = submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    sqlite_store.request_cancel(job_id=cancelled)
    c.step()
    timer = threading.Timer(0.2, launcher.release.set)
    timer.start()
    c.shutdown(stop_jobs=True)
    timer.join()
    assert all(g.shut for g in launcher.groups) and c.teardowns.pending == 0


def test_controller_shutdown_is_bounded(sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[RUNNING]])
    launcher.release = threading.Event()
    submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path, shutdown_timeout_s=0.1)
    c.step(), c.step()
    c.shutdown(stop_jobs=True)  # returns with the group still stopping
    assert c.teardowns.pending == 1 and not launcher.groups[0].shut
    launcher.release.set()
    assert stopped(c, launcher.groups[0])


def test_a_cancelled_groups_last_reports_are_stored_from_beside_the_pass(
        sqlite_store: Store, tmp_path: Path) -> None:
    """The pass that sees the cancel does not poll the group: CANCELLED at once. The group's
    last poll runs on its teardown thread, and what it brought (the ranks' reports not stored
    yet) is stored when a later pass reaps the teardown, before the teardown's event."""
    first = PollResult(state="running", reports=[step_report(r, 1, 5.0) for r in (0, 1)],
                       acks={0: 1, 1: 1})
    launcher = FakeLauncher([[first]])
    launcher.release = threading.Event()
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    group = launcher.groups[0]
    group.after_cancel = PollResult(state="stopped", reports=[
        step_report(r, s, 4.0) for s in (2, 3) for r in (0, 1)], acks={0: 3, 1: 3})
    polls = group.polls
    sqlite_store.request_cancel(job_id=job_id)
    assert [ch.to for ch in c.step().changes] == [JobState.CANCELLED]
    assert group.cancelled and not group.shut
    launcher.release.set()
    assert stopped(c, group)
    assert group.polls == polls + 1 and group.poll_threads[-1] == f"teardown-job{job_id}"
    assert [m.step for m in sqlite_store.list_metrics(job_id=job_id)] == [1]
    c.step()  # reaps the teardown: the drained reports are stored
    assert [(m.step, m.rank) for m in sqlite_store.list_metrics(job_id=job_id, rank=None)] == [
        (s, r) for s in (1, 2, 3) for r in (0, 1)]
    kinds = [e.kind for e in sqlite_store.list_events(job_id=job_id)]
    assert kinds[-1] == "teardown"
    assert sqlite_store.get_job(job_id=job_id).state == JobState.CANCELLED


def test_a_controller_that_stops_stores_what_its_cancelled_groups_drained(
        sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[RUNNING]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    launcher.groups[0].after_cancel = PollResult(state="stopped",
                                                 reports=[step_report(0, 7, 1.0)])
    sqlite_store.request_cancel(job_id=job_id)
    c.step()
    c.shutdown()  # no further pass: shutdown reaps the teardown it waited for
    assert [m.step for m in sqlite_store.list_metrics(job_id=job_id)] == [7]
    assert [e.kind for e in sqlite_store.list_events(job_id=job_id)][-1] == "teardown"


def test_a_failed_groups_last_reports_are_stored(sqlite_store: Store, tmp_path: Path) -> None:
    """A rank fails: the pass that sees it stops the group, while the ranks that did not fail
    may hold steps that no poll brought yet. The teardown polls the group once more, and what
    that brings is stored under the failed attempt, as for a cancel."""
    failed = PollResult(state="failed", error="rank 1 died", failed_ranks=[1],
                        reports=[step_report(0, 1, 5.0)], acks={0: 1})
    late = PollResult(state="failed", error="rank 1 died", failed_ranks=[1],
                      reports=[step_report(0, 2, 4.0)], acks={0: 2})
    launcher = FakeLauncher([[RUNNING, failed, late], [RUNNING]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    c.step()  # sees the failure: the attempt fails, the group is torn down
    group = launcher.groups[0]
    assert stopped(c, group)
    assert group.poll_threads[-1] == f"teardown-job{job_id}"
    c.step()  # reaps the teardown: the drained step is stored
    assert [m.step for m in sqlite_store.list_metrics(job_id=job_id, attempt=1)] == [1, 2]
