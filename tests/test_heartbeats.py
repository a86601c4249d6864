"""Heartbeats as the controller saw them, kept for the API: what the attempt's health writes,
and how often (at most once a second, only ranks that changed)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from service.contract.reports import HeartbeatReport
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.monitor.attempt import AttemptHealth
from service.store import Store
from service.store.heartbeats import HeartbeatLog, HeartbeatThrottle, ages
from service.submission.intake import submit
from tests.conftest import tiny_spec


def started(store: Store) -> Any:
    job = submit(store, JobSpec.model_validate(tiny_spec()))
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job.id, to=to, message=to.value)
    return store.start_attempt(job_id=job.id)


class CountingLog(HeartbeatLog):
    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.writes: list[dict[int, float]] = []

    def record(self, *, job_id: int, attempt: int, seen: Any) -> None:
        self.writes.append(dict(seen))
        super().record(job_id=job_id, attempt=attempt, seen=seen)


def test_throttle_writes_changed_ranks_at_most_once_a_second(store: Store) -> None:
    job = started(store)
    log = CountingLog(store)
    beats = HeartbeatThrottle(log, job.id, 1)
    assert beats.offer({0: 100.0, 1: 100.0}, now=10.0)
    assert not beats.offer({0: 101.0, 1: 100.0}, now=10.5)  # within the second
    assert beats.offer({0: 101.0, 1: 100.0}, now=11.0)
    assert not beats.offer({0: 101.0, 1: 100.0}, now=20.0)  # nothing changed
    assert log.writes == [{0: 100.0, 1: 100.0}, {0: 101.0}]
    seen = log.last_seen(job_id=job.id, attempt=1)
    assert seen == {0: datetime.fromtimestamp(101.0, UTC), 1: datetime.fromtimestamp(100.0, UTC)}
    assert log.last_seen(job_id=job.id, attempt=2) == {}
    assert ages(seen, datetime.fromtimestamp(111.0, UTC)) == {0: 10.0, 1: 11.0}


def test_polled_heartbeats_are_stored_on_the_controllers_clock(store: Store) -> None:
    job = started(store)
    health = AttemptHealth(store, job, 1, job.spec)
    # The rank's clock is not ours: its heartbeat's age (monotonic) is what counts.
    hb = HeartbeatReport(rank=0, step=3, phase="forward", time=5.0, age_s=0.0)
    health.polled({0: hb.model_copy(update={"age_s": 2.0}),
                   1: hb.model_copy(update={"rank": 1, "age_s": 0.5})}, received=1000.0)
    seen = HeartbeatLog(store).last_seen(job_id=job.id, attempt=1)
    assert {r: t.timestamp() for r, t in seen.items()} == pytest.approx({0: 998.0, 1: 999.5})
