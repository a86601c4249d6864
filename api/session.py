"""The dashboard's log-in: the same tokens as the API, kept in a session cookie.

`POST /login` takes an API token from the form, checks it, and issues a session: a token of
its own (named `dashboard session`, expiring after `TRIDENT_SESSION_HOURS`), set as an
HttpOnly, SameSite=Strict cookie, so that page scripts cannot read it and other sites' pages
cannot send it. A state-changing request authenticated by the cookie, on any route, must also
carry the session's CSRF token (`api.auth.csrf_token`: the `X-CSRF-Token` header, which the
pages' scripts send; on `/logout`, whose form posts it, also the form field `csrf`), and is
refused when its `Origin` (or `Referer`) names another site, token or not (`api.auth.check_csrf`).
`page_principal` guards the page routes: a Bearer token or a session, else a redirect to the
log-in page.
"""

from __future__ import annotations

from datetime import timedelta
from html import escape
from typing import Annotated
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from api.auth import (
    CSRF_HEADER,
    RULES,
    SESSION_COOKIE,
    check_csrf,
    cross_site,
    csrf_token,
    identity_of,
)
from service.store.identity import AuthError, Principal

router = APIRouter(include_in_schema=False)

SESSION_TOKEN_NAME = "dashboard session"

_LOGIN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Trident: log in</title>
<link rel="icon" href="data:,"></head><body>
<h1>Trident</h1>
<form method="post" action="/login">
<label>API token <input type="password" name="token" autocomplete="off" required></label>
<button type="submit">Log in</button>
</form>
<p>{message}</p>
<p>A token comes from <code>trident token create</code>, or, for the first admin, from the
file <code>admin.token</code> in the server's data directory.</p>
</body></html>"""


async def _form(request: Request) -> dict[str, str]:
    body = (await request.body()).decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, max_num_fields=8).items()}


def session_principal(request: Request) -> tuple[Principal, str] | None:
    """The principal of the request's session cookie, and the session's secret."""
    secret = request.cookies.get(SESSION_COOKIE)
    if secret is None:
        return None
    try:
        return identity_of(request).authenticate(secret), secret
    except AuthError:
        return None


def page_principal(request: Request) -> Principal:
    """Who is looking at a page: by a Bearer token or the session cookie; a redirect to the
    log-in page otherwise."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        try:
            who = identity_of(request).authenticate(header[7:].strip())
        except AuthError as exc:
            raise HTTPException(status_code=401, detail=str(exc),
                                headers={"WWW-Authenticate": "Bearer"}) from None
    elif (found := session_principal(request)) is not None:
        who = found[0]
        check_csrf(request, found[1], request.headers.get(CSRF_HEADER, ""))
    else:
        raise HTTPException(status_code=303, detail="log in first",
                            headers={"Location": "/login"})
    if who.role not in RULES["pages:read"].roles:
        raise HTTPException(status_code=403, detail=RULES["pages:read"].refusal(who))
    request.state.principal = who
    return who


PageUser = Annotated[Principal, Depends(page_principal)]


def session_csrf(request: Request) -> str | None:
    """The CSRF token to put into the forms of a page (None without a session)."""
    secret = request.cookies.get(SESSION_COOKIE)
    return csrf_token(secret) if secret else None


@router.get("/login", response_class=HTMLResponse)
def login_page(message: str = "") -> str:
    return _LOGIN.format(message=escape(message[:200]))


@router.post("/login")
async def login(request: Request) -> RedirectResponse:
    """Check the form's token and set the session cookie; back to the form if it is wrong."""
    if cross_site(request) is not None:
        raise HTTPException(status_code=403, detail="csrf: log-in form sent from another site")
    token = (await _form(request)).get("token", "").strip()
    identity = identity_of(request)
    try:
        who = identity.authenticate(token)
    except AuthError as exc:
        return RedirectResponse("/login?" + urlencode({"message": f"log-in refused: {exc}"}),
                                status_code=303)
    request.state.principal = who
    hours = request.app.state.settings.session_hours
    identity.prune_tokens(user=who.name, name=SESSION_TOKEN_NAME)  # ended sessions go
    secret, _ = identity.create_token(user=who.name, name=SESSION_TOKEN_NAME,
                                      expires_in=timedelta(hours=hours))
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(SESSION_COOKIE, secret, max_age=int(hours * 3600), httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")
    return response


@router.post("/logout")
async def logout(request: Request) -> RedirectResponse:
    """End the session (its token is revoked) and drop the cookie; needs the CSRF token."""
    found = session_principal(request)
    if found is not None:
        who, secret = found
        sent = (await _form(request)).get("csrf") or request.headers.get(CSRF_HEADER, "")
        check_csrf(request, secret, sent, how=f"the form field `csrf` or the {CSRF_HEADER}"
                   " header")
        request.state.principal = who
        identity_of(request).revoke_token(token_id=who.token_id)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
