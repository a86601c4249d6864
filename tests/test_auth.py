"""Tokens (life cycle, every kind of 401), owners and projects of jobs, the audit log, the
bootstrap admin, and the dashboard's session cookie; on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import unquote_plus

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from api.auth import SESSION_COOKIE, csrf_token
from service.settings import Settings
from service.store import Store
from service.store.bootstrap import bootstrap, prod_refusal, token_file
from service.store.identity import Identity, hash_token
from service.store.tables import TokenRow, utcnow
from tests.conftest import tiny_spec, user_token


@pytest.fixture
def client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_token_lifecycle_create_use_revoke_expire(client: TestClient, store: Store) -> None:
    admin = user_token(store)
    r = client.post("/api/v1/tokens", json={"name": "laptop"}, headers=bearer(admin))
    assert r.status_code == 201, r.text
    secret, info = r.json()["token"], r.json()["info"]
    assert secret.startswith("trd_") and len(secret) >= 4 + 43  # 32 random bytes
    assert info["name"] == "laptop" and info["user"] == "admin" and info["revoked_at"] is None
    # Stored only as its hash: the secret is nowhere in the database.
    with store.engine.connect() as c:
        hashes = [row.hash for row in c.execute(TokenRow.__table__.select())]
    assert hash_token(secret) in hashes and secret not in hashes
    listed = client.get("/api/v1/tokens", headers=bearer(secret)).json()["items"]
    assert "token" not in listed[0] and {t["name"] for t in listed} == {"test", "laptop"}
    assert client.get("/api/v1/whoami", headers=bearer(secret)).json()["token"]["name"] == \
        "laptop"
    # Revoked: the very next request is a 401 that says so.
    assert client.delete(f"/api/v1/tokens/{info['id']}", headers=bearer(admin)).status_code == 200
    r = client.get("/api/v1/jobs", headers=bearer(secret))
    assert r.status_code == 401 and "token 'laptop' of admin was revoked" in r.json()["detail"]
    assert r.headers["WWW-Authenticate"] == "Bearer"
    # Expiry: a token whose time has passed is refused, naming when it expired.
    r = client.post("/api/v1/tokens", json={"name": "short", "expires_in_days": 1},
                    headers=bearer(admin))
    short, short_id = r.json()["token"], r.json()["info"]["id"]
    assert client.get("/api/v1/jobs", headers=bearer(short)).status_code == 200
    with store.engine.begin() as c:
        c.execute(update(TokenRow).where(TokenRow.id == short_id)
                  .values(expires_at=utcnow() - timedelta(seconds=1)))
    # Written behind the API's back: a process trusts a token it checked for AUTH_CACHE_S
    # unless told (`Identity.changed`, which the API's own revocations call).
    client.app.state.identity.changed()  # type: ignore[attr-defined]
    r = client.get("/api/v1/jobs", headers=bearer(short))
    assert r.status_code == 401 and "token 'short' of admin expired at" in r.json()["detail"]


@pytest.mark.parametrize(("headers", "message"), [
    ({}, "missing token"),
    ({"Authorization": "Basic YWRtaW46eA=="}, "malformed Authorization header"),
    ({"Authorization": "Bearer"}, "malformed Authorization header"),
    ({"Authorization": "Bearer trd_not-a-token"}, "unknown token"),
    ({"Authorization": "Bearer " + "x" * 5000}, "unknown token"),
])
def test_every_bad_credential_is_a_401_that_says_which(client: TestClient,
                                                       headers: dict[str, str],
                                                       message: str) -> None:
    for method, path in [("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs/1/cancel"),
                         ("GET", "/api/v1/audit")]:
        r = client.request(method, path, headers=headers)
        assert r.status_code == 401, r.text
        assert message in r.json()["detail"]
    assert client.get("/api/v1/healthz", headers=headers).status_code in (200, 503)


def test_disabled_user_is_refused(client: TestClient, store: Store) -> None:
    admin, alice = user_token(store), user_token(store, "alice", "member")
    assert client.get("/api/v1/jobs", headers=bearer(alice)).status_code == 200
    r = client.post("/api/v1/users/alice/disable", headers=bearer(admin))
    assert r.status_code == 200 and r.json()["disabled"] is True
    r = client.get("/api/v1/jobs", headers=bearer(alice))
    assert r.status_code == 401 and r.json()["detail"] == "user alice is disabled"


def test_jobs_record_owner_and_project_and_listing_filters(client: TestClient,
                                                           store: Store) -> None:
    admin = user_token(store)
    client.post("/api/v1/projects", json={"name": "vision", "gpus": 24}, headers=bearer(admin))
    r = client.post("/api/v1/users", json={"name": "alice", "projects": ["vision", "default"]},
                    headers=bearer(admin))
    assert r.status_code == 201 and r.json()["role"] == "member"
    alice = client.post("/api/v1/tokens", json={"name": "a", "user": "alice"},
                        headers=bearer(admin)).json()["token"]
    mine = client.post("/api/v1/jobs", json=tiny_spec(), headers=bearer(alice)).json()
    assert (mine["owner"], mine["project"]) == ("alice", "vision")  # the first project
    other = client.post("/api/v1/jobs?project=default", json=tiny_spec(),
                        headers=bearer(alice)).json()
    assert other["project"] == "default"
    theirs = client.post("/api/v1/jobs", json=tiny_spec(), headers=bearer(admin)).json()
    assert (theirs["owner"], theirs["project"]) == ("admin", "default")
    listed = client.get("/api/v1/jobs?owner=alice", headers=bearer(alice)).json()
    assert listed["total"] == 2 and {j["owner"] for j in listed["items"]} == {"alice"}
    listed = client.get("/api/v1/jobs?project=vision", headers=bearer(alice)).json()
    assert [j["id"] for j in listed["items"]] == [mine["id"]]
    r = client.post("/api/v1/jobs?project=nope", json=tiny_spec(), headers=bearer(alice))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "project"]
    # A member cancels only their own job; the refusal names the rule and the owner.
    r = client.post(f"/api/v1/jobs/{theirs['id']}/cancel", headers=bearer(alice))
    assert r.status_code == 403
    assert r.json()["detail"].startswith("jobs:cancel: admins cancel any job, members only"
                                         " their own (you are alice, member); this belongs"
                                         " to admin")
    assert client.post(f"/api/v1/jobs/{mine['id']}/cancel",
                       headers=bearer(alice)).status_code == 202


def test_every_mutating_request_is_audited(client: TestClient, store: Store) -> None:
    admin, viewer = user_token(store), user_token(store, "vic", "viewer")
    job = client.post("/api/v1/jobs", json=tiny_spec(), headers=bearer(admin)).json()
    client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=bearer(viewer))  # refused
    client.post("/api/v1/jobs", json=tiny_spec())  # no token
    zed = client.post("/api/v1/users", json={"name": "zed"}, headers=bearer(admin)).json()
    assert (zed["role"], zed["projects"]) == ("member", ["default"])  # the default project
    client.get("/api/v1/jobs", headers=bearer(admin))  # reads are not audited
    r = client.get("/api/v1/audit", headers=bearer(admin))
    got = [(e["actor"], e["method"], e["path"], e["action"], e["status"])
           for e in r.json()["items"]]
    assert got == [("admin", "POST", "/api/v1/jobs", "jobs:submit", 201),
                   ("vic", "POST", f"/api/v1/jobs/{job['id']}/cancel", "jobs:cancel", 403),
                   (None, "POST", "/api/v1/jobs", None, 401),
                   ("admin", "POST", "/api/v1/users", "users:manage", 201)]
    assert all(e["client"] == "testclient" and e["time"] for e in r.json()["items"])
    assert client.get("/api/v1/audit?actor=vic",
                      headers=bearer(admin)).json()["items"][0]["status"] == 403
    assert client.get("/api/v1/audit", headers=bearer(viewer)).status_code == 403
    # Token, user and project changes, a resubmission and a dashboard log-in are recorded too.
    made = client.post("/api/v1/tokens", json={"name": "ci", "user": "zed"},
                       headers=bearer(admin)).json()["info"]
    client.delete(f"/api/v1/tokens/{made['id']}", headers=bearer(admin))
    client.post("/api/v1/users/zed/disable", headers=bearer(admin))
    client.put("/api/v1/projects/default/quota", json={"gpus": 8}, headers=bearer(admin))
    client.post(f"/api/v1/jobs/{job['id']}/resubmit", headers=bearer(admin))
    client.post("/login", data={"token": viewer}, follow_redirects=False)
    items = client.get("/api/v1/audit", headers=bearer(admin)).json()["items"]
    got = [(e["actor"], e["method"], e["path"], e["action"], e["status"]) for e in items[4:]]
    assert got == [("admin", "POST", "/api/v1/tokens", "tokens:manage", 201),
                   ("admin", "DELETE", f"/api/v1/tokens/{made['id']}", "tokens:manage", 200),
                   ("admin", "POST", "/api/v1/users/zed/disable", "users:manage", 200),
                   ("admin", "PUT", "/api/v1/projects/default/quota", "projects:manage", 200),
                   ("admin", "POST", f"/api/v1/jobs/{job['id']}/resubmit", "jobs:resubmit",
                    201),
                   ("vic", "POST", "/login", None, 303)]


def test_first_start_creates_the_admin_and_an_owner_only_token_file(tmp_path: Path,
                                                                   db_url: str) -> None:
    data = tmp_path / "data"
    with TestClient(create_app(Settings(data_dir=data, database_url=db_url))) as c:
        path = token_file(data)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        me = c.get("/api/v1/whoami", headers=bearer(token)).json()
        assert me["user"] == "admin" and me["role"] == "admin" and me["projects"] == ["default"]
    # A second start keeps the admin and its file.
    with TestClient(create_app(Settings(data_dir=data, database_url=db_url))) as c:
        assert token_file(data).read_text().strip() == token
        assert c.get("/api/v1/whoami", headers=bearer(token)).status_code == 200


def test_prod_refuses_without_admin_or_with_a_readable_token_file(store: Store,
                                                                  tmp_path: Path) -> None:
    identity = Identity(store)
    assert "no admin user exists" in (prod_refusal(identity, tmp_path) or "")
    path = bootstrap(identity, tmp_path)
    assert path is not None and prod_refusal(identity, tmp_path) is None
    os.chmod(path, 0o644)
    assert "is readable by others" in (prod_refusal(identity, tmp_path) or "")
    assert bootstrap(identity, tmp_path) is None  # users exist: nothing is written again


def test_dashboard_login_sets_a_strict_httponly_session_with_csrf(client: TestClient,
                                                                  store: Store) -> None:
    token = user_token(store, "alice", "member")
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert "API token" in client.get("/login").text
    r = client.post("/login", data={"token": "trd_wrong"}, follow_redirects=False)
    assert r.status_code == 303 and "log-in refused" in unquote_plus(r.headers["location"])
    # A log-in form posted from another site is refused.
    r = client.post("/login", data={"token": token}, headers={"Origin": "https://evil.example"},
                    follow_redirects=False)
    assert r.status_code == 403
    r = client.post("/login", data={"token": token}, follow_redirects=False)
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=") and "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    session = client.cookies[SESSION_COOKIE]
    assert session != token  # a session token of its own, revoked at log-out
    assert "alice" in client.get("/").text
    assert client.get("/api/v1/whoami").json()["user"] == "alice"
    # A state-changing request with the cookie needs the session's CSRF token.
    r = client.post("/api/v1/jobs", json=tiny_spec())
    assert r.status_code == 403 and r.json()["detail"].startswith("csrf:")
    r = client.post("/api/v1/jobs", json=tiny_spec(), headers={"X-CSRF-Token": "0" * 64})
    assert r.status_code == 403
    r = client.post("/api/v1/jobs", json=tiny_spec(),
                    headers={"X-CSRF-Token": csrf_token(session)})
    assert r.status_code == 201 and r.json()["owner"] == "alice"
    assert client.post("/logout", data={"csrf": "x"}).status_code == 403
    r = client.post("/logout", data={"csrf": csrf_token(session)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    r = client.get("/api/v1/whoami", headers=bearer(session))
    assert r.status_code == 401 and "revoked" in r.json()["detail"]



def test_ended_dashboard_sessions_are_deleted_at_the_next_log_in(client: TestClient,
                                                                store: Store) -> None:
    token = user_token(store, "alice", "member")
    identity = Identity(store)
    kept = identity.create_token(user="alice", name="laptop", expires_in=timedelta(seconds=1))
    sessions = []
    for _ in range(3):
        r = client.post("/login", data={"token": token}, follow_redirects=False)
        assert r.status_code == 303
        sessions.append(client.cookies[SESSION_COOKIE])
        client.post("/logout", data={"csrf": csrf_token(sessions[-1])})
    live = client.post("/login", data={"token": token}, follow_redirects=False)
    assert live.status_code == 303
    # One more log-in from elsewhere: the live session stays, the three ended ones went.
    client.cookies.clear()
    assert client.post("/login", data={"token": token}, follow_redirects=False).status_code \
        == 303
    names = [t.name for t in identity.list_tokens(user="alice")]
    assert names.count("dashboard session") == 2
    assert "laptop" in names and kept[1].id in [t.id for t in identity.list_tokens()]
    for secret in sessions:
        r = client.get("/api/v1/whoami", headers=bearer(secret))
        assert r.status_code == 401

def test_a_prod_server_does_not_start_without_an_admin(store: Store, tmp_path: Path) -> None:
    prod = Settings.model_construct(**{**Settings(data_dir=tmp_path).model_dump(),
                                       "env": "prod"})
    with (pytest.raises(RuntimeError, match="refusing to start in prod: no admin user exists"),
          TestClient(create_app(prod, store=store))):
        pass
    assert not token_file(tmp_path).exists()  # nothing is created by itself in prod
    bootstrap(Identity(store), tmp_path)
    with TestClient(create_app(prod, store=store)) as c:
        assert c.get("/api/v1/whoami", headers=bearer(token_file(tmp_path).read_text().strip())
                     ).json()["user"] == "admin"
    os.chmod(token_file(tmp_path), 0o644)  # world-readable: refused too
    with (pytest.raises(RuntimeError, match="refusing to start in prod: the bootstrap token"
                        r" file .* is readable by others \(mode -rw-r--r--\): chmod 600 it"),
          TestClient(create_app(prod, store=store))):
        pass


def test_resubmit_copies_the_spec_for_its_owner_and_the_last_admin_stays(
        client: TestClient, store: Store) -> None:
    admin, alice = user_token(store), user_token(store, "alice", "member")
    bob = user_token(store, "bob", "member")
    spec = tiny_spec(name="again", env={"NCCL_DEBUG": "INFO"})
    first = client.post("/api/v1/jobs", json=spec, headers=bearer(alice)).json()
    r = client.post(f"/api/v1/jobs/{first['id']}/resubmit", headers=bearer(alice))
    assert r.status_code == 201, r.text
    again = r.json()
    assert again["id"] != first["id"] and again["spec"] == first["spec"]
    assert (again["owner"], again["project"], again["state"]) == ("alice", "default", "QUEUED")
    r = client.post(f"/api/v1/jobs/{first['id']}/resubmit", headers=bearer(bob))
    assert r.status_code == 403 and r.json()["detail"].startswith("jobs:resubmit:")
    assert client.post(f"/api/v1/jobs/{first['id']}/resubmit",
                       headers=bearer(admin)).json()["owner"] == "admin"
    r = client.post("/api/v1/users/admin/disable", headers=bearer(admin))
    assert r.status_code == 409 and "last active admin" in r.json()["detail"]


def test_a_token_trusted_by_one_process_is_dropped_when_another_revokes_it(
        sqlite_store: Store, tmp_path: Path) -> None:
    """Each API process keeps the tokens it checked for a few seconds; a revocation or a
    disabled user in one process replaces the data dir's stamp file, and the others ask the
    database again on their next request."""
    from service.store.identity import AuthError
    from service.store.trusted_tokens import STAMP_FILE

    secret = user_token(sqlite_store, name="ann", role="member")
    one = Identity(sqlite_store, stamp=tmp_path / STAMP_FILE)
    two = Identity(sqlite_store, stamp=tmp_path / STAMP_FILE)
    who = two.authenticate(secret)
    assert two.authenticate(secret) == who  # trusted: no query (asserted below by a revoke)
    one.revoke_token(token_id=who.token_id)
    with pytest.raises(AuthError, match="revoked"):
        two.authenticate(secret)
    other = user_token(sqlite_store, name="bob", role="member")
    assert two.authenticate(other).name == "bob"
    one.set_disabled(name="bob")
    with pytest.raises(AuthError, match="disabled"):
        two.authenticate(other)


def test_a_principal_carries_its_projects_and_a_new_membership_reaches_every_process(
        sqlite_store: Store, tmp_path: Path) -> None:
    """A submission reads the member's projects from the principal its token check made (no
    read of its own); a membership added in one process replaces the stamp file, so another
    process that trusted the token reads the user's projects again on its next request, and
    the member may submit under the new project at once."""
    from service.store.trusted_tokens import STAMP_FILE

    secret = user_token(sqlite_store, name="ann", role="member", projects=("default",))
    one = Identity(sqlite_store, stamp=tmp_path / STAMP_FILE)
    two = Identity(sqlite_store, stamp=tmp_path / STAMP_FILE)
    one.create_project(name="vision")
    assert two.authenticate(secret).projects == ("default",)
    one.add_member(project="vision", user="ann")
    assert two.trusted(secret) is None  # the change reached the other process
    assert two.authenticate(secret).projects == ("default", "vision")  # the default first
    one.add_member(project="vision", user="ann")  # a member already: nothing changes
    assert two.trusted(secret) is not None
    assert one.authenticate(user_token(sqlite_store, name="root")).projects == ("default",)
    assert one.authenticate(user_token(sqlite_store, name="loner", role="admin",
                                       projects=())).projects == ()


def test_the_audit_writer_gathers_a_burst_into_one_transaction_and_flushes_at_once(
        store: Store) -> None:
    """Entries that come within `linger_s` of the first wait for it and are written together
    (one commit, one take of SQLite's write lock, for a burst of requests); `flush` writes
    what is queued without waiting for the linger; `close` writes the rest."""
    import time

    from api.audit import AuditWriter

    class Counting(Identity):
        def __init__(self, store: Store) -> None:
            super().__init__(store)
            self.batches: list[int] = []

        def record_many(self, entries: list[dict]) -> None:
            self.batches.append(len(entries))
            super().record_many(entries)

    def entry(i: int) -> dict:
        return {"time": utcnow(), "actor": "admin", "client": "c", "method": "POST",
                "path": f"/p/{i}", "action": "x", "status": 201}

    ident = Counting(store)
    writer = AuditWriter(ident, linger_s=60.0)  # far longer than anything below takes
    try:
        for i in range(20):
            writer.put(entry(i))
        time.sleep(0.2)
        assert ident.batches == []  # lingering: the burst is not written entry by entry
        t0 = time.monotonic()
        writer.flush()  # lists every request answered before it, without the linger
        assert ident.batches == [20] and time.monotonic() - t0 < 30
        writer.put(entry(20))
        time.sleep(0.2)
        assert ident.batches == [20]
    finally:
        writer.close()  # writes what lingers
    assert ident.batches == [20, 1]
    assert [e.path for e in ident.list_audit(limit=100)] == [f"/p/{i}" for i in range(21)]
