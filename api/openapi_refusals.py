"""The refusals every route may answer, written into the OpenAPI schema.

Routes document what is particular to them (a 409 of a taken name, a 422 of their fields);
what the app answers for all of them alike is added here, once, to the schema FastAPI makes:

- 401 and 403 on every route with a rule (a token missing, unknown, expired or revoked; a
  role or an owner the rule refuses: `api.auth`), and on those that change something the
  403 of a request authenticated by the dashboard's session cookie from another site or
  without its CSRF token (`api.auth.check_csrf`);
- 404 on every route with a path parameter (the job, token, user, ... does not exist);
- 400 and 413 on every route with a request body (not UTF-8 text; over 1 MiB:
  `api.body_limit`);
- 503 on every route (the database is away, retried by the client, or damaged:
  `api.db_errors`).

Each is a `Refusal`: `{"detail": "..."}` saying what is wrong. So a client, and the schema
fuzzing of the tests, knows every status the API answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.schemas import Refusal

_REF = {"$ref": "#/components/schemas/Refusal"}

ALWAYS = {503: "The database is unavailable (retry in a few seconds: `Retry-After`), or it is"
                " damaged (an operator must restore it): the detail says which."}
WITH_RULE = {401: "The token is missing, malformed, unknown, expired or revoked, or its user is"
                  " disabled.",
             403: "The caller's role, or its ownership of the object, does not allow this:"
                  " the detail names the rule."}
CHANGING = {403: WITH_RULE[403] + " Or (`csrf: ...`) a request authenticated by the dashboard's"
                 " session cookie came from another site (its `Origin`, else its `Referer`,"
                 " names another host than `Host`), or without the session's `X-CSRF-Token`;"
                 " a Bearer token needs neither."}
WITH_PATH = {404: "What the path names does not exist."}
WITH_BODY = {400: "The request body could not be read as JSON (it is not UTF-8 text).",
             413: "The request body is larger than 1 MiB."}


def _add(operation: dict[str, Any], statuses: dict[int, str]) -> None:
    responses = operation.setdefault("responses", {})
    for status, text in statuses.items():
        responses.setdefault(str(status), {
            "description": text, "content": {"application/json": {"schema": _REF}}})


def document_refusals(app: FastAPI) -> None:
    """Make `app.openapi()` include the refusals common to its routes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).setdefault(
            "Refusal", Refusal.model_json_schema())
        for item in schema.get("paths", {}).values():
            for method, operation in item.items():
                if method not in {"get", "put", "post", "delete", "patch"}:
                    continue
                _add(operation, ALWAYS)
                if operation.get("security"):
                    _add(operation, WITH_RULE if method == "get" else {**WITH_RULE, **CHANGING})
                if any(p.get("in") == "path" for p in operation.get("parameters", [])):
                    _add(operation, WITH_PATH)
                if "requestBody" in operation:
                    _add(operation, WITH_BODY)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
