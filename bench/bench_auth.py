"""Cost of identity on a submit: `POST /api/v1/jobs` p50 with authentication against without,
in one process, on one database (acceptance: within 2 ms).

`python bench/bench_auth.py [--n 200] [--pg | --db-url URL]` (default: a SQLite file in a
scratch folder; `--pg`: a scratch database on the local PostgreSQL, dropped after). Five
ways in, taken in turn request by request so that drift in the load of a shared machine falls
on all alike:

- `today`: the submit route as it was before identity: the spec in,
`service.submission.intake.submit`,
  the job out (the same body limit and JSON handling);
- `now`: `today` with what the submit route gained since apart from identity (the request
  timer of /metrics, the answer's queue position and reason): the baseline of identity's cost
  on the route as it is now;
- `no-token`: the app as it is, but the token check replaced by a fixed principal and the
  audit middleware left out: what the rest of identity (rule, project, confinement) costs;
- `no-audit`: the app as it is, token checked, without the audit middleware;
- `auth`: the app as it is: Bearer token checked (one indexed query), rule, project, spec
  confinement, and the audit entry queued for the audit writer thread (which competes with
  the submits for the database).

Prints the p50 and p90 of each; `auth - now` is what identity costs a submit (acceptance:
within 2 ms), `auth - today` the whole change since the route had no identity.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, text

from api.app import create_app
from api.audit import Audit
from api.auth import authenticate
from api.body_limit import MAX_BODY_BYTES, BodyLimit
from api.prometheus import RequestTimer, request_latency
from api.schemas import JobOut, job_out_of
from service.contract.spec import JobSpec
from service.settings import Settings
from service.store import Store
from service.store.dashboard import job_summary
from service.store.identity import Identity, Principal
from service.submission.intake import Submitter, submit

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
"""The local PostgreSQL server (its `test` database only to create and drop the scratch one)."""

SPEC = {"name": "bench", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}


def today_app(store: Store) -> FastAPI:
    """The submit route before identity."""
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)

    @app.post("/api/v1/jobs", status_code=201)
    def submit_route(spec: JobSpec) -> JobOut:
        return job_out_of(submit(store, spec))

    return app


def now_app(store: Store) -> FastAPI:
    """The submit route as it is now, without identity: `today`'s route with what came after
    it apart from identity (the request timer of /metrics, and the answer's line of the jobs
    list: queue position and reason)."""
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(RequestTimer, histogram=request_latency(CollectorRegistry()))

    @app.post("/api/v1/jobs", status_code=201)
    def submit_route(spec: JobSpec) -> JobOut:
        job = submit(store, spec, by=Submitter(owner="bencher", project="bench"))
        return job_out_of(job, summary=job_summary(store, job.id, new=True))

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="submits per way in")
    parser.add_argument("--db-url", default="", help="database (default: SQLite, scratch)")
    parser.add_argument("--pg", action="store_true",
                        help="a scratch database on the local PostgreSQL server")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="trident-bench-auth-"))
    scratch = f"trident_bench_auth_{uuid.uuid4().hex[:10]}" if args.pg else ""
    if scratch:
        with create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT").connect() as c:
            c.execute(text(f'CREATE DATABASE "{scratch}"'))
        args.db_url = PG_ADMIN.rsplit("/", 1)[0] + f"/{scratch}"
    try:
        run(args.n, Store(args.db_url or f"sqlite:///{data / 'bench.db'}"), data)
    finally:
        if scratch:
            with create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT").connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)'))
        shutil.rmtree(data, ignore_errors=True)


def run(n: int, store: Store, data: Path) -> None:
    """Time `n` submits per way in on `store`."""
    store.migrate()
    identity = Identity(store)
    identity.create_project(name="bench")
    identity.create_user(name="bencher", role="member", projects=["bench"])
    secret, token = identity.create_token(user="bencher", name="bench")
    settings = Settings(data_dir=data)

    full = create_app(settings, store=store)
    bare = create_app(settings, store=store)
    bare.user_middleware = [m for m in bare.user_middleware if m.cls is not Audit]
    who = Principal(user_id=1, name="bencher", role="member", token_id=token.id,
                    token_name="bench")
    bare.dependency_overrides[authenticate] = lambda: who
    unaudited = create_app(settings, store=store)
    unaudited.user_middleware = [m for m in unaudited.user_middleware if m.cls is not Audit]
    bearer = {"Authorization": f"Bearer {secret}"}
    clients = {"today": TestClient(today_app(store)),
               "now": TestClient(now_app(store)),
               "no-token": TestClient(bare),
               "no-audit": TestClient(unaudited, headers=bearer),
               "auth": TestClient(full, headers=bearer)}
    times: dict[str, list[float]] = {k: [] for k in clients}
    with clients["no-token"], clients["no-audit"], clients["auth"]:
        for i in range(n + 10):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for name in order:
                t0 = time.perf_counter()
                r = clients[name].post("/api/v1/jobs", json=SPEC)
                dt = time.perf_counter() - t0
                assert r.status_code == 201, (name, r.status_code, r.text)
                if i >= 10:  # warm-up
                    times[name].append(dt)
    print(f"database: {store.url.split(':')[0]}; {n} submits per way in")
    p50 = {}
    for name, ts in times.items():
        p50[name] = statistics.median(ts) * 1e3
        p90 = statistics.quantiles(ts, n=10)[-1] * 1e3
        print(f"  {name:<9} p50 {p50[name]:7.2f} ms   p90 {p90:7.2f} ms")
    print(f"auth - today:    {p50['auth'] - p50['today']:+.2f} ms at p50"
          f" (ratio {p50['auth'] / p50['today']:.3f})")
    print(f"identity (auth - now):  {p50['auth'] - p50['now']:+.2f} ms at p50 (acceptance:"
          f" within 2 ms); now - today: {p50['now'] - p50['today']:+.2f} ms (the request timer"
          " and the answer's queue position, not identity)")
    print(f"token check alone (no-audit - no-token): "
          f"{p50['no-audit'] - p50['no-token']:+.2f} ms; audit (auth - no-audit):"
          f" {p50['auth'] - p50['no-audit']:+.2f} ms at p50")
    store.close()


if __name__ == "__main__":
    main()
