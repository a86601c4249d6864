"""Placement on a Ray cluster of 2 simulated nodes with 4 logical GPUs each: a tp2 pp2 dp2 job
(8 ranks) runs through the control plane to SUCCEEDED, and every TP group sits on one node.
The nodes' GPUs are logical: ranks see no CUDA device. The ranks are light (`program: light`,
`workers.rank.light`): what is tested is where they land, not what they compute."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from service.contract.parallel import Dim, ParallelDims  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.store import Store  # noqa: E402
from service.submission.intake import submit  # noqa: E402
from tests.conftest import migrated_sqlite, tiny_spec  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=4, num_gpus=4)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_tp2_pp2_dp2_on_two_nodes_keeps_tp_groups_together(two_nodes: Cluster,
                                                          tmp_path: Path) -> None:
    store = Store(migrated_sqlite(tmp_path / "p.db"))
    spec = JobSpec.model_validate(tiny_spec(
        name="tp2pp2dp2", program="light",
        train={"steps": 3, "global_batch": 8, "micro_batch": 1, "precision": "fp32"},
        parallel={"tp": 2, "pp": 2, "dp": 2, "zero": 1},
        resources={"gpus_per_worker": 1, "cpus_per_worker": 0.25},
        cluster={"gpu": "cpu", "nodes": 2, "gpus_per_node": 4}))
    job_id = submit(store, spec).id
    controller = Controller(store, RayLauncher(light_ranks=True), checkpoint_root=tmp_path,
                            start_timeout_s=300)
    assert len(controller.launcher.total_capacity()) == 3  # head (no CPUs) + 2 GPU nodes
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            controller.step()
            if store.get_job(job_id=job_id).state.terminal:
                break
            time.sleep(0.3)
    finally:
        controller.shutdown(stop_jobs=True)
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.SUCCEEDED, job.error

    ranks = store.list_attempts(job_id=job_id)[0].placement["ranks"]
    node_of = {r["rank"]: r["node_id"] for r in ranks}
    assert len(node_of) == 8
    for group in ParallelDims(tp=2, pp=2, dp=2).groups(Dim.TP):
        assert len({node_of[r] for r in group}) == 1, (group, node_of)
    assert len(set(node_of.values())) == 2  # 8 GPUs needed, 4 per node: both nodes used
    assert all(len(r["gpu_ids"]) == 1 for r in ranks)
    assert all(r["nice"] == 0 for r in ranks)  # not Ray's background niceness (15)

    metrics = store.list_metrics(job_id=job_id, rank=None)
    assert {m.rank for m in metrics} == set(range(8))
    assert [m.step for m in metrics if m.rank == 0] == [1, 2, 3]
    store.close()
