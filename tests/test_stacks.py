"""`trident stacks` without Ray: grouping and its bounds, the stored requests and their limits,
the controller answering from a fake group beside its loop, the REST routes and the CLI (the
real ranks are in test_stacks_ray.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from api.app import create_app
from cli.main import app as cli_app
from cli.stacks import rank_ranges
from service.cluster.data_plane import PollResult
from service.contract.states import JobState
from service.control.controller import Controller
from service.control.stack_collect import StackCollector, group_stacks
from service.settings import Settings
from service.store import Store
from service.store.stack_requests import (
    KEEP_PER_JOB,
    MAX_OPEN,
    StackRequests,
    StackStatus,
    TooManyOpen,
)
from tests.conftest import authed_client
from tests.fakes import FakeGroup, FakeLauncher, submit
from tests.waiting import drive_until, wait_for

LOOP = '  File "workers/trainer/train.py", line 90, in train_rank\n    loss = engine(batch)\n'
WAIT = '  File "workers/monitor/comm_timer.py", line 40, in all_reduce\n    work.wait()\n'


def answers(world: int, odd: dict[int, Any] | None = None) -> dict[int, Any]:
    """Every rank in the training loop with an idle main thread, but those of `odd`."""
    out: dict[int, Any] = {r: [{"thread": "MainThread", "stack": "  idle\n"},
                               {"thread": "train", "stack": LOOP}] for r in range(world)}
    out.update(odd or {})
    return out


def running_job(store: Store) -> int:
    job_id = submit(store)
    for to in (JobState.PLACING, JobState.RUNNING):
        store.transition(job_id=job_id, to=to, message="test")
    return job_id


def test_ranks_with_identical_stacks_are_one_group_and_the_silent_are_named() -> None:
    res = group_stacks(answers(6, {4: [{"thread": "train", "stack": WAIT}],
                                   5: "(no answer)"}))
    assert res["ranks"] == 6 and res["left_out"] == 0
    train, main = res["threads"]  # the work thread first
    assert train["thread"] == "train" and main["thread"] == "MainThread"
    assert train["groups"] == [{"ranks": [0, 1, 2, 3], "stack": LOOP},
                               {"ranks": [4], "stack": WAIT}]
    assert main["groups"] == [{"ranks": [0, 1, 2, 3], "stack": "  idle\n"}]
    assert res["missing"] == [{"reason": "(no answer)", "ranks": [5]}]
    assert rank_ranges([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"


def test_the_answer_is_bounded() -> None:
    big = {r: [{"thread": "train", "stack": f"rank {r} " + "x" * 1000}] for r in range(10)}
    res = group_stacks(big, max_bytes=3500)
    stacks = [g["stack"] for g in res["threads"][0]["groups"]]
    assert sum(s is not None for s in stacks) == 3 and res["left_out"] == 7
    many = {0: [{"thread": f"t{i}", "stack": "s" * 100_000} for i in range(100)]}
    res = group_stacks(many)
    assert len(res["threads"]) == 64  # THREADS_MAX
    assert all(len(g["stack"] or "") <= 32 << 10 for t in res["threads"] for g in t["groups"])


def test_requests_are_bounded_per_job(store: Store) -> None:
    job_id = running_job(store)
    requests = StackRequests(store)
    made = [requests.create(job_id=job_id, requested_by="admin") for _ in range(MAX_OPEN)]
    with pytest.raises(TooManyOpen, match=f"at most {MAX_OPEN}"):
        requests.create(job_id=job_id, requested_by="admin")
    assert [r.id for r in requests.open()] == [r.id for r in made]
    for _ in range(KEEP_PER_JOB + 3):  # answered ones make room; only the newest are kept
        for r in requests.open():
            requests.finish(request_id=r.id, result={"ranks": 2})
        requests.create(job_id=job_id, requested_by="admin")
    kept = [r for r in range(1, made[-1].id + KEEP_PER_JOB + 4)
            if _exists(requests, job_id, r)]
    assert len(kept) == KEEP_PER_JOB and kept[-1] == made[-1].id + KEEP_PER_JOB + 3


def _exists(requests: StackRequests, job_id: int, request_id: int) -> bool:
    try:
        requests.get(job_id=job_id, request_id=request_id)
        return True
    except Exception:
        return False


def test_the_controller_answers_from_the_running_group_beside_its_loop(
        sqlite_store: Store, tmp_path: Path) -> None:
    store = sqlite_store
    launcher = FakeLauncher([[PollResult(state="running")]])
    c = Controller(store, launcher, checkpoint_root=tmp_path)
    job_id = submit(store)
    drive_until(c, lambda: store.get_job(job_id=job_id).state == JobState.RUNNING, 120,
                "RUNNING")
    group: FakeGroup = launcher.groups[0]
    asked = threading.Event()
    release = threading.Event()

    def thread_stacks(timeout_s: float, max_bytes: int) -> dict[int, Any]:
        asked.set()
        assert release.wait(30)  # ranks slow to answer: the passes go on meanwhile
        return answers(2, {1: [{"thread": "train", "stack": WAIT}]})

    group.thread_stacks = thread_stacks  # type: ignore[attr-defined]
    requests = StackRequests(store)
    req = requests.create(job_id=job_id, requested_by="admin")
    c.step()
    assert asked.wait(10)
    polls = group.polls
    for _ in range(3):
        c.step()
    assert group.polls == polls + 3  # the job is still watched every pass
    assert requests.get(job_id=job_id, request_id=req.id).status == StackStatus.RUNNING
    release.set()
    drive_until(c, lambda: requests.get(job_id=job_id, request_id=req.id).status
                == StackStatus.DONE, 120, "answered")
    done = requests.get(job_id=job_id, request_id=req.id)
    assert done.attempt == 1 and done.finished_at is not None
    assert done.result["threads"][0]["groups"] == [{"ranks": [0], "stack": LOOP},
                                                   {"ranks": [1], "stack": WAIT}]


def test_requests_that_cannot_be_answered_fail_with_the_reason(sqlite_store: Store) -> None:
    store = sqlite_store
    requests = StackRequests(store)
    job_id = running_job(store)
    gone = requests.create(job_id=job_id, requested_by="admin")
    taken = requests.create(job_id=job_id, requested_by="admin")
    requests.take(request_id=taken.id, attempt=1)  # by a controller that then stopped
    broken = FakeGroup([PollResult(state="running")])
    collector = StackCollector(requests)
    collector.step({})
    assert "no running ranks" in (requests.get(job_id=job_id, request_id=gone.id).error or "")
    assert "stopped before" in (requests.get(job_id=job_id, request_id=taken.id).error or "")
    failing = requests.create(job_id=job_id, requested_by="admin")
    broken.thread_stacks = lambda *_: 1 / 0  # type: ignore[attr-defined]
    collector.step({job_id: (broken, 1)})  # type: ignore[dict-item]

    def answered() -> bool:
        collector.step({job_id: (broken, 1)})  # type: ignore[dict-item]
        return collector.pending == 0

    wait_for("the failed collection answered", answered)
    got = requests.get(job_id=job_id, request_id=failing.id)
    assert got.status == StackStatus.FAILED and "ZeroDivisionError" in (got.error or "")


def test_rest_routes(sqlite_store: Store, tmp_path: Path) -> None:
    store = sqlite_store
    queued = submit(store)
    job_id = running_job(store)
    with authed_client(create_app(Settings(data_dir=tmp_path), store=store), store) as client:
        r = client.post(f"/api/v1/jobs/{queued}/stacks")
        assert r.status_code == 409 and "QUEUED" in r.json()["detail"]
        ids = []
        for _ in range(MAX_OPEN):
            r = client.post(f"/api/v1/jobs/{job_id}/stacks")
            assert r.status_code == 202 and r.json()["status"] == "pending", r.text
            assert r.json()["requested_by"] == "admin"
            ids.append(r.json()["id"])
        r = client.post(f"/api/v1/jobs/{job_id}/stacks")
        assert r.status_code == 429 and f"at most {MAX_OPEN}" in r.json()["detail"]
        assert client.get(f"/api/v1/jobs/{job_id}/stacks/{ids[0]}").json()["id"] == ids[0]
        assert client.get(f"/api/v1/jobs/{queued}/stacks/{ids[0]}").status_code == 404
        r = client.get(f"/api/v1/jobs/{job_id}/stacks/0")
        assert r.status_code == 422 and "request_id" in r.text
        assert client.post("/api/v1/jobs/99999/stacks").status_code == 404


runner = CliRunner()


def test_trident_stacks_prints_the_groups(server: str, tmp_path: Path) -> None:  # noqa: F811
    store = Store(Settings(data_dir=tmp_path).db_url)
    job_id = running_job(store)
    group = FakeGroup([PollResult(state="running")])
    group.thread_stacks = lambda *_: answers(  # type: ignore[attr-defined]
        4, {2: [{"thread": "train", "stack": WAIT}], 3: "(no answer)"})
    collector = StackCollector(StackRequests(store))
    stop = threading.Event()

    def controller() -> None:  # answers as the controller's passes do
        while not stop.is_set():
            collector.step({job_id: (group, 1)})  # type: ignore[dict-item]
            time.sleep(0.05)

    t = threading.Thread(target=controller, daemon=True)
    t.start()
    try:
        r = runner.invoke(cli_app, ["stacks", str(job_id), "--server", server])
        assert r.exit_code == 0, r.output
        out = r.output
        assert "=== thread train: 2 distinct stack(s)" in out
        assert "--- ranks 0-1 (2 of 4)" in out and "--- rank 2 (1 of 4)" in out
        assert out.index("ranks 0-1") < out.index("in train_rank") < out.index("rank 2 (")
        assert "no stacks from rank(s) 3: (no answer)" in out
        assert "1 other thread(s): MainThread; --all-threads" in out and "idle" not in out
        r = runner.invoke(cli_app, ["stacks", str(job_id), "--all-threads", "--server", server])
        assert "=== thread MainThread" in r.output and "idle" in r.output
        r = runner.invoke(cli_app, ["stacks", str(job_id), "-o", "json", "--server", server])
        assert r.exit_code == 0 and '"status": "done"' in r.output
    finally:
        stop.set()
        t.join(5)
    queued = submit(store)
    r = runner.invoke(cli_app, ["stacks", str(queued), "--server", server])
    assert r.exit_code == 2 and "409" in r.output and "only a RUNNING job" in r.output
    store.close()
