"""On a real local Ray, through the API with members' tokens and the controller: a job never
starts on a checkpoint folder another owner's job wrote, nor do its ranks when started
there; and a start that fails after its placement group was made releases the group and its
ranks in the same controller pass."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from fastapi.testclient import TestClient  # noqa: E402

from api.app import create_app  # noqa: E402
from service.contract.spec import JobSpec  # noqa: E402
from service.contract.states import JobState  # noqa: E402
from service.control.controller import Controller  # noqa: E402
from service.files.checkpoint_dirs import RULE, CheckpointPlaces, CheckpointWriter, read_writer  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store import Store  # noqa: E402
from service.submission.intake import Submitter  # noqa: E402
from service.submission.intake import submit as submit_job  # noqa: E402
from tests.conftest import migrated_sqlite, ray_namespace, tiny_spec, user_token  # noqa: E402
from tests.smallfs import snapshot  # noqa: E402
from tests.waiting import drive  # noqa: E402
from workers.launch.group import RayWorkerGroup  # noqa: E402
from workers.launch.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(local_ray: None, tmp_path: Path) -> Iterator[tuple[TestClient, Store, Controller]]:
    store = Store(migrated_sqlite(tmp_path / "e2e.db"))
    settings = Settings(data_dir=tmp_path / "data")
    with ray_namespace() as namespace:
        controller = Controller(store, RayLauncher(namespace=namespace),
                                checkpoint_root=settings.checkpoint_root,
                                places=CheckpointPlaces(settings.checkpoint_root_dirs,
                                                        settings.data_dir),
                                start_timeout_s=120, cancel_grace_s=5)
        with TestClient(create_app(settings, store=store)) as client:
            yield client, store, controller
        controller.shutdown(stop_jobs=True)
    store.close()


def live_groups(name: str) -> tuple[list[str], list[str]]:
    """The named ranks and the placement groups of group `name` that Ray still holds."""
    actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith(name + "-r"))
    pgs = [pg["name"] for pg in ray.util.placement_group_table().values()
           if pg.get("name") == name and pg["state"] != "REMOVED"]
    return actors, pgs


def test_a_job_never_starts_on_another_owners_checkpoint_folder(stack) -> None:
    client, store, controller = stack
    data = Path(client.app.state.settings.data_dir)  # type: ignore[attr-defined]
    alice = {"Authorization": f"Bearer {user_token(store, 'alice', 'member')}"}
    bob = {"Authorization": f"Bearer {user_token(store, 'bob', 'member')}"}
    theirs = data / "checkpoints" / "alice-run"
    r = client.post("/api/v1/jobs", headers=alice, json=tiny_spec(
        train={"steps": 4, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        checkpoint={"every_steps": 2, "dir": str(theirs)}, monitor={"probe": False}))
    assert r.status_code == 201, r.text
    a = r.json()["id"]
    assert drive(controller, store, a, {JobState.SUCCEEDED, JobState.FAILED}, 240) == \
        JobState.SUCCEEDED, store.get_job(job_id=a).error
    assert read_writer(theirs) == CheckpointWriter(job_id=a, owner="alice")
    assert os.path.exists(theirs / "step4" / "COMPLETE")
    before = snapshot(theirs)

    # Through the API, bob may not name alice's folder.
    r = client.post("/api/v1/jobs", headers=bob, json=tiny_spec(
        checkpoint={"every_steps": 2, "dir": str(theirs)}))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "checkpoint", "dir"]
    assert f"job {a} (owner alice)" in r.json()["detail"][0]["msg"]

    # Queued without that check (a job submitted before it, or a folder that changed since):
    # refused at start, not retried, nothing started, nothing written.
    spec = JobSpec.model_validate(tiny_spec(
        train={"steps": 8, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        checkpoint={"every_steps": 2, "dir": str(theirs)}, max_retries=2,
        monitor={"probe": False}))
    b = submit_job(store, spec, by=Submitter(owner="bob")).id
    assert drive(controller, store, b, {JobState.FAILED, JobState.SUCCEEDED}, 60) == \
        JobState.FAILED
    job = store.get_job(job_id=b)
    assert job.attempts == 1 and job.error is not None, job
    assert job.error.startswith(f"not started: {theirs} holds the checkpoints of job {a}"
                                " (owner alice)") and RULE in job.error, job.error
    states = [e.data["to"] for e in store.list_events(job_id=b) if e.kind == "state"]
    assert "RESTARTING" not in states and "RUNNING" not in states, states
    assert store.list_metrics(job_id=b) == []
    assert live_groups(f"trident-job{b}-a1") == ([], [])

    # Its ranks, started there all the same (as a controller from before the check would
    # start them): rank 0 refuses the folder before any rank resumes, and they fail.
    group = RayLauncher(namespace=controller.launcher.namespace).start(
        job_id=b, attempt=2, spec=spec, plan=job.plan, checkpoint_dir=str(theirs),
        writer=CheckpointWriter(job_id=b, owner="bob"))
    try:
        deadline = time.monotonic() + 180
        poll = group.poll(1.0)
        while poll.state in ("starting", "running") and not poll.reports:
            assert time.monotonic() < deadline, "the ranks neither failed nor trained"
            poll = group.poll(1.0)
        assert poll.state == "failed" and poll.reports == [], poll
        assert poll.error is not None and "CheckpointRefused" in poll.error
        assert f"holds the checkpoints of job {a} (owner alice)" in poll.error
    finally:
        group.shutdown(5)
    assert snapshot(theirs) == before


def test_a_start_that_fails_after_its_placement_group_releases_it_at_once(stack) -> None:
    client, store, controller = stack
    # A quantity Ray rounds to no CPU at all: the placement group is made, the first rank is
    # refused (`resources.cpus_per_worker` refuses it at submission now).
    name = "trident-job90-a1"
    with pytest.raises(ValueError, match="0.0001"):
        RayWorkerGroup(name=name, world_size=2, ranks_per_bundle=1, cpus=1e-9, gpus=0,
                       env={}, launch=None, detached=True)
    assert live_groups(name) == ([], [])

    # Through the controller: the second rank's name is taken (a rank another controller
    # left), after the placement group and the first rank were made.
    admin = {"Authorization": f"Bearer {user_token(store)}"}
    controller.step()  # the first pass sweeps what no attempt owns: nothing left to sweep
    job_id = client.post("/api/v1/jobs", headers=admin, json=tiny_spec(
        monitor={"probe": False})).json()["id"]
    group = f"trident-job{job_id}-a1"

    @ray.remote(num_cpus=0)
    class Squatter:
        def ping(self) -> bool:
            return True

    squatter = Squatter.options(name=f"{group}-r1",  # type: ignore[attr-defined]
                                namespace=controller.launcher.namespace,
                                lifetime="detached").remote()
    assert ray.get(squatter.ping.remote())
    try:
        changes = controller.step().changes
        assert [c.to for c in changes] == [JobState.PLACING, JobState.FAILED], changes
        error = store.get_job(job_id=job_id).error
        assert error is not None and "worker group failed to start" in error, error
        # In the same pass: the placement group is removed and the first rank killed (its
        # process ends asynchronously: it leaves the named actors within moments).
        assert live_groups(group)[1] == []
        deadline = time.monotonic() + 60
        while live_groups(group)[0] != [f"{group}-r1"]:
            assert time.monotonic() < deadline, live_groups(group)
            time.sleep(0.2)
        assert ray.get(squatter.ping.remote())  # not the group's: left alone
    finally:
        ray.kill(squatter)
