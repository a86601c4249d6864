"""Jobs outlive the controller: a new controller re-attaches to live groups, resumes from what
the ranks did not get acknowledged, stops groups no active attempt owns, and a report is
acknowledged to the ranks only once it is stored (fake groups; the real ones are in
test_e2e_detached.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.store import AttemptStatus, Store
from service.store.metrics import MetricsIngest
from tests.fakes import FakeGroup, FakeLauncher, make, step_report, submit
from tests.waiting import DEADLINE_S, drive


def running(*steps: int, acks: dict[int, int] | None = None) -> PollResult:
    return PollResult(state="running", reports=[step_report(0, s, 5.0 - s / 10) for s in steps],
                      acks=acks if acks is not None else ({0: steps[-1]} if steps else {}))


def start_one(store: Store, launcher: FakeLauncher, tmp_path: Path) -> tuple[int, FakeGroup]:
    job_id = submit(store, max_retries=1)
    c = make(store, launcher, tmp_path)
    c.step(), c.step()
    assert store.get_job(job_id=job_id).state == JobState.RUNNING
    c.shutdown()  # the controller goes away; by default its groups train on
    return job_id, launcher.groups[0]


def test_shutdown_leaves_groups_running_unless_asked_to_stop_them(sqlite_store: Store,
                                                                  tmp_path: Path) -> None:
    launcher = FakeLauncher([[running(1)], [running(1)]], cpus=2)
    submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    submit(sqlite_store, resources={"cpus_per_worker": 0.5})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    c.shutdown()
    assert c.teardowns.pending == 0 and not any(g.shut or g.cancelled for g in launcher.groups)
    c2 = make(sqlite_store, launcher, tmp_path)
    c2.step()
    c2.shutdown(stop_jobs=True)
    assert all(g.shut for g in launcher.groups)


def test_a_new_controller_reattaches_without_using_a_retry(sqlite_store: Store,
                                                           tmp_path: Path) -> None:
    launcher = FakeLauncher([[running(1), running(2), running(3, 4),
                              PollResult(state="succeeded")]])
    job_id, group = start_one(sqlite_store, launcher, tmp_path)
    c = make(sqlite_store, launcher, tmp_path)  # a new controller, same cluster
    c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.RUNNING and job.attempts == 1
    assert len(launcher.groups) == 1  # nothing started again
    assert any(e.kind == "reattach" and "no retry used" in e.message
               for e in sqlite_store.list_events(job_id=job_id))
    while not sqlite_store.get_job(job_id=job_id).state.terminal:
        c.step()
    assert sqlite_store.get_job(job_id=job_id).state == JobState.SUCCEEDED
    assert [m.step for m in sqlite_store.list_metrics(job_id=job_id)] == [1, 2, 3, 4]
    assert group.acked == {0: 4}
    assert [a.status for a in sqlite_store.list_attempts(job_id=job_id)] == [
        AttemptStatus.SUCCEEDED]


def test_a_gone_group_resumes_from_its_checkpoint_as_a_new_attempt(sqlite_store: Store,
                                                                   tmp_path: Path) -> None:
    launcher = FakeLauncher([[running(1)], [running(1)]])
    job_id, group = start_one(sqlite_store, launcher, tmp_path)
    del launcher.live[(job_id, 1)]  # its ranks died with their node
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    c.step()
    assert [a.status for a in sqlite_store.list_attempts(job_id=job_id)] == [
        AttemptStatus.LOST, AttemptStatus.RUNNING]
    assert launcher.groups[1].starts["attempt"] == 2


@pytest.mark.parametrize("ending", ["cancel", "finished"])
def test_groups_of_jobs_no_longer_active_are_stopped(sqlite_store: Store, tmp_path: Path,
                                                     ending: str) -> None:
    launcher = FakeLauncher([[running(1)], [running(1)]], cpus=2)
    job_id, group = start_one(sqlite_store, launcher, tmp_path)
    if ending == "cancel":  # cancelled while no controller ran: CANCELLED and stopped
        sqlite_store.request_cancel(job_id=job_id)
    else:  # the store says it is over (an operator, a lost write): nothing owns the group
        sqlite_store.transition(job_id=job_id, to=JobState.FAILED, message="x", error="x")
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert c.teardowns.wait(30)
    assert group.shut
    if ending == "cancel":
        assert sqlite_store.get_job(job_id=job_id).state == JobState.CANCELLED
    else:
        assert launcher.swept == [(job_id, 1)]


def test_reports_are_acknowledged_only_once_stored(sqlite_store: Store, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The database is away for one pass: the ranks keep the reports and send them again.
    launcher = FakeLauncher([[running(), running(1, 2), running(1, 2, 3), running()]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    real = c.ingest.record  # the controller's metrics writer (service.store.metrics)

    def away(**kw: object) -> None:
        raise ConnectionError("database away")

    monkeypatch.setattr(c.ingest, "record", away)
    with pytest.raises(ConnectionError):
        c.step()
    assert launcher.groups[0].acked == {}
    monkeypatch.setattr(c.ingest, "record", real)
    c.step()
    assert launcher.groups[0].acked == {0: 3}
    assert [m.step for m in sqlite_store.list_metrics(job_id=job_id)] == [1, 2, 3]


def test_a_report_stored_twice_is_kept_once(store: Store) -> None:
    job_id = submit(store)
    rows = [{"rank": r, "step": s, "loss": 1.0, "step_time_s": 0.1, "tokens_per_s": 1.0}
            for s in (1, 2) for r in (0, 1)]
    ingest = MetricsIngest(store)  # the controller's metrics writer
    ingest.record(job_id=job_id, attempt=1, world_size=2, rows=rows[:3])
    ingest.record(job_id=job_id, attempt=1, world_size=2, rows=rows)  # sent again, plus one new
    got = store.list_metrics(job_id=job_id, rank=None)
    assert [(m.step, m.rank) for m in got] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert [(st.step, st.ranks) for st in ingest.list_steps(job_id=job_id)] == [(1, 2), (2, 2)]


def test_a_job_that_lost_its_node_waits_queued_until_the_cluster_has_room(
        sqlite_store: Store, tmp_path: Path) -> None:
    failed = PollResult(state="failed", error="rank 1: actor died", failed_ranks=[1])
    launcher = FakeLauncher([[running(1), failed], [running(2)]], cpus=2)
    job_id = submit(sqlite_store, max_retries=2,  # 2 ranks of 1 CPU
                    resources={"gpus_per_worker": 0, "cpus_per_worker": 1})
    c = make(sqlite_store, launcher, tmp_path)
    c.step(), c.step()
    launcher.cpus = 1  # a node is gone with its ranks: one CPU is left
    c.step()
    assert sqlite_store.get_job(job_id=job_id).state == JobState.RESTARTING
    # Requeued once its group is stopped (on a thread beside the loop), then kept queued:
    # never failed as impossible, for it ran here and the cluster may grow back.
    drive(c, sqlite_store, job_id, {JobState.QUEUED, JobState.FAILED}, DEADLINE_S)
    for _ in range(3):
        c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.QUEUED and len(launcher.groups) == 1
    waiting = [e for e in sqlite_store.list_events(job_id=job_id)
               if e.kind == "state" and e.data["to"] == "QUEUED"][-1]
    assert "no longer has room" in waiting.message and "2 CPUs" in waiting.message
    launcher.cpus = 2  # the node is back
    c.step()
    c.step()
    assert launcher.groups[1].starts["attempt"] == 2
    assert sqlite_store.get_job(job_id=job_id).state == JobState.RUNNING


def test_non_finite_numbers_never_fail_a_write(store: Store) -> None:
    """PostgreSQL refuses NaN and Infinity in JSON; they are stored as null instead."""
    job_id = submit(store)
    store.add_event(job_id=job_id, attempt=1, kind="straggler", message="m",
                    data={"ratio": float("inf"), "nested": [float("nan"), 1.5]})
    event = store.list_events(job_id=job_id)[-1]
    assert event.data == {"ratio": None, "nested": [None, 1.5]}
