"""Every route of the API driven by its own OpenAPI schema (schemathesis), authenticated as an
admin, on SQLite and on PostgreSQL: requests that fit the schema and requests that break it,
in every parameter, header and body field (the job spec included). No answer is a 5xx, every
answer's status is one the schema documents for its route, its body, content type and
headers fit what the schema says of that status, every 4xx says what is wrong in `detail`,
and every 422 names the field (its location) it refuses.

Bounded and deterministic: few examples per route, derandomized, no example database (under
a minute per database for the whole API).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from api.app import create_app
from service.contract.spec import JobSpec
from service.settings import Settings
from service.store import Store
from service.store.identity import Identity
from service.store.lease import Leader
from service.submission.intake import submit
from tests.conftest import PG_ADMIN_URL, migrated_sqlite, scratch_pg_database, tiny_spec, user_token

FUZZER = "fuzzer"
"""The admin the requests are sent as: the fuzzing may revoke or disable anyone but it."""
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.response_schema_conformance,
          checks.content_type_conformance, checks.response_headers_conformance]
"""What every answer is checked for: no 5xx, a status the schema documents for the route, and
a body, content type and headers that fit what the schema says of that status."""

# Schemathesis makes one test per operation from a schema it has when the module is collected;
# each database's app is made here (nothing connects yet), its database made and filled by
# `served` before the first request starts the app.
_DATA = Path(tempfile.mkdtemp(prefix="trident-properties-"))
_PG_NAME = f"trident_fuzz_{uuid.uuid4().hex[:10]}"
URLS = {"sqlite": f"sqlite:///{_DATA / 'trident.db'}",
        "postgres": PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{_PG_NAME}"}


def _schema(db: str) -> Any:
    app = create_app(Settings(data_dir=_DATA / db, database_url=URLS[db]))
    loaded = schemathesis.openapi.from_dict(app.openapi())
    loaded.app, loaded.location = app, "/openapi.json"
    return loaded


sqlite_schema, postgres_schema = _schema("sqlite"), _schema("postgres")


def _seed(url: str) -> dict[str, Any]:
    """Something to find: a job (id 1) and a node with its resources, so that the routes that
    read them and the submit-time placement check have data to work on; a controller holding
    its lease, without which healthz is (by design) a 503; and the fuzzer's token. The
    database at `url` is at the newest revision."""
    store = Store(url)
    try:
        Leader(store, duration_s=3600, holder="test-controller").acquire_or_renew()
        secret = user_token(store, FUZZER, "admin")
        submit(store, JobSpec.model_validate(tiny_spec()))
        store.upsert_nodes(nodes=[{"node_id": "n0", "hostname": "h0", "accelerator": "cpu",
                                   "resources": {"CPU": 64.0, "memory": 1e11}}])
        token_id = Identity(store).authenticate(secret).token_id
    finally:
        store.close()
    return {"headers": {"Authorization": f"Bearer {secret}"}, "token_id": token_id}


@pytest.fixture(scope="module", autouse=True)
def _scratch() -> Iterator[None]:
    yield
    shutil.rmtree(_DATA, ignore_errors=True)


@pytest.fixture(scope="module")
def sqlite_served() -> dict[str, Any]:
    return _seed(migrated_sqlite(_DATA / "trident.db"))


@pytest.fixture(scope="module")
def postgres_served() -> Iterator[dict[str, Any]]:
    with scratch_pg_database(_PG_NAME) as url:
        assert url == URLS["postgres"]
        made = Store(url)  # a database of the module's own, which the schema's app names
        made.migrate()
        made.close()
        yield _seed(url)


def _names_what_is_wrong(status: int, body: Any) -> bool:
    """`detail` is a list of errors each with a location (the field: where in the path,
    query, header or body) and a message; or, for a refusal that is not about one field (401,
    403, 404, 409, 413, 429), a sentence. A 422 always names the field."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return status != 422 and bool(detail.strip())
    if not isinstance(detail, list) or not detail:
        return False
    return all(isinstance(d, dict) and d.get("loc") and isinstance(d.get("msg"), str)
               and d["msg"].strip() for d in detail)


def _check(case: Any, auth: dict[str, Any]) -> None:
    params = case.path_parameters or {}
    if str(params.get("token_id")) == str(auth["token_id"]):  # path values may be text
        params["token_id"] = 999_999  # its own token stays valid: the rest runs as admin
    if params.get("name") == FUZZER:
        params["name"] = "someone-else"
    response = case.call(headers=auth["headers"])
    where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    assert response.status_code < 500, where
    if response.request.headers.get("Authorization") == auth["headers"]["Authorization"]:
        # Sent as the admin (some cases leave the header out on purpose): never a 401.
        assert response.status_code != 401, where
    case.validate_response(response, headers=auth["headers"], checks=CHECKS)
    if response.status_code >= 400:
        assert _names_what_is_wrong(response.status_code, response.json()), where


BOUNDED = settings(max_examples=12, derandomize=True, database=None, deadline=None,
                   suppress_health_check=list(HealthCheck))


@sqlite_schema.parametrize()
@BOUNDED
def test_no_route_answers_5xx_or_off_schema_on_sqlite(case: Any,
                                                      sqlite_served: dict[str, Any]) -> None:
    _check(case, sqlite_served)


@pytest.mark.postgres
@postgres_schema.parametrize()
@BOUNDED
def test_no_route_answers_5xx_or_off_schema_on_postgres(case: Any,
                                                        postgres_served: dict[str, Any]) -> None:
    _check(case, postgres_served)


def test_every_operation_documents_the_refusals_it_may_answer() -> None:
    """401 and 403 where a rule applies, 404 with a path parameter, 400 and 413 with a body,
    503 everywhere: each a `Refusal` with its `detail`."""
    doc = create_app(Settings(data_dir=_DATA / "doc")).openapi()
    assert doc["components"]["schemas"]["Refusal"]["required"] == ["detail"]
    ref = {"$ref": "#/components/schemas/Refusal"}
    operations = [(path, method, op) for path, item in doc["paths"].items()
                  for method, op in item.items()]
    assert len(operations) > 20
    for path, method, op in operations:
        want = {"503"}
        if path != "/api/v1/healthz":
            assert op.get("security"), path
            want |= {"401", "403"}
            # A change sent with the dashboard's session cookie: the CSRF rule's 403 too.
            csrf = "`csrf: ...`" in op["responses"]["403"]["description"]
            assert csrf == (method != "get"), (method, path)
        if "{" in path:
            want.add("404")
        if "requestBody" in op:
            want |= {"400", "413"}
        assert want <= set(op["responses"]), (path, sorted(op["responses"]))
        for status in want:
            if (path, status) != ("/api/v1/healthz", "503"):  # healthz's own: `degraded`
                assert op["responses"][status]["content"]["application/json"]["schema"] == ref
