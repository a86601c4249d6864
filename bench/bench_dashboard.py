"""Server time of the dashboard with a large store (acceptance: under 200 ms each for the jobs
page with 10,000 jobs and a job page with 100,000 metric rows).

`python bench/bench_dashboard.py [--jobs 10000 --steps 100000 --repeat 15 --db-url URL]`:
fills a fresh database (SQLite in a scratch folder unless `--db-url`, e.g. the PostgreSQL
test server) with `--jobs` jobs in mixed states and one running job with `--steps` metric
rows, then requests each page and the JSON a page loads through the ASGI app in this process
(no network) and prints the median wall time and the slowest of `--repeat` requests, the
median process CPU time (the server's own work, less sensitive to other load on a shared
machine), and the median wall time's ratio to the 200 ms budget. The job page's charts are
its HTML plus `series` (at most 2,000 points a series) and `ranks`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sqlalchemy import insert

from api.app import create_app  # noqa: E402
from bench.auth import admin_headers  # noqa: E402
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.settings import Settings
from service.store import Store
from service.store.tables import JobRow, MetricRow, utcnow
from service.submission.intake import prepare

BUDGET_S = 0.2
SPEC = {"name": "bench", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 100000, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 2, "dp": 2, "zero": 1},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}


def fill(store: Store, jobs: int, steps: int) -> int:
    """`jobs` jobs (one running with `steps` rank-0 rows and 3 rows per other rank), bulk."""
    prepared = prepare(JobSpec.model_validate(SPEC))
    plan = prepared.plan.model_dump(mode="json")
    spec = prepared.spec.model_dump(mode="json")
    states = [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED]
    now = utcnow()
    rows = [{"name": f"bench-{i % 97}", "owner": f"user{i % 7}", "state": states[i % 4].value,
             "priority": i % 3, "spec": spec, "plan": plan, "world_size": prepared.world_size,
             "cpus": 0.5, "gpus": 0.0, "attempts": 0, "created_at": now - timedelta(seconds=i),
             "updated_at": now} for i in range(jobs - 1)]
    rows.append({**rows[0], "name": "bench-running", "state": JobState.RUNNING.value,
                 "created_at": now})
    with store.engine.begin() as c:
        for i in range(0, len(rows), 2000):
            c.execute(insert(JobRow), rows[i:i + 2000])
    job_id = store.list_jobs(states=[JobState.RUNNING], limit=1)[0][0].id
    # A few metrics for every listed page's jobs, so the list reads a step for each.
    listed = [j.id for j in store.list_jobs(limit=200)[0]]
    data = {"memory": {"process_peak_bytes": 3e8}, "timed": True,
            "comm": {"dp": {"all_reduce": {"time_s": 0.01, "bytes": 1e6, "calls": 2}},
                     "pp": {"send": {"time_s": 0.002, "bytes": 1e5, "calls": 4}}}}
    store.start_attempt(job_id=job_id)
    metric_rows = [{"job_id": job_id, "attempt": 1, "step": s, "rank": 0,
                    "loss": 10.0 / s, "step_time_s": 0.2 + (s % 13) / 100,
                    "tokens_per_s": 1000.0 + s % 17, "data": data, "time": now}
                   for s in range(1, steps + 1)]
    metric_rows += [{**metric_rows[-1 - k], "rank": r} for r in (1, 2, 3) for k in range(3)]
    metric_rows += [{**metric_rows[k], "job_id": j} for j in listed if j != job_id
                    for k in range(3)]
    with store.engine.begin() as c:
        for i in range(0, len(metric_rows), 5000):
            c.execute(insert(MetricRow), metric_rows[i:i + 5000])
    return job_id


def time_get(client: TestClient, url: str, repeat: int) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds of `repeat` requests (after one that warms up)."""
    wall, cpu = [], []
    for _ in range(repeat + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        r = client.get(url)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
    return wall[1:], cpu[1:]  # the first request warms caches and the template compiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--db-url", default="")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="trident-bench-dashboard-"))
    settings = Settings(data_dir=data, database_url=args.db_url)
    store = Store(settings.db_url)
    store.migrate()
    t0 = time.perf_counter()
    job_id = fill(store, args.jobs, args.steps)
    print(f"{store.engine.url.get_backend_name()}: {args.jobs} jobs, {args.steps} metric rows"
          f" for job {job_id} (filled in {time.perf_counter() - t0:.1f} s)")
    pages = [("jobs page (newest 50)", "/"),
             ("jobs page, last page", f"/?page={args.jobs // 50}"),
             ("jobs page, state+name filter, sorted", "/?state=QUEUED&name=bench-1&sort=name"),
             ("jobs rows fragment (polled)", "/ui/jobs/rows"),
             ("job page HTML", f"/jobs/{job_id}"),
             ("job series (charts)", f"/api/v1/jobs/{job_id}/series"),
             ("job ranks grid", f"/api/v1/jobs/{job_id}/ranks"),
             ("queue page", "/queue"),
             ("GET /metrics", "/metrics")]
    print(f"{'request':<40} {'median ms':>10} {'max ms':>8} {'cpu ms':>7} {'median/200ms':>13}")
    with TestClient(create_app(settings, store=store), headers=admin_headers(store)) as client:
        for label, url in pages:
            wall, cpu = time_get(client, url, args.repeat)
            med = statistics.median(wall)
            print(f"{label:<40} {med * 1000:10.1f} {max(wall) * 1000:8.1f}"
                  f" {statistics.median(cpu) * 1000:7.1f} {med / BUDGET_S:13.2f}")
    store.close()


if __name__ == "__main__":
    main()
