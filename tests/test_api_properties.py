"""Every route of the API driven by its own OpenAPI schema (schemathesis), authenticated as an
admin: requests that fit the schema and requests that break it, in every parameter, header
and body field (the job spec included). No answer is a 5xx, every 4xx says what is wrong
in `detail`, and every 422 names the field (its location) it refuses.

Bounded and deterministic: few examples per route, derandomized, no example database (about
a minute for the whole API).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from api.app import create_app
from service.identity import Identity
from service.jobs import submit
from service.lease import Leader
from service.settings import Settings
from service.spec import JobSpec
from service.store import Store
from tests.conftest import tiny_spec

# The schema is read from the app when the module is collected (schemathesis makes one test
# per operation from it), which starts the app: its own SQLite database in a scratch folder.
_DATA = Path(tempfile.mkdtemp(prefix="trident-properties-"))
app = create_app(Settings(data_dir=_DATA))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
FUZZER = "fuzzer"
"""The admin the requests are sent as: the fuzzing may revoke or disable anyone but it."""
_auth: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _data() -> Iterator[None]:
    """Something to find: a job (id 1) and a node with its resources, so that the routes that
    read them and the submit-time placement check have data to work on; and a controller
    holding its lease, without which healthz is (by design) a 503."""
    store: Store = app.state.store
    Leader(store, duration_s=3600, holder="test-controller").acquire_or_renew()
    identity = Identity(store)
    if not any(u.name == FUZZER for u in identity.list_users()):
        identity.create_user(name=FUZZER, role="admin", projects=["default"])
    secret, token = identity.create_token(user=FUZZER, name="fuzz")
    _auth.update(headers={"Authorization": f"Bearer {secret}"}, token_id=token.id)
    if not store.list_jobs(limit=1)[0]:
        submit(store, JobSpec.model_validate(tiny_spec()))
        store.upsert_nodes(nodes=[{"node_id": "n0", "hostname": "h0", "accelerator": "cpu",
                                   "resources": {"CPU": 64.0, "memory": 1e11}}])
    yield
    shutil.rmtree(_DATA, ignore_errors=True)


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


@schema.parametrize()
@settings(max_examples=12, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_5xx_and_every_refusal_names_the_problem(case: Any) -> None:
    params = case.path_parameters or {}
    if str(params.get("token_id")) == str(_auth["token_id"]):  # path values may be text
        params["token_id"] = 999_999  # its own token stays valid: the rest runs as admin
    if params.get("name") == FUZZER:
        params["name"] = "someone-else"
    response = case.call(headers=_auth["headers"])
    where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        assert _names_what_is_wrong(response.status_code, response.json()), where
