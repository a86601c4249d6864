"""A live API server (uvicorn on a free port) on a store of the test's own, with the CLI's
token set: what the CLI tests run their commands against (the `live` fixture). It takes jobs
with `program: light` (`TRIDENT_LIGHT_RANKS`: ranks of `workers.rank.light`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from typer.testing import CliRunner

from api.app import create_app
from cli.main import app
from service.settings import Settings
from service.store import Store
from tests.conftest import migrated_sqlite, user_token
from tests.servers import ROOT, serving

runner = CliRunner()


class Live:
    """A running API on a store of the test's own, and the CLI pointed at it."""

    def __init__(self, url: str, store: Store, settings: Settings) -> None:
        self.url, self.store, self.settings = url, store, settings

    def cli(self, *args: str, **kw: object) -> click.testing.Result:
        return runner.invoke(app, [*args, "--server", self.url], **kw)  # type: ignore[arg-type]


def live_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    store = Store(migrated_sqlite(tmp_path / "cli.db"))
    settings = Settings(data_dir=tmp_path, light_ranks=True)
    with serving(create_app(settings, store=store)) as url:
        yield live_on(monkeypatch, url, store, settings)
    store.close()


def live_on(monkeypatch: pytest.MonkeyPatch, url: str, store: Store,
            settings: Settings) -> Live:
    """The CLI pointed at the API served at `url` (an admin's token, a configuration folder
    of the data directory's)."""
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(store))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(settings.data_dir / "config"))
    return Live(url, store, settings)


TINY = str(ROOT / "examples/tiny.yaml")
"""The tiny example spec, as a path for the CLI."""


def spawn(live: Live, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`trident ARGS --server URL` as a process, its output lines collected as they come."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRIDENT_TOKEN": user_token(live.store)}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *args, "--server", live.url],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(line.rstrip("\n") for line in proc.stdout),
                     daemon=True).start()
    return proc, out


def finish(proc: subprocess.Popen[str], out: list[str]) -> int:
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still following after the job ended: {out}") from None
