"""The dashboard's session against other sites (`api.session`, `api.auth.check_csrf`): a request
authenticated by the session cookie that changes something needs the session's CSRF token and
is refused from another site even with it, on the API's routes, the pages and log-out; the
form field `csrf` is read where the README says it is (log-out, whose form sends it). Through
the real app, on SQLite and PostgreSQL. Every API route is swept in `tests.test_auth_matrix`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import CSRF_HEADER, SESSION_COOKIE, csrf_token
from api.session import PageUser
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec, user_token

HERE = {"Origin": "http://testserver"}
"""What a browser sends from the dashboard's own pages (the test server's origin)."""
EVIL = {"Origin": "http://evil.example"}
FROM_ANOTHER_SITE = ("csrf: a request authenticated by the session cookie is refused from"
                     " another site ('http://evil.example' is not this server)")


@pytest.fixture
def client(store: Store, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as c:
        yield c


def log_in(client: TestClient, store: Store) -> str:
    """Log alice in through the form: the session's CSRF token."""
    r = client.post("/login", data={"token": user_token(store, "alice", "member")},
                    follow_redirects=False)
    assert r.status_code == 303, r.text
    return csrf_token(client.cookies[SESSION_COOKIE])


def test_submit_and_cancel_from_another_site_are_refused_and_change_nothing(
        client: TestClient, store: Store) -> None:
    good = log_in(client, store)
    r = client.post("/api/v1/jobs", json=tiny_spec(), headers={**EVIL, CSRF_HEADER: good})
    assert r.status_code == 403 and r.json()["detail"] == FROM_ANOTHER_SITE
    assert store.list_jobs()[1] == 0
    r = client.post("/api/v1/jobs", json=tiny_spec(), headers={**HERE, CSRF_HEADER: good})
    assert r.status_code == 201 and r.json()["owner"] == "alice", r.text
    job_id = r.json()["id"]
    cancel = f"/api/v1/jobs/{job_id}/cancel"
    for headers in ({**EVIL, CSRF_HEADER: good},
                    {"Referer": "http://evil.example/page", CSRF_HEADER: good},  # no Origin
                    {**HERE, "Referer": "http://evil.example/"},  # Origin decides
                    HERE, {**HERE, CSRF_HEADER: csrf_token("another session")}):
        r = client.post(cancel, headers=headers)
        assert r.status_code == 403 and r.json()["detail"].startswith("csrf: "), (headers, r.text)
    job = store.get_job(job_id=job_id)
    assert job.state == JobState.QUEUED and not job.cancel_requested
    r = client.post(cancel, headers={**HERE, CSRF_HEADER: good})
    assert r.status_code == 202, r.text
    assert store.get_job(job_id=job_id).state == JobState.CANCELLED
    # Reading changes nothing: no check (and SameSite=Strict keeps a browser from sending the
    # cookie with other sites' requests in the first place).
    assert client.get("/api/v1/whoami", headers=EVIL).json()["user"] == "alice"


def test_a_bearer_token_needs_no_csrf_token_from_anywhere(client: TestClient,
                                                          store: Store) -> None:
    """A Bearer token is nothing a browser sends by itself: the rule is the cookie's only."""
    log_in(client, store)
    r = client.post("/api/v1/jobs", json=tiny_spec(), headers={
        **EVIL, "Authorization": f"Bearer {user_token(store, 'bob', 'member')}"})
    assert r.status_code == 201 and r.json()["owner"] == "bob", r.text


def test_log_out_takes_the_forms_field_and_refuses_another_site(client: TestClient,
                                                                store: Store) -> None:
    log_in(client, store)
    session = client.cookies[SESSION_COOKIE]
    # The token as the dashboard sends it: the hidden field of the log-out form on every page.
    [field] = re.findall(r'name="csrf" value="([0-9a-f]+)"', client.get("/").text)
    assert field == csrf_token(session)
    for data, headers in [({"csrf": field}, EVIL),
                          ({"csrf": field}, {"Referer": "http://evil.example/"}),
                          ({}, HERE), ({"csrf": "x"}, HERE), ({"csrf": "é"}, HERE)]:
        r = client.post("/logout", data=data, headers=headers, follow_redirects=False)
        assert r.status_code == 403, (data, headers, r.text)
        assert r.json()["detail"].startswith("csrf: "), (data, headers, r.text)
    r = client.post("/logout", data={"csrf": field}, headers=EVIL)
    assert r.json()["detail"] == FROM_ANOTHER_SITE
    assert client.get("/api/v1/whoami").json()["user"] == "alice"  # the session lives on
    r = client.post("/logout", data={"csrf": field},
                    headers={**HERE, "Referer": "http://testserver/jobs/1"},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    r = client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {session}"})
    assert r.status_code == 401 and "revoked" in r.json()["detail"]


def test_the_api_takes_the_token_from_its_header_only(client: TestClient,
                                                      store: Store) -> None:
    """As the README says: the form field is log-out's; the API's routes (JSON bodies, sent
    by the pages' scripts) read `X-CSRF-Token`."""
    good = log_in(client, store)
    job_id = client.post("/api/v1/jobs", json=tiny_spec(),
                         headers={**HERE, CSRF_HEADER: good}).json()["id"]
    r = client.post(f"/api/v1/jobs/{job_id}/cancel", data={"csrf": good}, headers=HERE)
    assert r.status_code == 403
    assert r.json()["detail"] == ("csrf: a request authenticated by the session cookie must"
                                  " carry the session's CSRF token (the X-CSRF-Token header)")
    assert not store.get_job(job_id=job_id).cancel_requested


def test_a_token_of_any_characters_is_a_403_not_a_500(client: TestClient,
                                                      store: Store) -> None:
    log_in(client, store)
    r = client.post("/api/v1/jobs", json=tiny_spec(),
                    headers=[("Origin", "http://testserver"), (CSRF_HEADER, "é".encode())])
    assert r.status_code == 403 and r.json()["detail"].startswith("csrf: "), r.text


def test_a_page_route_that_changes_something_is_held_to_the_same_rule(
        store: Store, tmp_path: Path) -> None:
    """The pages only read today; one that changes something, behind `page_principal` like
    every page, gets the same checks with the session cookie."""
    app = create_app(Settings(data_dir=tmp_path), store=store)

    def change(who: PageUser) -> dict[str, str]:
        return {"changed_by": who.name}

    app.add_api_route("/ui/change", change, methods=["POST"], include_in_schema=False)
    with TestClient(app) as client:
        good = log_in(client, store)
        r = client.post("/ui/change", headers={**EVIL, CSRF_HEADER: good})
        assert r.status_code == 403 and r.json()["detail"] == FROM_ANOTHER_SITE
        r = client.post("/ui/change", headers=HERE)
        assert r.status_code == 403 and r.json()["detail"].startswith("csrf: ")
        r = client.post("/ui/change", headers={**HERE, CSRF_HEADER: good})
        assert r.status_code == 200 and r.json() == {"changed_by": "alice"}
