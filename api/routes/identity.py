"""Identity routes: who am I, users, API tokens, projects with their quotas, the audit log."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Who, check_owner, identity_of, require
from api.deps import INT32_MAX, INT64_MAX
from api.routes.jobs import NAME_PATTERN
from api.schemas import AuditList, NewToken, ProjectList, TokenList, UserList, WhoAmI
from service.store import NotFound
from service.store.audit_log import AuditEntry
from service.store.identity import (
    DEFAULT_PROJECT,
    Conflict,
    Identity,
    Project,
    Token,
    User,
)
from service.store.tables import NAME_MAX

router = APIRouter()

Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN)]
UserName = Annotated[str, Path(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN,
                               description="A user's name.")]
ProjectPath = Annotated[str, Path(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN,
                                  description="A project's name.")]
TokenId = Annotated[int, Path(ge=1, le=INT32_MAX, description="A token's id.")]
Quota = Annotated[float, Field(ge=0, le=1_000_000)] | None
Hours = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] | None
"""A budget's amount: hours of GPUs or CPUs, or money."""
MaxPriority = Annotated[int, Field(ge=-1000, le=1000)] | None
"""A project's priority cap, within the range of `JobSpec.priority`."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


async def _identity(request: Request) -> Identity:
    return identity_of(request)


IdentityDep = Annotated[Identity, Depends(_identity)]


def _not_found(exc: NotFound) -> HTTPException:
    return HTTPException(status_code=404, detail=str(exc))


def _invalid(*loc: str, msg: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[
        {"loc": list(loc), "msg": msg, "type": "value_error"}])


def _conflict(exc: Conflict) -> HTTPException:
    return HTTPException(status_code=409, detail=str(exc))


# --- who am I -------------------------------------------------------------------------------

@router.get("/whoami", response_model=WhoAmI, tags=["identity"],
            dependencies=[Depends(require("self"))])
async def whoami(who: Who) -> dict[str, object]:
    """The caller: user, role, projects (the default first) and the token used; the projects
    are those the token check read (`Principal.projects`), not read again."""
    return {"user": who.name, "role": who.role, "projects": list(who.projects),
            "token": {"id": who.token_id, "name": who.token_name}}


# --- users ----------------------------------------------------------------------------------

class UserIn(_Body):
    name: Name
    """Letters, digits, '.', '_', '-'; at most 64."""
    role: Literal["admin", "member", "viewer"] = "member"
    """admin: everything; member: submits, reads all, cancels its own; viewer: reads."""
    projects: Annotated[list[Name], Field(max_length=64)] = Field(default_factory=list)
    """Projects it belongs to; the first is its default. None given: the `default` project
    (made on the first start), so that a new member can submit."""


_USERS = [Depends(require("users:manage"))]


@router.post("/users", status_code=201, tags=["identity"], dependencies=_USERS,
             responses={409: {"description": "The name is taken"}})
def add_user(body: UserIn, identity: IdentityDep) -> User:
    """Create a user (it gets tokens with `POST /tokens` and `user`)."""
    projects = body.projects
    if not projects and any(p.name == DEFAULT_PROJECT for p in identity.list_projects()):
        projects = [DEFAULT_PROJECT]
    try:
        return identity.create_user(name=body.name, role=body.role, projects=projects)
    except Conflict as exc:
        raise _conflict(exc) from None
    except NotFound as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "projects"], "msg": str(exc), "type": "value_error"}]) from None


@router.get("/users", response_model=UserList, tags=["identity"], dependencies=_USERS)
def list_users(identity: IdentityDep) -> dict[str, list[User]]:
    return {"items": identity.list_users()}


@router.post("/users/{name}/disable", tags=["identity"], dependencies=_USERS,
             responses={409: {"description": "The last active admin"}})
def disable_user(name: UserName, identity: IdentityDep) -> User:
    """Disable a user: their tokens are refused from the next request on. The last active
    admin stays (409): someone must be able to manage users."""
    try:
        user = identity.get_user(name=name)
        admins = [u for u in identity.list_users() if u.role == "admin" and not u.disabled]
        if user.role == "admin" and not user.disabled and len(admins) == 1:
            raise HTTPException(status_code=409, detail=f"{name} is the last active admin;"
                                " make another admin first")
        return identity.set_disabled(name=name)
    except NotFound as exc:
        raise _not_found(exc) from None


# --- tokens ---------------------------------------------------------------------------------

class TokenIn(_Body):
    name: Name
    """What the token is for (e.g. `laptop`, `ci`)."""
    expires_in_days: Annotated[float, Field(gt=0, le=3650)] | None = None
    """Days until it expires; none: it lasts until revoked."""
    user: Name | None = None
    """Whose token (admins only; default: the caller's)."""


_TOKENS = [Depends(require("tokens:manage"))]


@router.post("/tokens", status_code=201, tags=["identity"], dependencies=_TOKENS)
def create_token(body: TokenIn, who: Who, identity: IdentityDep) -> NewToken:
    """A new API token, for the caller (or, for an admin, any user)."""
    user = body.user or who.name
    check_owner(who, "tokens:manage", user)
    expires = timedelta(days=body.expires_in_days) if body.expires_in_days else None
    try:
        secret, info = identity.create_token(user=user, name=body.name, expires_in=expires)
    except NotFound as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "user"], "msg": str(exc), "type": "value_error"}]) from None
    return NewToken(token=secret, info=info)


@router.get("/tokens", response_model=TokenList, tags=["identity"], dependencies=_TOKENS)
def list_tokens(who: Who, identity: IdentityDep,
                user: Annotated[str | None, Query(
                    min_length=1, max_length=NAME_MAX,
                    description="Only this user's tokens (others than yourself: admins only)."
                    )] = None) -> dict[str, list[Token]]:
    """Tokens (never their secrets): by default an admin's list has everyone's, others
    their own."""
    if user is not None:
        check_owner(who, "tokens:manage", user)
    elif who.role != "admin":
        user = who.name
    return {"items": identity.list_tokens(user=user)}


@router.delete("/tokens/{token_id}", tags=["identity"], dependencies=_TOKENS)
def revoke_token(token_id: TokenId, who: Who, identity: IdentityDep) -> Token:
    """Revoke a token: the next request with it is a 401."""
    try:
        token = identity.get_token(token_id=token_id)
        check_owner(who, "tokens:manage", token.user)
        return identity.revoke_token(token_id=token_id)
    except NotFound as exc:
        raise _not_found(exc) from None


# --- projects -------------------------------------------------------------------------------

class ProjectIn(_Body):
    name: Name
    gpus: Quota = None
    """GPUs its running jobs may hold together (none: no limit)."""
    cpus: Quota = None
    """CPUs its running CPU-only jobs may hold together (none: no limit)."""
    max_priority: MaxPriority = None
    """The highest `priority` its members may give a job (none: no cap)."""
    members: Annotated[list[Name], Field(max_length=1000)] = Field(default_factory=list)
    """Users to add to it."""


class QuotaIn(_Body):
    gpus: Quota = None
    """GPUs its running jobs may hold together (none: no limit)."""
    cpus: Quota = None
    """CPUs its running CPU-only jobs may hold together (none: no limit)."""
    max_priority: MaxPriority = None
    """The highest `priority` its members may give a job; a submission above it is a 403
    (none: no cap; admins are not capped)."""


class BudgetIn(_Body):
    gpu_hours: Hours = None
    """GPU-hours its jobs may spend from `since` (none: no such budget)."""
    cpu_hours: Hours = None
    """CPU-hours its ranks without a GPU may spend from `since` (none: no such budget)."""
    cost: Hours = None
    """Money its jobs may spend from `since`, at the server's prices (`TRIDENT_PRICES`; a
    server without prices refuses it)."""
    since: Annotated[datetime | None, Field(strict=False)] = None
    """Since when it is counted (default: now; not in the future; UTC when it names no
    zone)."""
    stop_running: bool = False
    """Cancel the project's running jobs once a budget is spent (default: they finish; only
    new jobs are refused)."""


class MemberIn(_Body):
    user: Name


_MANAGE = [Depends(require("projects:manage"))]


@router.post("/projects", status_code=201, tags=["identity"], dependencies=_MANAGE,
             responses={409: {"description": "The name is taken"}})
def add_project(body: ProjectIn, identity: IdentityDep) -> Project:
    try:
        project = identity.create_project(name=body.name, gpu_quota=body.gpus,
                                          cpu_quota=body.cpus, max_priority=body.max_priority)
        for user in body.members:
            project = identity.add_member(project=body.name, user=user)
    except Conflict as exc:
        raise _conflict(exc) from None
    except NotFound as exc:
        raise HTTPException(status_code=422, detail=[
            {"loc": ["body", "members"], "msg": str(exc), "type": "value_error"}]) from None
    return project


@router.get("/projects", response_model=ProjectList, tags=["identity"],
            dependencies=[Depends(require("projects:read"))])
def list_projects(identity: IdentityDep) -> dict[str, list[Project]]:
    return {"items": identity.list_projects()}


@router.put("/projects/{name}/quota", tags=["identity"], dependencies=_MANAGE)
def set_quota(name: ProjectPath, body: QuotaIn, identity: IdentityDep) -> Project:
    """Set (or, with none, lift) a project's quota and priority cap: the body is the whole
    of them, a field left out is lifted. The scheduler applies the quota from its next pass
    on; the cap applies to submissions from now on (jobs queued before keep theirs)."""
    try:
        return identity.set_quota(name=name, gpu_quota=body.gpus, cpu_quota=body.cpus,
                                  max_priority=body.max_priority)
    except NotFound as exc:
        raise _not_found(exc) from None


@router.put("/projects/{name}/budget", tags=["identity"], dependencies=_MANAGE)
def set_budget(name: ProjectPath, body: BudgetIn, request: Request,
               identity: IdentityDep) -> Project:
    """Set a project's budget: GPU-hours, CPU-hours and money (any of them), counted from
    `since` (default: now); its 80 % warning is given again. The controller warns its jobs at
    80 % of a budget; at 100 % its new jobs are refused (422), and with `stop_running` its
    running jobs are cancelled. DELETE removes it."""
    if body.gpu_hours is None and body.cpu_hours is None and body.cost is None:
        raise _invalid("body", "gpu_hours", msg="give gpu_hours, cpu_hours or cost (DELETE"
                       " /api/v1/projects/{name}/budget removes a budget)")
    if body.cost is not None and not request.app.state.settings.prices:
        raise _invalid("body", "cost", msg="this server sets no prices (TRIDENT_PRICES): a"
                       " budget in money would never be spent; give gpu_hours or cpu_hours")
    since = body.since
    if since is not None:
        since = since if since.tzinfo is not None else since.replace(tzinfo=UTC)
        if since.year < 2000 or since > datetime.now(UTC) + timedelta(minutes=1):
            raise _invalid("body", "since", msg=f"{since.isoformat()} is not between 2000"
                           " and now")
    try:
        return identity.set_budget(name=name, gpu_hours=body.gpu_hours,
                                   cpu_hours=body.cpu_hours, cost=body.cost, since=since,
                                   stop_running=body.stop_running)
    except NotFound as exc:
        raise _not_found(exc) from None


@router.delete("/projects/{name}/budget", tags=["identity"], dependencies=_MANAGE)
def remove_budget(name: ProjectPath, identity: IdentityDep) -> Project:
    """Remove a project's budget: its jobs are no longer counted, warned nor refused."""
    try:
        return identity.set_budget(name=name)
    except NotFound as exc:
        raise _not_found(exc) from None


@router.post("/projects/{name}/members", tags=["identity"], dependencies=_MANAGE)
def add_member(name: ProjectPath, body: MemberIn, identity: IdentityDep) -> Project:
    try:
        return identity.add_member(project=name, user=body.user)
    except NotFound as exc:
        raise _not_found(exc) from None


# --- audit ----------------------------------------------------------------------------------

@router.get("/audit", response_model=AuditList, tags=["identity"],
            dependencies=[Depends(require("audit:read"))])
def audit(request: Request, identity: IdentityDep,
          actor: Annotated[str | None, Query(min_length=1, max_length=NAME_MAX,
                                             description="Only this user's requests.")] = None,
          after: Annotated[int, Query(ge=0, le=INT64_MAX,
                                      description="Only entries with an id above this.")] = 0,
          limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> dict[str, list[AuditEntry]]:
    """Every request that changed something (or tried to): who, when, from where, the rule
    of the route and the status it got; oldest first."""
    request.app.state.audit.flush()  # every request answered before this one is listed
    return {"items": identity.list_audit(actor=actor, after_id=after, limit=limit)}
