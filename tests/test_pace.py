"""The controller's pace (`service.control.pace`): fast while a group starts, the base interval
after a
change or with nothing training, longer while every group trains and nothing changes (bounded
by the lease and the hang timeouts); and a slower pace stores every step a poll brings."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.control.daemon import LeaderLoop
from service.control.pace import FAST_S, Activity, Pace
from service.settings import Settings
from service.store import Store
from service.store.lease import Leader
from tests.fakes import FakeLauncher, make, step_report, submit

STEADY = Activity(steady=True)


def test_the_wait_doubles_while_nothing_changes_up_to_its_bound() -> None:
    pace = Pace(0.5, 2.0)
    assert [pace.next(STEADY) for _ in range(4)] == [1.0, 2.0, 2.0, 2.0]
    # A change, or nothing training: the base interval again, then growing anew.
    assert pace.next(Activity(steady=True, changed=True)) == 0.5
    assert pace.next(STEADY) == 1.0
    assert pace.next(Activity()) == 0.5


def test_a_starting_group_is_polled_fast_then_the_base_interval_follows() -> None:
    pace = Pace(0.5, 2.0)
    pace.next(STEADY)
    assert pace.next(Activity(starting=True, steady=True)) == FAST_S
    assert pace.next(STEADY) == 0.5  # never below the base once it trains
    assert Pace(0.05, 2.0).next(Activity(starting=True)) == 0.05  # never above the base


def test_the_shortest_hang_timeout_bounds_the_wait() -> None:
    pace = Pace(0.5, 10.0)
    waits = [pace.next(Activity(steady=True, hang_timeout_s=6.0)) for _ in range(4)]
    assert waits == [1.0, 1.5, 1.5, 1.5]  # a quarter of 6 s
    # A timeout shorter than four base intervals: the base interval, as before.
    assert Pace(0.5, 10.0).next(Activity(steady=True, hang_timeout_s=1.0)) == 0.5


def test_the_controller_says_starting_until_a_step_is_stored_then_steady(
        sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[
        PollResult(state="starting"),
        PollResult(state="running", placement={"ranks": [{"rank": 0, "node_id": "n0"}]}),
        PollResult(state="running", reports=[step_report(0, 1, 5.0), step_report(1, 1, 5.0)]),
        PollResult(state="running"),
    ]])
    submit(sqlite_store, monitor={"hang_timeout_s": 60})
    c = make(sqlite_store, launcher, tmp_path)
    seen = []
    for _ in range(5):
        a = c.activity(c.step())
        seen.append((a.starting, a.changed, a.steady))
    assert seen == [(True, True, True),     # placed: PLACING
                    (True, False, True),    # starting
                    (True, True, True),     # RUNNING, no step yet (probing)
                    (False, False, True),   # its first steps stored
                    (False, False, True)]   # training, nothing new
    assert c.activity(c.step()).hang_timeout_s == 60
    pace = Pace(0.5, 30.0)
    assert [pace.next(c.activity(c.step())) for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 15.0]


def test_nothing_running_is_not_steady_nor_a_pass_after_a_cancel(
        sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="running", reports=[step_report(0, 1, 5.0)])]])
    c = make(sqlite_store, launcher, tmp_path)
    assert c.activity(c.step()) == Activity()  # no job
    job_id = submit(sqlite_store)
    c.step()
    c.step()
    assert c.activity(c.step()).steady
    sqlite_store.request_cancel(job_id=job_id)
    result = c.step()
    assert [ch.to for ch in result.changes] == [JobState.CANCELLED]
    assert not c.activity(result).steady


def test_a_poll_after_a_long_wait_stores_every_step_in_order(sqlite_store: Store,
                                                             tmp_path: Path) -> None:
    """A longer wait means more steps per poll: all of them stored, the ranks told so."""
    reports = []
    for step in range(1, 201):
        for rank in (0, 1):
            reports.append(step_report(rank, step, 10.0 - step / 100))
    launcher = FakeLauncher([[PollResult(state="running"),
                              PollResult(state="running", reports=reports,
                                         acks={0: 200, 1: 200}),
                              PollResult(state="running")]])
    job_id = submit(sqlite_store)
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    c.step()
    assert c.step().metrics == 400
    assert [m.step for m in sqlite_store.list_metrics(job_id=job_id, limit=1000)] == \
        list(range(1, 201))
    assert launcher.groups[0].acked == {0: 200, 1: 200}


def test_the_daemon_waits_the_base_interval_as_standby_then_its_pace(
        sqlite_store: Store, tmp_path: Path) -> None:
    launcher = FakeLauncher([[PollResult(state="running", reports=[step_report(0, 1, 5.0)]),
                              PollResult(state="running")]])
    submit(sqlite_store)
    loop = LeaderLoop(Leader(sqlite_store, duration_s=30, holder="c0"),
                      lambda: make(sqlite_store, launcher, tmp_path))
    pace = Pace(0.5, 4.0)
    assert loop.wait_s(pace, 0.5) == 0.5  # no pass yet
    waits = []
    for _ in range(5):
        loop.tick()
        waits.append(loop.wait_s(pace, 0.5))
    assert waits == [FAST_S, 0.5, 1.0, 2.0, 4.0]


def test_the_longest_wait_is_a_setting() -> None:
    assert Settings().poll_max_interval_s == 2.0
    with pytest.raises(ValueError):
        Settings(poll_max_interval_s=0)
