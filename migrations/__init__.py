"""Alembic revisions of the database schema (`versions/`) and their environment (`env.py`).

Run them with `service.store.schema.upgrade` (what `Store.migrate`, `trident up` and the tests
call) or `alembic upgrade head` from the repository root. This package imports the schema
(`service.store.tables`) for Alembic's comparisons; `service` never imports this package.
"""
