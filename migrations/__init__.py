"""Alembic revisions of the database schema, and running them from Python.

`upgrade` is what `Store.migrate`, `trident up` and the tests call; it is the same as
`alembic upgrade head` from the repository root (alembic.ini), without needing that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _alembic(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (default: the newest)."""
    from alembic import command

    command.upgrade(_alembic(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Take the database at `url` back to `revision` (default: empty)."""
    from alembic import command

    command.downgrade(_alembic(url), revision)
