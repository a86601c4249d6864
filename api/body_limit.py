"""A cap on request bodies: a 413 before the body is parsed, whatever the client declares.

A declared Content-Length over the cap is refused before the application runs; a body sent
without one (chunked) is counted as it arrives and refused as soon as it passes the cap, so
that the JSON parser never sees more than `max_bytes`.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 1 << 20
"""The largest request body the API reads (1 MiB); a job spec is a few KiB."""


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the cap. An HTTPException, so that
    FastAPI's body reader passes it on and the 413 reaches the client as JSON."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(status_code=413, detail=_detail(max_bytes))


def _detail(max_bytes: int) -> str:
    return f"request body larger than {max_bytes} bytes ({max_bytes / (1 << 20):g} MiB)"


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and \
                int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            # Read outside FastAPI's body reader (which turns it into the response itself).
            if started:
                raise
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": _detail(self.max_bytes)}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
