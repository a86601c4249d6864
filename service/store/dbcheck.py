"""Whether the database can be read, and the one line that says so when it cannot.

A database Trident cannot read (a SQLite file whose header or pages are damaged, a PostgreSQL
server that reports corrupted data, one that does not answer) is a line naming the file or
URL, what is wrong and what to do, never a traceback:

- at start, `trident up`, `trident controller`, the API's factory (`api.app:app`) and the
  controller daemon call `check`, and wrap their first reads (the migrations, the first
  admin) in `readable`; `Unreadable` carries the line they print before they exit;
- while serving, the API answers 503 with `describe`'s text (`api.db_errors`), and the daemon
  logs it for every pass that fails on it;
- at stop, when `trident up` cannot read which jobs are still active on the Ray head it
  started, it stops the head if the database is damaged and keeps it if the database is
  away, in one line, within its stop's grace (`cli.stopping.stop_head`).

`check` on SQLite reads the schema (the header and the first pages: a damaged header is found
at once), then runs `PRAGMA quick_check`, which reads every page of the file, for at most
`QUICK_CHECK_S`. It is linear in the file: on the scale bench's file (100,000 jobs and 10
million metric rows, 2.3 GB) it takes 6.5 s with the file in the page cache and 40 s from
disk. So a large file is checked only in part at start, and a damaged page found later is
the 503 of the request that reads it.

A header damaged under a running process is not seen by the connections it opened before:
SQLite reads on from what they hold. So a checkout of a pooled SQLite connection has a new
connection of its own read the header (`header_sound`, `service.store.engine.make_engine`),
once a second at most (about 0.15 ms each time, more than a request's own work): a header
SQLite refuses discards the pooled connection, and the new one the pool opens meets the
damage as SQLite reports it (`file is not a database`), the request's 503.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError

QUICK_CHECK_S = 2.0
"""The most seconds `check` spends in SQLite's `PRAGMA quick_check` at start."""

_SQLITE_DAMAGE = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
"""SQLite's codes (and the extended ones under them) of a file whose content is damaged."""
_PG_DAMAGE = ("XX001", "XX002")
"""PostgreSQL's SQLSTATEs data_corrupted and index_corrupted."""


def header_sound(path: Path) -> bool:
    """Whether a new connection to the SQLite file at `path` reads its header (page 1) as a
    database's. Through SQLite itself, never a file descriptor of our own: closing one would
    drop the locks the process's SQLite connections hold on the file. Only damage says no; a
    file that cannot be opened or is busy is not this check's to judge (the request's own
    connection says what is wrong)."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1)
    except sqlite3.Error:
        return True
    try:
        conn.execute("PRAGMA schema_version").fetchall()
    except sqlite3.DatabaseError as exc:
        return not damaged(exc)
    finally:
        conn.close()
    return True


class Unreadable(RuntimeError):
    """The database cannot be read: the message is one line, what an operator needs."""


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for another database, or SQLite in memory."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def where(url: str) -> str:
    """The database as an operator names it: the SQLite file, else the URL without its
    password."""
    path = sqlite_path(url)
    if path is not None:
        return str(path)
    return make_url(url).render_as_string(hide_password=True)


def _first_line(text: object) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def damaged(exc: BaseException) -> bool:
    """Whether a database error says that the stored data is damaged (not that the server is
    away, nor a query's mistake)."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    name = str(getattr(orig, "sqlite_errorname", ""))
    return name.startswith(_SQLITE_DAMAGE) or getattr(orig, "sqlstate", None) in _PG_DAMAGE


def away(exc: BaseException) -> bool:
    """Whether a database error says the database is away (a server stopped, restarting or
    unreachable; a file that cannot be opened; the pool's connections reset, sqlalchemy's
    `DisconnectionError`), so that a retry may succeed."""
    return (isinstance(exc, OperationalError | InterfaceError | DisconnectionError)
            and not damaged(exc))


def restore_hint(url: str) -> str:
    path = sqlite_path(url)
    if path is not None:
        new = path.with_name(path.name + ".recovered")
        return (f"stop Trident, then put a backup copy of the file in its place (and delete"
                f" {path.name}-wal and {path.name}-shm beside it), or recover what is still"
                f" readable into a new file, `sqlite3 {path} .recover | sqlite3 {new}`, and put"
                f" that in its place")
    return ("restore the database from a backup (pg_restore of a dump, or the server's base"
            " backup and WAL)")


def describe(url: str, exc: BaseException) -> str:
    """One line: which database, what is wrong, what to do."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    what = f"{type(orig).__name__}: {_first_line(orig) or type(orig).__name__}"
    if damaged(exc):
        return f"the database {where(url)} is damaged ({what}): {restore_hint(url)}"
    if away(exc) or isinstance(orig, sqlite3.OperationalError):
        hint = ("check that its folder and the file can be read and written"
                if sqlite_path(url) is not None else
                "check that the server runs and that the URL, user and password are right")
        return f"cannot reach the database {where(url)} ({what}): {hint}"
    return (f"cannot read the database {where(url)} ({what}): if it was damaged,"
            f" {restore_hint(url)}")


def _answers(url: str) -> None:
    engine = create_engine(url)
    try:
        with readable(url), engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()


@contextmanager
def readable(url: str) -> Iterator[None]:
    """Turn an error of the database inside the block into `Unreadable`, with its line."""
    try:
        yield
    except (DBAPIError, sqlite3.Error) as exc:
        raise Unreadable(describe(url, exc)) from exc


def check(url: str, budget_s: float = QUICK_CHECK_S) -> str | None:
    """Raise `Unreadable` if the database at `url` cannot be read: a server database that
    does not answer a query; a SQLite file that is damaged, as far as reading its schema and
    `budget_s` seconds of `PRAGMA quick_check` tell (0: the schema only). A note when the
    quick check was cut short by the budget, else None."""
    path = sqlite_path(url)
    if path is None:
        if make_url(url).get_backend_name() != "sqlite":
            _answers(url)
        return None
    if not path.exists():
        return None  # the migrations are about to create it
    with readable(url):
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=rw", uri=True)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            if budget_s <= 0:
                return None
            # SQLite asks the handler every 10,000 instructions of the check; past the
            # deadline it stops the check (SQLITE_INTERRUPT), in the check's own thread.
            deadline = time.monotonic() + budget_s
            conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
            try:
                rows = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorname", "") != "SQLITE_INTERRUPT":
                    raise
                return (f"PRAGMA quick_check of {path} ({path.stat().st_size / 2**30:.1f} GiB)"
                        f" stopped after {budget_s:g} s: a damaged page found later is a 503"
                        f" of the request that reads it; `sqlite3 {path} 'PRAGMA"
                        f" quick_check'` checks it all")
        finally:
            conn.close()
    if rows != ["ok"]:
        lines = [ln.strip() for r in rows for ln in r.splitlines()]
        found = "; ".join([ln for ln in lines if ln and not ln.startswith("***")][:3])[:300]
        raise Unreadable(f"the database {path} is damaged (PRAGMA quick_check: {found}):"
                         f" {restore_hint(url)}")
    return None
