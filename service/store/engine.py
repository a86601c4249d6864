"""The store's engines and transactions: `make_engine` (SQLite's WAL, foreign keys, busy
timeout, a line for the process's writers and a quick writer's lock; PostgreSQL's
pre-ping), the JSON columns' serializer, the engines for reads (`reads`, `snapshot_reads`)
and `EngineTx`, the transactions every module of `service.store` queries the tables of
`service.store.tables` through.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from service.store.dbcheck import header_sound, sqlite_path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps_json(value: Any) -> str:
    """JSON columns' serializer: standard JSON, so a non-finite float (which PostgreSQL
    refuses and other readers choke on) is stored as null instead of failing the write."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


SQLITE_BUSY_S = 30.0
"""How long a SQLite statement waits for a lock another connection holds before it fails."""
_POLL_S = (0.0002, 0.001)
"""`begin_immediate`'s first and longest wait between two tries for the write lock: short,
as one thread of a process tries at a time (`_Writers`), so that the lock does not lie free
for milliseconds while another process's writers wait."""


def begin_immediate(dbapi_conn: sqlite3.Connection) -> None:
    """BEGIN IMMEDIATE on a SQLite connection, waiting for the writer that holds the lock by
    trying again every 0.2 to 1 ms, for up to `SQLITE_BUSY_S`. SQLite's own busy handler
    (the connection's timeout, which every other statement keeps) sleeps 1, 2, 5, 10, 15,
    20, 25, 25, 25, 50, 50 and then 100 ms between its tries: among many short writers (a
    burst of submissions to several API processes, each process's audit writer, the
    controller) a waiter that lost a few rounds slept through dozens of free moments, and a
    submission's p99 was a few hundred milliseconds where its median was ten."""
    dbapi_conn.execute("PRAGMA busy_timeout = 0")
    try:
        deadline, wait = time.monotonic() + SQLITE_BUSY_S, _POLL_S[0]
        while True:
            try:
                dbapi_conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                # SQLITE_BUSY ("database is locked"); anything else is not ours to retry.
                if "locked" not in str(exc) or time.monotonic() + wait > deadline:
                    raise
            time.sleep(wait)
            wait = min(wait * 2, _POLL_S[1])
    finally:
        dbapi_conn.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_S * 1000)}")


class _Writers:
    """An engine's writers in one process, in line for SQLite's write lock one at a time.

    Without it every thread of an API process that wants to write tried `BEGIN IMMEDIATE`
    every 1 to 4 ms while another held the lock, each try a thread woken to take the GIL
    from the ones working: one API process with 8 submissions in flight spent 5.0-5.9 ms of
    CPU on each, against 2.9-3.9 ms one at a time (4.0-4.8 ms in line). In line, a waiting
    thread sleeps until the writer before it has committed and is woken once;
    `begin_immediate` still decides between processes (other API processes, the
    controller)."""

    def __init__(self) -> None:
        self._line = threading.Lock()

    def begin(self, dbapi_conn: _Connection) -> None:
        """Take this process's turn, then SQLite's write lock (`begin_immediate`); the turn
        passes on when `dbapi_conn` commits, rolls back or closes. Either wait fails after
        `SQLITE_BUSY_S` as SQLite would ("database is locked"): a write that a thread opens
        inside its own other write fails so, as it did when it waited for SQLite alone."""
        if not self._line.acquire(timeout=SQLITE_BUSY_S):
            raise sqlite3.OperationalError(
                f"database is locked: this process's writer before held it {SQLITE_BUSY_S:g} s")
        dbapi_conn.turn = self
        try:
            begin_immediate(dbapi_conn)
        except BaseException:
            dbapi_conn.pass_turn()
            raise

    def release(self) -> None:
        self._line.release()


class _Connection(sqlite3.Connection):
    """A SQLite connection that passes its process's turn to write (`_Writers`) on when its
    transaction ends."""

    turn: _Writers | None = None

    def pass_turn(self) -> None:
        turn, self.turn = self.turn, None
        if turn is not None:
            turn.release()

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self.pass_turn()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self.pass_turn()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.pass_turn()


HEADER_CHECK_EVERY_S = 1.0
"""How often an engine's SQLite checkouts look at the file's header (`dbcheck.header_sound`):
a header damaged under a running process is a 503 within this long."""


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys, a busy timeout, and writers that
    wait in line in the process (`_Writers`) and take the write lock quickly
    (`begin_immediate`)."""
    if url.startswith("sqlite"):
        writers = _Writers()
        engine = create_engine(url, connect_args={"check_same_thread": False,
                                                  "timeout": SQLITE_BUSY_S,
                                                  "factory": _Connection},
                               json_serializer=dumps_json)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            # The driver's own transaction handling would BEGIN lazily (DEFERRED); we begin
            # ourselves, below.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        path = sqlite_path(url)
        checked = [-HEADER_CHECK_EVERY_S]  # when the header was last found sound

        @event.listens_for(engine, "checkout")
        def _header(_dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
            # A connection opened before the header was damaged reads on from its cache and
            # never sees it: discard it; the new one meets the damage (`dbcheck`). Once a
            # second at most (a new connection costs more than a request's own work); once
            # damaged, at every checkout, so that each pooled connection is discarded.
            now = time.monotonic()
            if path is None or now - checked[0] < HEADER_CHECK_EVERY_S:
                return
            if not header_sound(path):
                raise DisconnectionError(f"the header of {path} is not SQLite's")
            checked[0] = now

        @event.listens_for(engine, "begin")
        def _begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front, so a read-check-write transaction (a
            # state transition) cannot interleave with another writer: SQLite's stand-in
            # for PostgreSQL's SELECT ... FOR UPDATE. A read (`reads`) needs no lock.
            if conn.get_execution_options().get(_READ):
                conn.exec_driver_sql("BEGIN")
            else:
                writers.begin(conn.connection.dbapi_connection)

        return engine
    return create_engine(url, pool_pre_ping=True, json_serializer=dumps_json)


_READ = "trident_read"


def reads(engine: Engine) -> Engine:
    """`engine` for single reads that every request makes (the token check): on PostgreSQL
    outside a transaction (no BEGIN and COMMIT round trips), on SQLite without the write
    lock."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(**{_READ: True})
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def snapshot_reads(engine: Engine) -> Engine:
    """`engine` for read-only transactions of several statements (a page and its count, a
    job and its summary): on SQLite a plain (deferred) BEGIN, so that readers in several API
    processes and the controller's writes do not queue for the write lock (WAL readers see
    one snapshot); on PostgreSQL the engine itself (a transaction: one snapshot)."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(**{_READ: True})
    return engine


class EngineTx:
    """The transactions on an engine: `Store` builds them on its engine, and the package's
    modules beside it that query their tables on that engine (identity, quota notes,
    heartbeats, stack requests, the trackers' cursors, checkpoints, elastic moves, leases,
    metrics) take the store's (`EngineTx(store)`), so one engine has one set of session
    factories however many of them a request or a controller pass makes. `_reads` for single
    reads outside a transaction (`reads`); `_snapshot` for read-only transactions of several
    plain statements on a connection (`snapshot_reads`), which the hot pages use: no ORM
    session's bookkeeping per request."""

    _sessions: sessionmaker[Session]
    _snapshot: Engine
    _read_sessions: sessionmaker[Session]
    _reads: Engine

    def __init__(self, engine: Engine | EngineTx) -> None:
        if isinstance(engine, EngineTx):  # a module beside Store, on the store's transactions
            self._sessions, self._snapshot = engine._sessions, engine._snapshot
            self._read_sessions, self._reads = engine._read_sessions, engine._reads
            return
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._snapshot = snapshot_reads(engine)
        self._read_sessions = sessionmaker(self._snapshot, expire_on_commit=False)
        self._reads = reads(engine)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    @contextmanager
    def _rx(self) -> Iterator[Session]:
        """A read-only transaction (`snapshot_reads`): no write lock on SQLite."""
        with self._read_sessions.begin() as session:
            yield session
