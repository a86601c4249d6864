"""The FastAPI application: REST under /api/v1, the status page at /, OpenAPI at /docs.

It reads and writes the store only and never calls Ray, so it stays fast when the cluster
is slow. `create_app` is used by `trident up`, by uvicorn (`api.app:app`) and by the tests.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy.exc import DBAPIError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import pages, session
from api.audit import Audit, AuditWriter
from api.auth import require
from api.body_limit import MAX_BODY_BYTES, BodyLimit
from api.db_errors import database_error
from api.openapi_refusals import document_refusals
from api.prometheus import RequestTimer, StoreCollector, request_latency
from api.routes import (
    checkpoints,
    cluster,
    dashboard,
    exports,
    goodput,
    identity,
    jobs,
    logs,
    plan,
    profile,
    resubmit,
    stacks,
    tracking,
)
from api.routes.health import health
from api.schemas import Health
from api.serve import watch_parent
from service.control.heap import freeze_startup_objects
from service.secrets import SecretBox
from service.settings import Settings
from service.store import Store
from service.store.bootstrap import bootstrap, prod_refusal
from service.store.dbcheck import Unreadable, check
from service.store.identity import Identity
from service.store.trusted_tokens import STAMP_FILE
from service.tracking.config import TrackingConfig

log = logging.getLogger(__name__)

_FIELD_PREFIX = re.compile(r"^(?:Value error, )?([a-z_]+(?:\.[A-Za-z_0-9]+)*): (.*)$", re.S)


def _name_the_field(err: dict[str, Any]) -> dict[str, Any]:
    """Cross-field spec errors say `parallel.tp: ...`; put that field into `loc`."""
    m = _FIELD_PREFIX.match(str(err.get("msg", "")))
    if m and err.get("type") == "value_error":
        err = {**err, "loc": [*err.get("loc", ["body"]), *m.group(1).split(".")],
               "msg": m.group(2)}
    err.pop("ctx", None)
    err.pop("input", None)
    return err


class HealthFirst:
    """ASGI middleware: `GET /api/v1/healthz` answered before routing (the route below is
    its documentation, and the same function): every probe, load balancer and `trident up`
    polls it, and walking FastAPI's routes and dependencies cost more than the check."""

    PATH = "/api/v1/healthz"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.PATH or \
                scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        scope["route"] = self.PATH  # the request-latency histogram's label
        state = scope["app"].state
        answer = await run_in_threadpool(health, state.store, state.settings)
        await answer(scope, receive, send)


class PidHeader:
    """ASGI middleware (tests only, `TRIDENT_DEBUG_PID_HEADER`): `X-Trident-Pid`, the API
    process that answered, on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pid = str(os.getpid()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_pid(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-trident-pid", self.pid)]}
            await send(message)

        await self.app(scope, receive, with_pid)


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = store is None
        app.state.store = store or Store(settings.db_url)
        app.state.identity = Identity(app.state.store, stamp=settings.data_dir / STAMP_FILE)
        if own:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            app.state.store.migrate()
            if settings.env != "prod" and (path := bootstrap(app.state.identity,
                                                             settings.data_dir)):
                log.warning("first start: created the admin user; its token is in %s", path)
        if settings.env == "prod" and (why := prod_refusal(app.state.identity,
                                                           settings.data_dir)):
            raise RuntimeError(f"refusing to start in prod: {why}")
        key = settings.secrets_key.get_secret_value() if settings.secrets_key else None
        try:
            app.state.box = SecretBox.of(key, settings.data_dir)
        except ValueError as exc:  # a message without the key's value
            raise RuntimeError(f"refusing to start: TRIDENT_SECRETS_KEY: {exc}") from None
        app.state.tracking = TrackingConfig.of(settings)
        app.state.audit = AuditWriter(app.state.identity)
        if own:
            watch_parent()  # a worker of `trident up --api-workers N` ends with it
        yield
        app.state.audit.close()
        if own:
            app.state.store.close()

    app = FastAPI(title="Trident", version="0.1.0", lifespan=lifespan,
                  description="Plan, run and watch TP x PP x DP (ZeRO) training jobs.\n\n"
                  f"Request bodies are at most {MAX_BODY_BYTES} bytes (1 MiB): a larger one"
                  " is refused with 413 before it is parsed.\n\n"
                  "Every route but `GET /api/v1/healthz` needs `Authorization: Bearer <token>`"
                  " (401 when it is missing, unknown, expired or revoked); roles: `admin`"
                  " (everything), `member` (submits, reads, cancels its own jobs), `viewer`"
                  " (reads); a route its role may not call is a 403 naming the rule.")
    app.state.settings = settings
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(HealthFirst)
    registry = CollectorRegistry(auto_describe=False)
    app.add_middleware(RequestTimer, histogram=request_latency(registry))
    registry.register(StoreCollector(lambda: app.state.store, settings.metrics_per_rank))
    app.add_middleware(Audit)  # outermost: it records the refusals of the others too
    if settings.debug_pid_header:
        app.add_middleware(PidHeader)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [_name_the_field(dict(e)) for e in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": jsonable_encoder(detail)})

    # The database away or damaged: a 503 naming it (JSON, text or a page), never a 500.
    app.add_exception_handler(DBAPIError, database_error)

    v1 = APIRouter(prefix="/api/v1")

    # Routes match in order: the health check (polled by every probe and load balancer)
    # first, so that it does not walk every other route.
    @v1.get("/healthz", tags=["system"], response_model=Health,
            responses={503: {"model": Health, "description": "degraded"}})
    def healthz(request: Request) -> JSONResponse:
        """`ok` (200) when the database answers and a controller holds an unexpired lease;
        else `degraded` (503), naming which of the two is wrong. `data_dir` says how full the
        data directory's filesystem is: `nearly full` under `TRIDENT_DATA_DIR_MIN_FREE`."""
        return health(request.app.state.store, request.app.state.settings)

    v1.include_router(jobs.router)
    v1.include_router(resubmit.router)
    v1.include_router(checkpoints.router)
    v1.include_router(exports.router)
    v1.include_router(logs.router)
    v1.include_router(dashboard.router)
    v1.include_router(cluster.router)
    v1.include_router(plan.router)
    v1.include_router(identity.router)
    v1.include_router(stacks.router)
    v1.include_router(profile.router)
    v1.include_router(tracking.router)
    v1.include_router(goodput.router)

    @app.get("/metrics", tags=["system"], response_class=Response,
             dependencies=[Depends(require("metrics:read"))],
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def prometheus_metrics() -> Response:
        """Prometheus exposition: jobs by state; for active jobs their layout, steps, step
        time and tokens/s measured and predicted, MFU, loss, collectives by dimension and op,
        per-rank memory; API latency; the controller's pass duration. Needs a token (any
        role): Prometheus sends it with `authorization: {credentials: TOKEN}`."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(v1)
    app.include_router(pages.router)
    app.include_router(session.router)
    app.mount("/static", StaticFiles(directory=Path(__file__).parent / "static"), name="static")
    document_refusals(app)
    return app


def app() -> FastAPI:
    """Factory for `uvicorn --factory api.app:app`: the app, with start-up's objects frozen
    out of garbage collection (`service.control.heap`). A database it cannot read is one line on
    stderr and exit status 1 (`service.store.dbcheck`): uvicorn would print a traceback."""
    settings = Settings()
    try:
        if note := check(settings.db_url):
            log.warning("%s", note)
    except Unreadable as exc:
        sys.exit(f"error: {exc}")
    made = create_app(settings)
    freeze_startup_objects()
    return made
