"""Running the Alembic revisions of `migrations/` from Python.

`upgrade` is what `Store.migrate`, `trident up` and the tests call; it is the same as
`alembic upgrade head` from the repository root (alembic.ini), without needing that file.
The revisions are found by path, beside the `service` package (in the repository, and where
the wheel installs both, `pyproject.toml`'s package data shipping `migrations/`): this
package never imports `migrations`, whose `env.py` imports `service.store.tables` for the
schema it compares against, so the import goes one way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
"""The Alembic script directory: `env.py` and `versions/`."""


def _alembic(url: str) -> Any:
    from alembic.config import Config

    if not (MIGRATIONS / "env.py").is_file():
        raise FileNotFoundError(f"the database migrations are missing: no {MIGRATIONS}/env.py")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
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
