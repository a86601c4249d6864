"""What every `trident` command that talks to the REST API shares: the `--server` option, the
one-line error with a non-zero exit (`fail`), and the request with the caller's token that
turns every refusal into such a line (`_call`): which address was unreachable, what to do
about a 401 or a 403, and for a 422 the field with the arithmetic. Never a traceback.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, NoReturn

import httpx
import typer

from api.cli_auth import token_for

ServerOpt = Annotated[str, typer.Option("--server", envvar="TRIDENT_SERVER",
                                        help="Base URL of the Trident API.")]
DEFAULT_SERVER = "http://127.0.0.1:8000"
RETRY_STATUS = {502, 503, 504}  # the server could not answer now (a proxy, or a restart)
BACKOFF_S = 0.5  # the first retry's wait; each next one waits twice as long, up to 5 s


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr and exit with `code` (2: the request was refused or
    could not be made)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _client(server: str) -> httpx.Client:
    token, _ = token_for(server)  # the token `_call` sends, for streams too
    return httpx.Client(base_url=server.rstrip("/") + "/api/v1", timeout=30,
                        headers={"Authorization": f"Bearer {token}"} if token else {})


def unreachable(server: str, exc: Exception) -> str:
    """The line for a server that did not answer: its address, and how to pick another."""
    reason = str(exc) or type(exc).__name__
    return (f"cannot reach the Trident API at {server}: {reason} (is `trident up` running"
            " there? --server or TRIDENT_SERVER selects another)")


def refusal(server: str, r: httpx.Response) -> str:
    """One line for a 4xx/5xx answer: the status, the server's reason, and what to do."""
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = r.text.strip()[:300] or r.reason_phrase
    if isinstance(detail, list):  # 422: the field, then the arithmetic
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'request'}:"
                           f" {d.get('msg')}" for d in detail if isinstance(d, dict))
    if r.status_code == 401:
        _, source = token_for(server)
        detail = (f"{detail} (token from {source}; set TRIDENT_TOKEN or run `trident login`"
                  f" for {server})")
    elif r.status_code == 403:
        detail = f"{detail} (`trident whoami` shows your role; an admin can change it)"
    return f"{r.status_code}: {detail}"


def _call(server: str, method: str, path: str, *, retries: int = 0, **kw: Any) -> Any:
    """One request, with the API token; `retries` more after a transport error or a
    502/503/504, with backoff (only for requests that are safe to repeat)."""
    token, _ = token_for(server)
    headers = {**({"Authorization": f"Bearer {token}"} if token else {}),
               **kw.pop("headers", {})}
    for attempt in range(retries + 1):
        try:
            with _client(server) as c:
                r = c.request(method, path, headers=headers, **kw)
        except httpx.HTTPError as exc:
            if attempt == retries:
                fail(unreachable(server, exc))
            time.sleep(min(BACKOFF_S * 2**attempt, 5.0))
            continue
        if r.status_code not in RETRY_STATUS or attempt == retries:
            break
        time.sleep(min(BACKOFF_S * 2**attempt, 5.0))
    if r.status_code >= 400:
        fail(refusal(server, r))
    try:
        return r.json()
    except ValueError:
        fail(f"{server} answered {method} {path} with something that is not JSON (is it a"
             " Trident API?)")
