"""A node removed from a simulated two-node Ray cluster during a job: the attempt fails, the
job waits QUEUED (with the reason) while what is left cannot hold it, and resumes from its
checkpoint once a node joins again."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.store import AttemptStatus, Store  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import migrated_sqlite, tiny_spec  # noqa: E402
from tests.waiting import drive_until  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_job_that_loses_a_node_waits_then_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    store = Store(migrated_sqlite(tmp_path / "n.db"))
    controller = Controller(store, RayLauncher(), checkpoint_root=tmp_path, start_timeout_s=300)
    try:
        # Two ranks of 1.5 CPUs: one on each node; one node alone cannot hold the job.
        spec = JobSpec.model_validate(tiny_spec(
            name="node-loss", max_retries=2, checkpoint={"every_steps": 3},
            train={"steps": 40, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
            monitor={"probe": False},
            resources={"gpus_per_worker": 0, "cpus_per_worker": 1.5},
            faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}]))
        job_id = submit(store, spec).id

        def trained(n: int) -> Callable[[], bool]:
            return lambda: any(m.step >= n for m in store.list_metrics(job_id=job_id))

        drive_until(controller, trained(4), 300, "step 4")
        placement = store.list_attempts(job_id=job_id)[0].placement["ranks"]
        assert len({r["node_id"] for r in placement}) == 2
        cluster.remove_node(nodes[0])
        drive_until(controller, lambda: store.get_job(job_id=job_id).state == JobState.QUEUED,
                    300, "QUEUED after the node loss")
        job = store.get_job(job_id=job_id)
        assert job.attempts == 1
        assert store.list_attempts(job_id=job_id)[0].status == AttemptStatus.FAILED
        waiting = [e for e in store.list_events(job_id=job_id, limit=1000)
                   if e.kind == "state" and e.data["to"] == "QUEUED"][-1]
        assert "no longer has room" in waiting.message, waiting.message
        for _ in range(5):  # it waits; it is not failed as impossible
            controller.step()
            time.sleep(0.2)
        assert store.get_job(job_id=job_id).state == JobState.QUEUED

        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        drive_until(controller, lambda: store.get_job(job_id=job_id).state.terminal, 300,
                    "finished")
        job = store.get_job(job_id=job_id)
        assert job.state == JobState.SUCCEEDED, job.error
        assert job.attempts == 2
        first = [m.step for m in store.list_metrics(job_id=job_id, attempt=1)]
        second = [m.step for m in store.list_metrics(job_id=job_id, attempt=2)]
        assert second[0] > 1 and second[0] - 1 <= max(first), (first, second)
        assert (second[0] - 1) % 3 == 0  # resumed after a checkpoint
        assert second == list(range(second[0], 41))
    finally:
        controller.shutdown(stop_jobs=True)
        store.close()
        ray.shutdown()
        cluster.shutdown()
