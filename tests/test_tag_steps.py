"""A checkpoint tag carries its ranks' step reports not acknowledged yet
(`service.files.tag_steps`),
and the controller stores them and indexes the tags it finds on disk
(`service.control.tag_recovery`):
once, under the attempt that ran the steps, whatever the store had already. The ranks writing
them, and a node's death on real Ray, are in test_tag_steps_ray.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.control.tag_recovery import recover
from service.files.checkpoint_dirs import default_folder
from service.files.checkpoint_tags import MARKER, tag
from service.files.tag_steps import write
from service.settings import Settings
from service.store import Store
from service.store.checkpoints import CheckpointIndex
from service.store.metrics import MetricsIngest
from tests.conftest import authed_client
from tests.fakes import FakeGroup, FakeLauncher, make, step_report, submit
from tests.waiting import DEADLINE_S, drive_until


def _tag(folder: Path, step: int, *, job_id: int | None, attempt: int,
         reports: dict[int, list[int]], complete: bool = True) -> Path:
    """Tag `step` as the ranks save it: a shard, each rank's unacknowledged reports (`reports`:
    rank -> steps), the marker last."""
    path = folder / tag(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    for rank, steps in reports.items():
        write(path, job_id=job_id, attempt=attempt, world_size=2, rank=rank,
              reports=[step_report(rank, s, 5.0 - s / 10) for s in steps])
    if complete:
        (path / MARKER).write_text(f"{step}\n")
    return path


def _stored(store: Store, job_id: int) -> list[tuple[int, int, int]]:
    """(attempt, step, rank) of every per-rank row stored."""
    return [(m.attempt, m.step, m.rank) for m in store.list_metrics(job_id=job_id, rank=None)]


def test_a_tags_reports_are_stored_once_under_the_attempt_that_ran_them(
        store: Store, tmp_path: Path) -> None:
    job_id = submit(store)
    job = store.start_attempt(job_id=job_id)
    ingest = MetricsIngest(store)
    # Steps 1-2 were polled and stored; the ranks then trained to step 6 and saved its tag,
    # each rank still holding step 2 (its acknowledgement not yet polled) to 6.
    ingest.record(job_id=job_id, attempt=1, world_size=2,
                  rows=[{**step_report(r, s, 1.0), "data": {}} for s in (1, 2) for r in (0, 1)])
    folder = tmp_path / "ckpt"
    _tag(folder, 6, job_id=job_id, attempt=1, reports={0: [2, 3, 4, 5, 6], 1: [2, 3, 4, 5, 6]})
    _tag(folder, 8, job_id=job_id, attempt=1, reports={0: [7, 8]}, complete=False)  # cut short
    (folder / tag(6) / "trident-steps" / "rank5.json").write_text('{"job_id": ' + str(job_id)
                                                                  + ', "reports": 3}')

    got = recover(store, ingest, job=job, folder=str(folder), max_bytes=1 << 20)

    assert got.steps == {6: [2, 3, 4, 5, 6]}
    assert _stored(store, job_id) == [(1, s, r) for s in range(1, 7) for r in (0, 1)]
    steps = ingest.list_steps(job_id=job_id)
    assert [(s.attempt, s.step, s.ranks) for s in steps] == [(1, s, 2) for s in range(1, 7)]
    assert [s.loss for s in steps][2:] == [5.0 - s / 10 for s in range(3, 7)]
    assert len(got.skipped) == 1 and "rank5.json" in got.skipped[0]
    said = [e for e in store.list_events(job_id=job_id) if e.kind == "recovered"]
    assert len(said) == 1 and "step6 (steps 2-6)" in said[0].message

    # Read again (a later attempt's start, another controller): nothing is stored twice.
    again = recover(store, ingest, job=job, folder=str(folder), max_bytes=1 << 20)
    assert again.steps == {} and again.indexed == []
    assert _stored(store, job_id) == [(1, s, r) for s in range(1, 7) for r in (0, 1)]
    assert len([e for e in store.list_events(job_id=job_id) if e.kind == "recovered"]) == 1


def test_reports_of_another_job_too_large_or_not_regular_files_are_passed_over(
        store: Store, tmp_path: Path) -> None:
    job_id = submit(store)
    job = store.start_attempt(job_id=job_id)
    folder = tmp_path / "ckpt"
    path = _tag(folder, 3, job_id=job_id + 1, attempt=1, reports={0: [1, 2, 3]})  # copied in
    os.mkfifo(path / "trident-steps" / "rank1.json")  # would block a reader that waits
    _tag(folder, 6, job_id=job_id, attempt=1, reports={0: [4, 5, 6], 1: list(range(1, 300))})
    done = threading.Event()
    out: dict[str, Any] = {}

    def run() -> None:
        out["got"] = recover(store, MetricsIngest(store), job=job, folder=str(folder),
                             max_bytes=4096)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "a FIFO among a tag's reports held the reader"
    got = out["got"]
    assert got.steps == {6: [4, 5, 6]}  # rank 1's file was too large; tag 3 is another job's
    assert _stored(store, job_id) == [(1, s, 0) for s in (4, 5, 6)]
    assert any("rank1.json" in s and "larger than 4096" in s for s in got.skipped)
    assert any("rank1.json" in s and "not a regular file" in s for s in got.skipped)


def running(*steps: int, rank: int = 0) -> PollResult:
    return PollResult(state="running", reports=[step_report(rank, s, 1.0) for s in steps],
                      acks={rank: len(steps)} if steps else {})


@pytest.mark.parametrize("state", [JobState.RUNNING, JobState.PREEMPTED])
def test_a_new_controller_indexes_the_tags_it_finds_on_disk_and_stores_their_steps(
        sqlite_store: Store, tmp_path: Path, state: JobState) -> None:
    """The controller is killed while the job runs, or while it is being preempted: rank 0
    had reported tag 3, then saved tag 6 (and deleted tag 3 by retention) without a poll; the
    ranks are gone with it. The tags are listed as they are on disk (the API reads the index),
    every step of tag 6 is stored, and the job resumes from it."""
    store = sqlite_store
    launcher = FakeLauncher([[running(1, 2), running()], [running()]])
    job_id = submit(store, max_retries=2, train={"steps": 20, "global_batch": 8,
                                                   "micro_batch": 2, "precision": "fp32"})
    c = make(store, launcher, tmp_path)
    c.step(), c.step()
    assert store.get_job(job_id=job_id).state == JobState.RUNNING
    CheckpointIndex(store).saved(job_id=job_id, attempt=1, step=3, size=10, layout={})
    folder = default_folder(tmp_path, job_id)
    _tag(folder, 6, job_id=job_id, attempt=1, reports={0: [3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6]})
    if state == JobState.PREEMPTED:
        store.transition(job_id=job_id, to=state, message="preempted", attempt=1)
    c.shutdown()  # as after a kill -9: the group is gone
    del launcher.live[(job_id, 1)]

    fresh = make(store, launcher, tmp_path)
    fresh.step()
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as api:
        listed = api.get(f"/api/v1/jobs/{job_id}/checkpoints").json()
    assert [(t["step"], t["attempt"]) for t in listed["items"]] == [(6, 1)]
    assert listed["bytes_on_disk"] == sum(f.stat().st_size for f in (folder / tag(6)).rglob("*")
                                          if f.is_file())
    removed = CheckpointIndex(store).list(job_id=job_id, removed=True)
    assert [(t.step, t.removed_at is not None) for t in removed] == [(3, True), (6, False)]
    steps = fresh.ingest.list_steps(job_id=job_id, attempt=1)
    assert [(s.step, s.ranks) for s in steps] == [(s, 2) for s in range(1, 7)]
    drive_until(fresh, lambda: len(launcher.groups) == 2, DEADLINE_S,  # resumes from tag 6
                "attempt 2 started")
    assert launcher.groups[-1].starts["attempt"] == 2


def test_the_tag_an_attempt_resumes_from_is_read_before_it_starts(sqlite_store: Store,
                                                                  tmp_path: Path) -> None:
    """A node's death fails the attempt after the ranks saved tag 4 past the last poll: the
    steps are stored before the next attempt's group is started."""
    store = sqlite_store
    failed = PollResult(state="failed", error="rank 1: actor died", failed_ranks=[1])
    launcher = FakeLauncher([[running(1), failed], [running()]])
    job_id = submit(store, max_retries=2)
    c = make(store, launcher, tmp_path)
    c.step(), c.step()
    folder = default_folder(tmp_path, job_id)  # claimed by the controller for attempt 1
    seen: dict[str, Any] = {}
    start = launcher.start

    def starting(**kw: Any) -> FakeGroup:
        seen["steps"] = [(s.attempt, s.step) for s in c.ingest.list_steps(job_id=job_id)]
        return start(**kw)

    launcher.start = starting  # type: ignore[method-assign]
    _tag(folder, 4, job_id=job_id, attempt=1, reports={0: [2, 3, 4], 1: [1, 2, 3, 4]})
    c.step()
    assert c.teardowns.wait(30)
    drive_until(c, lambda: len(launcher.groups) == 2, DEADLINE_S, "attempt 2 started")
    assert seen["steps"] == [(1, s) for s in range(1, 5)]


def test_a_tag_saved_again_by_a_later_attempt_is_that_attempts(store: Store,
                                                               tmp_path: Path) -> None:
    """Attempt 2 (one rank fewer) saved tag 4 again over attempt 1's: rank 1's file of attempt
    1 is left there, and is not taken for attempt 2's."""
    job_id = submit(store)
    store.start_attempt(job_id=job_id)
    job = store.start_attempt(job_id=job_id)
    folder = tmp_path / "ckpt"
    path = _tag(folder, 4, job_id=job_id, attempt=1, reports={0: [3, 4], 1: [3, 4]})
    write(path, job_id=job_id, attempt=2, world_size=1, rank=0,
          reports=[step_report(0, s, 1.0) for s in (3, 4)])
    got = recover(store, MetricsIngest(store), job=job, folder=str(folder), max_bytes=1 << 20)
    assert got.steps == {4: [3, 4]}
    assert _stored(store, job_id) == [(2, 3, 0), (2, 4, 0)]
    assert [(t.step, t.attempt) for t in CheckpointIndex(store).list(job_id=job_id)] == [(4, 2)]
