"""No step a checkpoint tag holds is lost with its attempt, on real Ray with several nodes: the
ranks train and save tags while the controller makes no pass (a slow controller), then a
node's death ends the attempt with those reports unpolled; the job resumes from the newest
tag and succeeds, and every step 1..N is stored exactly once (the reports the tags carry,
`service.files.tag_steps`, stored before the next attempt starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.files.checkpoint_dirs import default_folder  # noqa: E402
from service.files.checkpoint_tags import newest_complete_step  # noqa: E402
from service.store import Store  # noqa: E402
from service.store.checkpoints import CheckpointIndex  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import migrated_sqlite, tiny_spec  # noqa: E402
from tests.waiting import drive_until, wait_for  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 40


def test_a_node_lost_while_the_ranks_ran_ahead_of_the_polls_loses_no_step(
        tmp_path: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    store = Store(migrated_sqlite(tmp_path / "n.db"))
    controller = Controller(store, RayLauncher(), checkpoint_root=tmp_path, start_timeout_s=300)
    try:
        # Two ranks of 1.5 CPUs, one per node; two of the three nodes hold the job.
        spec = JobSpec.model_validate(tiny_spec(
            name="ahead", max_retries=2, checkpoint={"every_steps": 2},
            train={"steps": STEPS, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
            monitor={"probe": False},
            resources={"gpus_per_worker": 0, "cpus_per_worker": 1.5}))
        job_id = submit(store, spec).id
        drive_until(controller, lambda: any(m.step >= 2 for m in store.list_metrics(
            job_id=job_id)), 300, "step 2 stored")
        polled = max(m.step for m in store.list_metrics(job_id=job_id))

        # The controller makes no pass: the ranks train on and save tags past its last poll.
        folder = default_folder(tmp_path, job_id)
        wait_for("tags 6 steps past the last poll",
                 lambda: newest_complete_step(folder) >= polled + 6, 120)
        rank0 = store.list_attempts(job_id=job_id)[0].placement["ranks"][0]["node_id"]
        cluster.remove_node(next(n for n in nodes if n.node_id == rank0))
        saved = newest_complete_step(folder)
        assert saved < STEPS, "the job finished before its node was lost: more steps needed"

        drive_until(controller, lambda: store.get_job(job_id=job_id).state.terminal, 300,
                    "finished")
        job = store.get_job(job_id=job_id)
        assert job.state == JobState.SUCCEEDED, job.error
        assert job.attempts == 2
        second = store.list_metrics(job_id=job_id, attempt=2, rank=None)
        resumed = second[0].step - 1
        assert resumed >= saved and resumed % 2 == 0  # the newest tag, or one saved after it
        assert {m.data["resumed_from"] for m in second} == {resumed}

        # Every step 1..N once: up to the tag resumed from, as the first attempt ran it (its
        # reports that no poll brought, from the tag); after it, as the second did.
        first = [m for m in store.list_metrics(job_id=job_id, attempt=1, rank=None)
                 if m.step <= resumed]
        assert [(m.step, m.rank) for m in first] == [
            (s, r) for s in range(1, resumed + 1) for r in (0, 1)]
        assert [(m.step, m.rank) for m in second] == [
            (s, r) for s in range(resumed + 1, STEPS + 1) for r in (0, 1)]
        steps = controller.ingest.list_steps(job_id=job_id)
        lineage = [(s.attempt, s.step, s.ranks) for s in steps
                   if (s.attempt, s.step <= resumed) in ((1, True), (2, False))]
        assert lineage == [(1, s, 2) for s in range(1, resumed + 1)] + [
            (2, s, 2) for s in range(resumed + 1, STEPS + 1)]
        assert resumed in {t.step for t in CheckpointIndex(store).list(job_id=job_id)}
        told = [e for e in store.list_events(job_id=job_id, limit=1000)
                if e.kind == "recovered" and "step reports" in e.message]
        assert told, "no event says the tag's reports were stored"
    finally:
        controller.shutdown(stop_jobs=True)
        store.close()
        ray.shutdown()
        cluster.shutdown()
