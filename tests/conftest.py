"""Shared fixtures: a migrated store on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Connection, create_engine, text

from service.planner import StoredPlan
from service.store import Store

if TYPE_CHECKING:
    from service.control.controller import Controller
    from service.settings import Settings
    from tests.hosts import Hosts
    from tests.up import Up

def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its module's tier (`tests/tiers.py`)."""
    from tests.tiers import tier_of

    for item in items:
        tier = tier_of(item.path.stem)
        if tier is not None:  # a module in no tier fails tests/test_suite_rules.py
            item.add_marker(tier)


PG_ADMIN_URL = os.environ.get("TRIDENT_TEST_PG_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextlib.contextmanager
def scratch_pg_database(name: str) -> Iterator[str]:
    """A PostgreSQL database called `name` on the local server, dropped on exit: its URL."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # the server is part of the test environment: say so loudly
        pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is not usable: {exc}")
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped afterwards."""
    with scratch_pg_database(f"trident_test_{uuid.uuid4().hex[:10]}") as url:
        yield url


@functools.cache
def _migrated_template() -> Path:
    """A SQLite database migrated to the newest revision, once per test process."""
    template = Path(tempfile.mkdtemp(prefix="trident-migrated-")) / "template.db"
    made = Store(f"sqlite:///{template}")
    made.migrate()
    made.close()  # the last connection: its write-ahead log is folded into the file
    return template


def migrated_sqlite(path: Path) -> str:
    """The URL of a SQLite database at `path` that is at the newest revision: a copy of one
    migrated once per test process (Alembic's 18 revisions cost 50 to 200 ms of CPU each time,
    and several hundred tests start from a migrated store). The revisions themselves run on
    empty databases in `test_migrations_drift` and `test_store`."""
    shutil.copyfile(_migrated_template(), path)
    return f"sqlite:///{path}"


def _empty_pg(url: str, *, keep_schema: bool) -> None:
    """Empty the database at `url` for the next test. With `keep_schema`, its tables are
    truncated (identities restarted) while its schema is the newest revision's; otherwise, or
    when it is not (a test that took it back, or that failed half way), the schema is dropped,
    for the next `Store.migrate` (or test of the migrations) to make again."""
    from service.store.tables import Base

    engine = create_engine(url)
    try:
        with engine.begin() as c:
            if keep_schema and _at_head(c):
                names = ", ".join(f'"{t}"' for t in sorted(Base.metadata.tables))
                c.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
            else:
                c.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    finally:
        engine.dispose()


def _at_head(c: Connection) -> bool:
    """Whether the PostgreSQL schema on `c` holds exactly the tables of the newest revision
    and says that it is at it."""
    from service.store.tables import Base

    tables = set(c.execute(text(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars())
    if tables != {*Base.metadata.tables, "alembic_version"}:
        return False
    versions = c.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    return versions == [_pg_head()]


@functools.cache
def _pg_head() -> str:
    """The newest revision of `migrations/`."""
    from alembic.script import ScriptDirectory

    from service.store.schema import MIGRATIONS

    return str(ScriptDirectory(str(MIGRATIONS)).get_current_head())


@pytest.fixture(scope="session")
def pg_store_url() -> Iterator[str]:
    """The session's PostgreSQL database of the `store` fixture: migrated by its first test,
    emptied (`_empty_pg`) after each."""
    with scratch_pg_database(f"trident_store_{uuid.uuid4().hex[:10]}") as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database on SQLite (a file of the test's own) and on PostgreSQL. Empty, for the tests
    of the migrations themselves; at the newest revision with no rows where the test takes the
    `store` fixture too (a copy of a migrated file; the session's migrated database,
    emptied after each test)."""
    migrated = "store" in request.fixturenames
    if request.param == "sqlite":
        path = tmp_path / "trident.db"
        yield migrated_sqlite(path) if migrated else f"sqlite:///{path}"
        return
    url: str = request.getfixturevalue("pg_store_url" if migrated else "pg_url")
    yield url
    # The next test starts from empty tables (a store's) or an empty schema (the migrations').
    _empty_pg(url, keep_schema=migrated)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    s.migrate()  # nothing to do but in the session's first PostgreSQL test
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    """A migrated store on a SQLite file of its own (the controller tests)."""
    s = Store(migrated_sqlite(tmp_path / "c.db"))
    yield s
    s.close()


SMALL_PROBE = {"probe_max_bytes": 64 << 10}
"""The monitor of `tiny_spec`: the bandwidth probe runs, on messages of up to 64 KiB. The
default's, up to 64 MiB, cost a few CPU-seconds per job (tens with 8 ranks) in tests that do not
read it; the monitor's tests, and the demo job run as a user runs it, probe in full."""


def tiny_spec(**over: object) -> dict[str, object]:
    """The demo job's spec as JSON, with a small probe (`SMALL_PROBE`), and top-level
    overrides (a `monitor` given replaces it whole)."""
    spec: dict[str, object] = {
        "name": "tiny",
        "model": {"preset": "gpt-tiny"},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32",
                  "lr": 0.003},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5},
        "monitor": dict(SMALL_PROBE),
    }
    spec.update(over)
    return spec


def stored_plan(*, tp: int = 1, pp: int = 1, dp: int = 1) -> StoredPlan:
    """The plan the control plane stores for a small GPT on tp * pp * dp CPU ranks."""
    from service.contract.spec import JobSpec
    from service.submission.intake import prepare

    spec = JobSpec.model_validate(tiny_spec(
        model={"layers": 8, "hidden": 64, "heads": 8, "vocab": 256, "seq_len": 32},
        train={"global_batch": 4 * dp, "micro_batch": 1, "precision": "fp32"},
        parallel={"tp": tp, "pp": pp, "dp": dp}))
    return prepare(spec).plan


def record_steps(store: Store, *, job_id: int, attempt: int,
                 rows: Sequence[dict[str, Any]]) -> None:
    """Step reports (`StepReport.row()` form) stored as the controller stores them
    (`MetricsIngest.record`, at the job's world size)."""
    from service.store.metrics import MetricsIngest

    MetricsIngest(store).record(job_id=job_id, attempt=attempt, rows=rows,
                                world_size=store.get_job(job_id=job_id).world_size)


def user_token(store: Store, name: str = "admin", role: str = "admin",
               projects: tuple[str, ...] = ("default",)) -> str:
    """A token of user `name` (created, with its projects, unless it exists)."""
    from service.store.identity import Conflict, Identity

    identity = Identity(store)
    for p in projects:
        with contextlib.suppress(Conflict):
            identity.create_project(name=p)
    with contextlib.suppress(Conflict):
        identity.create_user(name=name, role=role, projects=list(projects))
    return identity.create_token(user=name, name="test")[0]


def authed_client(app: FastAPI, store: Store, **kw: object) -> TestClient:
    """A TestClient of `app` that sends an admin's token with every request."""
    return TestClient(app, headers={"Authorization": f"Bearer {user_token(store)}"},
                      **kw)  # type: ignore[arg-type]


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A live API server and the CLI pointed at it (`tests.cli_stack.Live`)."""
    from tests.cli_stack import live_stack

    yield from live_stack(tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real `mlflow server` (SQLite, loopback, a free port) for the session's tracking
    tests (`tests.mlflow_server.MlflowServer`): seconds to start, so started once."""
    from tests.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Ray of this test process (one per xdist worker), started by the first module that
    runs on it and stopped at the session's end: a head of 2 CPUs (`tests.servers.ray_head`);
    its address. Modules connect to it (`local_ray`) and each launcher on it has a namespace
    of its own (`ray_namespace`), emptied when its test (or module) ends. The tests that
    must own their Ray (several nodes, a node lost, `trident up`'s head, a killed head) start
    their own."""
    from tests.servers import ray_head

    with ray_head(tmp_path_factory.mktemp("shared-ray") / "ray-head.log") as address:
        yield address


@pytest.fixture(scope="module")
def local_ray(shared_ray: str) -> Iterator[None]:
    """This module's driver, connected to the test process's Ray (`shared_ray`), and
    disconnected at its end (the head stays for the next module). While it is connected the
    driver's environment says that the head starts its workers at niceness 0, as that of the
    Ray Trident starts does (`service.cluster.rayhead.WORKER_NICENESS_ENV`): the ranks take
    no runtime environment (`workers.rank.actor.rank_runtime_env`)."""
    import ray

    from service.cluster.rayhead import WORKER_NICENESS_ENV

    with pytest.MonkeyPatch.context() as mp:
        for k, v in WORKER_NICENESS_ENV.items():
            mp.setenv(k, v)
        ray.init(address=shared_ray, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def ray_namespace() -> Iterator[str]:
    """A Ray namespace of its own for a launcher on the shared Ray
    (`RayLauncher(namespace=...)`): its groups' names cannot meet another test's. On exit,
    what is left on the Ray is stopped (the namespace's named actors, every placement group:
    the head is this process's, and its modules run one after another), so that the next
    test finds the Ray as empty as a Ray of its own."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    namespace = f"trident-test-{uuid.uuid4().hex[:10]}"
    try:
        yield namespace
    finally:
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == namespace:
                with contextlib.suppress(ValueError, ray.exceptions.RayError):
                    ray.kill(ray.get_actor(entry["name"], namespace=namespace),
                             no_restart=True)
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))


@pytest.fixture
def ray_ns(local_ray: None) -> Iterator[str]:
    """A Ray namespace of the test's own on the shared Ray (`ray_namespace`)."""
    with ray_namespace() as namespace:
        yield namespace


@contextlib.contextmanager
def ray_stack(tmp_path: Path, settings: Settings, *, light_ranks: bool = False,
              log_root: Path | None = None) -> Iterator[tuple[TestClient, Store, Controller]]:
    """The API on `settings` (a TestClient, an admin's token), its store and a controller on
    the shared local Ray, in a namespace of the test's own; the controller stops its jobs
    at the end."""
    from api.app import create_app
    from service.control.controller import Controller
    from service.files.order_cache import ServerData
    from workers.launch.launcher import RayLauncher

    store = Store(migrated_sqlite(tmp_path / "e2e.db"))
    with ray_namespace() as namespace:
        controller = Controller(store, RayLauncher(log_root=log_root,
                                                   server=ServerData.of(settings),
                                                   light_ranks=light_ranks,
                                                   namespace=namespace),
                                checkpoint_root=tmp_path / "ckpt", start_timeout_s=120,
                                cancel_grace_s=5, data_dir=tmp_path)
        with authed_client(create_app(settings, store=store), store) as client:
            yield client, store, controller
        controller.shutdown(stop_jobs=True)
    store.close()


@pytest.fixture
def stack(local_ray: None, tmp_path: Path) -> Iterator[tuple[TestClient, Store, Controller]]:
    """The API (a TestClient, an admin's token), its store and a controller on the real local
    Ray (a namespace of the test's own), with faults and light ranks allowed (`program:
    light`, `workers.rank.light`): what the Ray end-to-end tests drive one pass at a time."""
    from service.settings import Settings

    with ray_stack(tmp_path, Settings(data_dir=tmp_path, allow_faults=True, light_ranks=True),
                   light_ranks=True) as got:
        yield got


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An API server whose first start created the admin; the CLI finds its token file as
    it would for `trident up` (TRIDENT_DATA_DIR), and no `trident login` profile."""
    from tests.servers import first_start

    yield from first_start(tmp_path, monkeypatch)


@pytest.fixture
def server_on_each_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      db_url: str) -> Iterator[str]:
    """`server`, on SQLite and on PostgreSQL."""
    from tests.servers import first_start

    yield from first_start(tmp_path, monkeypatch, db_url)


@pytest.fixture(scope="module")
def hosts_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hosts, Up]]:
    """Three hosts in network namespaces (`tests.hosts`) and `trident up --ray-address` on the
    head's host driving them, for one module (the tests on hosts); needs root."""
    from tests.hosts import up_on_hosts

    with up_on_hosts(tmp_path_factory.mktemp("hosts"), 3) as stack:
        yield stack


@pytest.fixture
def on_hosts(hosts_cluster: tuple[Hosts, Up]) -> Iterator[tuple[Hosts, Up]]:
    """`hosts_cluster`, and after the test every host it cut off back on the network, every
    one it powered off started again, and all of them in the inventory."""
    from tests.hosts import all_joined

    yield hosts_cluster
    hosts, up = hosts_cluster
    for host in hosts.hosts:
        hosts.heal(host)
        if not host.alive:
            hosts.start_node(host)
    all_joined(hosts, up)
