"""What a request gets when the database fails under it: 503 naming the error, never a 500.

Registered by `api.app` for every SQLAlchemy error of the driver (`DBAPIError`), raised by a
route, a dependency (the token check) or the `/metrics` collector (`api.prometheus`). The
answer takes the shape of what was asked: JSON (`{"detail": ...}`) under `/api/`, plain text
for `/metrics` (what Prometheus shows as the scrape's error), a page for the dashboard's.

Two kinds, told apart by `service.store.dbcheck`: a database that is away (a server stopped,
restarting or unreachable) answers with `Retry-After`, since a retry will do; a damaged one
(a malformed SQLite page, PostgreSQL's data_corrupted) says so, and that an operator must
restore it. Nothing was written either way: every store function is one transaction.
"""

from __future__ import annotations

import logging
from html import escape

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from sqlalchemy.exc import DBAPIError

from service.store.dbcheck import away, damaged, describe

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
"""`Retry-After` of a 503 while the database is away."""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Trident: 503, database error</title>
<link rel="stylesheet" href="/static/app.css"></head>
<body><main><h1>The database cannot answer</h1><p>{detail}</p>
<p><a href="">Try again</a></p></main></body></html>
"""


def detail(exc: DBAPIError) -> str:
    """What the client is told: the kind of failure and the driver's error, not the file or
    the URL (the server's log names them)."""
    what = type(exc.orig).__name__
    first = str(exc.orig).strip().splitlines()[0][:200] if str(exc.orig).strip() else what
    if damaged(exc):
        return (f"the database is damaged ({what}: {first}); an operator must restore it from"
                " a backup")
    if away(exc):
        return f"the database is unavailable ({what}); retry in a few seconds"
    return f"the database failed to answer ({what}: {first})"


async def database_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DBAPIError)
    text = detail(exc)
    log.warning("%s %s: 503, %s", request.method, request.url.path,
                describe(request.app.state.store.url, exc))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if away(exc) else {}
    path = request.url.path
    if path.startswith("/api/"):
        return JSONResponse(status_code=503, headers=headers, content={"detail": text})
    if path == "/metrics":
        return PlainTextResponse(text + "\n", status_code=503, headers=headers)
    return HTMLResponse(_PAGE.format(detail=escape(text)), status_code=503, headers=headers)
