"""Preemption on real Ray (a simulated one-node cluster): a job of higher priority submitted to
the full cluster preempts the running one, which saves a checkpoint, requeues, resumes once the
high one ended and succeeds, with every step stored once and no retry spent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.store import AttemptStatus, Store  # noqa: E402
from service.store.checkpoints import CheckpointIndex  # noqa: E402
from service.store.goodput import GoodputLedger  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import migrated_sqlite, tiny_spec  # noqa: E402
from tests.waiting import drive_until  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow


def spec(name: str, steps: int, **over: object) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(
        name=name, train={"steps": steps, "global_batch": 8, "micro_batch": 2,
                          "precision": "fp32"},
        monitor={"probe": False}, resources={"gpus_per_worker": 0, "cpus_per_worker": 1},
        **over))


def test_a_high_priority_job_preempts_a_running_one_which_resumes_and_succeeds(
        tmp_path: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    store = Store(migrated_sqlite(tmp_path / "p.db"))
    controller = Controller(store, RayLauncher(), checkpoint_root=tmp_path, start_timeout_s=300)
    try:
        # No periodic checkpoint: the one it resumes from is the one the preemption asked for.
        low = submit(store, spec("low", 30, max_retries=0, checkpoint={"every_steps": 1000},
                                 faults=[{"kind": "slow", "rank": 0, "step": 1,
                                          "seconds": 0.2}])).id

        def trained(job_id: int, n: int) -> Callable[[], bool]:
            return lambda: any(m.step >= n for m in store.list_metrics(job_id=job_id))

        drive_until(controller, trained(low, 3), 300, "low at step 3")
        high = submit(store, spec("high", 4, priority=10)).id
        drive_until(controller, lambda: store.get_job(job_id=low).state == JobState.QUEUED,
                    300, "low requeued")
        saved = CheckpointIndex(store).list(job_id=low)
        assert len(saved) == 1 and saved[0].bytes > 0
        drive_until(controller, lambda: store.get_job(job_id=low).state.terminal and
                    store.get_job(job_id=high).state.terminal, 600, "both ended")

        h, lo = store.get_job(job_id=high), store.get_job(job_id=low)
        assert h.state == JobState.SUCCEEDED, h.error
        assert lo.state == JobState.SUCCEEDED, lo.error
        assert (lo.attempts, lo.preemptions) == (2, 1)  # max_retries 0: no retry spent
        attempts = store.list_attempts(job_id=low)
        assert [a.status for a in attempts] == [AttemptStatus.PREEMPTED, AttemptStatus.SUCCEEDED]
        high_done = store.list_attempts(job_id=high)[0].ended_at
        assert high_done is not None and attempts[1].started_at >= high_done
        first = [m.step for m in store.list_metrics(job_id=low, attempt=1)]
        second = [m.step for m in store.list_metrics(job_id=low, attempt=2)]
        assert second[0] - 1 == saved[0].step == max(first), (first, second)
        assert sorted(first + second) == list(range(1, 31)), "every step stored once"
        events = store.list_events(job_id=low, limit=1000)
        assert any(e.data.get("to") == "PREEMPTED" and e.data.get("preempted_by") == high
                   for e in events)
        assert any(e.kind == "preempting" and e.data["victims"] == [low]
                   for e in store.list_events(job_id=high, limit=1000))
        # Its ledger: the wait after its preemption is a preempted wait, as long as the high
        # job held the room; its ranks were stopping from the request to their stop; nothing
        # was redone (it saved where it stopped).
        ledger = GoodputLedger(store).ledger(low)
        requeued = next(e.time for e in events if e.data.get("from") == "PREEMPTED")
        placed = next(e.time for e in events if e.data.get("to") == "PLACING" and
                      e.time > requeued)
        assert ledger.queued_reasons["preempted"] == pytest.approx(
            (placed - requeued).total_seconds(), abs=0.01)
        high_ran = store.list_attempts(job_id=high)[0]
        assert high_ran.ended_at is not None
        assert ledger.queued_reasons["preempted"] >= (
            high_ran.ended_at - max(high_ran.started_at, requeued)).total_seconds()
        asked = next(e.time for e in events if e.data.get("to") == "PREEMPTED")
        assert ledger.total("stopping").seconds == pytest.approx(
            (requeued - asked).total_seconds(), abs=0.01)
        assert (ledger.steps_counted, ledger.steps_lost) == (30, 0)
        assert ledger.total("lost").seconds == 0
    finally:
        controller.shutdown(stop_jobs=True)
        ray.shutdown()
        cluster.shutdown()
        store.close()
