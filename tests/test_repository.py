"""The repository's own promises: the README lists every `trident` command, pyproject.toml
declares only package data that exists, every test the documents cite by name exists, and
every long module says why it is one thing."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from cli.main import app

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


LONG_MODULE = 400
"""Lines beyond which a module of service/, api/, client/, cli/ or workers/ must say why it is
one thing."""
ONE_THING = re.compile(r"\bOne module(:| because\b)")
"""The sentence of a long module's docstring that says why it is one thing and long:
`One module because ...` or `One module: ...`."""


def long_modules_unexplained(root: Path) -> list[str]:
    """Modules of service/, api/, client/, cli/, workers/ under `root` over `LONG_MODULE` lines
    whose module docstring does not say why they are one thing (`ONE_THING`). Length is a smell,
    never a reason to cut a docstring: split a module by what it is for, or say why it is one."""
    found = []
    for package in ("service", "api", "client", "cli", "workers"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n")
            doc = ast.get_docstring(ast.parse(text, str(path))) or ""
            if lines > LONG_MODULE and not ONE_THING.search(doc):
                found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def test_a_long_module_without_its_reason_is_found(tmp_path: Path) -> None:
    (tmp_path / "service").mkdir()
    body = "x = 1\n" * LONG_MODULE
    (tmp_path / "service" / "long.py").write_text(f'"""Many things."""\n{body}')
    (tmp_path / "service" / "short.py").write_text('"""Few things."""\nx = 1\n')
    (tmp_path / "service" / "kept.py").write_text(
        f'"""One thing.\n\nOne module because its parts share one state."""\n{body}')
    (tmp_path / "service" / "colon.py").write_text(
        f'"""One thing.\n\nOne module: one class."""\n{body}')
    assert long_modules_unexplained(tmp_path) == [f"service/long.py ({LONG_MODULE + 1} lines)"]


def test_every_long_module_says_why_it_is_one_thing() -> None:
    found = long_modules_unexplained(ROOT)
    assert not found, (f"over {LONG_MODULE} lines with no 'One module because ...' in the"
                       f" docstring: split by responsibility or say why it is one: {found}")
