"""The controller's lease on SQLite and PostgreSQL: one holder, renewal, hand-over on expiry,
concurrent takers; and two controllers against one database, of which only the leader acts."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.control.controller import Controller
from service.control.daemon import LeaderLoop, LeaseLost, retry_wait_s
from service.store import AttemptStatus, Fence, NotHolder, Store
from service.store.lease import CONTROLLER, Leader, Leases, Role
from tests.fakes import FakeLauncher, submit

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_one_holder_renews_and_expiry_hands_over(store: Store) -> None:
    a = Leader(store, duration_s=10, holder="a")
    b = Leader(store, duration_s=10, holder="b")
    assert a.acquire_or_renew(at(0)) == Role.LEADER
    assert b.acquire_or_renew(at(1)) == Role.STANDBY
    assert b.lease is not None and b.lease.holder == "a"
    # The holder renews: the lease runs on from the renewal, past its first expiry.
    assert a.acquire_or_renew(at(8)) == Role.LEADER
    assert b.acquire_or_renew(at(12)) == Role.STANDBY
    lease = Leases(store).read(name="controller")
    assert lease is not None and lease.holder == "a" and lease.epoch == 1
    assert lease.renewed_at == at(8) and lease.expires_at == at(18)
    # Not renewed: once expired, the standby takes it, and the old holder has lost it.
    assert b.acquire_or_renew(at(18.5)) == Role.LEADER
    assert b.lease is not None and b.lease.epoch == 2 and b.lease.acquired_at == at(18.5)
    assert a.acquire_or_renew(at(19)) == Role.LOST
    assert a.acquire_or_renew(at(20)) == Role.STANDBY


def test_release_lets_the_standby_take_over_at_once(store: Store) -> None:
    a = Leader(store, duration_s=60, holder="a")
    b = Leader(store, duration_s=60, holder="b")
    assert a.acquire_or_renew(at(0)) == Role.LEADER
    assert not Leases(store).release(name="controller", holder="b", now=at(1))  # not b's
    assert b.acquire_or_renew(at(1)) == Role.STANDBY
    a.release(at(2))
    assert b.acquire_or_renew(at(2.5)) == Role.LEADER


def test_concurrent_takers_get_exactly_one_holder(db_url: str, store: Store) -> None:
    n = 8
    stores = [Store(db_url) for _ in range(n)]  # one engine each, as separate processes
    leaders = [Leader(s, duration_s=30, holder=f"c{i}") for i, s in enumerate(stores)]
    barrier = threading.Barrier(n)
    roles: dict[int, Role] = {}
    errors: list[BaseException] = []

    def take(i: int) -> None:
        try:
            barrier.wait(30)
            roles[i] = leaders[i].acquire_or_renew(at(0))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in stores:
        s.close()
    assert not errors, errors
    winners = [i for i, r in roles.items() if r == Role.LEADER]
    assert len(roles) == n and len(winners) == 1, roles
    lease = Leases(store).read(name="controller")
    assert lease is not None and lease.holder == f"c{winners[0]}" and lease.epoch == 1


def test_two_controllers_only_the_leader_acts_and_the_standby_takes_over(
        store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only the leader's launcher starts the queued job; when the leader stops renewing, the
    standby takes over after expiry and never starts the attempt the first leader started."""
    job_id = submit(store, max_retries=1)
    launchers = [FakeLauncher([[PollResult(state="running")]]) for _ in range(2)]
    loops = [LeaderLoop(Leader(store, duration_s=5, holder=f"c{i}"),
                        lambda i=i: Controller(store, launchers[i],  # type: ignore[misc]
                                               checkpoint_root=tmp_path))
             for i in range(2)]
    caplog.set_level("INFO", logger="trident.controller")
    assert loops[0].tick(at(0)) == Role.LEADER
    assert loops[1].tick(at(0.1)) == Role.STANDBY
    assert loops[1].controller is None  # a standby makes no controller, connects nothing
    assert "standby: the lease is held by c0" in caplog.text
    assert [g.starts["attempt"] for g in launchers[0].groups] == [1]
    for t in (1, 2, 3):
        assert loops[0].tick(at(t)) == Role.LEADER
        assert loops[1].tick(at(t + 0.5)) == Role.STANDBY
    assert store.get_job(job_id=job_id).state == JobState.RUNNING
    assert launchers[1].groups == []

    # The leader stops renewing (killed, hung). Until its lease expires the standby waits.
    assert loops[1].tick(at(7.9)) == Role.STANDBY
    assert launchers[1].groups == []
    assert loops[1].tick(at(8.1)) == Role.LEADER
    # The job is active with no group of the new leader's: lost, restarted as attempt 2.
    assert loops[1].tick(at(8.5)) == Role.LEADER
    assert [g.starts["attempt"] for g in launchers[1].groups] == [2]
    assert [a.status for a in store.list_attempts(job_id=job_id)] == [
        AttemptStatus.LOST, AttemptStatus.RUNNING]
    # The old leader comes back: it finds the lease taken and stops without acting.
    with pytest.raises(LeaseLost):
        loops[0].tick(at(9))
    assert [g.starts["attempt"] for g in launchers[0].groups] == [1]
    assert not launchers[0].groups[0].cancelled  # it touched nothing
    # Every attempt was started once, by one controller.
    started = [g.starts["attempt"] for launcher in launchers for g in launcher.groups]
    assert sorted(started) == [1, 2]


def test_an_attempt_starts_only_while_its_controllers_lease_is_held(store: Store,
                                                                    tmp_path: Path) -> None:
    """A leader taken over in the middle of a pass (its lease expired while the pass ran) cannot
    start an attempt: the lease is checked in the attempt's own transaction."""
    job_id = submit(store)
    old = Leader(store, duration_s=5, holder="old")
    assert old.acquire_or_renew(at(0)) == Role.LEADER
    assert Leader(store, duration_s=5, holder="new").acquire_or_renew(at(6)) == Role.LEADER
    launcher = FakeLauncher([[PollResult(state="running")]])
    controller = Controller(store, launcher, checkpoint_root=tmp_path,
                            fence=Fence(CONTROLLER, "old"))
    with pytest.raises(NotHolder, match="held by new, not old"):
        controller.step()
    assert launcher.groups == [] and store.list_attempts(job_id=job_id) == []
    assert store.get_job(job_id=job_id).attempts == 0
    # The holder's fence lets it through.
    assert store.start_attempt(job_id=job_id, fence=Fence(CONTROLLER, "new")).attempts == 1


def test_the_leader_writes_its_previous_pass_duration_with_each_renewal(store: Store,
                                                                        tmp_path) -> None:
    """`GET /metrics` reads the controller's pass duration from the lease row (the API is
    another process): the first renewal has none yet, every later one the pass before it."""
    loop = LeaderLoop(Leader(store, duration_s=5, holder="c0"),
                      lambda: Controller(store, FakeLauncher([]),  # type: ignore[arg-type]
                                         checkpoint_root=tmp_path))
    assert loop.tick(at(0)) == Role.LEADER
    lease = Leases(store).read(name=CONTROLLER)
    assert lease is not None and lease.last_pass_s is None
    assert loop.last_pass_s is not None and loop.last_pass_s > 0
    loop.tick(at(1))
    lease = Leases(store).read(name=CONTROLLER)
    assert lease is not None and lease.last_pass_s is not None and lease.last_pass_s > 0


def test_a_leader_renews_after_connecting_and_stops_if_it_lost_the_lease_meanwhile(
        store: Store, tmp_path: Path) -> None:
    """Making the controller (connecting to Ray) takes seconds: the lease is renewed before the
    first pass; if it expired meanwhile and a standby took it, the first pass never runs."""
    job_id = submit(store)
    launcher = FakeLauncher([[PollResult(state="running")]])

    def slow_connect() -> Controller:  # the lease expires while connecting: b takes it
        assert Leader(store, duration_s=5, holder="b").acquire_or_renew(at(6)) == Role.LEADER
        return Controller(store, launcher, checkpoint_root=tmp_path)

    loop = LeaderLoop(Leader(store, duration_s=5, holder="a"), slow_connect)
    with pytest.raises(LeaseLost):
        loop.tick(at(0))
    assert launcher.groups == [] and store.get_job(job_id=job_id).attempts == 0
    # Connected in time: renewed (the lease runs from the renewal), then the first pass acts.
    renewed = LeaderLoop(Leader(store, duration_s=5, holder="c"),
                         lambda: Controller(store, launcher, checkpoint_root=tmp_path))
    assert renewed.tick(at(20)) == Role.LEADER
    assert [g.starts["attempt"] for g in launcher.groups] == [1]


def test_failed_passes_are_retried_with_backoff_bounded_by_a_third_of_the_lease() -> None:
    assert [retry_wait_s(n, 0.5, 15) for n in range(1, 6)] == [1, 2, 4, 5, 5]
    assert [retry_wait_s(n, 0.2, 3) for n in range(1, 4)] == [0.4, 0.8, 1.0]


def _taken_over(store: Store) -> None:
    """Another controller takes the lease from "old" (whose lease ran out meanwhile)."""
    later = datetime.now(UTC) + timedelta(seconds=120)
    assert Leader(store, duration_s=600, holder="new").acquire_or_renew(later) == Role.LEADER


def test_a_controller_that_loses_the_lease_after_starting_an_attempt_launches_nothing(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt's row is written under the lease; the lease goes before the group is
    started (readying the folder and the secrets took long): no group is started."""
    job_id = submit(store)
    assert Leader(store, duration_s=60, holder="old").acquire_or_renew() == Role.LEADER
    launcher = FakeLauncher([[PollResult(state="running")]])
    controller = Controller(store, launcher, checkpoint_root=tmp_path,
                            fence=Fence(CONTROLLER, "old"))
    started = store.start_attempt

    def start_then_lose(**kw: object) -> object:
        out = started(**kw)  # type: ignore[arg-type]
        _taken_over(store)
        return out

    monkeypatch.setattr(store, "start_attempt", start_then_lose)
    with pytest.raises(NotHolder, match="held by new, not old"):
        controller.step()
    assert launcher.groups == [] and launcher.started == []
    # The attempt it wrote is the new leader's to settle (lost: no group of its own).
    assert store.get_job(job_id=job_id).attempts == 1


def test_a_starting_group_is_not_polled_once_the_lease_is_lost(store: Store,
                                                               tmp_path: Path) -> None:
    """A starting group's poll launches its ranks (after the rendezvous): a controller that
    lost its lease between passes' renewal and the poll does not poll it."""
    submit(store)
    assert Leader(store, duration_s=60, holder="old").acquire_or_renew() == Role.LEADER
    launcher = FakeLauncher([[PollResult(state="starting")]])
    controller = Controller(store, launcher, checkpoint_root=tmp_path,
                            fence=Fence(CONTROLLER, "old"))
    controller.step()
    controller.step()
    assert launcher.groups[0].polls == 1
    _taken_over(store)
    with pytest.raises(NotHolder):
        controller.step()
    assert launcher.groups[0].polls == 1


def test_a_cluster_probe_is_not_claimed_once_the_lease_is_lost(store: Store,
                                                               tmp_path: Path) -> None:
    probe = store.create_probe(scope="cluster", request={"ranks_per_node": 1, "max_bytes": 1024})
    assert Leader(store, duration_s=60, holder="old").acquire_or_renew() == Role.LEADER
    launcher = FakeLauncher([[PollResult(state="starting")]])
    controller = Controller(store, launcher, checkpoint_root=tmp_path,
                            fence=Fence(CONTROLLER, "old"))
    _taken_over(store)
    with pytest.raises(NotHolder):
        controller.step()
    assert launcher.groups == []
    assert store.get_probe(probe_id=probe.id).status.value == "pending"
