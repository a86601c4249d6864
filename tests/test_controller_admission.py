"""Admission reads the queue a page at a time (`Controller._admit`): a long queue costs a pass
no more than its head, and no job is skipped or admitted out of order."""

from __future__ import annotations

from pathlib import Path

import pytest

from service import controller as controller_mod
from service.protocols import PollResult
from service.states import JobState
from service.store import Store
from tests.fakes import FakeLauncher, make, submit


def _pages(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, int]]:
    calls: list[tuple[int | None, int]] = []
    real = store.queued_jobs

    def spy(*, limit: int | None = None, offset: int = 0):  # type: ignore[no-untyped-def]
        calls.append((limit, offset))
        return real(limit=limit, offset=offset)

    monkeypatch.setattr(store, "queued_jobs", spy)
    return calls


def test_a_blocked_queue_reads_one_page(sqlite_store: Store, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_mod, "ADMIT_PAGE", 2)
    launcher = FakeLauncher([[PollResult(state="running")]] * 5, cpus=1)  # room for one job
    ids = [submit(sqlite_store, resources={"cpus_per_worker": 0.5}) for _ in range(5)]
    calls = _pages(sqlite_store, monkeypatch)
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert calls == [(2, 0)]
    assert [sqlite_store.get_job(job_id=i).state for i in ids] == [
        JobState.PLACING] + [JobState.QUEUED] * 4


def test_impossible_jobs_fill_a_page_and_the_next_page_is_admitted(
        sqlite_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_mod, "ADMIT_PAGE", 2)
    launcher = FakeLauncher([[PollResult(state="running")]] * 3, cpus=4)
    too_big = [submit(sqlite_store, resources={"cpus_per_worker": 3}) for _ in range(2)]
    fits = [submit(sqlite_store, resources={"cpus_per_worker": 0.5}) for _ in range(3)]
    calls = _pages(sqlite_store, monkeypatch)
    c = make(sqlite_store, launcher, tmp_path)
    c.step()
    assert [sqlite_store.get_job(job_id=i).state for i in too_big] == [JobState.FAILED] * 2
    # The first page was all impossible (failed): the next page is read in the same pass and
    # admitted in order; having admitted, the pass stops there.
    assert calls == [(2, 0), (2, 0)]
    assert [sqlite_store.get_job(job_id=i).state for i in fits] == [
        JobState.PLACING, JobState.PLACING, JobState.QUEUED]
    c.step()
    assert sqlite_store.get_job(job_id=fits[2]).state == JobState.PLACING
