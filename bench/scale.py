"""Scale of the store and the controller, on SQLite and PostgreSQL, with synthetic data.

For each database: 100,000 jobs (the newest 1,000 queued and 200 running) and 10 million
per-rank metric rows (1,000 jobs x 1,250 steps x 8 ranks), loaded in bulk (PostgreSQL:
INSERT ... SELECT over generate_series; SQLite: executemany); then, through the real FastAPI
app in process (routing, validation and JSON included):

- list latency: the first page, the queued jobs, a deep page; detail latency: a job with
  metrics (its plan compared with its newest steps); a job page's metrics query;
- the controller's pass with 1,000 queued and 200 running jobs (fake launcher: the groups
  answer "running" with no reports; the cluster is full, so nothing is admitted);
- ingest of a simulated 4,096-rank job reporting a step every second, in a process of its
  own (as the controller is), validated as the controller validates them, for `ingest_s`
  seconds in real time while list and detail are measured; then as fast as it goes (the
  limit).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.harness import Section, dist, fmt_dist, fmt_s, timed

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
LIST_GOAL_S = 0.050
PASS_GOAL_S = 0.100


@dataclass
class Size:
    jobs: int
    metric_jobs: int
    steps: int
    ranks: int
    queued: int
    running: int
    reps: int
    ingest_s: int
    world: int = 4096

    @property
    def metric_rows(self) -> int:
        return self.metric_jobs * self.steps * self.ranks


FULL = Size(jobs=100_000, metric_jobs=1000, steps=1250, ranks=8, queued=1000, running=200,
            reps=200, ingest_s=60)
QUICK = Size(jobs=2000, metric_jobs=10, steps=100, ranks=8, queued=100, running=20, reps=20,
             ingest_s=3, world=512)


def _spec_plan() -> tuple[dict[str, Any], dict[str, Any]]:
    from service.contract.spec import JobSpec
    from service.submission.intake import prepare

    spec = JobSpec.model_validate({
        "name": "synthetic", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 1250, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}})
    prepared = prepare(spec)
    return prepared.spec.model_dump(mode="json"), prepared.plan.to_json()


def load(url: str, size: Size) -> dict[str, float]:
    """Bulk-load the synthetic jobs, attempts and metrics; seconds per table."""
    import json

    spec, plan = _spec_plan()
    n, q, r = size.jobs, size.queued, size.running
    done_to = n - q - r  # ids 1..done_to succeeded, then running, then queued (newest)
    engine = create_engine(url)
    took: dict[str, float] = {}
    t0 = time.perf_counter()
    if url.startswith("postgresql"):
        with engine.begin() as c:
            c.execute(text(
                "INSERT INTO jobs (name, owner, state, priority, spec, plan, world_size, cpus,"
                " gpus, cancel_requested, attempts, created_at, updated_at)"
                " SELECT 'job-' || g, 'local', CASE WHEN g <= :d THEN 'SUCCEEDED'"
                " WHEN g <= :d + :r THEN 'RUNNING' ELSE 'QUEUED' END, 0, CAST(:spec AS json),"
                " CAST(:plan AS json), 2, 1, 0, false, CASE WHEN g <= :d + :r THEN 1 ELSE 0 END,"
                " now(), now() FROM generate_series(1, :n) g"),
                {"d": done_to, "r": r, "n": n, "spec": json.dumps(spec), "plan": json.dumps(plan)})
            c.execute(text(
                "INSERT INTO attempts (job_id, number, status, placement, started_at)"
                " SELECT g, 1, CASE WHEN g <= :d THEN 'succeeded' ELSE 'running' END,"
                " CAST('{}' AS json), now() FROM generate_series(1, :d + :r) g"),
                {"d": done_to, "r": r})
        took["jobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with engine.begin() as c:
            c.execute(text(
                "INSERT INTO metrics (job_id, attempt, step, rank, loss, step_time_s,"
                " tokens_per_s, data, time) SELECT j, 1, s, k, 2.0 + 1.0 / s, 0.5, 512.0,"
                " CAST('{\"memory\": {\"params_bytes\": 1000}}' AS json), now()"
                " FROM generate_series(1, :j) j, generate_series(1, :s) s,"
                " generate_series(0, :k - 1) k"),
                {"j": size.metric_jobs, "s": size.steps, "k": size.ranks})
            c.execute(text("ANALYZE"))
    else:
        raw = engine.raw_connection()
        try:
            cur = raw.cursor()
            cur.execute("BEGIN")
            sj, sp = json.dumps(spec), json.dumps(plan)
            now = "2026-01-01 00:00:00.000000"
            cur.executemany(
                "INSERT INTO jobs (name, owner, state, priority, spec, plan, world_size, cpus,"
                " gpus, cancel_requested, attempts, created_at, updated_at) VALUES"
                " (?, 'local', ?, 0, ?, ?, 2, 1, 0, 0, ?, ?, ?)",
                ((f"job-{g}", "SUCCEEDED" if g <= done_to else "RUNNING" if g <= done_to + r
                  else "QUEUED", sj, sp, 1 if g <= done_to + r else 0, now, now)
                 for g in range(1, n + 1)))
            cur.executemany(
                "INSERT INTO attempts (job_id, number, status, placement, started_at)"
                " VALUES (?, 1, ?, '{}', ?)",
                ((g, "succeeded" if g <= done_to else "running", now)
                 for g in range(1, done_to + r + 1)))
            cur.execute("COMMIT")
            took["jobs_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            cur.execute("BEGIN")
            data = '{"memory": {"params_bytes": 1000}}'
            cur.executemany(
                "INSERT INTO metrics (job_id, attempt, step, rank, loss, step_time_s,"
                " tokens_per_s, data, time) VALUES (?, 1, ?, ?, ?, 0.5, 512.0, ?, ?)",
                ((j, s, k, 2.0 + 1.0 / s, data, now) for j in range(1, size.metric_jobs + 1)
                 for s in range(1, size.steps + 1) for k in range(size.ranks)))
            cur.execute("COMMIT")
            cur.execute("ANALYZE")
        finally:
            raw.close()
    took["metrics_s"] = time.perf_counter() - t0
    engine.dispose()
    return took


class _Group:
    def poll(self, timeout_s: float) -> Any:
        from service.cluster.data_plane import PollResult
        return PollResult(state="running")

    def cancel(self) -> None: ...
    def shutdown(self, grace_s: float) -> None: ...
    def stacks(self, timeout_s: float) -> dict[int, str]:
        return {}

    def acknowledge(self, acks: dict[int, int]) -> None: ...


class FullClusterLauncher:
    """Every running job's group answers "running"; the cluster is full (nothing admitted)."""

    def total_capacity(self) -> list[Any]:
        from service.cluster.data_plane import NodeCapacity
        return [NodeCapacity("n0", 1e6, 0)]

    def free_capacity(self) -> list[Any]:
        from service.cluster.data_plane import NodeCapacity
        return [NodeCapacity("n0", 0, 0)]

    def inventory(self) -> list[dict[str, Any]]:
        return [{"node_id": "n0", "hostname": "bench", "accelerator": "cpu"}]

    def cordon(self, node_ids: frozenset[str]) -> None: ...

    def attach(self, **kw: Any) -> _Group:
        return _Group()

    def sweep(self, keep: set[tuple[int, int]]) -> list[str]:
        return []

    def start(self, **kw: Any) -> _Group:
        raise AssertionError("a full cluster admits nothing")

    def start_cluster_probe(self, **kw: Any) -> _Group:
        raise AssertionError("no probe in the bench")


def controller_pass(store: Any, size: Size, reps: int) -> dict[str, Any]:
    from service.control.controller import Controller

    c = Controller(store, FullClusterLauncher(), checkpoint_root=Path(tempfile.mkdtemp()))
    first = timed(c.step, 1)[0]  # re-attaches the running jobs
    assert len(c.running) == size.running, f"{len(c.running)} groups re-attached"
    passes = timed(c.step, reps)
    return {"first_pass_s": first, "pass": dist(passes), "running": len(c.running)}


def _reports(world: int, step: int, rng: random.Random) -> list[dict[str, Any]]:
    """A step's reports from `world` ranks as they cross Ray (`StepReport.model_dump()`)."""
    out = []
    for r in range(world):
        t = 1.0 + rng.random() * 0.02 + (0.5 if r == 1234 % world else 0.0)
        out.append({"kind": "step", "rank": r, "step": step, "loss": 2.0, "step_time_s": t,
                    "tokens_per_s": 1e6 / t,
                    "memory": {"params_bytes": 10**9, "grads_bytes": 10**9,
                               "optimizer_bytes": 4 * 10**9, "process_peak_bytes": 3 * 10**10,
                               "process_peak_source": "cuda_max_allocated"},
                    "tp_rank": r % 8, "pp_rank": 0, "dp_rank": r // 8, "attempt": 1,
                    "comm": {"dp": {"all_reduce": {"time_s": 0.05, "bytes": 1e9, "calls": 4}},
                             "tp": {"all_reduce": {"time_s": 0.02, "bytes": 1e8, "calls": 96}}},
                    "timed": True})
    return out


def _ingest_proc(url: str, job_id: int, world: int, seconds: int, q: Any) -> None:
    from service.contract.reports import StepReport
    from service.store import Store
    from service.store.metrics import MetricsIngest

    store = Store(url)
    ing = MetricsIngest(store)
    rng = random.Random(0)

    def one(step: int) -> tuple[float, float]:
        raw = _reports(world, step, rng)
        t0 = time.perf_counter()
        rows = [StepReport.model_validate(x).row() for x in raw]  # the controller's _record
        t1 = time.perf_counter()
        ing.record(job_id=job_id, attempt=1, world_size=world, rows=rows)
        return t1 - t0, time.perf_counter() - t1

    validate, write, late = [], [], 0
    start = time.monotonic()
    for step in range(1, seconds + 1):  # in real time: a step a second
        v, w = one(step)
        validate.append(v)
        write.append(w)
        wait = start + step - time.monotonic()
        late += wait < 0
        if wait > 0:
            time.sleep(wait)
    t0 = time.perf_counter()
    flat = [sum(one(seconds + 1 + i)) for i in range(3)]  # as fast as it goes
    flat_s = (time.perf_counter() - t0) / 3
    steps = ing.list_steps(job_id=job_id, attempt=1)
    q.put({"validate": validate, "write": write, "late_steps": late, "flat_step_s": flat_s,
           "flat_split": flat, "stored_steps": len(steps),
           "complete": sum(s.complete for s in steps),
           "per_rank_rows_per_step": len(store.list_metrics(job_id=job_id, rank=None,
                                                            attempt=1, limit=10**6)) / max(
                                                                1, len(steps))})
    store.close()


def run_backend(kind: str, size: Size, sec: Section) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from bench.auth import admin_headers
    from service.control.heap import freeze_startup_objects
    from service.settings import Settings
    from service.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="trident-bench-"))
    name = f"trident_bench_{uuid.uuid4().hex[:8]}"
    admin = None
    if kind == "postgres":
        admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    else:
        url = f"sqlite:///{tmp / 'bench.db'}"
    store = Store(url)
    try:
        store.migrate()
        took = load(url, size)
        fig: dict[str, Any] = {"load": took, "jobs": size.jobs, "metric_rows": size.metric_rows}
        app = create_app(Settings(data_dir=tmp), store=store)
        with TestClient(app, headers=admin_headers(store)) as client:
            # As the server and the controller do after start-up (service.control.heap): without
            # it, full collections over this process's heap (the loader's too) stalled
            # requests and passes by 100-570 ms, which showed as the p99s.
            freeze_startup_objects()

            def get(path: str) -> Any:
                r = client.get(path)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
                return r

            deep = size.jobs // 2
            job = size.metric_jobs // 2
            queries = {"list_first_page": "/api/v1/jobs?limit=50",
                       "list_queued": "/api/v1/jobs?state=QUEUED&limit=50",
                       f"list_offset_{deep}": f"/api/v1/jobs?limit=50&offset={deep}",
                       "detail_job_with_metrics": f"/api/v1/jobs/{job}",
                       "detail_random_job": None,
                       "job_page_metrics": f"/api/v1/jobs/{job}/metrics?limit=10000"}
            rng = random.Random(1)
            lat: dict[str, Any] = {}
            for label, path in queries.items():
                if path is None:
                    xs = timed(lambda: get(f"/api/v1/jobs/{rng.randint(1, size.jobs)}"),
                               size.reps)
                else:
                    get(path)
                    xs = timed(lambda p=path: get(p), size.reps)  # type: ignore[misc]
                lat[label] = dist(xs)
            fig["latency"] = lat
            fig["controller"] = controller_pass(store, size, max(5, size.reps // 4))
            # A 4,096-rank job reporting every second, in a process of its own, while list
            # and detail are measured here.
            from service.contract.spec import JobSpec
            from service.planner import StoredPlan

            spec, plan = _spec_plan()
            big = store.create_job(name="big", spec=JobSpec.model_validate(spec),
                                   plan=StoredPlan.from_json(plan), world_size=size.world,
                                   cpus=1, gpus=0).id
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_ingest_proc, args=(url, big, size.world, size.ingest_s, q))
            p.start()
            during: dict[str, list[float]] = {"list": [], "detail": []}
            while p.is_alive() and q.empty():
                during["list"] += timed(lambda: get("/api/v1/jobs?limit=50"), 1)
                during["detail"] += timed(lambda: get(f"/api/v1/jobs/{big}"), 1)
                time.sleep(0.02)
            ingest = q.get(timeout=600)
            p.join(60)
            fig["ingest"] = {
                "world": size.world, "seconds": size.ingest_s,
                "validate": dist(ingest["validate"]), "write": dist(ingest["write"]),
                "late_steps": ingest["late_steps"], "stored_steps": ingest["stored_steps"],
                "complete_steps": ingest["complete"],
                "per_rank_rows_per_step": ingest["per_rank_rows_per_step"],
                "flat_out_step_s": ingest["flat_step_s"],
                "limit_ranks_at_1_step_per_s": size.world / ingest["flat_step_s"],
                "list_during": dist(during["list"]), "detail_during": dist(during["detail"])}
        sec.figures[kind] = fig
        _rows_and_goals(kind, fig, sec)
    finally:
        gc.unfreeze()  # the next backend's load is collected as usual
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if admin is not None:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


def _rows_and_goals(kind: str, fig: dict[str, Any], sec: Section) -> None:
    lat = fig["latency"]
    sec.row(f"{kind}: bulk load", f"{fig['jobs']:,} jobs in {fmt_s(fig['load']['jobs_s'])}",
            f"{fig['metric_rows']:,} metric rows in {fmt_s(fig['load']['metrics_s'])}")
    for label, d in lat.items():
        sec.row(f"{kind}: {label}", f"p99 {fmt_s(d['p99'])}", fmt_dist(d))
        sec.goal(f"{kind} {label} p99 (s)", d["p99"], "< 0.05", d["p99"] < LIST_GOAL_S)
    c = fig["controller"]
    sec.row(f"{kind}: controller pass", f"median {fmt_s(c['pass']['median'])}",
            f"{fmt_dist(c['pass'])}; first pass (re-attach {c['running']}) "
            f"{fmt_s(c['first_pass_s'])}")
    sec.goal(f"{kind} controller pass median (s)", c["pass"]["median"], "< 0.1",
             c["pass"]["median"] < PASS_GOAL_S)
    i = fig["ingest"]
    share = (i["validate"]["median"] + i["write"]["median"])
    sec.row(f"{kind}: ingest, {i['world']} ranks at 1 step/s",
            f"{share:.0%} of each second used",
            f"validate {fmt_dist(i['validate'])}; write {fmt_dist(i['write'])}; "
            f"{i['per_rank_rows_per_step']:.0f} per-rank rows/step; late steps "
            f"{i['late_steps']}/{i['seconds']}")
    sec.row(f"{kind}: ingest limit", f"{i['limit_ranks_at_1_step_per_s']:,.0f} ranks at 1 step/s",
            f"flat out {fmt_s(i['flat_out_step_s'])} per {i['world']}-rank step")
    sec.row(f"{kind}: list / detail while ingesting",
            f"p99 {fmt_s(i['list_during']['p99'])} / {fmt_s(i['detail_during']['p99'])}",
            f"list {fmt_dist(i['list_during'])}; detail {fmt_dist(i['detail_during'])}")
    sec.goal(f"{kind} {i['world']}-rank job absorbed at 1 step/s (share of a second)", share,
             "< 1", share < 1 and i["late_steps"] <= max(1, i["seconds"] // 20))
    sec.goal(f"{kind} list p99 while ingesting (s)", i["list_during"]["p99"], "< 0.05",
             i["list_during"]["p99"] < LIST_GOAL_S)
    sec.goal(f"{kind} detail p99 while ingesting (s)", i["detail_during"]["p99"], "< 0.05",
             i["detail_during"]["p99"] < LIST_GOAL_S)


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ("sqlite", "postgres")) -> None:
    size = QUICK if quick else FULL
    sec.figures["size"] = size.__dict__
    for kind in dbs:
        run_backend(kind, size, sec)
