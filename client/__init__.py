"""Trident's Python client: the REST API (`/api/v1`) without the server.

`TridentClient` (`client.rest`) has one method per route; `client.payloads` is the REST
contract, the bodies those methods return and the rule that keeps old clients and new servers
compatible; `client.token` finds the token. Nothing here imports the server (SQLAlchemy,
FastAPI, `service.store`, `api`): `import client` is light enough for a laptop and a
notebook (tests/test_imports.py). The `trident` CLI is built on it; docs/client.md is
its guide.
"""

from client.rest import (
    DEFAULT_SERVER,
    ApiError,
    BadServerURL,
    Conflict,
    ConnectionFailed,
    ExportFailed,
    FieldError,
    Forbidden,
    Invalid,
    NotFound,
    NotTridentAPI,
    TooManyRequests,
    TridentClient,
    TridentError,
    Unauthorized,
    Unavailable,
    model_json,
)

__all__ = ["DEFAULT_SERVER", "ApiError", "BadServerURL", "Conflict", "ConnectionFailed",
           "ExportFailed", "FieldError", "Forbidden", "Invalid", "NotFound", "NotTridentAPI",
           "TooManyRequests", "TridentClient", "TridentError", "Unauthorized", "Unavailable",
           "model_json"]
