"""The exporter (`service.tracking.exporter`) against a real store and fake trackers: the
cursor, whole steps only, an outage (nothing moves, backoff, one event each way, complete
after), a refusal (dropped and counted exactly), a restart (no step twice, none missed), the
final state, a round that never holds the controller's pass; and the TensorBoard sink's files
read back by TensorBoard's own `EventAccumulator`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from service.contract.reports import StepReport
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import Job, Store
from service.store.goodput import GoodputLedger
from service.store.metrics import MetricsIngest
from service.store.tracking_exports import Export, Exports, Sink
from service.submission.confine import mlflow_refusal
from service.submission.intake import Submitter, submit
from service.tracking.config import TrackingConfig
from service.tracking.exporter import Exporter
from tests.conftest import tiny_spec
from tests.fakes import FakeTracker

URI = "http://mlflow.test:5000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(sqlite_store: Store, tmp_path: Path) -> tuple[Store, FakeTracker, Clock, Exporter]:
    tracker = FakeTracker(URI)
    clock = Clock()
    exporter = Exporter(sqlite_store, lambda kind, target: tracker, clock=clock, settle_s=0,
                        batch_steps=4, backoff_s=1, max_backoff_s=8)
    return sqlite_store, tracker, clock, exporter


CFG = TrackingConfig(mlflow_uri=URI, mlflow_allowed=frozenset({URI}))


def running_job(store: Store, tracking: TrackingConfig = CFG, **spec: object) -> Job:
    job = submit(store, JobSpec.model_validate(tiny_spec(**spec)),
                 by=Submitter(owner="alice", project="vision", tracking=tracking))
    store.start_attempt(job_id=job.id)
    store.transition(job_id=job.id, to=JobState.PLACING, message="test")
    return store.transition(job_id=job.id, to=JobState.RUNNING, message="test")


def report(store: Store, job: Job, steps: range, ranks: Sequence[int] = (0, 1),
           attempt: int = 1) -> None:
    MetricsIngest(store).record(job_id=job.id, attempt=attempt, world_size=job.world_size,
                                rows=[StepReport(rank=r, step=s, loss=10.0 / s,
                                                 step_time_s=0.1, tokens_per_s=100.0 + s,
                                                 custom={"acc": s / 100}).row()
                                      for s in steps for r in ranks])


def export(store: Store, job: Job) -> Export:
    found = Exports(store).get(job_id=job.id, sink=Sink.MLFLOW)
    assert found is not None
    return found


def test_steps_go_whole_in_order_and_the_cursor_follows(world) -> None:
    store, tracker, _, exporter = world
    job = running_job(store)
    report(store, job, range(1, 6))
    report(store, job, range(6, 8), ranks=[0])  # rank 1 has not reported steps 6 and 7 yet
    assert exporter.cycle() == 5
    assert [s for _, s, _ in tracker.steps] == [1, 2, 3, 4, 5]
    assert tracker.steps[0][2]["loss"] == 10.0 and tracker.steps[0][2]["acc"] == 0.01
    e = export(store, job)
    assert (e.run_id, e.attempt, e.step, e.exported, e.dropped) == ("run-1", 1, 5, 5, 0)
    assert tracker.told == [("RUNNING", False)]
    report(store, job, range(6, 8), ranks=[1])
    assert exporter.cycle() == 2 and [s for _, s, _ in tracker.steps][-2:] == [6, 7]
    assert exporter.cycle() == 0 and tracker.opened == 1


def test_an_outage_moves_nothing_then_everything_goes_once_it_is_back(world) -> None:
    store, tracker, clock, exporter = world
    job = running_job(store)
    report(store, job, range(1, 3))
    exporter.cycle()
    tracker.down = True
    report(store, job, range(3, 12))
    delays = []
    for _ in range(4):  # each try waits out the backoff, which doubles (with jitter below 1)
        before = clock.now
        clock.now = exporter.outages[(Sink.MLFLOW, URI)].next_try if exporter.outages else before
        exporter.cycle()
        delays.append(exporter.outages[(Sink.MLFLOW, URI)].next_try - clock.now)
        assert exporter.cycle() == 0  # not due again yet: not even tried
    assert [0.8 * 2 ** i <= d <= 2 ** i for i, d in enumerate(delays)] == [True] * 4
    e = export(store, job)
    assert (e.step, e.exported) == (2, 2) and e.failing_since is not None and "refused" in e.error
    tracker.down = False
    clock.now = exporter.outages[(Sink.MLFLOW, URI)].next_try
    assert exporter.cycle() == 9  # two batches of 4 and one of 1, in one round
    assert [s for _, s, _ in tracker.steps] == list(range(1, 12))
    e = export(store, job)
    assert (e.step, e.exported, e.dropped, e.failing_since, e.error) == (11, 11, 0, None, None)
    tracking = [ev for ev in store.list_events(job_id=job.id) if ev.kind == "tracking"]
    assert [ev.data["down"] for ev in tracking] == [True, False]
    assert "not answering" in tracking[0].message and "answers again" in tracking[1].message


def test_a_refused_batch_is_dropped_and_counted_exactly(world) -> None:
    store, tracker, _, exporter = world
    job = running_job(store)
    tracker.refuse = {6, 10}
    report(store, job, range(1, 11))
    exporter.cycle()
    e = export(store, job)
    sent = [s for _, s, _ in tracker.steps]
    assert sent == [1, 2, 3, 4]  # the batches 5-8 and 9-10 held refused steps
    assert (e.step, e.exported, e.dropped) == (10, 4, 6) and "INVALID_PARAMETER" in e.error
    assert e.exported + e.dropped == 10
    events = [ev for ev in store.list_events(job_id=job.id) if ev.kind == "tracking"]
    assert [(ev.data["dropped"], "refused steps" in ev.message) for ev in events] == \
        [(4, True), (2, True)]
    assert "steps 5-8" in events[0].message and "steps 9-10" in events[1].message
    report(store, job, range(11, 12))
    exporter.cycle()  # a batch that goes clears the failure; the count stays
    e = export(store, job)
    assert (e.exported, e.dropped, e.error) == (5, 6, None)


def test_a_new_exporter_goes_on_from_the_stored_cursor(world, sqlite_store: Store) -> None:
    store, tracker, _, exporter = world
    job = running_job(store)
    report(store, job, range(1, 4))
    exporter.cycle()
    exporter.close()
    report(store, job, range(4, 7))
    again = FakeTracker(URI)
    Exporter(store, lambda kind, target: again, settle_s=0).cycle()
    assert [s for _, s, _ in again.steps] == [4, 5, 6] and again.opened == 0


def test_the_final_state_goes_once_every_step_went(world) -> None:
    store, tracker, _, exporter = world
    job = running_job(store)
    report(store, job, range(1, 4))
    report(store, job, range(4, 5), ranks=[0])  # the last step of a group that was stopped
    store.transition(job_id=job.id, to=JobState.CANCELLED, message="test")
    exporter.cycle()
    assert [s for _, s, _ in tracker.steps] == [1, 2, 3, 4]  # an ended attempt: every step
    assert tracker.told == [("CANCELLED", True)]
    assert export(store, job).done
    exporter.cycle()
    assert tracker.told == [("CANCELLED", True)] and Exports(store).pending() == []


def test_an_ended_jobs_ledger_goes_once_and_only_once_it_ended(world) -> None:
    store, tracker, _, exporter = world
    job = running_job(store)
    report(store, job, range(1, 4))
    exporter.cycle()
    assert tracker.summaries == []  # it runs: its ledger is not a run's yet
    store.transition(job_id=job.id, to=JobState.SUCCEEDED, message="test")
    tracker.down = True  # not sent: tried again with the state
    exporter.cycle()
    assert tracker.summaries == [] and not export(store, job).done
    tracker.down = False
    exporter.clock.now += 60
    exporter.cycle()
    exporter.cycle()
    assert len(tracker.summaries) == 1
    ledger = GoodputLedger(store).ledger(job.id)
    assert tracker.summaries[0] == {
        "goodput.wall_s": ledger.wall_s, "goodput.ettr": ledger.ettr,
        **{f"goodput.{c.category}_s": c.seconds for c in ledger.categories},
        "goodput.steps_counted": 3.0, "goodput.steps_lost": 0.0,
        "goodput.tokens_per_s": ledger.goodput_tokens_per_s}


def test_a_later_attempt_goes_after_the_earlier(world) -> None:
    store, tracker, _, exporter = world
    job = running_job(store)
    report(store, job, range(1, 5))
    store.transition(job_id=job.id, to=JobState.RESTARTING, message="test")
    store.start_attempt(job_id=job.id)
    report(store, job, range(3, 6), attempt=2)  # resumed from the checkpoint of step 2
    exporter.cycle()
    assert [(a, s) for a, s, _ in tracker.steps] == [(1, 1), (1, 2), (1, 3), (1, 4),
                                                       (2, 3), (2, 4), (2, 5)]


def test_a_round_never_holds_the_controllers_pass(world) -> None:
    store, tracker, clock, exporter = world
    job = running_job(store)
    report(store, job, range(1, 3))
    tracker.block = threading.Event()  # the tracker hangs on every request
    exporter.every_s = 0
    exporter.step()  # the round starts on the exporter's thread and hangs there
    for _ in range(3):
        exporter.step()  # returns at once while the round is in flight
    assert not tracker.block.is_set() and tracker.steps == []
    tracker.block.set()
    exporter.close(wait_s=60)
    assert [s for _, s, _ in tracker.steps] == [1, 2]
    assert export(store, job).exported == 2


def test_a_target_the_server_no_longer_allows_is_given_up(sqlite_store: Store) -> None:
    tracker = FakeTracker(URI)
    exporter = Exporter(sqlite_store, lambda kind, target: tracker,
                        allowed=lambda kind, target: False)
    job = running_job(sqlite_store)
    report(sqlite_store, job, range(1, 3))
    exporter.cycle()
    e = export(sqlite_store, job)
    assert e.done and "no longer" in e.error and tracker.steps == [] and tracker.opened == 0


def test_a_spec_chooses_its_trackers_within_what_the_server_allows(tmp_path: Path) -> None:
    cfg = TrackingConfig(mlflow_uri=URI, mlflow_allowed=frozenset({URI, "http://other:1"}),
                         tensorboard_root=tmp_path / "tensorboard")
    spec = JobSpec.model_validate(tiny_spec()).tracking
    assert cfg.targets(spec) == {"mlflow": URI, "tensorboard": "tensorboard"}
    other = JobSpec.model_validate(tiny_spec(tracking={"mlflow": "http://other:1/"})).tracking
    assert cfg.targets(other)["mlflow"] == "http://other:1"
    assert mlflow_refusal(other.mlflow, cfg.mlflow_allowed) is None
    off = JobSpec.model_validate(tiny_spec(tracking={"enabled": False})).tracking
    assert cfg.targets(off) == {}
    evil = JobSpec.model_validate(tiny_spec(tracking={"mlflow": "http://evil:1"})).tracking
    assert "TRIDENT_MLFLOW_URIS" in (mlflow_refusal(evil.mlflow, cfg.mlflow_allowed) or "")
    assert "allows no MLflow server" in (mlflow_refusal(evil.mlflow, frozenset()) or "")
    with pytest.raises(ValueError, match="without credentials"):
        JobSpec.model_validate(tiny_spec(tracking={"mlflow": "http://u:p@host:1"}))


def test_tensorboards_reader_reads_back_the_stored_scalars(sqlite_store: Store,
                                                          tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrackingConfig(tensorboard_root=tmp_path / "tensorboard")
    job = running_job(sqlite_store, tracking=cfg)
    report(sqlite_store, job, range(1, 6))
    sqlite_store.transition(job_id=job.id, to=JobState.RESTARTING, message="test")
    sqlite_store.start_attempt(job_id=job.id)
    report(sqlite_store, job, range(4, 9), attempt=2)  # resumed at step 3: 4, 5 run again
    sqlite_store.transition(job_id=job.id, to=JobState.FAILED, message="test")
    exporter = Exporter(sqlite_store, cfg.make_sink, allowed=cfg.allows, settle_s=0)
    exporter.cycle()
    exporter.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / f"job-{job.id}"),
                           size_guidance={"scalars": 0})
    acc.Reload()
    stored = {m.step: m for m in sqlite_store.list_metrics(job_id=job.id, attempt=2)}
    stored |= {m.step: m for m in sqlite_store.list_metrics(job_id=job.id, attempt=1)
               if m.step < 4}
    read = acc.Scalars("loss")
    assert [e.step for e in read] == sorted(stored)  # attempt 2's steps 4, 5 replace attempt 1's
    for e in read:
        assert e.value == np.float32(stored[e.step].loss)  # TensorBoard keeps float32
        assert e.wall_time == pytest.approx(stored[e.step].time.timestamp())
    assert [e.value for e in acc.Scalars("acc")] == [np.float32(s / 100) for s in sorted(stored)]
    assert {"loss", "step_time_s", "tokens_per_s", "mfu", "acc"} <= set(acc.Tags()["scalars"])


@pytest.mark.parametrize("away", [True, False])
def test_a_round_that_fails_because_the_database_is_away_logs_no_traceback(
        world, caplog: pytest.LogCaptureFixture, away: bool) -> None:
    """The daemon says a database outage once (`service.control.daemon.Outage`): a tracking
    round that fails meanwhile adds no traceback to the log (a pool reset, sqlalchemy's
    `InvalidatePoolError`, counts as away too). Any other failure keeps its traceback."""
    import concurrent.futures
    import logging

    from sqlalchemy.exc import InvalidatePoolError, OperationalError

    from service.store.dbcheck import away as database_away

    assert database_away(InvalidatePoolError())  # a pool reset says the database is away
    store, tracker, clock, exporter = world
    error = (OperationalError("select 1", {}, Exception("connection refused")) if away
             else ValueError("a bug"))

    def cycle() -> int:
        raise error

    exporter.cycle = cycle  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="trident.tracking")
    exporter.step()  # the round starts on the exporter's thread, and fails there
    concurrent.futures.wait([exporter._pending], timeout=30)
    clock.now += 10
    exporter.step()  # reaps the failed round
    exporter.close()
    with_tracebacks = [r for r in caplog.records if r.exc_info]
    assert (with_tracebacks == []) is away, caplog.text
    assert ("the database is away (OperationalError)" in caplog.text) is away, caplog.text
