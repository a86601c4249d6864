"""Elastic re-plan on real Ray (a simulated two-node cluster): a job on both nodes loses one
that does not come back; within `wait_s` plus a pass it resumes on the node left, on the layout
the planner chose (DP 2 -> 1, the same global batch), and once a node joins again
(`scale_up`) it saves a checkpoint, moves back to its submitted layout and succeeds, with
every step stored once."""

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
from service.store.goodput import GoodputLedger  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import migrated_sqlite, tiny_spec  # noqa: E402
from tests.waiting import drive_until  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 40
WAIT_S = 3.0


def test_a_job_that_loses_a_node_is_re_planned_onto_the_other_and_moves_back(
        tmp_path: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    store = Store(migrated_sqlite(tmp_path / "e.db"))
    controller = Controller(store, RayLauncher(), checkpoint_root=tmp_path, start_timeout_s=300)
    try:
        # Two ranks of 1.5 CPUs: one on each node; one node holds one rank only. Slowed in
        # the first two attempts, so that the node's loss and return land mid-run.
        spec = JobSpec.model_validate(tiny_spec(
            # Synchronous saves: each step's tag is complete when its report is, so the node's
            # loss re-runs no stored step. (In the background the newest tag lags the newest
            # report by up to a step, which the next attempt runs again, stored under it.)
            name="elastic", max_retries=1, checkpoint={"every_steps": 1, "async": False},
            train={"steps": STEPS, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
            elastic={"min_ranks": 1, "wait_s": WAIT_S, "scale_up": True},
            monitor={"probe": False},
            resources={"gpus_per_worker": 0, "cpus_per_worker": 1.5},
            faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2},
                    {"kind": "slow", "rank": 0, "step": 1, "seconds": 0.4, "attempt": 2}]))
        job_id = submit(store, spec).id

        def trained(n: int, attempt: int) -> Callable[[], bool]:
            return lambda: any(m.step >= n for m in store.list_metrics(job_id=job_id,
                                                                       attempt=attempt))

        drive_until(controller, trained(3, 1), 300, "step 3")
        placement = store.list_attempts(job_id=job_id)[0].placement["ranks"]
        rank0 = next(r["node_id"] for r in placement if r["rank"] == 0)
        assert len({r["node_id"] for r in placement}) == 2
        # The node of rank 1 goes and never comes back (rank 0's reports all reach the store).
        cluster.remove_node(next(n for n in nodes if n.node_id != rank0))
        drive_until(controller, trained(1, 2), 300, "a step of attempt 2")
        job = store.get_job(job_id=job_id)
        assert job.world_size == 1 and job.spec.layout.dp == 1, store.list_events(job_id=job_id)
        first, second = store.list_attempts(job_id=job_id)[:2]
        assert first.status == AttemptStatus.FAILED and first.ended_at is not None
        events = store.list_events(job_id=job_id, limit=1000)
        [down] = [e for e in events if e.kind == "elastic"]
        assert down.data["from"]["layout"] == "tp1 pp1 dp2 zero2"
        assert down.data["to"]["world_size"] == 1
        assert down.data["from"]["predicted_step_s"] > 0 < down.data["to"]["predicted_step_s"]
        # Re-planned once wait_s was over, and started in that same pass.
        waited = (down.time - first.ended_at).total_seconds()
        assert WAIT_S <= waited < WAIT_S + 10, waited
        assert (second.started_at - down.time).total_seconds() < 5
        assert len({r["node_id"] for r in second.placement["ranks"]}) == 1

        cluster.add_node(num_cpus=2)  # room for the submitted layout again
        cluster.wait_for_nodes()
        drive_until(controller, lambda: store.get_job(job_id=job_id).state.terminal, 600,
                    "finished")
        job = store.get_job(job_id=job_id)
        assert job.state == JobState.SUCCEEDED, job.error
        assert [a.status for a in store.list_attempts(job_id=job_id)] == [
            AttemptStatus.FAILED, AttemptStatus.MOVED, AttemptStatus.SUCCEEDED]
        assert job.world_size == 2 and job.spec.layout.dp == 2 and job.moves_up == 1
        up = [e for e in store.list_events(job_id=job_id, limit=1000)
              if e.kind == "elastic" and e.data.get("direction") == "up"]
        assert [e.data["to"]["layout"] for e in up] == ["tp1 pp1 dp2 zero2"] * 2
        third = store.list_attempts(job_id=job_id)[2]
        assert len({r["node_id"] for r in third.placement["ranks"]}) == 2
        steps = [m.step for m in store.list_metrics(job_id=job_id)]
        assert sorted(steps) == list(range(1, STEPS + 1)), "every step stored once"
        # Its ledger: each attempt's ranks held as placed (one rank while re-planned down),
        # and the move back up, asked for and saved, is stopping, not a failure's recovery.
        ledger = GoodputLedger(store).ledger(job_id)
        assert ledger.steps_counted == STEPS
        assert {seg.ranks for seg in ledger.segments if seg.attempt == 2} == {1}
        assert {seg.ranks for seg in ledger.segments if seg.attempt in (1, 3)} == {2}
        events = store.list_events(job_id=job_id, limit=1000)
        move = next(e.time for e in events if e.kind == "state" and e.attempt == 2 and
                    e.data["to"] == "RESTARTING")
        assert [seg.category for seg in ledger.segments if seg.start == move] == ["stopping"]
        assert ledger.total("recovery").seconds > 0  # the lost node's
    finally:
        controller.shutdown(stop_jobs=True)
        store.close()
        ray.shutdown()
        cluster.shutdown()
