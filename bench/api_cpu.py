"""Server CPU per request of the common routes against issue 25's budgets (`api_cpu`).

`/healthz`, whoami, a job's detail, a jobs page (50), its events, its chart series, a
submission and `/metrics`, each on Trident's real server (`bench.control_plane.trident_server`:
uvicorn in a process of its own, one API process) over SQLite and PostgreSQL: the server
process's CPU time (user + system) over n requests after a warm-up, so that other work on a
shared machine counts only through caches, with the load average beside each figure.
`bench/profile_api.py` shows where a route's time goes.
"""

from __future__ import annotations

import os
from typing import Any

from bench.control_plane import TINY, TOKENS, URLS, cpu_per_request, trident_server
from bench.harness import Section, fmt_s

BUDGETS_S = {"healthz": 0.3e-3, "job detail": 1e-3, "job list": 3e-3,
             "submit sqlite": 3e-3, "submit postgres": 4e-3}
"""Server CPU per request (issue 25): `/healthz`, an authenticated job detail, a jobs list
page (50 jobs), a submission on SQLite and on PostgreSQL."""


def _metrics(api: str, job_id: int, steps: int, world: int = 8) -> None:
    """`steps` steps of `world` ranks of job `job_id`, written as the controller writes them
    (`MetricsIngest.record`), straight into the server's database."""
    import random

    from bench.scale import _reports
    from service.contract.reports import StepReport
    from service.store import Store
    from service.store.metrics import MetricsIngest

    store = Store(URLS[api])
    try:
        ing = MetricsIngest(store)
        rng = random.Random(0)
        for step in range(1, steps + 1):
            rows = [StepReport.model_validate(x).row() for x in _reports(world, step, rng)]
            ing.record(job_id=job_id, attempt=1, world_size=world, rows=rows)
    finally:
        store.close()


def budgets(sec: Section, quick: bool, dbs: tuple[str, ...] = ("sqlite", "postgres")) -> None:
    """Server CPU per request of the common routes, one client, one API process: the
    process's CPU time (user + system, `psutil`) over n requests after a warm-up, so that
    other work on a shared machine counts only through caches, and the load average with
    each figure."""
    n = 100 if quick else 400
    fig: dict[str, Any] = {}
    for db in dbs:
        with trident_server(db) as api:
            per = _per_route(api, n)
        fig[db] = {k: {"cpu_s": v, "load_avg": la} for k, (v, la) in per.items()}
        for name, (v, la) in per.items():
            budget = BUDGETS_S.get(f"{name} {db}" if name == "submit" else name)
            sec.row(f"{db}: {name}", fmt_s(v), f"server CPU per request over {n}, load"
                    f" average {la:.1f} on {os.cpu_count()} cores" + (
                        f"; budget {fmt_s(budget)}" if budget else ""))
            if budget is not None:
                sec.goal(f"{db}: {name} CPU per request (s)", v, f"<= {budget:g}",
                         v <= budget)
    sec.figures.update(fig)


def _per_route(api: str, n: int) -> dict[str, tuple[float, float]]:
    """(server CPU seconds per request, load average meanwhile) of each common route."""
    import httpx

    c = httpx.Client(base_url=api, timeout=30, headers=TOKENS[api])
    load0 = os.getloadavg()[0]
    submit_s = cpu_per_request(api, lambda: _created(c.post("/api/v1/jobs", json=TINY)), n)
    per = {"submit": (submit_s, (load0 + os.getloadavg()[0]) / 2)}
    job_id = c.get("/api/v1/jobs", params={"limit": 1}).json()["items"][0]["id"]
    _metrics(api, job_id, 200)
    routes = {
        "healthz": lambda: c.get("/api/v1/healthz"),
        "whoami": lambda: c.get("/api/v1/whoami"),
        "job detail": lambda: c.get(f"/api/v1/jobs/{job_id}"),
        "job list": lambda: c.get("/api/v1/jobs", params={"limit": 50}),
        "job events": lambda: c.get(f"/api/v1/jobs/{job_id}/events"),
        "metrics series": lambda: c.get(f"/api/v1/jobs/{job_id}/series"),
        "/metrics": lambda: c.get("/metrics"),
    }
    for name, call in routes.items():
        l0 = os.getloadavg()[0]
        per[name] = (cpu_per_request(api, call, n), (l0 + os.getloadavg()[0]) / 2)
    c.close()
    return per


def _created(r: Any) -> None:
    assert r.status_code == 201, r.text[:300]
