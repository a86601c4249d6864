"""The repository's own promises: the README lists every `trident` command, and
pyproject.toml declares only package data that exists."""

from __future__ import annotations

import tomllib
from pathlib import Path

from api.cli import app

ROOT = Path(__file__).resolve().parent.parent


def test_readme_lists_every_cli_command() -> None:
    names = [c.name or c.callback.__name__ for c in app.registered_commands if c.callback]
    names += [f"{g.name} {c.name or c.callback.__name__}" for g in app.registered_groups
              if g.typer_instance for c in g.typer_instance.registered_commands if c.callback]
    assert "capacity" in names and "token revoke" in names
    readme = (ROOT / "README.md").read_text()
    missing = [n for n in names if f"trident {n}" not in readme]
    assert not missing, f"README.md does not list: {missing}"


def test_package_data_patterns_match_files() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = config["tool"]["setuptools"]["package-data"]
    empty = [f"{pkg}: {pattern}" for pkg, patterns in package_data.items()
             for pattern in patterns
             if not list((ROOT / pkg.replace(".", "/")).glob(pattern))]
    assert not empty, f"package data that matches no file: {empty}"
