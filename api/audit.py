"""The audit log: every request that changes something (submit, cancel, probes, users, tokens,
projects, dashboard log-in and out), recorded with who, when, from where and the outcome;
`GET /api/v1/audit` lists it for admins.

An ASGI middleware, outermost, so that refusals (401, 403, 413, 422) are recorded too. It
reads who asked from the request state the authentication dependency fills in, and writes
after the response has been sent, in a worker thread: the client does not wait for it.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.identity import Identity, Principal

log = logging.getLogger(__name__)

SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


class Audit:
    """ASGI middleware recording every request with an unsafe method."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE:
            await self.app(scope, receive, send)
            return
        status = 500

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            await run_in_threadpool(self._record, scope, status)

    @staticmethod
    def _record(scope: Scope, status: int) -> None:
        state: dict[str, Any] = scope.get("state") or {}
        identity: Identity | None = getattr(scope["app"].state, "identity", None)
        if identity is None:
            return
        who: Principal | None = state.get("principal")
        client = scope.get("client")
        try:
            identity.record(actor=who.name if who else None,
                            client=client[0] if client else None, method=scope["method"],
                            path=scope["path"], action=state.get("action"), status=status)
        except Exception:  # an audit that fails must not turn an answer into an error
            log.exception("recording %s %s in the audit log failed", scope["method"],
                          scope["path"])
