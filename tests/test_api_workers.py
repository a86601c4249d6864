"""Two API processes on one port and one database (`python -m api.serve --workers 2`, as
the compose stack and `trident up --api-workers 2` run them): a session, its CSRF token, an
Idempotency-Key and a log stream each work whichever process answers. Every request goes
on a connection of its own, and each check repeats until both processes (`X-Trident-Pid`)
have answered it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from api.auth import CSRF_HEADER, SESSION_COOKIE, csrf_token
from service.contract.states import JobState
from service.files.ranklogs import attempt_log_dir
from service.settings import Settings
from service.store import Store
from tests.conftest import tiny_spec
from tests.servers import admin_headers, api_processes
from tests.waiting import wait_for

PID = "x-trident-pid"


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    data = tmp_path_factory.mktemp("two-workers")
    with api_processes(data, workers=2) as url:
        yield url, data


def fresh(url: str) -> httpx.Client:
    """A client whose every request opens a connection of its own (either process may
    accept it)."""
    return httpx.Client(base_url=url, timeout=30,
                        limits=httpx.Limits(max_keepalive_connections=0))


def from_both(what: str, send: Callable[[], httpx.Response],
              ok: Callable[[httpx.Response], bool]) -> dict[str, httpx.Response]:
    """Send until two processes have answered; every answer must be `ok`."""
    seen: dict[str, httpx.Response] = {}

    def both() -> bool:
        r = send()
        assert ok(r), (what, r.headers.get(PID), r.status_code, r.text[:300])
        seen.setdefault(r.headers[PID], r)
        return len(seen) >= 2

    wait_for(f"{what} answered by both API processes", both)
    return seen


@pytest.mark.slow
def test_a_session_and_its_csrf_token_work_in_either_process(two: tuple[str, Path]) -> None:
    url, data = two
    token = admin_headers(data)["Authorization"].removeprefix("Bearer ")
    with fresh(url) as c:
        r = c.post("/login", data={"token": token}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/", r.text
        cookie = r.cookies[SESSION_COOKIE]
        jar = {"Cookie": f"{SESSION_COOKIE}={cookie}"}
        from_both("a session's whoami", lambda: c.get("/api/v1/whoami", headers=jar),
                  lambda r: r.status_code == 200 and r.json()["user"] == "admin")
        # A change by cookie: refused without the session's CSRF token, accepted with it.
        from_both("a cookie's POST without the CSRF token",
                  lambda: c.post("/api/v1/jobs", json=tiny_spec(), headers=jar),
                  lambda r: r.status_code == 403 and "csrf" in r.json()["detail"])
        with_csrf = {**jar, CSRF_HEADER: csrf_token(cookie)}
        from_both("a cookie's POST with the CSRF token",
                  lambda: c.post("/api/v1/jobs", json=tiny_spec(), headers=with_csrf),
                  lambda r: r.status_code == 201)
        # Logged out in one process: refused in both, at once.
        r = c.post("/logout", data={"csrf": csrf_token(cookie)}, headers=jar,
                   follow_redirects=False)
        assert r.status_code == 303, r.text
        from_both("a logged-out session", lambda: c.get("/api/v1/whoami", headers=jar),
                  lambda r: r.status_code == 401 and "revoked" in r.json()["detail"])


@pytest.mark.slow
def test_an_idempotency_key_is_one_job_across_processes(two: tuple[str, Path]) -> None:
    url, data = two
    auth = admin_headers(data)
    spec = tiny_spec()
    # Eight at once, on both processes: one creates the job, the others get it back.
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def submit() -> None:
        with fresh(url) as c:
            r = c.post("/api/v1/jobs", json=spec, headers={**auth, "Idempotency-Key": "k-8"})
        with lock:
            answers.append(r)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in answers) == [200] * 7 + [201], \
        [(r.status_code, r.text[:200]) for r in answers]
    job_id = answers[0].json()["id"]
    assert {r.json()["id"] for r in answers} == {job_id}
    with fresh(url) as c:
        from_both("a retried submission",
                  lambda: c.post("/api/v1/jobs", json=spec,
                                 headers={**auth, "Idempotency-Key": "k-8"}),
                  lambda r: r.status_code == 200 and r.json()["id"] == job_id)
        from_both("the key with another spec",
                  lambda: c.post("/api/v1/jobs", json={**spec, "name": "other"},
                                 headers={**auth, "Idempotency-Key": "k-8"}),
                  lambda r: r.status_code == 409)


@pytest.mark.slow
def test_a_log_stream_follows_a_rank_in_either_process(two: tuple[str, Path]) -> None:
    url, data = two
    auth = admin_headers(data)
    with fresh(url) as c:
        r = c.post("/api/v1/jobs", json=tiny_spec(), headers=auth)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    store = Store(Settings(data_dir=data).db_url)
    try:
        store.transition(job_id=job_id, to=JobState.PLACING, message="placing")
        store.start_attempt(job_id=job_id)
        store.transition(job_id=job_id, to=JobState.RUNNING, message="running", attempt=1)
    finally:
        store.close()
    d = attempt_log_dir(Settings(data_dir=data).log_root, job_id, 1)
    d.mkdir(parents=True)
    log = d / "rank-0.log"
    log.write_text("first line\n")
    followed: set[str] = set()

    def one_stream() -> bool:
        """A follow stream: the rank's output so far, then a line written while it is open."""
        n = len(followed)
        with fresh(url) as c, c.stream("GET", f"/api/v1/jobs/{job_id}/logs", headers=auth,
                                       params={"follow": True, "rank": 0}) as resp:
            assert resp.status_code == 200, resp.read()
            pid = resp.headers[PID]
            text, written = "", False
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    text += json.loads(line[6:])["text"]
                    if not written:  # the output so far came: now a line while it follows
                        assert text.startswith("first line\n"), text
                        with log.open("a") as f:
                            f.write(f"live {pid} {n}\n")
                        written = True
                    if f"live {pid} {n}\n" in text:
                        break
        followed.add(pid)
        return len(followed) >= 2

    wait_for("log streams followed in both API processes", one_stream)


def test_uvicorn_serves_the_api_with_httptools_on_uvloop() -> None:
    """`uvicorn[standard]` is installed, so every API process (`trident up`, `api.serve`, the
    compose stack) parses HTTP with httptools on uvloop, uvicorn's "auto" choices, rather than
    h11 on asyncio's own loop: about a quarter less CPU per request (docs/benchmarks.md)."""
    import asyncio

    import uvloop
    from uvicorn.loops.auto import auto_loop_factory
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert AutoHTTPProtocol is HttpToolsProtocol
    loop = auto_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop) and isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()
