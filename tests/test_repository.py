"""The repository's own promises: the README lists every `trident` command, pyproject.toml
declares only package data that exists, and every test the documents cite by name exists."""

from __future__ import annotations

import ast
import re
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


CITED_TEST = re.compile(r"\b(tests/[\w/]+\.py)::(\w+)")
"""A test cited by name in a document: `tests/test_x.py::test_name` (a parameter list after it,
`[...]`, is not part of the name)."""


def cited_tests(text: str) -> list[tuple[str, str]]:
    return CITED_TEST.findall(text)


def test_cited_tests_are_found_in_text() -> None:
    text = ("held (`tests/test_a.py::test_one`, tests/sub/test_b.py::test_two[sqlite]);"
            " not `tests/test_c.py` alone")
    assert cited_tests(text) == [("tests/test_a.py", "test_one"),
                                 ("tests/sub/test_b.py", "test_two")]


def test_every_test_the_documents_cite_exists() -> None:
    """docs/*.md and the README name tests as `tests/FILE.py::test_name`: each must be a test
    function of that file, so that a renamed or removed test fails here, not in a reader's
    hands."""
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = [(doc.relative_to(ROOT), path, name) for doc in documents
             for path, name in cited_tests(doc.read_text())]
    assert len({doc for doc, _, _ in cited}) >= 2, cited  # docs/security.md, docs/planner.md
    defined: dict[str, set[str]] = {}
    missing = []
    for doc, path, name in cited:
        if path not in defined:
            file = ROOT / path
            tree = ast.parse(file.read_text()) if file.is_file() else ast.Module([], [])
            defined[path] = {n.name for n in ast.walk(tree)
                             if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                             and n.name.startswith("test")}
        if name not in defined[path]:
            missing.append(f"{doc} cites {path}::{name}")
    assert not missing, "tests cited that do not exist:\n" + "\n".join(missing)
