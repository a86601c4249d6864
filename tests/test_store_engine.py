"""`service.store.engine`: how SQLite writers wait for the write lock, between processes
(`begin_immediate`) and between the threads of one process (`_Writers`)."""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import pytest
from sqlalchemy import event, text

from service.store import engine


def test_a_sqlite_writer_waits_for_the_write_lock_by_trying_again(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`begin_immediate` takes the write lock as soon as its holder lets go (it tries again
    every few milliseconds instead of SQLite's busy handler, whose sleeps grow to 100 ms),
    fails as SQLite would once `SQLITE_BUSY_S` is spent, and leaves the connection's busy
    timeout as it was for the statements after it."""
    path = tmp_path / "w.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("PRAGMA journal_mode=WAL")
    holder.execute("CREATE TABLE t (x INTEGER)")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=engine.SQLITE_BUSY_S)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")
    release = threading.Timer(0.3, holder.execute, args=("COMMIT",))
    release.start()
    engine.begin_immediate(waiter)  # waits for the holder's commit, then holds the lock
    waiter.execute("INSERT INTO t VALUES (2)")
    waiter.execute("COMMIT")
    assert [r[0] for r in waiter.execute("SELECT x FROM t ORDER BY x")] == [1, 2]
    assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == 30000
    # A holder that keeps the lock past the deadline: the waiter fails as SQLite would.
    monkeypatch.setattr(engine, "SQLITE_BUSY_S", 0.2)
    holder.execute("BEGIN IMMEDIATE")
    t0 = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        engine.begin_immediate(waiter)
    assert time.monotonic() - t0 >= 0.15
    holder.execute("ROLLBACK")
    assert waiter.execute("PRAGMA busy_timeout").fetchone()[0] == 200


def _engine_counting_begins(tmp_path) -> tuple[Any, list[str]]:
    """An engine on a new SQLite file with table t, and the list of the BEGIN IMMEDIATE
    statements its connections have run (tries that found the lock taken included)."""
    eng = engine.make_engine(f"sqlite:///{tmp_path / 'line.db'}")
    begins: list[str] = []

    @event.listens_for(eng, "connect")
    def _trace(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.set_trace_callback(
            lambda sql: begins.append(sql) if sql == "BEGIN IMMEDIATE" else None)

    with eng.begin() as c:
        c.execute(text("CREATE TABLE t (x INTEGER)"))
    begins.clear()
    return eng, begins


def test_the_writers_of_one_process_wait_in_line_not_by_trying_the_lock(tmp_path) -> None:
    """While one thread holds the write lock, the process's other writers sleep on its turn
    and each tries BEGIN IMMEDIATE once, when the turn comes to it (they used to try every
    1 to 4 ms, each try waking a thread that took the GIL from the holder); every write lands."""
    eng, begins = _engine_counting_begins(tmp_path)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with eng.begin() as c:
            c.execute(text("INSERT INTO t VALUES (0)"))
            held.set()
            done.wait(10)

    def write(x: int) -> None:
        with eng.begin() as c:
            c.execute(text("INSERT INTO t VALUES (:x)"), {"x": x})

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    writers = [threading.Thread(target=write, args=(x,)) for x in range(1, 5)]
    for w in writers:
        w.start()
    time.sleep(0.3)  # about a hundred tries each, had they polled
    assert begins == ["BEGIN IMMEDIATE"]  # the holder's only
    done.set()
    for t in (holder, *writers):
        t.join(10)
    assert begins == ["BEGIN IMMEDIATE"] * 5
    with eng.connect() as c:
        assert sorted(c.execute(text("SELECT x FROM t")).scalars()) == [0, 1, 2, 3, 4]
    eng.dispose()


def test_the_turn_passes_on_after_a_rollback_and_a_closed_connection(tmp_path) -> None:
    """A transaction that fails, and a connection closed in the middle of one (as the pool
    invalidates a broken one), let the next writer in: no writer of the process is left
    waiting for a turn that nobody will pass on."""
    eng, _ = _engine_counting_begins(tmp_path)
    with pytest.raises(RuntimeError), eng.begin() as c:
        c.execute(text("INSERT INTO t VALUES (1)"))
        raise RuntimeError("the transaction fails")
    conn = eng.connect()
    conn.begin()
    conn.execute(text("INSERT INTO t VALUES (2)"))
    conn.invalidate()  # closes the DBAPI connection inside its transaction
    conn.close()
    wrote = threading.Thread(target=lambda: _insert(eng, 3))
    wrote.start()
    wrote.join(5)
    assert not wrote.is_alive()
    with eng.connect() as c:
        assert list(c.execute(text("SELECT x FROM t")).scalars()) == [3]
    eng.dispose()


def _insert(eng: Any, x: int) -> None:
    with eng.begin() as c:
        c.execute(text("INSERT INTO t VALUES (:x)"), {"x": x})


def test_a_write_inside_a_write_of_the_same_thread_fails_as_sqlite_would(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that opens a second write transaction while its first holds the lock does
    not wait for its own turn forever: it waits for SQLite's lock, and fails after
    `SQLITE_BUSY_S` as it did before writers waited in line; the first commits after."""
    eng, _ = _engine_counting_begins(tmp_path)
    monkeypatch.setattr(engine, "SQLITE_BUSY_S", 0.2)
    with eng.begin() as outer:
        outer.execute(text("INSERT INTO t VALUES (1)"))
        t0 = time.monotonic()
        with pytest.raises(Exception, match="locked"), eng.begin() as inner:
            inner.execute(text("INSERT INTO t VALUES (2)"))
        assert time.monotonic() - t0 < 5
    _insert(eng, 3)
    with eng.connect() as c:
        assert sorted(c.execute(text("SELECT x FROM t")).scalars()) == [1, 3]
    eng.dispose()
