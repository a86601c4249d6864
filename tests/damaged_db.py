"""Real damaged SQLite files for the tests of `service.store.dbcheck`: a database of Trident's
schema with jobs in it, whose header or pages are then overwritten in place, as a disk or a careless
copy would.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.store import Store
from service.submission.intake import prepare
from tests.conftest import migrated_sqlite, tiny_spec


def fill_jobs(path: Path, n: int) -> list[int]:
    """A database at `path` (made and migrated if new) with `n` more cancelled jobs (each with
    its spec, plan and events: rows that span many pages); their ids."""
    store = Store(f"sqlite:///{path}" if path.exists() else migrated_sqlite(path))
    prepared = prepare(JobSpec.model_validate(tiny_spec()))
    ids = []
    try:
        for i in range(n):
            job = store.create_job(name=f"job-{i}", spec=prepared.spec,
                                   plan=prepared.plan, world_size=prepared.world_size,
                                   cpus=prepared.cpus, gpus=prepared.gpus, owner="admin")
            store.transition(job_id=job.id, to=JobState.CANCELLED, message="test")
            ids.append(job.id)
    finally:
        store.close()  # the last connection: SQLite folds the WAL into the file
    return ids


def damage_header(path: Path) -> None:
    """Overwrite the first bytes: the magic string and the page size are gone."""
    with path.open("r+b") as f:
        f.write(b"this is not a database header!!!")


def table_pages(path: Path, table: str) -> list[int]:
    """The pages (1-based) of `table` and of its indexes, as SQLite's dbstat lists them."""
    conn = sqlite3.connect(path)
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE tbl_name = ?", (table,))]
        marks = ",".join("?" * len(names))
        return sorted(r[0] for r in conn.execute(
            f"SELECT pageno FROM dbstat WHERE name IN ({marks})", names))
    finally:
        conn.close()


def damage_pages(path: Path, pages: list[int]) -> None:
    """Overwrite `pages` with zeros (no b-tree page starts with a zero byte)."""
    size = page_size(path)
    with path.open("r+b") as f:
        for page in pages:
            assert page > 1, "page 1 is the header's"
            f.seek((page - 1) * size)
            f.write(bytes(size))


def page_size(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()


def malformed(path: Path, table: str = "jobs") -> str:
    """What SQLite itself says reading `table` of the file: the error (the test asserts that
    there is one)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute(f"SELECT count(*), max(length(spec)) FROM {table}").fetchall()
        rows = conn.execute("PRAGMA quick_check").fetchall()
        return "" if rows == [("ok",)] else str(rows[0][0])
    except sqlite3.DatabaseError as exc:
        return str(exc)
    finally:
        conn.close()
