"""Project quotas: the scheduler admits within them (pure admission), and the controller keeps
every project within its quota at every pass, with the waiting reason on the job and one
event per reason (fake worker groups; on SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from service.cluster.data_plane import NodeCapacity, PollResult
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.controller import Controller
from service.policy.quota import Quota, held
from service.policy.scheduler import admit
from service.settings import Settings
from service.store import Job, Store
from service.store.identity import Identity
from service.submission.intake import Submitter
from service.submission.intake import submit as submit_job
from tests.conftest import tiny_spec, user_token
from tests.fakes import FakeLauncher
from tests.fakes import job as make_job

BIG = [NodeCapacity("n0", 512, 64)]


def gpu_job(job_id: int, project: str, gpus: int, priority: int = 0) -> Job:
    return make_job(job_id, world=gpus, gpus=1, priority=priority).model_copy(
        update={"project": project})


def test_a_job_over_its_projects_gpu_quota_waits_with_the_reason() -> None:
    running = gpu_job(1, "vision", 16).model_copy(update={"state": JobState.RUNNING})
    queued = [gpu_job(2, "vision", 8), gpu_job(3, "vision", 16), gpu_job(4, "speech", 8)]
    quotas = {"vision": Quota(gpus=24), "speech": Quota(gpus=8)}
    adm = admit(queued, BIG, BIG, quotas=quotas, holding=held([running]))
    # 16 + 8 = 24 fits vision's quota; the next vision job would pass it and waits, without
    # blocking speech's job behind it.
    assert [j.id for j in adm.admitted] == [2, 4]
    [(waiting, why)] = adm.waiting
    assert waiting.id == 3
    assert why == "waiting for quota: project vision holds 24/24 GPUs, this job needs 16"


def test_a_job_larger_than_its_quota_says_so_and_cpu_quotas_count_cpu_jobs() -> None:
    adm = admit([gpu_job(1, "vision", 16)], BIG, BIG, quotas={"vision": Quota(gpus=8)})
    assert adm.waiting[0][1].startswith("waiting for quota: project vision may hold 8 GPUs,"
                                        " this job needs 16")
    cpu = make_job(2, world=4, cpus=2).model_copy(update={"project": "etl"})
    busy = cpu.model_copy(update={"id": 9, "state": JobState.RUNNING, "world_size": 2})
    adm = admit([cpu], BIG, BIG, quotas={"etl": Quota(gpus=0, cpus=10)}, holding=held([busy]))
    assert adm.waiting[0][1] == ("waiting for quota: project etl holds 4/10 CPUs, this job"
                                 " needs 8")
    assert admit([cpu], BIG, BIG, quotas={"etl": Quota(cpus=8)}).admitted == [cpu]
    assert admit([cpu], BIG, BIG, quotas={"other": Quota(cpus=1)}).admitted == [cpu]


def test_controller_keeps_every_project_within_quota_at_every_pass(store: Store,
                                                                   tmp_path: Path) -> None:
    """Two projects, quotas smaller than the cluster (16 CPUs): jobs beyond a quota wait with
    the reason and start when the quota frees; no project passes its quota at any pass."""
    identity = Identity(store)
    identity.create_project(name="vision", cpu_quota=2)
    identity.create_project(name="speech", cpu_quota=3)
    quotas = {"vision": 2.0, "speech": 3.0}
    ids: dict[int, str] = {}
    for i in range(4):
        for project in ("vision", "speech"):
            spec = JobSpec.model_validate(tiny_spec(name=f"{project}-{i}"))  # 2 x 0.5 CPUs
            ids[submit_job(store, spec, by=Submitter(owner="u", project=project)).id] = project
    # Every job runs for three polls, then succeeds.
    script = [PollResult(state="running"), PollResult(state="running"),
              PollResult(state="succeeded")]
    launcher = FakeLauncher([list(script) for _ in ids], cpus=16)
    c = Controller(store, launcher, checkpoint_root=tmp_path)
    concurrent = {"vision": 0, "speech": 0}
    for _ in range(60):
        c.step()
        holding = held(store.active_jobs())
        for project, quota in quotas.items():
            have = holding.get(project, {}).get("CPUs", 0.0)
            assert have <= quota, f"pass: {project} holds {have} CPUs, quota {quota}"
            concurrent[project] = max(concurrent[project], int(have))
        if all(store.get_job(job_id=j).state.terminal for j in ids):
            break
    assert all(store.get_job(job_id=j).state == JobState.SUCCEEDED for j in ids)
    # Both quotas were used in full (vision: 2 jobs at once of 1 CPU; speech: 3).
    assert concurrent == {"vision": 2, "speech": 3}
    last_vision = max(j for j, p in ids.items() if p == "vision")
    events = [e for e in store.list_events(job_id=last_vision) if e.kind == "quota"]
    assert events, "the last vision job never waited for its quota"
    assert events[0].message == ("waiting for quota: project vision holds 2/2 CPUs, this job"
                                 " needs 1")
    # One event per reason, not one per pass.
    assert len(events) == len({e.message for e in events})
    assert store.get_job(job_id=last_vision).waiting is None  # cleared once it started


def test_a_queued_job_shows_why_it_waits(store: Store, tmp_path: Path) -> None:
    Identity(store).create_project(name="vision", cpu_quota=1)
    spec = JobSpec.model_validate(tiny_spec())
    first = submit_job(store, spec, by=Submitter(owner="u", project="vision")).id
    second = submit_job(store, spec, by=Submitter(owner="u", project="vision")).id
    launcher = FakeLauncher([[PollResult(state="running")] * 20 for _ in range(2)], cpus=16)
    c = Controller(store, launcher, checkpoint_root=tmp_path)
    for _ in range(3):
        c.step()
    assert store.get_job(job_id=first).state == JobState.RUNNING
    job = store.get_job(job_id=second)
    assert job.state == JobState.QUEUED
    assert job.waiting == "waiting for quota: project vision holds 1/1 CPUs, this job needs 1"
    assert [e.message for e in store.list_events(job_id=second) if e.kind == "quota"] == [
        job.waiting]
    # The API shows it: in the job's detail (its own field and its reason), its line of the
    # jobs list, and its events.
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store),
                    headers={"Authorization": f"Bearer {user_token(store, 'vic', 'viewer')}"},
                    ) as api:
        detail = api.get(f"/api/v1/jobs/{second}").json()
        assert detail["state"] == "QUEUED"
        assert detail["waiting"] == detail["reason"] == job.waiting
        [line] = [j for j in api.get("/api/v1/jobs?project=vision").json()["items"]
                  if j["id"] == second]
        assert line["reason"] == job.waiting
        events = api.get(f"/api/v1/jobs/{second}/events").json()["items"]
        assert [e["message"] for e in events if e["kind"] == "quota"] == [job.waiting]
        # The quota frees: the job starts, and its detail no longer says it waits.
        store.request_cancel(job_id=first)
        for _ in range(5):
            c.step()
            if store.get_job(job_id=second).state == JobState.RUNNING:
                break
        detail = api.get(f"/api/v1/jobs/{second}").json()
        assert detail["state"] == "RUNNING" and detail["waiting"] is None
        assert detail["reason"] is None or "quota" not in detail["reason"]
