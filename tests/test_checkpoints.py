"""A checkpoint folder belongs to its job: its record (job id and owner) is written when the
job first starts, and checked again before every attempt, by the controller (with a fake
worker group here; on real Ray in test_checkpoint_ray.py, on real ranks in
test_workers_checkpoint_owner.py). A job whose folder is another job's, or lies where the
server keeps its own files, fails without a retry and without being started."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from api.app import create_app
from api.schemas import JobOut
from service.cluster.data_plane import PollResult
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.control.controller import Controller
from service.files.checkpoint_dirs import (
    RECORD,
    RULE,
    CheckpointPlaces,
    CheckpointRefused,
    CheckpointWriter,
    claim,
    read_writer,
    refusal,
)
from service.settings import Settings
from service.store import AttemptStatus, Store
from service.submission.intake import Submitter
from service.submission.intake import submit as submit_job
from tests.conftest import authed_client, tiny_spec
from tests.fakes import FakeLauncher

ALICE = CheckpointWriter(job_id=1, owner="alice")
BOB = CheckpointWriter(job_id=2, owner="bob")


def test_a_claimed_folder_is_its_jobs_alone(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    claim(folder, ALICE)
    assert read_writer(folder) == ALICE
    assert json.loads((folder / RECORD).read_text())["owner"] == "alice"
    claim(folder, ALICE)  # its own: again and again
    (folder / "step2").mkdir()
    assert refusal(folder, ALICE) is None
    for other in (BOB, CheckpointWriter(job_id=1, owner="bob"), None):  # same id, other owner
        why = refusal(folder, other)
        assert why == (f"{folder} holds the checkpoints of job 1 (owner alice), as its {RECORD}"
                       f" records: {RULE}, and resumes from no other job's"), why
    with pytest.raises(CheckpointRefused, match="job 1 \\(owner alice\\)"):
        claim(folder, BOB)
    assert read_writer(folder) == ALICE and sorted(os.listdir(folder)) == ["step2", RECORD]


def test_checkpoints_no_job_recorded_are_adopted_only_by_the_folders_own_job(
        tmp_path: Path) -> None:
    folder = tmp_path / "job-2"
    (folder / "step4").mkdir(parents=True)  # written before folders had records
    why = refusal(folder, BOB)
    assert why is not None and "(step4) that no job is recorded as having written" in why
    with pytest.raises(CheckpointRefused):
        claim(folder, BOB)
    claim(folder, BOB, adopt=True)  # the default folder named by the job's own id
    assert read_writer(folder) == BOB


@pytest.mark.parametrize("record", [b"not json", b'{"job_id": "1", "owner": "a"}', b"[]",
                                    b" " * (70 << 10)])
def test_a_record_trident_did_not_write_is_refused(tmp_path: Path, record: bytes) -> None:
    (tmp_path / RECORD).write_bytes(record)
    why = refusal(tmp_path, ALICE)
    assert why is not None and f"its record {RECORD} is not one Trident wrote" in why, why
    with pytest.raises(CheckpointRefused):
        claim(tmp_path, ALICE)


def test_a_file_is_no_checkpoint_folder(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert refusal(tmp_path / "f", ALICE) == f"{tmp_path / 'f'} is not a directory: {RULE}"


def test_places_where_a_named_folder_may_be(tmp_path: Path) -> None:
    data = tmp_path / "data"
    places = CheckpointPlaces([tmp_path], data)
    assert places.refusal(str(tmp_path / "runs" / "a")) is None
    assert places.refusal(str(data / "checkpoints" / "mine")) is None
    assert places.refusal(str(data / "checkpoints" / "job-7x")) is None  # not a job's name
    for path, words in [(tmp_path, "is the checkpoint root"), (data, "is the data directory"),
                        (data / "ray", "inside the data directory"),
                        (data / "trident.db", "inside the data directory"),
                        (data / "checkpoints", "where every job's default folder is"),
                        (data / "checkpoints" / "job-7" / "x",
                         "the default checkpoint folder of job 7"),
                        (tmp_path.parent / "elsewhere", "outside the server's checkpoint roots")]:
        why = places.refusal(str(path))
        assert why is not None and why.startswith(repr(str(path))) and words in why, why


# --- the controller, before every attempt ------------------------------------------------------

def make(store: Store, launcher: FakeLauncher, tmp_path: Path) -> Controller:
    data = tmp_path / "data"
    return Controller(store, launcher, checkpoint_root=data / "checkpoints",
                      places=CheckpointPlaces([tmp_path], data))


def queue(store: Store, owner: str, **over: object) -> int:
    """A job queued as one submitted before the checks of today (no confinement)."""
    spec = JobSpec.model_validate(tiny_spec(max_retries=2, **over))
    return submit_job(store, spec, by=Submitter(owner=owner)).id


def test_a_job_is_not_started_on_another_jobs_folder(sqlite_store: Store,
                                                    tmp_path: Path) -> None:
    store, theirs = sqlite_store, tmp_path / "runs" / "a"
    claim(theirs, CheckpointWriter(job_id=99, owner="alice"))
    (theirs / "step4").mkdir()
    before = sorted(os.listdir(theirs))
    job_id = queue(store, "bob", checkpoint={"dir": str(theirs), "every_steps": 2})
    launcher = FakeLauncher([])
    c = make(store, launcher, tmp_path)
    changes = c.step().changes
    assert [ch.to for ch in changes] == [JobState.PLACING, JobState.FAILED]  # no retry
    job = store.get_job(job_id=job_id)
    assert job.attempts == 1 and launcher.groups == []  # never started
    assert job.error is not None and job.error.startswith(f"not started: {theirs} holds the"
                                                          " checkpoints of job 99 (owner alice)")
    assert RULE in job.error
    [attempt] = store.list_attempts(job_id=job_id)
    assert attempt.status == AttemptStatus.FAILED and attempt.error == job.error
    assert sorted(os.listdir(theirs)) == before


def test_a_named_folder_where_the_server_keeps_its_files_is_refused_at_start(
        sqlite_store: Store, tmp_path: Path) -> None:
    ray_dir = tmp_path / "data" / "ray"
    ray_dir.mkdir(parents=True)
    job_id = queue(sqlite_store, "bob", checkpoint={"dir": str(ray_dir), "every_steps": 2})
    c = make(sqlite_store, FakeLauncher([]), tmp_path)
    assert [ch.to for ch in c.step().changes] == [JobState.PLACING, JobState.FAILED]
    error = sqlite_store.get_job(job_id=job_id).error
    assert error is not None and error.startswith(f"not started: checkpoint.dir: {str(ray_dir)!r}"
                                                  " resolves to") and RULE in error, error
    assert os.listdir(ray_dir) == []  # no record written there


def test_each_attempt_starts_on_its_jobs_own_folder(sqlite_store: Store, tmp_path: Path) -> None:
    """The default folder is made the job's with its first attempt (tags written before
    folders had records are adopted: the folder is named by the job's id); the ranks are
    told whose it must be."""
    job_id = queue(sqlite_store, "bob")
    default = tmp_path / "data" / "checkpoints" / f"job-{job_id}"
    (default / "step2").mkdir(parents=True)
    launcher = FakeLauncher([[PollResult(state="starting")]])
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert launcher.groups[0].starts["ckpt"] == str(default)
    assert launcher.started[0]["writer"] == CheckpointWriter(job_id=job_id, owner="bob")
    assert read_writer(default) == CheckpointWriter(job_id=job_id, owner="bob")


def test_a_folder_rank_0_refused_fails_the_job_without_a_retry(sqlite_store: Store,
                                                                tmp_path: Path) -> None:
    """The folder became another job's between the controller's claim and the ranks' start:
    rank 0 refuses it, and the controller, asking again, does not retry. Any other failure
    is retried."""
    mine = tmp_path / "runs" / "b"
    job_id = queue(sqlite_store, "bob", checkpoint={"dir": str(mine), "every_steps": 2})
    failed = PollResult(state="failed", failed_ranks=[0, 1],
                        error="rank 0:\nCheckpointRefused: ...")
    launcher = FakeLauncher([[failed], [failed]])
    c = make(sqlite_store, launcher, tmp_path)
    c.step()  # started
    c.step()  # an ordinary failure: retried
    assert sqlite_store.get_job(job_id=job_id).state == JobState.RESTARTING
    assert c.teardowns.wait(30)
    c.step()  # attempt 2 started on the folder, still bob's
    assert read_writer(mine) == CheckpointWriter(job_id=job_id, owner="bob")
    (mine / RECORD).write_text(json.dumps({"job_id": 99, "owner": "alice"}))
    c.step()
    job = sqlite_store.get_job(job_id=job_id)
    assert job.state == JobState.FAILED and job.attempts == 2, job
    assert job.error is not None and "not retried:" in job.error and "job 99 (owner alice)" in \
        job.error


def test_a_stored_spec_that_fails_a_newer_check_fails_without_a_start(sqlite_store: Store,
                                                                       tmp_path: Path) -> None:
    """Stored before a check it fails was added (a resource quantity Ray cannot claim): the
    job still lists and reads, in the store and through the API, as it was stored; it fails
    with the reason, without a retry, and the pass goes on; a resubmission is refused on the
    field, as a new submission would be."""
    job = submit_job(sqlite_store, JobSpec.model_validate(tiny_spec(max_retries=2)))
    good = queue(sqlite_store, "bob")
    stored = job.spec.model_dump(mode="json")
    spec = {**stored, "resources": {**stored["resources"], "cpus_per_worker": 1e-9}}
    with sqlite3.connect(tmp_path / "c.db") as db:  # as an older server stored it
        db.execute("UPDATE jobs SET spec = ? WHERE id = ?", (json.dumps(spec), job.id))
    assert sqlite_store.get_job(job_id=job.id).spec.resources.cpus_per_worker == 1e-9
    with authed_client(create_app(Settings(data_dir=tmp_path), store=sqlite_store),
                       sqlite_store) as api:
        def reads(state: JobState) -> None:
            listed = api.get("/api/v1/jobs")
            assert listed.status_code == 200, listed.text
            assert {j["id"]: j["state"] for j in listed.json()["items"]}[job.id] == state.value
            one = api.get(f"/api/v1/jobs/{job.id}")
            assert one.status_code == 200, one.text
            assert one.json()["spec"] == spec
            read = JobOut.model_validate(one.json())  # as TridentClient reads it
            assert read.spec.resources.cpus_per_worker == 1e-9 and read.state == state
            assert api.get(f"/jobs/{job.id}").status_code == 200  # its page
            assert api.get("/").status_code == 200  # the jobs list's page

        reads(JobState.QUEUED)
        refused = api.post(f"/api/v1/jobs/{job.id}/resubmit")
        assert refused.status_code == 422, refused.text
        [d] = refused.json()["detail"]
        assert d["loc"] == ["body", "resources", "cpus_per_worker"], d
        assert "is not a whole number of Ray's resource units" in d["msg"], d
        launcher = FakeLauncher([[PollResult(state="starting")]])
        c = make(sqlite_store, launcher, tmp_path)
        c.step()
        bad = sqlite_store.get_job(job_id=job.id)
        assert bad.state == JobState.FAILED and bad.error is not None
        assert "not started" in bad.error and "resources.cpus_per_worker" in bad.error, \
            bad.error
        assert bad.attempts == 1 and sqlite_store.get_job(job_id=good).state == JobState.PLACING
        # Only the good job was started.
        assert [g.starts["ckpt"] for g in launcher.groups] == [
            str(tmp_path / "data" / "checkpoints" / f"job-{good}")]
        reads(JobState.FAILED)
