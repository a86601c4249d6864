"""On a real local Ray, through the API with members' tokens and the controller: a job never
starts on a checkpoint folder another owner's job wrote, nor do its ranks when started there."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from fastapi.testclient import TestClient  # noqa: E402

from api.app import create_app  # noqa: E402
from service.checkpoints import RULE, CheckpointPlaces, CheckpointWriter, read_writer  # noqa: E402
from service.controller import Controller  # noqa: E402
from service.jobs import Submitter  # noqa: E402
from service.jobs import submit as submit_job  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.spec import JobSpec  # noqa: E402
from service.states import JobState  # noqa: E402
from service.store import Store  # noqa: E402
from tests.conftest import tiny_spec, user_token  # noqa: E402
from tests.test_e2e_ray import drive  # noqa: E402
from tests.test_workers_checkpoint_owner import snapshot  # noqa: E402
from workers.launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def stack(local_ray: None, tmp_path: Path) -> Iterator[tuple[TestClient, Store, Controller]]:
    store = Store(f"sqlite:///{tmp_path / 'e2e.db'}")
    store.migrate()
    settings = Settings(data_dir=tmp_path / "data")
    controller = Controller(store, RayLauncher(), checkpoint_root=settings.checkpoint_root,
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
    group = RayLauncher().start(job_id=b, attempt=2, spec=spec, plan=job.plan,
                                checkpoint_dir=str(theirs),
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
