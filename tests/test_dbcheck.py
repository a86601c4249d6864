"""A database Trident cannot read (`service.store.dbcheck`), on real damaged SQLite files: one line
at start for every entry point (`trident controller`, the daemon, the API's factory), a 503
naming the damage for every kind of route while serving, and `trident up`'s decision about its
Ray head when it cannot read which jobs are active. The live stack's side (`trident up` itself,
a file damaged under it, SIGTERM) is in tests/test_e2e_damaged_db.py."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from cli.stopping import stop_head
from service.control.daemon import DATABASE_UNREADABLE
from service.settings import Settings
from service.store import Store
from service.store.dbcheck import Unreadable, check, describe, readable
from tests.conftest import user_token
from tests.damaged_db import damage_header, damage_pages, fill_jobs, malformed, table_pages
from tests.servers import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_a_sound_file_and_a_new_one_pass(tmp_path: Path) -> None:
    db = tmp_path / "trident.db"
    assert check(f"sqlite:///{db}") is None  # not made yet: the migrations make it
    fill_jobs(db, 3)
    assert check(f"sqlite:///{db}") is None


def test_a_damaged_header_is_one_line_naming_the_file_and_the_way_back(tmp_path: Path) -> None:
    db = tmp_path / "trident.db"
    fill_jobs(db, 3)
    damage_header(db)
    assert "not a database" in malformed(db)
    with pytest.raises(Unreadable) as err:
        check(f"sqlite:///{db}", budget_s=0)  # the schema alone finds it
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"the database {db} is damaged (DatabaseError: file is not a"
                           " database)")
    assert "backup copy" in line and f"sqlite3 {db} .recover" in line


def test_damaged_pages_are_found_by_the_quick_check(tmp_path: Path) -> None:
    db = tmp_path / "trident.db"
    fill_jobs(db, 200)
    damage_pages(db, table_pages(db, "jobs"))
    assert "malformed" in malformed(db)
    assert check(f"sqlite:///{db}", budget_s=0) is None  # the schema's pages are sound
    with pytest.raises(Unreadable) as err:
        check(f"sqlite:///{db}")
    assert "\n" not in str(err.value)
    assert f"the database {db} is damaged (PRAGMA quick_check: Page " in str(err.value)


def test_the_quick_check_stops_at_its_budget_and_says_so(tmp_path: Path) -> None:
    db = tmp_path / "big.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE t (x BLOB)")
    conn.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i <"
                 " 100000) INSERT INTO t SELECT randomblob(1000) FROM n")  # 100 MB
    conn.commit()
    conn.close()
    note = check(f"sqlite:///{db}", budget_s=0.001)
    assert note is not None and "stopped after 0.001 s" in note, note
    assert check(f"sqlite:///{db}", budget_s=600) is None  # the whole file is sound


def test_a_server_that_does_not_answer_is_one_line_without_its_password() -> None:
    url = "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/test?connect_timeout=2"
    with pytest.raises(Unreadable) as err:
        check(url)
    line = str(err.value)
    assert line.startswith("cannot reach the database postgresql+psycopg://postgres:***@"
                           "127.0.0.1:1/test"), line
    assert "s3cret" not in line and "\n" not in line


def _run(argv: list[str], data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRIDENT_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    env.pop("TRIDENT_DATABASE_URL", None)
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("entry", ["trident controller", "daemon", "uvicorn api.app:app",
                                   "python -m api.serve"])
def test_each_entry_point_refuses_a_damaged_database_in_one_line(tmp_path: Path,
                                                                 entry: str) -> None:
    fill_jobs(tmp_path / "trident.db", 3)
    damage_header(tmp_path / "trident.db")
    argv = {"trident controller": [str(Path(sys.executable).parent / "trident"), "controller"],
            "daemon": [sys.executable, "-m", "service.control.daemon"],
            "uvicorn api.app:app": [sys.executable, "-m", "uvicorn", "--factory", "api.app:app",
                                    "--port", str(free_port())],
            "python -m api.serve": [sys.executable, "-m", "api.serve", "--port",
                                    str(free_port())]}[entry]
    r = _run(argv, tmp_path)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == (DATABASE_UNREADABLE if entry == "daemon" else 1), out
    assert len(out) == 1, out
    assert f"the database {tmp_path / 'trident.db'} is damaged" in out[0], out


def test_every_kind_of_route_answers_503_naming_the_damage(tmp_path: Path) -> None:
    """The job list, a job (JSON and its page), the jobs page and /metrics, on a file whose
    job pages are damaged: 503 in the shape each was asked in, never a 500."""
    db = tmp_path / "trident.db"
    [job_id, *_] = fill_jobs(db, 200)
    store = Store(f"sqlite:///{db}")
    token = user_token(store)  # the users' and tokens' pages stay sound
    store.close()
    damage_pages(db, table_pages(db, "jobs"))
    store = Store(f"sqlite:///{db}")
    try:
        with TestClient(create_app(Settings(data_dir=tmp_path), store=store),
                        headers={"Authorization": f"Bearer {token}"}) as c:
            for path in ("/api/v1/jobs", f"/api/v1/jobs/{job_id}"):
                r = c.get(path)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.json()["detail"].startswith(
                    "the database is damaged (DatabaseError: database disk image is"
                    " malformed); an operator must restore it from a backup"), r.text
                assert "Retry-After" not in r.headers  # a retry would not do
            for path in ("/", f"/jobs/{job_id}"):
                r = c.get(path)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.headers["content-type"].startswith("text/html")
                assert "The database cannot answer" in r.text and "malformed" in r.text
            r = c.get("/metrics")
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("text/plain")
            assert r.text.startswith("the database is damaged (DatabaseError")
            r = c.get("/api/v1/healthz")
            assert r.json()["database"] == "ok"  # the lease's pages answer
    finally:
        store.close()


def test_a_header_damaged_under_a_serving_app_is_a_503_on_every_route(tmp_path: Path) -> None:
    """The app's pooled connections were opened before the header was overwritten, and SQLite
    would let them read on from what they hold: a checkout looks at the header (once a second
    at most), so every kind of route, and healthz, meets the damage as a new connection does."""
    db = tmp_path / "trident.db"
    [job_id, *_] = fill_jobs(db, 20)
    store = Store(f"sqlite:///{db}")
    token = user_token(store)
    try:
        with TestClient(create_app(Settings(data_dir=tmp_path), store=store),
                        headers={"Authorization": f"Bearer {token}"}) as c:
            for path in ("/api/v1/jobs", f"/api/v1/jobs/{job_id}", "/", "/metrics"):
                assert c.get(path).status_code == 200, path  # connections now in the pool
            damage_header(db)
            assert malformed(db) == "file is not a database"
            # The header is looked at once a second at most (HEADER_CHECK_EVERY_S).
            wait_for("a 503 once the header is looked at again",
                     lambda: c.get("/api/v1/jobs").status_code == 503, 30)
            for path in ("/api/v1/jobs", f"/api/v1/jobs/{job_id}"):
                r = c.get(path)
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert r.json()["detail"] == (
                    "the database is damaged (DatabaseError: file is not a database); an"
                    " operator must restore it from a backup"), r.text
            r = c.get(f"/jobs/{job_id}")
            assert r.status_code == 503 and r.headers["content-type"].startswith("text/html")
            assert "file is not a database" in r.text
            r = c.get("/metrics")
            assert r.status_code == 503 and r.text.startswith(
                "the database is damaged (DatabaseError: file is not a database)"), r.text
            r = c.get("/api/v1/healthz")
            assert r.status_code == 503 and r.json()["database"] == "damaged: DatabaseError"
    finally:
        store.close()


class _Head:
    """What `stop_head` is given of a head: it says whether it was stopped (the real head's
    stop is tests/test_e2e_damaged_db.py's)."""

    address = "127.0.0.1:6379"

    def __init__(self) -> None:
        self.stopped = False

    def stop(self, grace_s: float) -> bool:
        self.stopped = True
        return True

    def kill(self) -> None:
        self.stopped = True


def test_trident_up_stops_its_head_when_the_database_cannot_say_which_jobs_are_active(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged file: nothing can re-attach the jobs, so the head stops with the stack. A
    PostgreSQL server that is only away: the records are intact, the head stays for the next
    `trident up` to adopt."""
    db = tmp_path / "trident.db"
    fill_jobs(db, 200)
    damage_pages(db, table_pages(db, "jobs"))
    head = _Head()
    assert stop_head(head, f"sqlite:///{db}", stop_jobs=False)
    out = capsys.readouterr().out
    assert head.stopped, out
    assert f"the database {db} is damaged" in out and "stopping the Ray head" in out, out
    assert len(out.strip().splitlines()) == 1, out

    damage_header(db)
    head = _Head()
    assert stop_head(head, f"sqlite:///{db}", stop_jobs=False)
    out = capsys.readouterr().out
    assert head.stopped and "(DatabaseError: file is not a database)" in out, out
    assert len(out.strip().splitlines()) == 1, out

    head = _Head()
    assert not stop_head(
        head, "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2", False)
    out = capsys.readouterr().out
    assert not head.stopped, out
    assert "keeps running" in out and "cannot reach the database" in out, out


def test_trident_up_keeps_its_head_when_the_database_does_not_answer_in_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A database that does not answer (here another process holds the SQLite file's lock,
    which SQLite would wait 30 s for) within the stop's bound: its records may be intact, so
    the head stays for the next `trident up`, in one line, and the stop goes on at once."""
    import time

    db = tmp_path / "trident.db"
    fill_jobs(db, 3)
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        head = _Head()
        began = time.monotonic()
        assert not stop_head(head, f"sqlite:///{db}", stop_jobs=False, answer_s=1)
        took = time.monotonic() - began
        out = capsys.readouterr().out
        assert not head.stopped, out
        assert took < 3, took
        assert out.strip() == (
            f"the database {db} did not say within 1 s which jobs are active; the Ray head at"
            " 127.0.0.1:6379 keeps running, for the jobs that may be active on it: the next"
            " `trident up` re-attaches them"), out
        # --stop-jobs asks the store nothing: the head stops.
        assert stop_head(head, f"sqlite:///{db}", stop_jobs=True, answer_s=1)
        assert head.stopped
    finally:
        holder.close()


def test_readable_turns_a_driver_error_into_the_line(tmp_path: Path) -> None:
    db = tmp_path / "trident.db"
    fill_jobs(db, 3)
    damage_header(db)
    store = Store(f"sqlite:///{db}")
    try:
        with pytest.raises(Unreadable) as err, readable(store.url):
            store.active_jobs()
    finally:
        store.close()
    assert str(err.value) == describe(store.url, err.value.__cause__)  # type: ignore[arg-type]


def test_the_daemon_logs_a_damaged_database_in_one_line_per_failed_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import threading
    import time

    import service.control.daemon as daemon
    from tests.fakes import FakeLauncher

    fill_jobs(tmp_path / "trident.db", 200)
    damage_pages(tmp_path / "trident.db", table_pages(tmp_path / "trident.db", "jobs"))
    monkeypatch.setattr(daemon, "connect_ray", lambda _settings: FakeLauncher([]))
    caplog.set_level("INFO", logger="trident.controller")

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "controller pass failed" in r.getMessage()]

    stop = threading.Event()
    status: list[int] = []
    t = threading.Thread(target=lambda: status.append(daemon.run(
        Settings(data_dir=tmp_path, poll_interval_s=0.05, lease_s=600), stop)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while len(failed()) < 2 and t.is_alive():
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(30)
    assert status == [0], caplog.text  # stopped cleanly, lease released
    for record in failed():
        assert record.exc_info is None, record  # no traceback
        assert f"the database {tmp_path / 'trident.db'} is damaged (DatabaseError: database" \
            " disk image is malformed)" in record.getMessage()


@pytest.mark.postgres
def test_the_daemon_logs_each_postgres_outage_in_one_line_and_says_when_it_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import threading
    import time

    import service.control.daemon as daemon
    from tests._private_pg import PrivatePostgres
    from tests.fakes import FakeLauncher

    monkeypatch.setattr(daemon, "connect_ray", lambda _settings: FakeLauncher([]))
    caplog.set_level("INFO", logger="trident.controller")

    def lines(text: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if text in r.getMessage()]

    def until(what: str, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(lines(what)) < count:
            assert t.is_alive() and time.monotonic() < deadline, caplog.text
            time.sleep(0.05)

    pg = PrivatePostgres()
    pg.start()
    stop = threading.Event()
    status: list[int] = []
    t = threading.Thread(target=lambda: status.append(daemon.run(
        Settings(data_dir=tmp_path, database_url=pg.url, poll_interval_s=0.05, lease_s=600),
        stop)))
    t.start()
    try:
        until("acting as the controller", 1)
        for outage in (1, 2):
            pg.stop()
            until("database away", outage)
            time.sleep(3)  # passes fail meanwhile: 0.1 s, 0.2 s, 0.4 s, ... apart
            pg.start()
            until("database back", outage)
    finally:
        stop.set()
        t.join(30)
        pg.close()
    assert status == [0], caplog.text
    away, back = lines("database away"), lines("database back")
    assert len(away) == 2 and len(back) == 2, caplog.text
    for record in away:
        assert record.exc_info is None and record.levelname == "ERROR", record
        assert "cannot reach the database" in record.getMessage(), record.getMessage()
    for record in back:
        failed = int(record.getMessage().split("(")[1].split()[0])
        assert failed >= 4, record.getMessage()  # the passes that failed said nothing more
    assert not [r for r in caplog.records if r.exc_info], caplog.text
    assert not lines("controller pass failed"), caplog.text


@pytest.mark.postgres
def test_a_daemon_started_while_postgres_is_away_waits_for_it_in_two_lines(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A controller that `trident up` starts again while PostgreSQL is still away (its lease
    # ran out during the outage) waits for the database instead of exiting at every start.
    import threading
    import time

    import service.control.daemon as daemon
    from tests._private_pg import PrivatePostgres

    caplog.set_level("INFO", logger="trident.controller")
    pg = PrivatePostgres()
    pg.start()
    pg.stop()
    stop = threading.Event()
    done: list[None] = []
    settings = Settings(data_dir=tmp_path, database_url=pg.url, poll_interval_s=0.05,
                        lease_s=3)
    t = threading.Thread(target=lambda: done.append(daemon.wait_for_database(settings, stop)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while "database away" not in caplog.text:
            assert t.is_alive() and time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        time.sleep(3)  # checks fail meanwhile, 0.1 s to 1 s apart
        assert t.is_alive(), caplog.text
        pg.start()
        t.join(30)
    finally:
        stop.set()
        t.join(30)
        pg.close()
    assert done == [None], caplog.text
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith("database away")]) == 1, messages
    [back] = [m for m in messages if m.startswith("database back")]
    assert int(back.split("(")[1].split()[0]) >= 4, back  # the checks that failed meanwhile
    assert not [r for r in caplog.records if r.exc_info], caplog.text
