"""Opening the database at start: check that it can be read, bring its schema up to date and
(but in prod) make the first admin, saying in one line each what was found and done.

`trident up` (`cli.main.up`, through `cli.identity.open_database`) and the API server's
own start (`python -m api.serve`) call `open_database` once, before anything serves, so that
N API workers never migrate at once. The controller daemon (`service.control.daemon.run`, also
under `trident controller`) waits until the database answers
(`service.control.daemon.wait_for_database`), then brings its schema up to date here
(`upgrade_schema`). A database that cannot be read raises `Unreadable` with its line
(`service.store.dbcheck`); the caller prints it and exits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from client.token import token_file
from service.store.bootstrap import bootstrap
from service.store.dbcheck import check, readable
from service.store.identity import Identity
from service.store.schema import upgrade
from service.store.store import Store

Say = Callable[[str], None]
"""Where a line for the operator goes (the CLI's `typer.echo`, the server's stdout)."""


def open_database(url: str, data_dir: Path, *, first_admin: bool, say: Say) -> None:
    """Check the database at `url`, upgrade its schema and, with `first_admin`, make the first
    admin and its token file in `data_dir`; `Unreadable` when it cannot be read."""
    with readable(url):
        if note := check(url):
            say(note)
    upgrade_schema(url)
    if first_admin:
        announce_bootstrap(url, data_dir, say)


def upgrade_schema(url: str) -> None:
    """Bring the schema of the database at `url` to the newest revision; `Unreadable` when it
    cannot be read. The controller's start: it does not read every table first, so that a
    damaged one is what its passes report, one line each, while the rest goes on."""
    with readable(url):
        upgrade(url)


def announce_bootstrap(url: str, data_dir: Path, say: Say) -> None:
    """Create the first admin and its token file, once; say where the file is."""
    store = Store(url)
    try:
        created = bootstrap(Identity(store), data_dir)
    finally:
        store.close()
    path = token_file(data_dir)
    if created:
        say(f"first start: created the admin user; its API token is in {path}"
            " (readable by you only; the CLI uses it for this local server)")
    elif path.exists():
        say(f"admin token: {path}")
