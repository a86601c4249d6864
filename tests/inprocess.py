"""`client.TridentClient` on an app served in this process (a `TestClient`'s), so that the CLI
and the client run against the API without a server on a port."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from client.rest import TridentClient


class _Whole(httpx.BaseTransport):
    """The TestClient's transport, each answer's body read whole (its stream is the
    TestClient's own kind, which a plain `httpx.Client` does not take)."""

    def __init__(self, client: TestClient) -> None:
        self.inner = client._transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.inner.handle_request(request)
        body = b"".join(r.stream)  # type: ignore[arg-type]
        return httpx.Response(r.status_code, headers=r.headers, content=body, request=request)


def client_of(api: TestClient) -> TridentClient:
    """A client of `api`'s app, with the token `api` sends."""
    token = api.headers["authorization"].split()[1]
    return TridentClient("http://testserver", token=token, transport=_Whole(api))
