"""The authorization matrix: every API route x every role x owner / not owner / other project,
on SQLite and PostgreSQL.

The routes come from the app itself (`api.auth.api_routes`), so a new route fails this test
until it declares a rule (`Depends(require(...))`) and has an example request here. What each
role may do is written out below, apart from `api.auth.RULES`, so that a rule loosened by
mistake fails too. The dashboard's pages, also read from the app, need a session or a token.
Every route that changes something refuses the session cookie from another site.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import CSRF_HEADER, SAFE_METHODS, SESSION_COOKIE, api_routes, csrf_token
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.files.profiles import ProfileFiles, profile_root
from service.settings import Settings
from service.store import Store
from service.store.exports import ExportRecords
from service.store.identity import Identity
from service.store.profile_requests import ProfileRequests
from service.store.stack_requests import StackRequests
from service.submission.intake import Submitter
from service.submission.intake import submit as submit_job
from tests.conftest import tiny_spec

ROLES = ("admin", "member", "viewer")
RELATIONS = ("own", "other", "other_project")
CALLER = {"admin": "admin", "member": "alice", "viewer": "victor"}
OTHER = {"own": None, "other": "bob", "other_project": "carol"}
"""Whose object a relation targets: the caller's own, another user's of the caller's project
(vision), or a user's of another project (speech)."""
PUBLIC = {("GET", "/api/v1/healthz")}
NOTHING_YET = {("POST", "/api/v1/jobs/{job_id}/exports"), ("POST", "/api/v1/calibrations")}
"""Routes whose allowed example answers 404: the example job has no checkpoint to export
(tests/test_hf_models.py exports one); the cluster has no probed profile to calibrate
(tests/test_calibration_ray.py calibrates one)."""

ANY, OWN, NONE = "any", "own", "none"
EXPECTED: dict[str, dict[str, str]] = {
    "jobs:read": {"admin": ANY, "member": ANY, "viewer": ANY},
    "jobs:submit": {"admin": ANY, "member": OWN, "viewer": NONE},
    "jobs:cancel": {"admin": ANY, "member": OWN, "viewer": NONE},
    "jobs:resubmit": {"admin": ANY, "member": OWN, "viewer": NONE},
    "jobs:stacks": {"admin": ANY, "member": OWN, "viewer": NONE},
    "jobs:profile": {"admin": ANY, "member": OWN, "viewer": NONE},
    "jobs:export": {"admin": ANY, "member": OWN, "viewer": NONE},
    "cluster:read": {"admin": ANY, "member": ANY, "viewer": ANY},
    "cluster:probe": {"admin": ANY, "member": ANY, "viewer": NONE},
    "nodes:cordon": {"admin": ANY, "member": NONE, "viewer": NONE},
    "nodes:drain": {"admin": ANY, "member": NONE, "viewer": NONE},
    "nodes:uncordon": {"admin": ANY, "member": NONE, "viewer": NONE},
    "plan": {"admin": ANY, "member": ANY, "viewer": ANY},
    "self": {"admin": ANY, "member": ANY, "viewer": ANY},
    "tokens:manage": {"admin": ANY, "member": OWN, "viewer": OWN},
    "users:manage": {"admin": ANY, "member": NONE, "viewer": NONE},
    "projects:read": {"admin": ANY, "member": ANY, "viewer": ANY},
    "projects:manage": {"admin": ANY, "member": NONE, "viewer": NONE},
    "audit:read": {"admin": ANY, "member": NONE, "viewer": NONE},
    "metrics:read": {"admin": ANY, "member": ANY, "viewer": ANY},
}
"""rule -> role -> ANY (allowed on everything), OWN (only on the caller's own), NONE (403)."""


@dataclass
class World:
    store: Store
    identity: Identity
    data_dir: Path
    tokens: dict[str, str] = field(default_factory=dict)
    counter: int = 0

    def owner(self, caller: str, relation: str) -> str:
        return OTHER[relation] or caller

    def project(self, caller: str, relation: str) -> str:
        """The caller's project, except for `other_project`."""
        if relation == "other_project":
            return "speech"
        return "default" if caller == "admin" else "vision"

    def job(self, owner: str) -> int:
        project = "speech" if owner == "carol" else "default" if owner == "admin" else "vision"
        spec = JobSpec.model_validate(tiny_spec())
        return submit_job(self.store, spec, by=Submitter(owner=owner, project=project)).id

    def running_job(self, owner: str) -> int:
        """A RUNNING job of `owner` (only those have ranks to ask for their stacks)."""
        job_id = self.job(owner)
        for to in (JobState.PLACING, JobState.RUNNING):
            self.store.transition(job_id=job_id, to=to, message="matrix")
        return job_id

    def stack_request(self, owner: str) -> str:
        """`/jobs/{id}/stacks/{request_id}` of a request for a job of `owner`."""
        job_id = self.running_job(owner)
        req = StackRequests(self.store).create(job_id=job_id, requested_by=owner)
        return f"/api/v1/jobs/{job_id}/stacks/{req.id}"

    def profile_request(self, owner: str, file: bool = False) -> str:
        """`/jobs/{id}/profile/{request_id}` of a done request for a job of `owner` (with
        `file`: the URL of its one trace file, stored)."""
        job_id = self.running_job(owner)
        requests = ProfileRequests(self.store)
        req = requests.create(job_id=job_id, requested_by=owner, steps=1, ranks=[0],
                              memory=False)
        name = "rank-0.pt.trace.json.gz"
        ProfileFiles(profile_root(self.data_dir)).write(job_id, req.id, name, b"trace")
        requests.finish(request_id=req.id, result={
            "files": [{"rank": 0, "name": name, "bytes": 5}]})
        return f"/api/v1/jobs/{job_id}/profile/{req.id}" + (f"/files/{name}" if file else "")

    def export(self, owner: str) -> str:
        """`/jobs/{id}/exports/{export_id}` of a done export of a job of `owner`, whose
        folder holds one file, `config.json`."""
        job_id = self.job(owner)
        folder = self.data_dir / "exports" / owner / f"job-{job_id}-step1"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        records = ExportRecords(self.store)
        rec = records.create(job_id=job_id, step=1, destination=str(folder),
                             checkpoint_dir=str(self.data_dir), max_shard_bytes=1 << 20,
                             requested_by=owner)
        records.finish(rec.id, files=["config.json"], size=2)
        return f"/api/v1/jobs/{job_id}/exports/{rec.id}"

    def node(self) -> str:
        """The hostname of the cluster's one (alive) node."""
        self.store.upsert_nodes(nodes=[{"node_id": "f" * 56, "hostname": "matrix-host"}])
        return "matrix-host"

    def token_id(self, user: str) -> int:
        return self.identity.create_token(user=user, name="t")[1].id

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"


Example = Callable[[World, str, str], tuple[str, Any]]
"""(world, caller, relation) -> (path with its parameters, JSON body or None)."""

EXAMPLES: dict[tuple[str, str], Example] = {
    ("POST", "/api/v1/jobs"): lambda w, c, r: (
        f"/api/v1/jobs?project={w.project(c, r)}", tiny_spec()),
    ("GET", "/api/v1/jobs"): lambda w, c, r: (f"/api/v1/jobs?owner={w.owner(c, r)}", None),
    ("GET", "/api/v1/jobs/{job_id}"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}", None),
    ("POST", "/api/v1/jobs/{job_id}/cancel"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/cancel", None),
    ("POST", "/api/v1/jobs/{job_id}/resubmit"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/resubmit", None),
    ("POST", "/api/v1/jobs/{job_id}/stacks"): lambda w, c, r: (
        f"/api/v1/jobs/{w.running_job(w.owner(c, r))}/stacks", None),
    ("GET", "/api/v1/jobs/{job_id}/stacks/{request_id}"): lambda w, c, r: (
        w.stack_request(w.owner(c, r)), None),
    ("POST", "/api/v1/jobs/{job_id}/profile"): lambda w, c, r: (
        f"/api/v1/jobs/{w.running_job(w.owner(c, r))}/profile", {"steps": 1}),
    ("GET", "/api/v1/jobs/{job_id}/profile"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/profile", None),
    ("GET", "/api/v1/jobs/{job_id}/profile/{request_id}"): lambda w, c, r: (
        w.profile_request(w.owner(c, r)), None),
    ("GET", "/api/v1/jobs/{job_id}/profile/{request_id}/files/{name}"): lambda w, c, r: (
        w.profile_request(w.owner(c, r), file=True), None),
    ("GET", "/api/v1/jobs/{job_id}/events"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/events", None),
    ("GET", "/api/v1/jobs/{job_id}/metrics"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/metrics", None),
    ("GET", "/api/v1/jobs/{job_id}/attempts"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/attempts", None),
    ("POST", "/api/v1/jobs/{job_id}/exports"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/exports", {}),
    ("GET", "/api/v1/jobs/{job_id}/exports"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/exports", None),
    ("GET", "/api/v1/jobs/{job_id}/exports/{export_id}"): lambda w, c, r: (
        w.export(w.owner(c, r)), None),
    ("GET", "/api/v1/jobs/{job_id}/exports/{export_id}/files"): lambda w, c, r: (
        w.export(w.owner(c, r)) + "/files", None),
    ("GET", "/api/v1/jobs/{job_id}/exports/{export_id}/files/{name}"): lambda w, c, r: (
        w.export(w.owner(c, r)) + "/files/config.json", None),
    ("GET", "/api/v1/jobs/{job_id}/checkpoints"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/checkpoints", None),
    ("GET", "/api/v1/jobs/{job_id}/comm"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/comm", None),
    ("GET", "/api/v1/jobs/{job_id}/tracking"): lambda w, c, r: (
        f"/api/v1/jobs/{w.job(w.owner(c, r))}/tracking", None),
    ("GET", "/api/v1/tracking"): lambda w, c, r: ("/api/v1/tracking", None),
    ("GET", "/api/v1/compare"): lambda w, c, r: (
        f"/api/v1/compare?jobs={w.job(w.owner(c, r))}&jobs={w.job(c)}", None),
    ("GET", "/api/v1/cluster"): lambda w, c, r: ("/api/v1/cluster", None),
    ("POST", "/api/v1/nodes/{host}/cordon"): lambda w, c, r: (
        f"/api/v1/nodes/{w.node()}/cordon", {"reason": "matrix"}),
    ("POST", "/api/v1/nodes/{host}/drain"): lambda w, c, r: (
        f"/api/v1/nodes/{w.node()}/drain", {"grace_s": 1}),
    ("POST", "/api/v1/nodes/{host}/uncordon"): lambda w, c, r: (
        f"/api/v1/nodes/{w.node()}/uncordon", None),
    ("POST", "/api/v1/probes"): lambda w, c, r: ("/api/v1/probes", {"ranks_per_node": 1}),
    ("POST", "/api/v1/calibrations"): lambda w, c, r: (
        "/api/v1/calibrations", {"profile": "cpu", "jobs": [1, 2, 3]}),
    ("GET", "/api/v1/probes"): lambda w, c, r: ("/api/v1/probes", None),
    ("GET", "/api/v1/probes/{probe_id}"): lambda w, c, r: (
        f"/api/v1/probes/{w.store.create_probe(scope='cluster', request={}).id}", None),
    ("POST", "/api/v1/plan"): lambda w, c, r: ("/api/v1/plan", tiny_spec()),
    ("GET", "/api/v1/whoami"): lambda w, c, r: ("/api/v1/whoami", None),
    ("POST", "/api/v1/users"): lambda w, c, r: (
        "/api/v1/users", {"name": w.fresh("u"), "role": "member", "projects": ["vision"]}),
    ("GET", "/api/v1/users"): lambda w, c, r: ("/api/v1/users", None),
    ("POST", "/api/v1/users/{name}/disable"): lambda w, c, r: (
        f"/api/v1/users/{w.identity.create_user(name=w.fresh('d'), role='member').name}"
        "/disable", None),
    ("POST", "/api/v1/tokens"): lambda w, c, r: (
        "/api/v1/tokens", {"name": "new", "user": w.owner(c, r)}),
    ("GET", "/api/v1/tokens"): lambda w, c, r: (f"/api/v1/tokens?user={w.owner(c, r)}", None),
    ("DELETE", "/api/v1/tokens/{token_id}"): lambda w, c, r: (
        f"/api/v1/tokens/{w.token_id(w.owner(c, r))}", None),
    ("POST", "/api/v1/projects"): lambda w, c, r: ("/api/v1/projects", {"name": w.fresh("p")}),
    ("GET", "/api/v1/projects"): lambda w, c, r: ("/api/v1/projects", None),
    ("PUT", "/api/v1/projects/{name}/quota"): lambda w, c, r: (
        f"/api/v1/projects/{w.project(c, r)}/quota", {"gpus": 8}),
    ("PUT", "/api/v1/projects/{name}/budget"): lambda w, c, r: (
        f"/api/v1/projects/{w.project(c, r)}/budget", {"gpu_hours": 8}),
    ("DELETE", "/api/v1/projects/{name}/budget"): lambda w, c, r: (
        f"/api/v1/projects/{w.project(c, r)}/budget", None),
    ("POST", "/api/v1/projects/{name}/members"): lambda w, c, r: (
        f"/api/v1/projects/{w.project(c, r)}/members", {"user": "bob"}),
    ("GET", "/api/v1/audit"): lambda w, c, r: ("/api/v1/audit", None),
    ("GET", "/metrics"): lambda w, c, r: ("/metrics", None),
    **{("GET", f"/api/v1/jobs/{{job_id}}/{view}"): (
        lambda w, c, r, view=view: (f"/api/v1/jobs/{w.job(w.owner(c, r))}/{view}", None))
       for view in ("logs", "series", "ranks", "comm/steps", "hangs", "goodput")},
    ("GET", "/api/v1/goodput"): lambda w, c, r: (f"/api/v1/goodput?owner={w.owner(c, r)}", None),
}
"""One example request per route. Where the relation matters it picks the object: the
caller's own job or token, another user's, or one of another project (submit: the caller's
project, or another one)."""


@pytest.fixture
def world(store: Store, tmp_path: Path) -> Iterator[tuple[TestClient, World]]:
    identity = Identity(store)
    for p in ("default", "vision", "speech"):
        identity.create_project(name=p)
    w = World(store, identity, tmp_path)
    for name, role, project in [("admin", "admin", "default"), ("alice", "member", "vision"),
                                ("bob", "member", "vision"), ("carol", "member", "speech"),
                                ("victor", "viewer", "vision")]:
        identity.create_user(name=name, role=role, projects=[project])
        w.tokens[name] = identity.create_token(user=name, name="matrix")[0]
    store.upsert_nodes(nodes=[{"node_id": "n0", "hostname": "h0", "accelerator": "cpu",
                               "resources": {"CPU": 64.0}}])
    with TestClient(create_app(Settings(data_dir=tmp_path), store=store)) as client:
        yield client, w


def test_every_route_has_a_rule_and_an_example(store: Store, tmp_path: Path) -> None:
    routes = list(api_routes(create_app(Settings(data_dir=tmp_path), store=store)))
    assert len(routes) > 20
    for method, path, rule in routes:
        if (method, path) in PUBLIC:
            assert rule is None
            continue
        assert rule is not None, f"{method} {path} declares no rule: add Depends(require(...))"
        assert rule.name in EXPECTED, f"{method} {path}: rule {rule.name} is not in EXPECTED"
        assert (method, path) in EXAMPLES, f"{method} {path}: add an example request here"


def test_authorization_matrix(world: tuple[TestClient, World]) -> None:
    client, w = world
    cells = 0
    for method, path, rule in api_routes(client.app):  # type: ignore[arg-type]
        if (method, path) in PUBLIC:
            assert client.request(method, path).status_code in (200, 503)
            continue
        assert rule is not None
        url, body = EXAMPLES[(method, path)](w, "admin", "own")
        r = client.request(method, url, json=body)
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        assert "missing token" in r.json()["detail"]
        for role in ROLES:
            caller = CALLER[role]
            for relation in RELATIONS:
                mode = EXPECTED[rule.name][role]
                allowed = mode == ANY or (mode == OWN and (
                    relation == "own" or (rule.name == "jobs:submit" and relation == "other")))
                url, body = EXAMPLES[(method, path)](w, caller, relation)
                r = client.request(method, url, json=body,
                                   headers={"Authorization": f"Bearer {w.tokens[caller]}"})
                where = f"{role} {relation}: {method} {url} -> {r.status_code} {r.text[:300]}"
                if allowed:
                    assert r.status_code < 400 or (method, path) in NOTHING_YET and \
                        r.status_code == 404, where
                else:
                    assert r.status_code == 403, where
                    assert r.json()["detail"].startswith(rule.name + ":"), where
                cells += 1
    assert cells == 3 * 3 * (len(EXAMPLES))


OTHER_SITES = [{"Origin": "http://evil.example"}, {"Origin": "null"},
               {"Origin": "http://testserver.evil.example"},
               {"Referer": "http://evil.example/jobs"}]
"""How a browser names a page of another site that sends a request (the test server is
`http://testserver`): its origin, an opaque origin (a sandboxed frame), a look-alike host, or
only a referrer."""


def test_every_changing_route_refuses_a_session_from_another_site(
        world: tuple[TestClient, World]) -> None:
    """Every API route that changes something, called with the dashboard's session cookie:
    from another site a 403 naming the rule even with the session's CSRF token; without the
    token a 403; from the dashboard's own pages with it, what the admin's Bearer token gets."""
    client, w = world
    r = client.post("/login", data={"token": w.tokens["admin"]}, follow_redirects=False)
    assert r.status_code == 303
    good = csrf_token(client.cookies[SESSION_COOKIE])
    changing = [(m, p) for m, p, _ in api_routes(client.app)  # type: ignore[arg-type]
                if m not in SAFE_METHODS]
    assert len(changing) >= 12, changing
    for method, path in changing:
        for site in OTHER_SITES:
            url, body = EXAMPLES[(method, path)](w, "admin", "own")
            r = client.request(method, url, json=body, headers={**site, CSRF_HEADER: good})
            where = f"{method} {url} {site} -> {r.status_code} {r.text[:300]}"
            assert r.status_code == 403, where
            assert r.json()["detail"].startswith("csrf:"), where
            assert "refused from another site" in r.json()["detail"], where
        for token in ({}, {CSRF_HEADER: "0" * 64}):
            url, body = EXAMPLES[(method, path)](w, "admin", "own")
            r = client.request(method, url, json=body,
                               headers={"Origin": "http://testserver", **token})
            where = f"{method} {url} {token} -> {r.status_code} {r.text[:300]}"
            assert r.status_code == 403, where
            assert "must carry the session's CSRF token" in r.json()["detail"], where
        url, body = EXAMPLES[(method, path)](w, "admin", "own")
        r = client.request(method, url, json=body, headers={
            "Origin": "http://testserver", "Referer": "http://testserver/", CSRF_HEADER: good})
        assert r.status_code < 400 or (method, path) in NOTHING_YET and r.status_code == 404, \
            f"{method} {url} -> {r.status_code} {r.text[:300]}"


SESSION_ROUTES = {"/login", "/logout"}
"""The dashboard's log-in and log-out (`tests.test_auth`): open to anyone, CSRF-checked."""
PAGES = {"/": "/", "/ui/jobs/rows": "/ui/jobs/rows", "/jobs/{job_id}": "/jobs/{job}",
         "/jobs/{job_id}/logs/rank-{rank}.log": "/jobs/{job}/logs/rank-0.log",
         "/plan": "/plan", "/cluster": "/cluster", "/queue": "/queue",
         "/compare": "/compare?jobs={job}&jobs={job}"}
"""One example URL per dashboard page (rule `pages:read`)."""


def test_every_dashboard_page_needs_a_session_or_a_token(
        world: tuple[TestClient, World]) -> None:
    """The dashboard's pages, from the app too: without credentials a redirect to the log-in
    form, with a bad token a 401, and open to every role."""
    client, w = world
    routes = client.app.routes  # type: ignore[attr-defined]
    pages = [(method, ctx.path) for ctx in iter_route_contexts(routes)
             if isinstance(ctx.original_route, APIRoute)
             and not ctx.original_route.include_in_schema and ctx.path not in SESSION_ROUTES
             for method in sorted(ctx.methods or ())]
    assert len(pages) >= len(PAGES)
    job = w.job("bob")
    for method, path in pages:
        assert path in PAGES, f"{method} {path}: add an example URL to PAGES"
        url = PAGES[path].format(job=job)
        r = client.request(method, url, follow_redirects=False)
        assert (r.status_code, r.headers.get("location")) == (303, "/login"), (url, r.text)
        r = client.request(method, url, headers={"Authorization": "Bearer trd_nope"})
        assert r.status_code == 401 and "unknown token" in r.json()["detail"], url
        for role in ROLES:
            r = client.request(method, url, follow_redirects=False,
                               headers={"Authorization": f"Bearer {w.tokens[CALLER[role]]}"})
            # The log of a job that never ran is a 404: found no log, not refused.
            assert r.status_code == (404 if path.endswith(".log") else 200), (role, url, r.text)
