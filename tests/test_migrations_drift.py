"""The ORM (`service.store.tables`) and the migrations (`migrations/versions/`) cannot drift.

A fresh database, SQLite and PostgreSQL, is upgraded to the newest revision and Alembic's
autogenerate comparison (`compare_metadata`, what `alembic check` runs) is run against every
table the package declares: types, nullability, server defaults, indexes, unique and foreign
keys. Any difference fails, listed: a column added to a row class without a migration is an
`add_column`, a table without one an `add_table`, a migration the ORM does not follow a
`remove_...`. The fix is a new revision (`alembic revision --autogenerate` drafts it).
"""

from __future__ import annotations

import pprint
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, create_engine

from service.store.schema import upgrade
from service.store.tables import Base


def differences(url: str, metadata: MetaData = Base.metadata) -> list[Any]:
    """What Alembic would change to bring the database at `url` to `metadata`."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={
                "compare_type": True, "compare_server_default": True})
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def test_the_database_at_head_is_what_the_orm_declares(db_url: str) -> None:
    upgrade(db_url)
    diff = differences(db_url)
    assert not diff, ("the migrations and service/store/tables.py differ; add a revision:\n"
                      + pprint.pformat(diff))


def test_a_column_without_a_migration_is_found(db_url: str) -> None:
    """The comparison is able to fail: the declared tables with one column more."""
    upgrade(db_url)
    more = MetaData()
    for table in Base.metadata.sorted_tables:
        table.to_metadata(more)
    more.tables["jobs"].append_column(Column("unmigrated", Integer, nullable=True))
    diff = differences(db_url, more)
    assert [(d[0], d[2], d[3].name) for d in diff] == [("add_column", "jobs", "unmigrated")]
