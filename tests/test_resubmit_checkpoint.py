"""Continuing elsewhere: `POST /api/v1/jobs/{id}/resubmit` with `from_checkpoint` and `set`
(and `trident resubmit JOB --from-checkpoint [STEP] --set ...`) makes a new job, owned by a
caller who may export the source's weights (its owner, an admin), that starts from the
source's tag: the controller seeds the new job's own folder with it (hard links), the ranks
resume there with the losses the source would have had. Another member gets a 403, and no
`env` value of the source they may not read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from cli.main import app as cli_app
from service.cluster.data_plane import PollResult
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.controller import Controller
from service.files.checkpoint_dirs import RECORD, CheckpointWriter, claim, seed
from service.files.checkpoint_tags import MARKER
from service.settings import Settings
from service.store import Store
from service.store.checkpoints import CheckpointIndex
from service.submission.intake import Submitter, submit
from tests.conftest import tiny_spec, user_token
from tests.fakes import FakeLauncher
from tests.servers import serving
from tests.workers_spawn import each_step, losses, run_ranks


def _source(store: Store, root: Path, owner: str = "alice", steps: tuple[int, ...] = (2, 4),
            **over: Any) -> int:
    """A job of `owner` whose folder under `root` holds complete tags `steps`, indexed."""
    job = submit(store, JobSpec.model_validate(tiny_spec(
        name="source", checkpoint={"every_steps": 2}, **over)),
        by=Submitter(owner=owner, project="default"))
    folder = root / f"job-{job.id}"
    claim(folder, CheckpointWriter(job_id=job.id, owner=owner))
    for s in steps:
        (folder / f"step{s}" / "global_step").mkdir(parents=True)
        (folder / f"step{s}" / "global_step" / "mp_rank_00_model_states.pt").write_bytes(
            b"w" * 1000)
        (folder / f"step{s}" / MARKER).write_text(f"{s}\n")
        CheckpointIndex(store).saved(job_id=job.id, attempt=1, step=s, size=1000,
                                     layout={"dp": 2})
    store.request_cancel(job_id=job.id)  # it ended (a queued job is cancelled at once)
    return job.id


@pytest.fixture
def api(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as client:
        yield client


def auth(store: Store, name: str, role: str = "member") -> dict[str, str]:
    return {"Authorization": f"Bearer {user_token(store, name, role)}"}


def test_the_owner_resubmits_from_a_checkpoint_on_another_layout(store: Store, tmp_path: Path,
                                                                  api: TestClient) -> None:
    source = _source(store, tmp_path / "checkpoints")
    alice = auth(store, "alice")
    bob = auth(store, "bob")
    r = api.post(f"/api/v1/jobs/{source}/resubmit", headers=alice,
                 json={"from_checkpoint": 0, "set": {"parallel.dp": 1, "parallel.zero": 1,
                                                     "train.steps": 8,
                                                     "train.global_batch": 16}})
    assert r.status_code == 201, r.text
    new = store.get_job(job_id=r.json()["id"])
    assert new.owner == "alice" and new.world_size == 1 and new.spec.train.steps == 8
    assert new.spec.train.global_batch == 16  # its ranks read on from the tag's samples
    assert new.spec.checkpoint.resume_from is not None
    assert new.spec.checkpoint.resume_from.model_dump() == {"job": source, "step": 4}
    assert new.spec.checkpoint.dir is None
    r = api.post(f"/api/v1/jobs/{source}/resubmit", headers=alice, json={"from_checkpoint": 2})
    assert r.status_code == 201
    assert store.get_job(job_id=r.json()["id"]).spec.checkpoint.resume_from.step == 2  # type: ignore[union-attr]

    def refused(body: Any, headers: dict[str, str] = alice) -> tuple[int, Any]:
        got = api.post(f"/api/v1/jobs/{source}/resubmit", headers=headers, json=body)
        return got.status_code, got.json()["detail"]

    code, detail = refused({"from_checkpoint": 3})
    assert code == 422 and detail[0]["loc"] == ["body", "from_checkpoint"]
    assert detail[0]["msg"] == f"job {source} has no checkpoint of step 3 (its tags: 2, 4)"
    code, detail = refused({"from_checkpoint": 0, "set": {"parallel.tp": 3}})
    assert code == 422 and detail[0]["loc"] == ["body", "parallel", "tp"]  # planning's check
    code, detail = refused({"from_checkpoint": 0, "set": {"train.steps": 0}})
    assert code == 422 and detail[0]["loc"] == ["body", "set", "train.steps"]
    code, detail = refused({"from_checkpoint": 0, "set": {"train.nope": 1}})
    assert code == 422 and detail[0]["loc"] == ["body", "set", "train.nope"]
    code, detail = refused({"from_checkpoint": -1})
    assert code == 422 and detail[0]["loc"] == ["body", "from_checkpoint"]
    code, _ = refused({"from_checkpoint": 0}, auth(store, "vic", "viewer"))
    assert code == 403
    code, detail = refused(None, bob)  # a plain resubmission of another's job: owners only
    assert code == 403 and "jobs:resubmit" in detail
    # The folder a job starts from is the resubmission's to name, never a submission's.
    r = api.post("/api/v1/jobs", headers=bob, json=tiny_spec(
        checkpoint={"resume_from": {"job": source, "step": 4}}))
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "checkpoint", "resume_from"]
    # A job with no tag: nothing to start from.
    bare = submit(store, JobSpec.model_validate(tiny_spec()),
                  by=Submitter(owner="alice", project="default")).id
    got = api.post(f"/api/v1/jobs/{bare}/resubmit", headers=alice, json={"from_checkpoint": 0})
    assert got.status_code == 422
    assert got.json()["detail"][0]["msg"] == f"job {bare} has no checkpoint (its tags: none)"


HIDDEN = "alice-private-entity-42"
"""An `env` value of alice's source job: hers and the admins' to read."""


def test_starting_from_another_owners_checkpoint_needs_the_rights_an_export_needs(
        store: Store, tmp_path: Path, api: TestClient) -> None:
    """Carol, a member of alice's project, may read alice's job but not export it: she may not
    start a job from its checkpoint either, by `from_checkpoint` or by resubmitting a job of
    hers that names alice's in `checkpoint.resume_from`; alice and an admin may. No answer
    carol gets, nor any job stored for her, holds alice's hidden `env` value."""
    source = _source(store, tmp_path / "checkpoints", env={"WANDB_ENTITY": HIDDEN})
    alice, carol, admin = auth(store, "alice"), auth(store, "carol"), auth(store, "root", "admin")
    export = api.post(f"/api/v1/jobs/{source}/exports", headers=carol, json={})
    assert export.status_code == 403 and export.json()["detail"].startswith("jobs:export:")

    def resubmit(body: Any, headers: dict[str, str], job: int = source) -> Any:
        return api.post(f"/api/v1/jobs/{job}/resubmit", headers=headers, json=body)

    r = resubmit({"from_checkpoint": 0}, carol)
    assert r.status_code == 403 and HIDDEN not in r.text
    assert r.json()["detail"] == (
        "jobs:export: admins export any job's weights, members only their own jobs' (you are"
        " carol, member); this belongs to alice (starting a job from its checkpoint hands you"
        " its weights, as an export does)")
    r = resubmit(None, carol)  # without a checkpoint: alice's to resubmit
    assert r.status_code == 403 and r.json()["detail"].startswith("jobs:resubmit:")
    assert HIDDEN not in r.text
    # A job of carol's that names alice's tag (as this route made them before) is refused too.
    hers = submit(store, JobSpec.model_validate(tiny_spec(
        name="hers", checkpoint={"resume_from": {"job": source, "step": 4}})),
        by=Submitter(owner="carol", project="default")).id
    r = resubmit(None, carol, hers)
    assert r.status_code == 403 and r.json()["detail"].startswith("jobs:export:")
    assert "this belongs to alice" in r.json()["detail"]
    assert store.list_jobs(owner="carol")[1] == 1  # nothing new stored for her
    for who, name in ((alice, "alice"), (admin, "root")):
        r = resubmit({"from_checkpoint": 4}, who)
        assert r.status_code == 201, r.text
        new = store.get_job(job_id=r.json()["id"])
        assert new.owner == name and new.spec.env == {"WANDB_ENTITY": HIDDEN}  # both read it
        assert new.spec.checkpoint.resume_from is not None
        assert new.spec.checkpoint.resume_from.model_dump() == {"job": source, "step": 4}
    r = resubmit(None, admin, hers)  # an admin may take any job's weights
    assert r.status_code == 201, r.text


def test_the_controller_seeds_the_new_jobs_own_folder_and_never_writes_the_source(
        store: Store, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    source = _source(store, root)
    spec = JobSpec.model_validate(tiny_spec(
        name="continued", checkpoint={"resume_from": {"job": source, "step": 4}}))
    new = submit(store, spec, by=Submitter(owner="bob", project="default")).id
    gone = submit(store, spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
        update={"resume_from": spec.checkpoint.resume_from.model_copy(  # type: ignore[union-attr]
            update={"step": 3})})}), by=Submitter(owner="bob", project="default")).id
    before = sorted(p.relative_to(root) for p in (root / f"job-{source}").rglob("*"))
    launcher = FakeLauncher([[PollResult(state="running")]] * 2, cpus=4)
    c = Controller(store, launcher, checkpoint_root=root)
    c.step()
    mine = root / f"job-{new}"
    assert launcher.groups[0].starts["ckpt"] == str(mine)
    assert sorted(p.name for p in mine.iterdir()) == sorted([RECORD, "step4"])
    model = mine / "step4" / "global_step" / "mp_rank_00_model_states.pt"
    assert (mine / "step4" / MARKER).read_text() == "4\n"
    assert model.stat().st_ino == (root / f"job-{source}" / "step4" / "global_step" /
                                   "mp_rank_00_model_states.pt").stat().st_ino  # a hard link
    [ev] = [e for e in store.list_events(job_id=new) if e.kind == "checkpoint"]
    assert ev.message.startswith(f"starts from job {source}'s checkpoint of step 4: 1 file(s),"
                                 " 1000 bytes hard-linked")
    assert sorted(p.relative_to(root) for p in (root / f"job-{source}").rglob("*")) == before
    # The tag that is not there fails the job at its start, naming it, without a retry.
    job = store.get_job(job_id=gone)
    assert job.state == JobState.FAILED and job.attempts == 1
    assert f"job {source} (owner alice) has no complete checkpoint of step 3" in (job.error or "")
    # A later attempt resumes from its own tags: the folder is seeded once.
    (mine / "step6").mkdir()
    (mine / "step6" / MARKER).write_text("6\n")
    assert seed(mine, root / f"job-{source}", CheckpointWriter(source, "alice"), 4) is None


@pytest.mark.slow
def test_ranks_started_from_a_seeded_tag_train_on_as_the_source_would_have(
        tmp_path: Path) -> None:
    """A real source run of 4 steps (tags 2 and 4); a new job from its step 4, 6 steps long,
    resumes at 4 with the losses of an uninterrupted 6-step run (fp32)."""
    def spec(steps: int) -> JobSpec:
        return JobSpec.model_validate(tiny_spec(
            parallel={"dp": 2, "zero": 1},
            train={"steps": steps, "global_batch": 8, "micro_batch": 2, "lr": 1e-3,
                   "precision": "fp32", "decay_steps": 6},  # the whole run's schedule
            checkpoint={"every_steps": 2}))

    source = tmp_path / "source"
    run_ranks(spec(4), checkpoint_dir=str(source), writer=CheckpointWriter(1, "alice"))
    mine = tmp_path / "mine"
    claim(mine, CheckpointWriter(2, "bob"))
    done = seed(mine, source, CheckpointWriter(1, "alice"), 4)
    assert done is not None and done.linked and done.files > 1
    (continued,) = run_ranks(spec(6), checkpoint_dir=str(mine),
                             writer=CheckpointWriter(2, "bob"))
    (whole,) = run_ranks(spec(6))
    assert {r["resumed_from"] for r in continued} == {4}
    assert losses(continued) == losses(whole)[4:]


@pytest.mark.slow
def test_a_resubmission_with_another_global_batch_reads_the_samples_that_follow(
        tmp_path: Path) -> None:
    """A source of 4 steps at a global batch of 8 (32 samples); the new job, seeded from its
    step 4 with `--set train.global_batch=16`, reads samples 32 to 63 in its 2 steps: the
    sample numbers its ranks' loaders returned, every DP rank, each sample once."""
    def spec(steps: int, global_batch: int) -> JobSpec:
        return JobSpec.model_validate(tiny_spec(
            parallel={"dp": 2, "zero": 1}, checkpoint={"every_steps": 2},
            train={"steps": steps, "global_batch": global_batch, "micro_batch": 2,
                   "lr": 1e-3, "precision": "fp32"}))

    source = tmp_path / "source"
    (first,) = run_ranks(spec(4, 8), checkpoint_dir=str(source),
                         writer=CheckpointWriter(1, "alice"))
    mine = tmp_path / "mine"
    claim(mine, CheckpointWriter(2, "alice"))
    assert seed(mine, source, CheckpointWriter(1, "alice"), 4) is not None
    (continued,) = run_ranks(spec(6, 16), checkpoint_dir=str(mine),
                             writer=CheckpointWriter(2, "alice"))
    for rank in (0, 1):
        rows = each_step(first, rank) + each_step(continued, rank)
        assert [r["batch"] for r in rows] == [8, 8, 8, 8, 16, 16]
        assert [j for r in rows for j in range(r["first_sample"],
                                               r["first_sample"] + r["batch"])] == list(range(64))


def test_the_cli_resubmits_from_a_checkpoint(store: Store, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    source = _source(store, tmp_path / "checkpoints")
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(store, "alice", "member"))
    runner = CliRunner()
    with serving(create_app(Settings(data_dir=tmp_path), store=store)) as url:
        r = runner.invoke(cli_app, ["resubmit", str(source), "--from-checkpoint", "2",
                                    "--set", "train.steps=9", "-d", "--server", url])
        assert r.exit_code == 0, r.output
        new = store.get_job(job_id=int(r.output.strip()))
        assert new.owner == "alice" and new.spec.train.steps == 9
        assert new.spec.checkpoint.resume_from is not None
        assert new.spec.checkpoint.resume_from.step == 2
        r = runner.invoke(cli_app, ["resubmit", str(source), "2", "--server", url])
        assert r.exit_code == 2 and "STEP: only with --from-checkpoint" in r.output
        r = runner.invoke(cli_app, ["resubmit", str(source), "--from-checkpoint", "5", "-d",
                                    "--server", url])
        assert r.exit_code == 2 and "has no checkpoint of step 5" in r.output
