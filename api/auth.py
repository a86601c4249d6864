"""Who may call what: the rule of every route, checked by one dependency per route.

Every route under /api/v1 but `GET /healthz` declares its rule as `Depends(require("jobs:cancel"))`
(usually through its router's `dependencies`); `RULES` is the one table of rules, and the
authorization matrix test reads each route's rule back from its dependencies, so that a route
without one fails the test. A request is authenticated by `Authorization: Bearer <token>`, or
by the dashboard's session cookie (`api.session`); a cookie-authenticated request that changes
something, on any route, must also carry the session's CSRF token and is refused when a browser
says it comes from another site (`check_csrf`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.store.identity import AuthError, Identity, Principal

SESSION_COOKIE = "trident_session"
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Rule:
    """Which roles may call a route: on anything (`roles`), or only on what they own
    (`own`: the route checks ownership with `check_owner`)."""

    name: str
    roles: frozenset[str]
    own: frozenset[str] = frozenset()
    text: str = ""

    def refusal(self, who: Principal) -> str:
        return (f"{self.name}: {self.text} (you are {who.name}, {who.role})")


def _rule(name: str, roles: str, own: str = "", text: str = "") -> tuple[str, Rule]:
    return name, Rule(name, frozenset(roles.split()), frozenset(own.split()), text)


RULES: dict[str, Rule] = dict([
    _rule("jobs:read", "admin member viewer", text="any user may read jobs"),
    _rule("jobs:submit", "admin member",
          text="admins and members submit jobs, members only under their own projects"),
    _rule("jobs:cancel", "admin", own="member",
          text="admins cancel any job, members only their own"),
    _rule("jobs:resubmit", "admin", own="member",
          text="admins resubmit any job, members only their own"),
    _rule("jobs:export", "admin", own="member",
          text="admins export any job's weights, members only their own jobs'"),
    _rule("jobs:env", "admin", own="member viewer",
          text="admins read every job's env values, other users only their own jobs'"),
    _rule("jobs:stacks", "admin", own="member",
          text="admins ask any job's ranks for their stacks, members only their own jobs'"),
    _rule("jobs:profile", "admin", own="member",
          text="admins profile any job's ranks, members only their own jobs'"),
    _rule("cluster:read", "admin member viewer", text="any user may read the cluster"),
    _rule("cluster:probe", "admin member", text="admins and members may probe the cluster"),
    _rule("nodes:cordon", "admin", text="only admins cordon nodes"),
    _rule("nodes:drain", "admin", text="only admins drain nodes"),
    _rule("nodes:uncordon", "admin", text="only admins uncordon nodes"),
    _rule("plan", "admin member viewer", text="any user may plan"),
    _rule("self", "admin member viewer", text="any user may see who they are"),
    _rule("tokens:manage", "admin", own="member viewer",
          text="admins manage every token, other users only their own"),
    _rule("users:manage", "admin", text="only admins manage users"),
    _rule("projects:read", "admin member viewer", text="any user may read projects"),
    _rule("projects:manage", "admin", text="only admins manage projects and quotas"),
    _rule("audit:read", "admin", text="only admins read the audit log"),
    _rule("pages:read", "admin member viewer", text="any user may see the dashboard"),
    _rule("metrics:read", "admin member viewer",
          text="any user's token may scrape /metrics (Prometheus: `authorization` in the"
          " scrape config)"),
])

_bearer = HTTPBearer(auto_error=False, description="An API token: `trident token create`,"
                     " or the bootstrap admin's `DATA_DIR/admin.token`.")


def identity_of(request: Request) -> Identity:
    ident: Identity = request.app.state.identity
    return ident


def csrf_token(session: str) -> str:
    """The CSRF token of a session: derived from its secret, so it needs no storage."""
    return hmac.new(session.encode(), b"trident-csrf", hashlib.sha256).hexdigest()


def cross_site(request: Request) -> str | None:
    """The other site a browser says the request comes from (its `Origin`, or its `Referer`
    when it sends no `Origin`), or None when that is this server (the `Host` the request was
    sent to) or the request names none (it is no browser's form or script)."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:
        return None
    host = request.headers.get("host", request.url.netloc).lower()
    return None if urlsplit(origin).netloc.lower() == host else origin[:200]


def check_csrf(request: Request, session: str, sent: str,
               how: str = f"the {CSRF_HEADER} header") -> None:
    """A request authenticated by the session cookie `session` that changes something: a 403
    naming the rule (`csrf`) when it comes from another site, even with the right token, or
    when `sent` is not the session's CSRF token (`how` says where it is looked for)."""
    if request.method in SAFE_METHODS:
        return
    if (other := cross_site(request)) is not None:
        raise HTTPException(status_code=403, detail=f"csrf: a request authenticated by the"
                            f" session cookie is refused from another site ({other!r} is not"
                            " this server)")
    # Bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
    if not hmac.compare_digest(sent.encode(), csrf_token(session).encode()):
        raise HTTPException(status_code=403, detail=f"csrf: a request authenticated by the"
                            f" session cookie must carry the session's CSRF token ({how})")


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status_code=401, detail=message,
                         headers={"WWW-Authenticate": "Bearer"})


async def authenticate(request: Request,
                       creds: Annotated[HTTPAuthorizationCredentials | None,
                                        Depends(_bearer)]) -> Principal:
    """The principal of the request's Bearer token (or session cookie); a 401 saying what is
    wrong otherwise. Async, like `require`'s dependency: a token this process trusts
    (`Identity.trusted`, no I/O but a `stat`) is checked on the event loop, and only a
    database read goes to FastAPI's thread pool; a sync dependency would cost every request
    a hop there and back, more CPU than the check."""
    header = request.headers.get("authorization")
    if creds is not None:
        token = creds.credentials
    elif header:
        raise _unauthorized("malformed Authorization header: send `Authorization: Bearer"
                            " <token>`")
    elif (cookie := request.cookies.get(SESSION_COOKIE)) is not None:
        token = cookie
        check_csrf(request, cookie, request.headers.get(CSRF_HEADER, ""))
    else:
        raise _unauthorized("missing token: send `Authorization: Bearer <token>`")
    identity = identity_of(request)
    try:
        who = identity.trusted(token)
        if who is None:
            who = await run_in_threadpool(identity.authenticate, token)
    except AuthError as exc:
        raise _unauthorized(str(exc)) from None
    request.state.principal = who
    return who


def require(name: str) -> Callable[..., Awaitable[Principal]]:
    """The dependency of a route under rule `name`: the principal, when its role may call
    the route at all (owners are checked by the route, `check_owner`); a 403 naming the rule
    otherwise."""
    rule = RULES[name]

    async def dependency(request: Request,
                         who: Annotated[Principal, Depends(authenticate)]) -> Principal:
        request.state.action = rule.name
        if who.role not in rule.roles | rule.own:
            raise HTTPException(status_code=403, detail=rule.refusal(who))
        return who

    dependency.rule = rule  # type: ignore[attr-defined]
    return dependency


def may(who: Principal, name: str, owner: str) -> bool:
    """Whether `who` may act on something `owner` owns under rule `name`."""
    rule = RULES[name]
    return who.role in rule.roles or (who.role in rule.own and owner == who.name)


def check_owner(who: Principal, name: str, owner: str, why: str = "") -> None:
    """A 403 unless `who` may act on something `owner` owns under rule `name`; `why`, when the
    route is not the rule's own, says what needs the rule."""
    rule = RULES[name]
    if may(who, name, owner):
        return
    raise HTTPException(status_code=403, detail=rule.refusal(who) + f"; this belongs to {owner}"
                        + (f" ({why})" if why else ""))


def check_weights(who: Principal, owner: str, why: str = "") -> None:
    """A 403 unless `who` may take the weights of a job `owner` owns (rule `jobs:export`):
    exporting them, or starting a new job from its checkpoint, which hands the new job's
    owner the same weights (`api.routes.resubmit`)."""
    check_owner(who, "jobs:export", owner, why)


def rule_of(route: Any) -> Rule | None:
    """The rule a route declares (through `require`), if any: read by the matrix test."""
    stack = [getattr(route, "original_route", route).dependant]
    while stack:
        dep = stack.pop()
        rule = getattr(dep.call, "rule", None)
        if isinstance(rule, Rule):
            return rule
        stack.extend(dep.dependencies)
    return None


def api_routes(app: FastAPI) -> Iterator[tuple[str, str, Rule | None]]:
    """(method, path, rule) of every API route of `app` (pages and OpenAPI excluded)."""
    for ctx in iter_route_contexts(app.routes):
        route = ctx.original_route
        if isinstance(route, APIRoute) and route.include_in_schema and ctx.path:
            for method in sorted(ctx.methods or ()):
                yield method, ctx.path, rule_of(route)


Who = Annotated[Principal, Depends(authenticate)]
"""The request's principal, once its route's rule (in the router's dependencies) let it in."""
