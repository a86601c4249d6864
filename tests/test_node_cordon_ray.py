"""Cordon, drain and the lemon rule on a real Ray cluster of three nodes (`ray.cluster_utils`):
a cordoned node gets no new ranks (Ray's label selectors, and admission's free room), an
uncordoned one gets them back; a drain makes a running job save a checkpoint at its next step
boundary and resume on another node, every step stored once; the lemon rule cordons the node
whose ranks failed two attempts. Light ranks (`program: light`) where only orchestration is
asserted; trained ones for the drain, whose checkpoint is the point."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.store import AttemptStatus, Store  # noqa: E402
from service.store.checkpoints import CheckpointIndex  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import migrated_sqlite, ray_namespace, tiny_spec  # noqa: E402
from tests.waiting import drive_until  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head without CPUs and three nodes of 2 CPUs each."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):
        c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def run(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[Store, Controller]]:
    """A store and a controller on the cluster (light ranks allowed; the lemon rule at two
    failed attempts within ten minutes), its first pass taken: the nodes are stored."""
    store = Store(migrated_sqlite(tmp_path / "c.db"))
    with ray_namespace() as namespace:
        controller = Controller(store, RayLauncher(light_ranks=True, namespace=namespace),
                                checkpoint_root=tmp_path / "ckpt", start_timeout_s=300,
                                lemon_failures=2, lemon_window_s=600)
        try:
            controller.step()
            assert len([n for n in store.list_nodes() if n.info.get("resources", {})
                        .get("CPU")]) == 3
            yield store, controller
        finally:
            controller.shutdown(stop_jobs=True)
    store.close()


def worker_nodes(store: Store) -> list[str]:
    return sorted(n.node_id for n in store.list_nodes() if n.info["resources"].get("CPU"))


def light(name: str, ranks: int, steps: int, **over: Any) -> JobSpec:
    return JobSpec.model_validate(tiny_spec(
        name=name, program="light", parallel={"tp": 1, "pp": 1, "dp": ranks, "zero": 2},
        train={"steps": steps, "global_batch": 2 * ranks, "micro_batch": 2,
               "precision": "fp32"},
        monitor={"probe": False}, resources={"gpus_per_worker": 0, "cpus_per_worker": 1},
        **over))


def nodes_of(store: Store, job_id: int, attempt: int = 1) -> set[str]:
    [a] = [a for a in store.list_attempts(job_id=job_id) if a.number == attempt]
    return {r["node_id"] for r in a.placement["ranks"]}


def state_is(store: Store, job_id: int, state: JobState) -> Callable[[], bool]:
    return lambda: store.get_job(job_id=job_id).state == state


def placed(store: Store, job_id: int, attempt: int = 1) -> Callable[[], bool]:
    return lambda: any(a.number == attempt and a.placement.get("ranks")
                       for a in store.list_attempts(job_id=job_id))


@ray.remote(num_cpus=1)
class Blocker:
    """Holds a CPU of the node it is pinned to."""

    def ready(self) -> bool:
        return True


def test_a_cordoned_node_gets_no_new_ranks_and_uncordoned_gets_them_back(
        run: tuple[Store, Controller]) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    store, controller = run
    cordoned, *others = worker_nodes(store)
    store.cordon_node(node_id=cordoned, by="admin", reason="test")
    # A CPU of each other node taken: only the cordoned node could hold two ranks together,
    # where Ray would pack them (PACK), were they not kept off it.
    blockers = [Blocker.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        for n in others]
    ray.get([b.ready.remote() for b in blockers], timeout=60)
    try:
        first = submit(store, light("first", 2, 100_000)).id
        drive_until(controller, placed(store, first), 240, "the first job placed")
        assert nodes_of(store, first) == set(others)
        # The next job fits only on the cordoned node: it waits, queued, without an attempt.
        second = submit(store, light("second", 2, 100_000)).id
        for _ in range(20):
            controller.step()
            time.sleep(0.1)
        job = store.get_job(job_id=second)
        assert (job.state, job.attempts) == (JobState.QUEUED, 0)

        store.uncordon_node(node_id=cordoned, by="admin")
        drive_until(controller, placed(store, second), 240, "the second job placed")
        assert nodes_of(store, second) == {cordoned}
        for job_id in (first, second):
            store.request_cancel(job_id=job_id)
        drive_until(controller, lambda: all(store.get_job(job_id=j).state.terminal
                                            for j in (first, second)), 120, "both cancelled")
    finally:
        for b in blockers:
            ray.kill(b)


def test_a_drain_moves_a_running_job_off_its_node_from_a_checkpoint_losing_no_step(
        run: tuple[Store, Controller]) -> None:
    store, controller = run
    # Two trained ranks of a CPU each, packed on one node; no periodic checkpoint: the one it
    # resumes from is the one the drain asked for. No retry to spend.
    spec = JobSpec.model_validate(tiny_spec(
        name="drained", max_retries=0, checkpoint={"every_steps": 1000},
        train={"steps": 30, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        monitor={"probe": False}, resources={"gpus_per_worker": 0, "cpus_per_worker": 1},
        faults=[{"kind": "slow", "rank": 0, "step": 1, "seconds": 0.2}]))
    job_id = submit(store, spec).id
    drive_until(controller, lambda: any(m.step >= 3 for m in store.list_metrics(
        job_id=job_id)), 300, "step 3")
    [node] = nodes_of(store, job_id)
    store.cordon_node(node_id=node, by="admin", reason="maintenance", drain_grace_s=120)
    drive_until(controller, lambda: store.get_job(job_id=job_id).attempts == 2, 300,
                "moved: a second attempt")
    saved = CheckpointIndex(store).list(job_id=job_id)
    assert len(saved) == 1 and saved[0].bytes > 0
    drive_until(controller, lambda: store.get_job(job_id=job_id).state.terminal, 600, "ended")

    job = store.get_job(job_id=job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    assert (job.attempts, job.preemptions) == (2, 1)  # max_retries 0: no retry spent
    attempts = store.list_attempts(job_id=job_id)
    assert [a.status for a in attempts] == [AttemptStatus.PREEMPTED, AttemptStatus.SUCCEEDED]
    assert attempts[0].error is not None and "(drained)" in attempts[0].error
    assert node not in nodes_of(store, job_id, 2)
    first = [m.step for m in store.list_metrics(job_id=job_id, attempt=1)]
    second = [m.step for m in store.list_metrics(job_id=job_id, attempt=2)]
    assert second[0] - 1 == saved[0].step == max(first), (first, second)
    assert sorted(first + second) == list(range(1, 31)), "every step stored once"
    events = store.list_events(job_id=job_id, limit=1000)
    asked = [e for e in events if e.data.get("to") == "PREEMPTED"]
    assert len(asked) == 1 and asked[0].data["drained_node"] == node
    assert "is drained by admin (maintenance)" in asked[0].message
    drained = next(n for n in store.list_nodes() if n.node_id == node)
    assert drained.state == "drained"
    assert [e.kind for e in drained.events] == ["drain", "drained"]
    assert drained.events[-1].data["moved"] == [job_id]


def test_the_lemon_rule_cordons_the_node_whose_ranks_failed_two_attempts(
        run: tuple[Store, Controller]) -> None:
    store, controller = run
    lemon, *others = worker_nodes(store)
    for n in others:  # every attempt lands on the one node left
        store.cordon_node(node_id=n, by="admin", reason="test")
    job_id = submit(store, light("lemon", 2, 5, max_retries=5, faults=[
        {"kind": "fail", "rank": 0, "step": 2, "attempt": 1},
        {"kind": "fail", "rank": 0, "step": 2, "attempt": 2}])).id
    # Two failed attempts on it: cordoned by itself, and the job waits for room.
    drive_until(controller, lambda: next(n for n in store.list_nodes()
                                         if n.node_id == lemon).state == "cordoned",
                300, "the lemon node cordoned")
    drive_until(controller, state_is(store, job_id, JobState.QUEUED), 120, "queued")
    node = next(n for n in store.list_nodes() if n.node_id == lemon)
    assert node.cordon is not None and node.cordon.by == "trident"
    assert node.cordon.reason.startswith(
        f"lemon: ranks here failed 2 attempts within 600 s (job {job_id} attempt 1, job"
        f" {job_id} attempt 2)"), node.cordon.reason
    assert node.events[-1].kind == "lemon"
    assert [a.status for a in store.list_attempts(job_id=job_id)] == [AttemptStatus.FAILED] * 2
    [event] = [e for e in store.list_events(job_id=job_id, limit=1000) if e.kind == "node"]
    assert event.attempt == 2 and "cordoned by the lemon rule" in event.message
    for _ in range(10):
        controller.step()
        time.sleep(0.1)
    assert store.get_job(job_id=job_id).attempts == 2  # no new rank on a cordoned node

    store.uncordon_node(node_id=lemon, by="admin")
    drive_until(controller, lambda: store.get_job(job_id=job_id).state.terminal, 240, "ended")
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    assert nodes_of(store, job_id, 3) == {lemon}
