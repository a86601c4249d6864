"""A live API server (uvicorn on a free port) on a store of the test's own, with the CLI's
token set: what the CLI tests run their commands against (the `live` fixture)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from typer.testing import CliRunner

from api.app import create_app
from api.cli import app
from service.settings import Settings
from service.store import Store
from tests.conftest import user_token
from tests.test_cli import serving

runner = CliRunner()


class Live:
    """A running API on a store of the test's own, and the CLI pointed at it."""

    def __init__(self, url: str, store: Store, settings: Settings) -> None:
        self.url, self.store, self.settings = url, store, settings

    def cli(self, *args: str, **kw: object) -> click.testing.Result:
        return runner.invoke(app, [*args, "--server", self.url], **kw)  # type: ignore[arg-type]


def live_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Live]:
    store = Store(f"sqlite:///{tmp_path / 'cli.db'}")
    store.migrate()
    settings = Settings(data_dir=tmp_path)
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(store))
    monkeypatch.setenv("TRIDENT_CONFIG_DIR", str(tmp_path / "config"))
    with serving(create_app(settings, store=store)) as url:
        yield Live(url, store, settings)
    store.close()


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached after {timeout} s"
        time.sleep(0.05)


