"""`trident goodput` against a real API server (uvicorn on a free port) whose jobs, attempts,
steps and state changes are written through the store as the controller writes them (no
Ray), with a price per CPU-hour set: a job's ledger and the totals over a window as tables,
`-o json|yaml` as the API answers them (the CLI run as a process too), and the window's flags
refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from api.app import create_app
from cli.goodput import when
from client.ledger import CATEGORIES
from service.contract.prices import ProfilePrice, money
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.views import AttemptStatus
from service.submission.intake import Submitter, submit
from tests.cli_stack import Live, live_on
from tests.conftest import migrated_sqlite, record_steps, tiny_spec, user_token
from tests.servers import ROOT, serving

CPU_HOUR = 3600.0
"""The price of a CPU-hour: a CPU-second costs 1."""


def _step(step: int, rank: int, **data: Any) -> dict[str, Any]:
    return {"step": step, "rank": rank, "loss": 5.0 - step / 10, "step_time_s": 0.05,
            "tokens_per_s": 100.0, "data": {"ended_at": time.time(), **data}}


def _steps(store: Store, job_id: int, attempt: int, steps: range, **data: Any) -> None:
    for s in steps:
        time.sleep(0.06)
        record_steps(store, job_id=job_id, attempt=attempt,
                     rows=[_step(s, r, **data) for r in (0, 1)])


def seed(store: Store) -> dict[str, int]:
    """Alice's job that failed at step 4 and was resumed from step 2 to succeed; Bob's that
    ran 2 steps and was cancelled."""
    def new(name: str, owner: str) -> int:
        return submit(store, JobSpec.model_validate(tiny_spec(name=name)),
                      by=Submitter(owner=owner, project="default")).id

    ids = {"resumed": new("resumed", "alice"), "cancelled": new("stopped", "bob")}
    job = ids["resumed"]
    store.transition(job_id=job, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=job)
    store.transition(job_id=job, to=JobState.RUNNING, message="running")
    _steps(store, job, 1, range(1, 5))
    store.end_attempt(job_id=job, number=1, status=AttemptStatus.FAILED, error="rank 1 died")
    store.transition(job_id=job, to=JobState.RESTARTING, message="attempt 1 failed")
    time.sleep(0.05)
    store.transition(job_id=job, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=job)
    store.transition(job_id=job, to=JobState.RUNNING, message="running")
    _steps(store, job, 2, range(3, 7), resumed_from=2)
    store.end_attempt(job_id=job, number=2, status=AttemptStatus.SUCCEEDED)
    store.transition(job_id=job, to=JobState.SUCCEEDED, message="done")
    bob = ids["cancelled"]
    store.transition(job_id=bob, to=JobState.PLACING, message="placing")
    store.start_attempt(job_id=bob)
    store.transition(job_id=bob, to=JobState.RUNNING, message="running")
    _steps(store, bob, 1, range(1, 3))
    store.end_attempt(job_id=bob, number=1, status=AttemptStatus.CANCELLED)
    store.transition(job_id=bob, to=JobState.CANCELLED, message="cancelled")
    return ids


@pytest.fixture
def priced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Live, dict[str,
                                                                                       int]]]:
    store = Store(migrated_sqlite(tmp_path / "cli.db"))
    settings = Settings(data_dir=tmp_path, prices={"cpu": ProfilePrice(cpu_hour=CPU_HOUR)})
    ids = seed(store)
    with serving(create_app(settings, store=store)) as url:
        yield live_on(monkeypatch, url, store, settings), ids
    store.close()


def api(live: Live, path: str, **params: str) -> Any:
    r = httpx.get(f"{live.url}/api/v1{path}", params=params,
                  headers={"Authorization": f"Bearer {os.environ['TRIDENT_TOKEN']}"})
    assert r.status_code == 200, r.text
    return r.json()


def run(live: Live, *args: str, code: int = 0) -> str:
    r = live.cli(*args)
    assert r.exit_code == code, r.output
    return r.output


def test_json_of_an_ended_job_is_the_api_s(priced: tuple[Live, dict[str, int]]) -> None:
    live, ids = priced
    job = ids["resumed"]
    # The CLI as a process, as a user runs it.
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "goodput", str(job), "-o", "json", "--server",
         live.url], env={**os.environ, "PYTHONPATH": str(ROOT),
                         "TRIDENT_TOKEN": user_token(live.store)},
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    answered = api(live, f"/jobs/{job}/goodput")
    assert printed == answered
    assert answered["ended"] and answered["state"] == "SUCCEEDED"
    assert [c["category"] for c in answered["categories"]] == list(CATEGORIES)
    assert answered["steps_lost"] == 2 and answered["steps_counted"] == 6
    assert yaml.safe_load(run(live, "goodput", str(job), "-o", "yaml")) == answered
    # Priced: every CPU-second costs 1.
    assert answered["cost"] == pytest.approx(sum(c["cpu_seconds"]
                                                 for c in answered["categories"]))


def test_job_table(priced: tuple[Live, dict[str, int]]) -> None:
    live, ids = priced
    job = ids["resumed"]
    d = api(live, f"/jobs/{job}/goodput")
    lines = run(live, "goodput", str(job)).splitlines()
    assert lines[0] == f"Job {job} (resumed) of alice, project default: SUCCEEDED, 2 rank(s) on cpu"
    head = lines.index(next(ln for ln in lines if ln.startswith("CATEGORY")))
    assert lines[head].split() == ["CATEGORY", "SECONDS", "SHARE", "RANK-S", "CPU-S", "COST"]
    rows = {ln.split()[0]: ln.split() for ln in lines[head + 1:head + 2 + len(CATEGORIES)]}
    assert list(rows) == [*CATEGORIES, "total"]
    for c in d["categories"]:
        seconds, share, rank_s, cpu_s, cost = rows[c["category"]][1:]
        assert float(seconds) == pytest.approx(c["seconds"], abs=0.05)
        assert float(share.rstrip("%")) == pytest.approx(100 * c["seconds"] / d["wall_s"],
                                                         abs=0.05)
        assert float(rank_s) == pytest.approx(c["rank_seconds"], abs=0.05)
        assert float(cpu_s) == pytest.approx(c["cpu_seconds"], abs=0.05)
        assert cost == money(c["cost"])
    assert float(rows["total"][1]) == pytest.approx(d["wall_s"], abs=0.05)
    assert rows["total"][2] == "100.0%"
    text = "\n".join(lines)
    assert f"ETTR:         {100 * d['ettr']:.1f}%" in text
    assert "Steps:        6 counted, 2 lost" in text
    assert f"Cost:         {money(d['cost'])}" in text


def test_unpriced_job_has_no_money(live: Live) -> None:
    job = submit(live.store, JobSpec.model_validate(tiny_spec()),
                 by=Submitter(owner="admin", project="default")).id
    out = run(live, "goodput", str(job))
    assert "COST" not in out and "(now: it has not ended)" in out
    assert "Cost:         - (no price set" in out
    # A queued job: all of its time so far waited for room.
    queued = next(ln for ln in out.splitlines() if ln.startswith("queued "))
    assert queued.split()[2] == "100.0%"


def test_totals_over_a_window(priced: tuple[Live, dict[str, int]]) -> None:
    live, ids = priced
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    until = datetime.now(UTC).isoformat()
    printed = json.loads(run(live, "goodput", "--since", since, "--until", until, "-o", "json"))
    assert printed == api(live, "/goodput", since=since, until=until)
    assert printed["cluster"]["jobs"] == 2
    assert sorted(g["key"] for g in printed["owners"]) == ["alice", "bob"]
    assert printed["top_lost"][0]["job_id"] == ids["resumed"]
    lines = run(live, "goodput", "--since", "1h").splitlines()
    assert lines[0].startswith("Goodput from ")
    head = lines[2].split()
    assert head[:5] == ["SCOPE", "KEY", "JOBS", "WALL", "ETTR"] and head[-2:] == ["COST",
                                                                                 "COST/BTOK"]
    rows = [ln.split() for ln in lines[3:6]]
    assert [r[:3] for r in rows] == [["cluster", "cluster", "2"], ["project", "default", "2"],
                                     ["owner", "alice", "1"]]
    top = lines.index("Jobs that lost the most time (lost work, recovery, stalls):")
    assert lines[top + 2].split()[:2] == [str(ids["resumed"]), "resumed"]
    # Filters: the owner's jobs only.
    bob = json.loads(run(live, "goodput", "--owner", "bob", "-o", "json"))
    assert bob["cluster"]["jobs"] == 1 and [g["key"] for g in bob["owners"]] == ["bob"]
    # A window before every job holds none.
    old = json.loads(run(live, "goodput", "--until", "2001-01-01", "-o", "json"))
    assert old["cluster"]["jobs"] == 0


def test_bad_windows_are_one_line(priced: tuple[Live, dict[str, int]]) -> None:
    live, ids = priced
    out = run(live, "goodput", "--since", "yesterday", code=2)
    assert out.strip() == ("error: --since: 'yesterday' is neither a time ago (7d, 12h, 30m)"
                           " nor an ISO time (2025-01-31 or 2025-01-31T12:00:00Z)")
    out = run(live, "goodput", "--until", "12x", code=2)
    assert out.startswith("error: --until: '12x'") and len(out.strip().splitlines()) == 1
    out = run(live, "goodput", "--since", "1h", "--until", "2h", code=2)
    assert out.startswith("error: --until: ") and "is not after --since" in out
    out = run(live, "goodput", str(ids["resumed"]), "--since", "7d", code=2)
    assert out.strip() == "error: --since: a window's filter; give it without a job id"
    out = run(live, "goodput", "9999", code=2)
    assert out.strip() == "error: 404: job 9999 not found"


def test_when_reads_times_ago_and_iso_times() -> None:
    now = datetime(2025, 3, 10, 12, 0, tzinfo=UTC)
    assert when("7d", "--since", now=now) == now - timedelta(days=7)
    assert when("12h", "--since", now=now) == now - timedelta(hours=12)
    assert when("30m", "--since", now=now) == now - timedelta(minutes=30)
    assert when("1.5h", "--since", now=now) == now - timedelta(minutes=90)
    assert when("2025-01-31", "--since") == datetime(2025, 1, 31, tzinfo=UTC)
    assert when("2025-01-31T12:00:00+02:00", "--since") == datetime(2025, 1, 31, 10,
                                                                     tzinfo=UTC)
    assert when(None, "--since") is None
