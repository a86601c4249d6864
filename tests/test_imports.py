"""No import loops among the project's modules (service/, api/, client/, workers/), and the
arrows between the programs: the client imports nothing of the server.

The graph is read from the source with `ast`: every import statement counts, at the top of a
module, inside a function (a lazy import is still a dependency) or under TYPE_CHECKING (a
type that needs the other module is one too); `from package import module` depends on that
module. Two levels are checked: modules, and subpackages (`service.planner`,
`service.monitor`, ...) taken whole, so that no code leaves a subpackage and comes back into
it through a module outside it.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "api", "client", "cli", "workers")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a copy: read once per test process)."""
    return {module: set(targets) for module, targets in _read_graph().items()}


@functools.cache
def _read_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package[:len(package) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                submodules = [f"{base}.{a.name}" for a in node.names
                              if f"{base}.{a.name}" in modules]
                # Names that are not submodules come from the package itself.
                targets = submodules + ([base] if len(submodules) < len(node.names) else [])
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def by_subpackage(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """The graph with every subpackage (`service.planner.*`, ...) one node."""
    def node(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else module

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(node(a), set()).update(node(b) for b in targets if node(b) != node(a))
    return out


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges(graph: Mapping[str, Iterable[str]], scc: list[str]) -> list[str]:
    return [f"{a} -> {b}" for a in scc for b in sorted(graph[a]) if b in scc]


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "service.store" in graph["service.control.controller"]  # top level
    assert "service.planner.clusters" in graph["service.planner.report"]  # in a function
    assert "service.planner.plan" in graph["service.planner.explain"]  # TYPE_CHECKING
    assert "service.planner.sac" in graph["service.planner.timing"]  # from package import mod


def test_cycles_are_found() -> None:
    loop = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "b": {"a.x"}}
    assert cycles(loop) == [["a.x", "a.y", "a.z"]]
    assert cycles({"s.m.a": {"s.c"}, "s.c": {"s.m.b"}, "s.m.b": set()}) == []
    assert cycles(by_subpackage({"s.m.a": {"s.c"}, "s.c": {"s.m.b"}, "s.m.b": set()})) == [
        ["s.c", "s.m"]]


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import loops: " + "; ".join(", ".join(_edges(graph, c)) for c in found)


def test_no_subpackage_is_left_and_entered_again() -> None:
    graph = by_subpackage(import_graph())
    found = cycles(graph)
    assert not found, "import loops: " + "; ".join(", ".join(_edges(graph, c)) for c in found)


# --- the map: which package may import which (docs/architecture.md) ---------------------

def area(module: str) -> str:
    """The node of the map a module belongs to: `client`, `cli` and `api` whole, and each
    package of `service/` and `workers/` (a top-level module of `service/` is its own)."""
    parts = module.split(".")
    return parts[0] if parts[0] in ("client", "cli", "api") else ".".join(parts[:2])


ARROWS: dict[str, set[str]] = {
    "service": set(), "workers": set(),  # the packages' own (empty) __init__ modules
    # service/, from the bottom up
    "service.contract": set(),
    "service.planner": {"service.contract"},
    "service.settings": {"service.contract"},
    "service.redaction": set(),
    "client": {"service.contract", "service.planner"},
    "service.files": {"service.contract", "service.planner", "service.settings", "client"},
    "service.store": {"service.contract", "service.planner", "client"},
    "service.secrets": {"service.redaction", "service.store"},
    "service.cluster": {"service.contract", "service.planner", "service.files", "service.store",
                        "service.secrets"},
    "service.monitor": {"service.contract", "service.planner", "service.store",
                        "service.cluster"},
    "service.policy": {"service.contract", "service.planner", "service.store", "service.cluster"},
    "service.tracking": {"service.contract", "service.planner", "service.settings",
                         "service.store"},
    "service.views": {"service.planner", "service.store", "service.tracking", "client"},
    "service.submission": {"service.contract", "service.planner", "service.files",
                           "service.store", "service.secrets", "service.cluster",
                           "service.policy", "service.tracking"},
    "service.control": {"service.contract", "service.settings", "service.redaction",
                        "service.files", "service.store", "service.secrets", "service.cluster",
                        "service.monitor", "service.policy", "service.tracking"},
    # the two programs on top of it
    "api": {"client", "service.contract", "service.planner", "service.settings",
            "service.files", "service.store", "service.secrets", "service.cluster",
            "service.monitor", "service.tracking", "service.views", "service.submission",
            "service.control"},
    "cli": {"client", "api", "service.contract", "service.planner", "service.settings",
            "service.files", "service.store", "service.secrets", "service.cluster",
            "service.control"},
    # workers/: a rank's packages from the bottom up, then the controller's side
    "workers.runtime": {"service.contract", "service.planner", "service.files",
                        "service.redaction"},
    "workers.monitor": {"service.contract", "service.monitor", "workers.runtime"},
    "workers.modeling": {"service.contract", "service.planner", "workers.runtime"},
    "workers.command": {"service.contract"},
    "workers.checkpoint": {"service.contract", "service.planner", "service.files",
                           "workers.modeling", "workers.monitor"},
    "workers.trainer": {"service.contract", "service.planner", "service.files",
                        "service.submission", "workers.runtime", "workers.monitor",
                        "workers.modeling", "workers.checkpoint"},
    "workers.rank": {"service.contract", "service.planner", "service.files", "workers.runtime",
                     "workers.monitor", "workers.modeling", "workers.trainer", "workers.command"},
    "workers.launch": {"service.contract", "service.planner", "service.files",
                       "service.cluster", "workers.runtime", "workers.rank",
                       "workers.checkpoint"},
}
"""Every package and the packages it may import (docs/architecture.md draws it). An arrow
not here is a change of the architecture: add it here and to the map, or move the code."""


def arrows_not_allowed(graph: Mapping[str, Iterable[str]],
                       allowed: Mapping[str, set[str]]) -> list[str]:
    """`a -> b (module -> module)` for every import between two areas that `allowed` lacks;
    an area `allowed` does not name at all is reported too."""
    found = []
    for module, targets in sorted(graph.items()):
        a = area(module)
        if a not in allowed:
            found.append(f"{a}: not on the map ({module})")
            continue
        for target in sorted(targets):
            b = area(target)
            if b != a and b not in allowed[a]:
                found.append(f"{a} -> {b} ({module} -> {target})")
    return found


def test_an_arrow_off_the_map_is_found() -> None:
    graph = {"service.store.x": {"service.control.y"}, "service.newpkg.z": set(),
             "service.control.y": {"service.store.x"}}
    assert arrows_not_allowed(graph, ARROWS) == [
        "service.newpkg: not on the map (service.newpkg.z)",
        "service.store -> service.control (service.store.x -> service.control.y)"]


def test_every_import_follows_the_map() -> None:
    assert arrows_not_allowed(import_graph(), ARROWS) == []


def test_the_map_has_no_loop() -> None:
    assert cycles(ARROWS) == []


# --- persistence stays in service/store/ --------------------------------------------------

STORE = "service.store"
ROW_NAMES = {"Base", "EngineTx", "make_engine", "reads"}
"""What `service.store.tables` keeps to the package beside its `...Row` classes (its
constants, such as `NAME_MAX`, and `utcnow` may be read anywhere)."""


def database_reaches(source: str) -> list[str]:
    """Where a module outside `service.store` reaches the database itself: an import from
    SQLAlchemy other than its exceptions (`sqlalchemy.exc`, which the API maps to a 503),
    an `.engine` attribute, an ORM row or session helper of `service.store.tables`, or the
    `migrations` package (which imports `service`, never the other way)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
            if node.module == f"{STORE}.tables":
                found += [f"line {node.lineno}: {STORE}.tables.{a.name}" for a in node.names
                          if a.name.endswith("Row") or a.name in ROW_NAMES]
        for name in names:
            if (name == "sqlalchemy" or name.startswith("sqlalchemy.")) and (
                    name != "sqlalchemy.exc"):
                found.append(f"line {node.lineno}: import {name}")
            if name == "migrations" or name.startswith("migrations."):
                found.append(f"line {node.lineno}: import {name}")
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"line {node.lineno}: .engine")
    return found


def test_reaching_the_database_is_found() -> None:
    assert database_reaches("from sqlalchemy.orm import sessionmaker") == [
        "line 1: import sqlalchemy.orm"]
    assert database_reaches("import sqlalchemy") == ["line 1: import sqlalchemy"]
    assert database_reaches("x = HeartbeatLog(store.engine)") == ["line 1: .engine"]
    assert database_reaches("from service.store.tables import JobRow, NAME_MAX") == [
        "line 1: service.store.tables.JobRow"]
    assert database_reaches("from migrations import env") == ["line 1: import migrations"]
    assert database_reaches("from sqlalchemy.exc import DBAPIError\n"
                            "from service.store.tables import NAME_MAX, utcnow\n"
                            "from service.store import Store") == []


def test_only_the_store_package_reaches_the_database() -> None:
    """The engine, sessions and rows are `service.store`'s: the rest of the service, the API
    and the workers call what the package hands out (`Store`, `HeartbeatLog(store)`, ...)."""
    found = [f"{path.relative_to(ROOT)} {where}" for name, path in sorted(_modules().items())
             if name != STORE and not name.startswith(f"{STORE}.")
             for where in database_reaches(path.read_text())]
    assert not found, "outside service/store/: " + "; ".join(found)


# --- the API and the service stay out of the ranks' package ------------------------------

RANKS = "workers"
"""The service imports nothing of the ranks' package: the export runs the checkpoint converter
as a Ray task (`workers.launch.export_task`, which `service.control.daemon` loads through
`importlib` at run time, as it starts the launcher) or as a process of its own
(`python -m workers.checkpoint.hf_export`, from `service.files.export`): no import statement
names them."""


def _into_ranks(graph: Mapping[str, Iterable[str]], package: str) -> dict[str, set[str]]:
    return {a: {b for b in targets if b == RANKS or b.startswith(RANKS + ".")}
            for a, targets in graph.items() if a == package or a.startswith(package + ".")}


def test_the_api_imports_nothing_of_the_ranks_package() -> None:
    """api/ (routes, app, CLI, client) goes through service/ for what the ranks' package
    does (the export: `service.files.export`): the ranks' code changes behind the service's
    functions, never under a route."""
    found = {a: sorted(b) for a, b in _into_ranks(import_graph(), "api").items() if b}
    assert not found, f"api/ imports workers/: {found}"


def test_the_service_imports_nothing_of_the_ranks_package() -> None:
    found = {a: sorted(b) for a, b in _into_ranks(import_graph(), "service").items() if b}
    assert not found, f"service/ imports workers/: {found}"


# --- a stored step is read through its typed view ----------------------------------------

STEP_VIEW = ("service/store/views.py", "service/store/steps.py")
"""Where a stored row's `data` is read by key: the step (`Metric.report`, `StoredStep`) and
the events' own readers; every other reader takes the typed fields."""
READERS = ("service", "api", "client", "cli", "bench")
DATA_KEY = re.compile(r"\.data\s*(\.get\(|\[)")


def data_keys(text: str) -> list[str]:
    """Lines of `text` that read a row's `data` by key (`.data.get(...)`, `.data[...]`)."""
    return [f"line {n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if DATA_KEY.search(line)]


def test_reading_data_by_key_is_found() -> None:
    assert data_keys('x = m.data.get("comm")\ny = m.report.comm') == [
        'line 1: x = m.data.get("comm")']
    assert data_keys("{% if it.latest.data['loss_nonfinite'] %}") == [
        "line 1: {% if it.latest.data['loss_nonfinite'] %}"]
    assert data_keys("m.report.memory.process_peak_bytes; StoredStep.of(data)") == []


def test_no_stored_step_is_read_by_key_outside_its_view() -> None:
    """Code and templates read a stored step's typed view (`Metric.report`,
    `Metric.step_split()`), never a key of its `data`: the names stay the step report's."""
    found = [f"{path.relative_to(ROOT)} {where}"
             for top in READERS if (ROOT / top).is_dir()
             for path in sorted((ROOT / top).rglob("*"))
             if path.suffix in (".py", ".html")
             and path.relative_to(ROOT).as_posix() not in STEP_VIEW
             for where in data_keys(path.read_text())]
    assert not found, "read by key outside the step's view: " + "; ".join(found)


# --- the client is a program of its own ----------------------------------------------------

CLIENT = "client"
SHARED = ("service.contract.spec", "service.contract.spec_limits", "service.contract.specfiles",
          "service.contract.presets", "service.contract.states", "service.contract.parallel",
          "service.contract.hardware", "service.contract.hf_config", "service.contract.ds_config",
          "service.contract.prices", "service.contract.command", "service.planner")
"""What the client may read of `service/`: the vocabulary both sides share and a user writes
(the job spec, its limits, presets and files, a command job's progress patterns, the job
states, the parallel dimensions, the hardware profiles and their prices, the stored plan and
the planner's model it holds, a rank's log chunk);
never the store, the controller or anything else that runs the server."""
SERVER_MODULES = ("sqlalchemy", "fastapi", "starlette", "uvicorn", "alembic", "ray", "torch",
                  "deepspeed", "service.store", "api", "workers")
"""What `import client` must not load: the server's database, web framework and programs."""


def _closure(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [m for m in graph if m == start or m.startswith(start + ".")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_client_imports_nothing_of_the_server() -> None:
    """Every module the client reaches, through any import statement (lazy and TYPE_CHECKING
    ones too), is the client's own or the shared vocabulary of `service/`: the REST contract
    (`client.payloads`) is what the server and the client share, and the server imports it,
    never the other way."""
    reached = _closure(import_graph(), CLIENT)
    found = sorted(m for m in reached if not _within(m, (CLIENT, *SHARED)))
    assert not found, f"client/ reaches the server: {found}"
    assert "client.payloads" in reached and "service.contract.spec" in reached  # the graph sees it


def test_import_client_loads_no_database_web_framework_or_store() -> None:
    """`python -c "import client"` in a fresh interpreter: what it loads is checked in
    `sys.modules` (a test process has the server loaded already)."""
    probe = ("import sys, client, client.payloads, client.token\n"
             "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout.split()
    assert "client.rest" in out and "pydantic" in out  # it did import the client
    loaded = sorted(m for m in out if _within(m, SERVER_MODULES))
    assert not loaded, f"import client loads the server's modules: {loaded}"


def test_the_servers_start_calls_no_command_line_code() -> None:
    """`python -m api.serve` opens the database through the store (`service.store.opening`),
    as `trident up` does: the server's start imports nothing of the CLI (`cli`), which
    echoes and exits."""
    reached = _closure(import_graph(), "api.serve")
    assert "service.store.opening" in reached
    assert sorted(m for m in reached if _within(m, ("cli",))) == []


# --- the command line talks to the server through the client ------------------------------

CLI = "cli"
CLI_SHARED = ("service.contract.specfile", "service.contract.reports")
"""Beside the client's shared vocabulary, what every command may read: the spec files a user
writes (`service.contract.specfile`) and a probe's result rows
(`service.contract.reports.ProbeRowModel`)."""
RUNS_HERE = {
    "cli.main": {"api.app", "api.serve", "service.files.datadir", "service.control.heap",
                 "service.cluster.rayhead", "service.settings", "service.store.dbcheck",
                 "service.cluster.supervisor"},
    "cli.stopping": {"service.store", "service.store.dbcheck"},
    "cli.identity": {"service.settings", "service.store", "service.store.bootstrap",
                     "service.store.dbcheck", "service.store.identity",
                     "service.store.opening", "service.store.schema"},
    "cli.node": {"service.cluster.inventory", "service.cluster.node_labels",
                 "service.cluster.rayhead", "service.cluster.raynode",
                 "service.secrets", "service.settings"},
    "cli.data": {"service.files.corpus", "service.files.corpus_prepare", "service.settings",
                 "service.files.chat_prepare"},
}
"""The commands that run a part of the server on this machine, and what of it they import:
`trident up` and `trident controller` (`cli.main`) start the API, the Ray head and the
controller, and `trident up`'s stop (`cli.stopping`) asks the database which jobs are
active; `trident bootstrap` (`cli.identity`) makes the first admin in the database;
`trident node start/stop` (`cli.node`) run a Ray node of this machine; `trident data
prepare/inspect` (`cli.data`) work on local corpus files (`inspect --index` records its scan
in the server's data directory, `TRIDENT_DATA_DIR`). Every other command talks to a
server through `client.TridentClient` only."""


def test_the_cli_reaches_the_server_only_in_the_commands_that_run_it_here() -> None:
    graph = import_graph()
    allowed = (CLIENT, CLI, *SHARED, *CLI_SHARED)
    found = {m: sorted(t for t in targets if not _within(t, allowed)
                       and t not in RUNS_HERE.get(m, set()))
             for m, targets in graph.items() if _within(m, (CLI,))}
    assert {m: t for m, t in found.items() if t} == {}
    assert "client.rest" in graph["cli.jobs"]  # the graph sees the CLI's modules
