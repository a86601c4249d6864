"""Users, API tokens and projects: who is asking (the audit log of what they asked for is
`service.store.audit_log`'s).

A token is 32 random bytes (URL-safe text, prefixed `trd_`), shown once and stored only as its
SHA-256. Tokens are high-entropy, so a plain hash (no salt, no slow KDF) cannot be reversed
by guessing, and a token check is one query on a unique index (`Identity.authenticate`), which
keeps it off the request's critical path. Like `service.store.store`, every method is one
transaction and hands out immutable views, never ORM rows.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import bindparam, delete, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from client.payloads import Project, Token, User
from service.store.audit_log import AuditLog
from service.store.store import NotFound, Store
from service.store.tables import (
    MembershipRow,
    ProjectRow,
    TokenRow,
    UserRow,
    utcnow,
)
from service.store.trusted_tokens import TrustedTokens
from service.store.views import aware

ROLES = ("admin", "member", "viewer")
TOKEN_PREFIX = "trd_"
BOOTSTRAP_USER = "admin"
DEFAULT_PROJECT = "default"


class AuthError(Exception):
    """The request's credentials are missing, unknown, expired or revoked (a 401)."""


class Conflict(ValueError):
    """A name that is taken already (a 409)."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who a request is from: the user and the token it carried, and the user's projects
    when the token was checked (the default, the first it joined, first; a membership added
    since makes every process check its tokens again, `Identity.add_member`)."""

    user_id: int
    name: str
    role: str
    token_id: int
    token_name: str
    projects: tuple[str, ...] = ()


def _token(row: TokenRow, user: str) -> Token:
    return Token(id=row.id, user=user, name=row.name, created_at=aware(row.created_at)
                 or utcnow(), expires_at=aware(row.expires_at),
                 revoked_at=aware(row.revoked_at))


_AUTH = (select(TokenRow.id, TokenRow.name, TokenRow.revoked_at, TokenRow.expires_at,
                UserRow.id.label("user_id"), UserRow.name.label("user"), UserRow.role,
                UserRow.disabled, MembershipRow.project)
         .join(UserRow, TokenRow.user_id == UserRow.id)
         .outerjoin(MembershipRow, MembershipRow.user_id == UserRow.id)
         .order_by(MembershipRow.id))

_USER = (select(UserRow.id, UserRow.name, UserRow.role, UserRow.disabled, UserRow.created_at,
                MembershipRow.project)
         .outerjoin(MembershipRow, MembershipRow.user_id == UserRow.id)
         .where(UserRow.name == bindparam("name")).order_by(MembershipRow.id))


class Identity(AuditLog):
    """Users, tokens and projects on the store's database (its engine), and its audit log
    (`AuditLog`).

    `stamp`: a file that every process serving the same database on this host shares (the
    data directory's `STAMP_FILE`); a change to who may authenticate replaces it, and the
    other processes see that on their next request (one `stat`)."""

    def __init__(self, store: Store, stamp: Path | None = None) -> None:
        super().__init__(store)
        self._trusted: TrustedTokens[Principal] = TrustedTokens(stamp)

    # --- tokens -----------------------------------------------------------------------------

    def changed(self) -> None:
        """Who may authenticate, or what a principal carries, changed (a token revoked, a
        user disabled, a member added to a project): every process forgets the tokens it
        trusted (`TrustedTokens.changed`)."""
        self._trusted.changed()

    def trusted(self, token: str) -> Principal | None:
        """The principal of a token this process trusts now (`authenticate` without its
        read): no I/O but one `stat`, so an async caller may ask on its event loop and go to
        a thread for `authenticate` only when this is None."""
        return self._trusted.get(hash_token(token))

    def authenticate(self, token: str) -> Principal:
        """The principal of a token; AuthError saying what is wrong with it otherwise. Every
        request pays for it: one statement (`service.store.engine.reads`), or none when this
        process checked the same token less than `AUTH_CACHE_S` ago and nothing that
        decides it changed since (`changed`); an expiry is checked on every request."""
        key = hash_token(token)
        trusted = self._trusted.get(key)
        if trusted is not None:
            return trusted
        mark = self._trusted.mark()  # before the read: a change during it is not missed
        who, expires = self._check(key)
        self._trusted.put(key, who, expires, mark)
        return who

    def _check(self, key: str) -> tuple[Principal, datetime | None]:
        with self._reads.connect() as c:
            rows = c.execute(_AUTH.where(TokenRow.hash == key)).all()  # one per project
        if not rows:
            raise AuthError("unknown token: it was never issued by this server")
        found = rows[0]
        if found.revoked_at is not None:
            raise AuthError(f"token {found.name!r} of {found.user} was revoked at"
                            f" {aware(found.revoked_at):%Y-%m-%d %H:%M:%S} UTC")
        expires = aware(found.expires_at)
        if expires is not None and expires <= utcnow():
            raise AuthError(f"token {found.name!r} of {found.user} expired at"
                            f" {expires:%Y-%m-%d %H:%M:%S} UTC")
        if found.disabled:
            raise AuthError(f"user {found.user} is disabled")
        return Principal(user_id=found.user_id, name=found.user, role=found.role,
                         token_id=found.id, token_name=found.name,
                         projects=tuple(r.project for r in rows if r.project is not None)
                         ), expires

    def create_token(self, *, user: str, name: str,
                     expires_in: timedelta | None = None) -> tuple[str, Token]:
        """A new token for `user`: its secret (shown once) and how it is listed."""
        secret = new_token()
        with self._tx() as s:
            u = self._user_row(s, user)
            row = TokenRow(user_id=u.id, name=name, hash=hash_token(secret),
                           expires_at=utcnow() + expires_in if expires_in else None)
            s.add(row)
            s.flush()
            return secret, _token(row, u.name)

    def prune_tokens(self, *, user: str, name: str) -> int:
        """Delete `user`'s tokens called `name` that expired or were revoked (the dashboard's
        sessions, one per log-in, would pile up otherwise); how many went."""
        now = utcnow()
        with self._tx() as s:
            u = self._user_row(s, user)
            gone = s.execute(delete(TokenRow).where(
                TokenRow.user_id == u.id, TokenRow.name == name,
                or_(TokenRow.revoked_at.is_not(None), TokenRow.expires_at <= now)))
            return int(gone.rowcount or 0)  # type: ignore[attr-defined]

    def list_tokens(self, *, user: str | None = None) -> list[Token]:
        with self._tx() as s:
            q = select(TokenRow, UserRow.name).join(UserRow, TokenRow.user_id == UserRow.id)
            if user is not None:
                q = q.where(UserRow.name == user)
            return [_token(t, n) for t, n in s.execute(q.order_by(TokenRow.id)).all()]

    def get_token(self, *, token_id: int) -> Token:
        with self._tx() as s:
            found = s.execute(select(TokenRow, UserRow.name)
                              .join(UserRow, TokenRow.user_id == UserRow.id)
                              .where(TokenRow.id == token_id)).first()
            if found is None:
                raise NotFound(f"token {token_id} not found")
            return _token(*found)

    def revoke_token(self, *, token_id: int) -> Token:
        """Revoke a token (again: nothing changes); the next request with it is a 401."""
        with self._tx() as s:
            row = s.get(TokenRow, token_id)
            if row is None:
                raise NotFound(f"token {token_id} not found")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            user = s.get(UserRow, row.user_id)
            out = _token(row, user.name if user else "?")
        self.changed()
        return out

    # --- users ------------------------------------------------------------------------------

    def _user_row(self, s: Session, name: str) -> UserRow:
        row = s.execute(select(UserRow).where(UserRow.name == name)).scalar()
        if row is None:
            raise NotFound(f"user {name!r} not found")
        return row

    def _user(self, s: Session, row: UserRow) -> User:
        projects = s.execute(select(MembershipRow.project).where(MembershipRow.user_id == row.id)
                             .order_by(MembershipRow.id)).scalars()
        return User(id=row.id, name=row.name, role=row.role, disabled=row.disabled,
                    projects=list(projects), created_at=aware(row.created_at) or utcnow())

    def create_user(self, *, name: str, role: str, projects: list[str] | None = None) -> User:
        """A new user, member of `projects` (the first is its default); Conflict if the name
        is taken, NotFound if a project does not exist."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        try:
            with self._tx() as s:
                row = UserRow(name=name, role=role, disabled=False)
                s.add(row)
                s.flush()
                for p in projects or []:
                    if s.get(ProjectRow, p) is None:
                        raise NotFound(f"project {p!r} not found")
                    s.add(MembershipRow(user_id=row.id, project=p))
                s.flush()
                return self._user(s, row)
        except IntegrityError:
            raise Conflict(f"a user named {name!r} exists already") from None

    def get_user(self, *, name: str) -> User:
        """One user and its projects (every submission reads them): one statement, built
        once per process, outside a transaction (`service.store.engine.reads`)."""
        with self._reads.connect() as c:
            rows = c.execute(_USER, {"name": name}).all()
        if not rows:
            raise NotFound(f"user {name!r} not found")
        u = rows[0]
        return User(id=u.id, name=u.name, role=u.role, disabled=u.disabled,
                    projects=[r.project for r in rows if r.project is not None],
                    created_at=aware(u.created_at) or utcnow())

    def list_users(self) -> list[User]:
        with self._tx() as s:
            rows = s.execute(select(UserRow).order_by(UserRow.id)).scalars()
            return [self._user(s, r) for r in rows]

    def set_disabled(self, *, name: str, disabled: bool = True) -> User:
        """Disable a user: every token of theirs is refused from the next request on."""
        with self._tx() as s:
            row = self._user_row(s, name)
            row.disabled = disabled
            out = self._user(s, row)
        self.changed()
        return out

    def has_admin(self) -> bool:
        with self._tx() as s:
            return s.execute(select(UserRow.id).where(UserRow.role == "admin",
                                                      UserRow.disabled.is_(False))
                             .limit(1)).first() is not None

    # --- projects ---------------------------------------------------------------------------

    def _project(self, s: Session, row: ProjectRow) -> Project:
        members = s.execute(select(UserRow.name).join(MembershipRow,
                                                      MembershipRow.user_id == UserRow.id)
                            .where(MembershipRow.project == row.name)
                            .order_by(UserRow.name)).scalars()
        return Project(name=row.name, gpu_quota=row.gpu_quota, cpu_quota=row.cpu_quota,
                       members=list(members), max_priority=row.max_priority,
                       budget_gpu_hours=row.budget_gpu_hours,
                       budget_cpu_hours=row.budget_cpu_hours, budget_cost=row.budget_cost,
                       budget_since=aware(row.budget_since),
                       budget_stop_running=bool(row.budget_stop_running))

    def create_project(self, *, name: str, gpu_quota: float | None = None,
                       cpu_quota: float | None = None,
                       max_priority: int | None = None) -> Project:
        try:
            with self._tx() as s:
                row = ProjectRow(name=name, gpu_quota=gpu_quota, cpu_quota=cpu_quota,
                                 max_priority=max_priority)
                s.add(row)
                s.flush()
                return self._project(s, row)
        except IntegrityError:
            raise Conflict(f"a project named {name!r} exists already") from None

    def get_project(self, *, name: str) -> Project:
        with self._rx() as s:
            row = s.get(ProjectRow, name)
            if row is None:
                raise NotFound(f"project {name!r} not found")
            return self._project(s, row)

    def list_projects(self) -> list[Project]:
        with self._tx() as s:
            rows = s.execute(select(ProjectRow).order_by(ProjectRow.name)).scalars()
            return [self._project(s, r) for r in rows]

    def set_quota(self, *, name: str, gpu_quota: float | None,
                  cpu_quota: float | None, max_priority: int | None = None) -> Project:
        with self._tx() as s:
            row = s.get(ProjectRow, name)
            if row is None:
                raise NotFound(f"project {name!r} not found")
            row.gpu_quota, row.cpu_quota = gpu_quota, cpu_quota
            row.max_priority = max_priority
            return self._project(s, row)

    def set_budget(self, *, name: str, gpu_hours: float | None = None,
                   cpu_hours: float | None = None, cost: float | None = None,
                   since: datetime | None = None, stop_running: bool = False) -> Project:
        """Set a project's budget, counted from `since` (default: now), its 80 % warning not
        given yet; with no amount at all, remove it (`service.store.budgets` counts it)."""
        with self._tx() as s:
            row = s.get(ProjectRow, name)
            if row is None:
                raise NotFound(f"project {name!r} not found")
            kept = any(v is not None for v in (gpu_hours, cpu_hours, cost))
            row.budget_gpu_hours, row.budget_cpu_hours = gpu_hours, cpu_hours
            row.budget_cost = cost
            row.budget_since = (since or utcnow()) if kept else None
            row.budget_stop_running = stop_running if kept else None
            row.budget_warned_at = None
            return self._project(s, row)

    def add_member(self, *, project: str, user: str) -> Project:
        """Add `user` to `project` (already a member: nothing changes). The tokens every
        process trusts are checked again (`changed`): a principal carries its user's
        projects, which a submission reads."""
        added = False
        with self._tx() as s:
            row = s.get(ProjectRow, project)
            if row is None:
                raise NotFound(f"project {project!r} not found")
            u = self._user_row(s, user)
            if s.execute(select(MembershipRow.id).where(MembershipRow.user_id == u.id,
                                                        MembershipRow.project == project)
                         ).first() is None:
                s.add(MembershipRow(user_id=u.id, project=project))
                s.flush()
                added = True
            out = self._project(s, row)
        if added:
            self.changed()
        return out

    def quotas(self) -> dict[str, tuple[float | None, float | None]]:
        """(GPU quota, CPU quota) of every project that has one."""
        with self._tx() as s:
            rows = s.execute(select(ProjectRow.name, ProjectRow.gpu_quota, ProjectRow.cpu_quota)
                             .where((ProjectRow.gpu_quota.is_not(None))
                                    | (ProjectRow.cpu_quota.is_not(None)))).all()
            return {name: (gpus, cpus) for name, gpus, cpus in rows}
