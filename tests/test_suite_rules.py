"""The test suite's own rules, checked on its source: helpers have one home (fakes in
tests/fakes.py, waiting in tests/waiting.py, servers in tests/servers.py), no test module
imports another, and no test polls a bounded number of times, which makes its outcome depend
on how fast the machine is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(TESTS.glob("*.py"))}


def imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_test_module_imports_another() -> None:
    found = [f"{p.name} imports {m}" for p, tree in modules().items()
             for m in imported_modules(tree) if m.startswith("tests.test_")]
    assert not found, found


def test_fakes_and_waits_are_defined_once() -> None:
    defined: dict[str, list[str]] = {}
    for p, tree in modules().items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                defined.setdefault(node.name, []).append(p.name)
    fakes = {n: files for n, files in defined.items() if n.startswith("Fake")}
    assert {"FakeGroup", "FakeLauncher"} <= set(fakes)
    assert all(files == ["fakes.py"] for files in fakes.values()), fakes
    for helper, home in [("wait_for", "waiting.py"), ("drive_until", "waiting.py"),
                         ("free_port", "servers.py"), ("serving", "servers.py"),
                         ("wait_healthy", "servers.py")]:
        assert defined.get(helper) == [home], (helper, defined.get(helper))


def polls_a_bounded_number_of_times(loop: ast.For) -> bool:
    """A `for _ in range(N)` that sleeps (or waits on an event) and leaves early once a
    condition holds: a poll whose budget is N times a sleep, however slow the machine is."""
    if not (isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name)
            and loop.iter.func.id == "range"):
        return False
    nodes = list(ast.walk(loop))
    sleeps = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in {"sleep", "wait"} for n in nodes)
    leaves = any(isinstance(n, ast.Break | ast.Return) for n in nodes)
    return sleeps and leaves


def test_polling_loops_are_found() -> None:
    bounded = ast.parse("for _ in range(200):\n    step()\n    if done():\n        break\n"
                        "    time.sleep(0.05)\n").body[0]
    training = ast.parse("for step in range(10):\n    train(step)\n    time.sleep(0.1)\n"
                         ).body[0]
    assert isinstance(bounded, ast.For) and isinstance(training, ast.For)
    assert polls_a_bounded_number_of_times(bounded)
    assert not polls_a_bounded_number_of_times(training)


RANK_CODE = {"entrypoints.py", "_monitor_dist.py", "_planner_ds_probe.py"}
"""Modules that run as a job's ranks, not as tests: their loops over steps are the job's own."""


def test_no_test_polls_a_bounded_number_of_times() -> None:
    """Tests wait for the event itself with a deadline (tests/waiting.py's `wait_for`)."""
    found = [f"{p.name}:{node.lineno}" for p, tree in modules().items()
             if p.name not in RANK_CODE for node in ast.walk(tree)
             if isinstance(node, ast.For) and polls_a_bounded_number_of_times(node)]
    assert not found, found


def test_every_test_module_is_in_exactly_one_tier() -> None:
    """`tests/tiers.py` names each test module once, and only modules that exist."""
    from tests.tiers import TIERS

    listed = [m for modules in TIERS.values() for m in modules]
    existing = {p.stem for p in TESTS.glob("test_*.py")}
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"in more than one tier: {twice}"
    assert not existing - set(listed), f"in no tier: {sorted(existing - set(listed))}"
    assert not set(listed) - existing, f"no such module: {sorted(set(listed) - existing)}"


def test_every_test_is_marked_with_its_module_tier(request: pytest.FixtureRequest) -> None:
    """The tier marks pytest selects on (`pytest -m unit`): this test's own, as every test's."""
    from tests.tiers import TIERS

    marks = {m.name for m in request.node.iter_markers()} & set(TIERS)
    assert marks == {"unit"}, marks
