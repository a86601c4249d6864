"""A platform's daily load on the API: dashboard viewers, submitters and a large job at once.

Two parts, each on a fresh API alone (no controller: jobs only queue) over SQLite, with the
default API processes (`python -m api.serve`: the machine's cores, at most 4):

- **submissions**: 8 clients x 50 submissions of the tiny spec, as fast as answers come:
  submissions a second and their latency (goal: >= 400/s, p99 <= 50 ms). The clients are
  threads of this process, each with a keep-alive connection of the standard library's
  `http.client` (`--client httpx`: an `httpx.Client` each, as before). They share the
  machine with the server, so what they spend is the server's loss: httpx spent 1.1 ms of
  CPU per submission here, `http.client` 0.2 ms, and the server's own 2.5 to 4 ms. Both
  are reported (the clients' process CPU over the submissions);
- **viewers**: 100 simulated dashboard viewers, each polling what a job's page polls every
  2 s (`api/static/job.js` on its metrics tab: the job, its events after the newest seen,
  its chart series), 8 clients submitting (each a job, then 1 s), and a simulated 4,096-rank
  job reporting a step a second (`MetricsIngest.record`, as the controller stores a poll's
  reports, in a process of its own), for `seconds`: p50 and p99 of every viewer request by
  route (goal: p99 <= 100 ms), the API's CPU (its processes' CPU seconds over the wall
  time: cores) and the load average.

The viewers run in one process of their own (asyncio, a connection each), the submitters in
another, so that the clients' own work does not delay the measuring of each other's.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing as mp
import os
import random
import resource
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from bench.control_plane import TINY, TOKENS, URLS, clients, connected, server_cpu_s, trident_server
from bench.harness import Section, dist, fmt_s

VIEWERS = 100
POLL_S = 2.0
SUBMITTERS = 8
WORLD = 4096
SUBMIT_RATE_GOAL = 400.0
SUBMIT_P99_GOAL_S = 0.050
VIEWER_P99_GOAL_S = 0.100


def _viewers_proc(api: str, headers: dict[str, str], job_id: int, n: int, seconds: float,
                  q: Any) -> None:
    import httpx

    lat: dict[str, list[float]] = {"job": [], "events": [], "series": []}
    errors: list[str] = []

    async def viewer(i: int, client: httpx.AsyncClient, end: float) -> None:
        after = 0
        await asyncio.sleep(random.Random(i).random() * POLL_S)  # pages opened apart
        while time.monotonic() < end:
            t_next = time.monotonic() + POLL_S
            for kind, path, params in (
                    ("job", f"/api/v1/jobs/{job_id}", None),
                    ("events", f"/api/v1/jobs/{job_id}/events", {"after": after,
                                                                  "limit": 1000}),
                    ("series", f"/api/v1/jobs/{job_id}/series", None)):
                t0 = time.perf_counter()
                r = await client.get(path, params=params)
                lat[kind].append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(f"{kind}: {r.status_code} {r.text[:200]}")
                elif kind == "events" and r.json()["items"]:
                    after = r.json()["items"][-1]["id"]
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))

    async def main() -> None:
        # One client whose pool keeps a connection per viewer (a client each would spend
        # seconds making TLS contexts before the first request).
        async with httpx.AsyncClient(base_url=api, headers=headers, timeout=60,
                                     limits=httpx.Limits(max_connections=n,
                                                         max_keepalive_connections=n)) as c:
            end = time.monotonic() + seconds
            await asyncio.gather(*(viewer(i, c, end) for i in range(n)))

    asyncio.run(main())
    q.put({"latency": lat, "errors": errors[:20], "n_errors": len(errors)})


def _submitters_proc(api: str, headers: dict[str, str], n: int, seconds: float,
                     q: Any) -> None:
    import httpx

    lat: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def one(i: int) -> None:
        with httpx.Client(base_url=api, headers=headers, timeout=60) as c:
            time.sleep(i / n)
            while time.monotonic() < end:
                t0 = time.perf_counter()
                r = c.post("/api/v1/jobs", json=TINY)
                with lock:
                    lat.append(time.perf_counter() - t0)
                assert r.status_code == 201, r.text[:300]
                time.sleep(1.0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.put({"latency": lat})


def _ingest_proc(url: str, job_id: int, world: int, seconds: float, q: Any) -> None:
    from bench.scale import _reports
    from service.contract.reports import StepReport
    from service.store import Store
    from service.store.metrics import MetricsIngest

    store = Store(url)
    ing = MetricsIngest(store)
    rng = random.Random(0)
    write, late = [], 0
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < seconds:
        step += 1
        rows = [StepReport.model_validate(x).row() for x in _reports(world, step, rng)]
        t0 = time.perf_counter()
        ing.record(job_id=job_id, attempt=1, world_size=world, rows=rows)
        write.append(time.perf_counter() - t0)
        wait = start + step - time.monotonic()
        late += wait < 0
        if wait > 0:
            time.sleep(wait)
    store.close()
    q.put({"steps": step, "write": write, "late_steps": late})


CLIENTS = ("stdlib", "httpx")
"""The submitting clients' HTTP library: the standard library's `http.client`, or httpx."""


class _Plain:
    """One keep-alive connection of `http.client`, submitting the tiny spec (connected when
    made, as `connected` does for httpx)."""

    def __init__(self, api: str) -> None:
        url = urlsplit(api)
        self.conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        self.headers = {**TOKENS[api], "Content-Type": "application/json"}
        self.body = json.dumps(TINY).encode()
        status, text = self._call("GET", "/api/v1/whoami", None)
        assert status == 200, text

    def _call(self, method: str, path: str, body: bytes | None) -> tuple[int, str]:
        self.conn.request(method, path, body=body, headers=self.headers)
        r = self.conn.getresponse()
        return r.status, r.read()[:300].decode(errors="replace")

    def submit(self) -> None:
        status, text = self._call("POST", "/api/v1/jobs", self.body)
        assert status == 201, text


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def submissions(api: str, per_client: int = 50, n: int = SUBMITTERS,
                client: str = "stdlib") -> dict[str, Any]:
    """n clients x per_client submissions: the rate, the latency, the server's CPU and the
    clients' (this process's) per submission."""
    if client == "httpx":
        import httpx

        def make() -> Any:
            return connected(httpx.Client(base_url=api, timeout=60, headers=TOKENS[api]))

        def submit(c: Any) -> None:
            r = c.post("/api/v1/jobs", json=TINY)
            assert r.status_code == 201, r.text[:300]
    elif client == "stdlib":
        def make() -> Any:
            return _Plain(api)

        def submit(c: Any) -> None:
            c.submit()
    else:
        raise ValueError(f"client: one of {CLIENTS}, not {client!r}")

    submit(make())  # warm-up
    l0 = os.getloadavg()[0]
    c0, own0 = server_cpu_s(api), _own_cpu_s()
    lat, wall = clients(n, per_client, submit, make)
    cpu, own = server_cpu_s(api) - c0, _own_cpu_s() - own0
    return {"latency": dist(lat), "per_s": len(lat) / wall, "cpu_per_submit_s": cpu / len(lat),
            "client_cpu_per_submit_s": own / len(lat), "client": client,
            "load_avg": (l0 + os.getloadavg()[0]) / 2}


def viewers(api: str, seconds: float, n_viewers: int = VIEWERS) -> dict[str, Any]:
    import httpx

    headers = TOKENS[api]
    with httpx.Client(base_url=api, headers=headers, timeout=60) as c:
        r = c.post("/api/v1/jobs", json={**TINY, "name": "watched"})
        assert r.status_code == 201, r.text[:300]
        job_id = r.json()["id"]
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    procs = [ctx.Process(target=_ingest_proc, args=(URLS[api], job_id, WORLD, seconds, q)),
             ctx.Process(target=_submitters_proc, args=(api, headers, SUBMITTERS, seconds, q)),
             ctx.Process(target=_viewers_proc, args=(api, headers, job_id, n_viewers,
                                                     seconds, q))]
    l0 = os.getloadavg()[0]
    c0, t0 = server_cpu_s(api), time.monotonic()
    for p in procs:
        p.start()
    got = [q.get(timeout=seconds + 600) for _ in procs]
    cpu, wall = server_cpu_s(api) - c0, time.monotonic() - t0
    for p in procs:
        p.join(60)
    out: dict[str, Any] = {"api_cores": cpu / wall, "wall_s": wall,
                           "load_avg": (l0 + os.getloadavg()[0]) / 2}
    for g in got:
        if "steps" in g:
            out["ingest"] = {"steps": g["steps"], "late_steps": g["late_steps"],
                             "write": dist(g["write"])}
        elif "n_errors" in g:
            lat = g["latency"]
            out["viewer"] = {k: dist(v) for k, v in lat.items()}
            out["viewer"]["all"] = dist([x for v in lat.values() for x in v])
            out["viewer_errors"] = {"n": g["n_errors"], "first": g["errors"]}
        else:
            out["submit"] = dist(g["latency"])
    return out


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ("sqlite",), *,
        workers: int | None = None, parts: tuple[str, ...] = ("submissions", "viewers"),
        client: str = "stdlib") -> None:
    """Both parts on SQLite with the default API processes (`workers` None), or with
    `workers` of them; `parts`: the parts to run (`python -m bench.viewers --only`);
    `client`: the submitting clients' HTTP library (`CLIENTS`)."""
    del dbs  # the figures are on SQLite, the default workers
    from api.serve import default_workers

    workers = workers or default_workers()
    seconds = 15.0 if quick else 60.0
    sec.figures["workers"] = workers
    if "submissions" in parts:
        with trident_server("sqlite", workers=workers) as api:
            s = submissions(api, per_client=10 if quick else 50, client=client)
        sec.figures["submissions"] = s
        _submission_rows(sec, s, workers, quick)
    if "viewers" in parts:
        with trident_server("sqlite", workers=workers) as api:
            v = viewers(api, seconds, 30 if quick else VIEWERS)
        sec.figures["viewers"] = v
        _viewer_rows(sec, v, workers)


def _submission_rows(sec: Section, s: dict[str, Any], workers: int, quick: bool) -> None:
    lat = s["latency"]
    sec.row(f"{SUBMITTERS} clients x {10 if quick else 50} submissions, {workers} API"
            " process(es), SQLite", f"{s['per_s']:.0f}/s",
            f"p50 {fmt_s(lat['median'])}, p99 {fmt_s(lat['p99'])}; server CPU"
            f" {fmt_s(s['cpu_per_submit_s'])} per submission, the clients' ({s['client']})"
            f" {fmt_s(s['client_cpu_per_submit_s'])}; load average"
            f" {s['load_avg']:.1f} on {os.cpu_count()} cores")
    sec.goal("submissions per second", s["per_s"], f">= {SUBMIT_RATE_GOAL:g}",
             s["per_s"] >= SUBMIT_RATE_GOAL)
    sec.goal("submission p99 (s)", lat["p99"], f"<= {SUBMIT_P99_GOAL_S:g}",
             lat["p99"] <= SUBMIT_P99_GOAL_S)


def _viewer_rows(sec: Section, v: dict[str, Any], workers: int) -> None:
    vw = v["viewer"]
    for kind in ("job", "events", "series", "all"):
        d = vw[kind]
        sec.row(f"viewers: {kind}", f"p99 {fmt_s(d['p99'])}",
                f"p50 {fmt_s(d['median'])}, p90 {fmt_s(d['p90'])}, n {d['n']}")
    sec.row("viewers: the API's CPU", f"{v['api_cores']:.2f} cores",
            f"{workers} API process(es) over {v['wall_s']:.0f} s; submissions meanwhile p99"
            f" {fmt_s(v['submit']['p99'])} (n {v['submit']['n']}); the 4,096-rank job stored"
            f" {v['ingest']['steps']} steps ({v['ingest']['late_steps']} late), a step's"
            f" write median {fmt_s(v['ingest']['write']['median'])}; load average"
            f" {v['load_avg']:.1f} on {os.cpu_count()} cores; errors"
            f" {v['viewer_errors']['n']}")
    sec.goal("viewer request p99 (s)", vw["all"]["p99"], f"<= {VIEWER_P99_GOAL_S:g}",
             vw["all"]["p99"] <= VIEWER_P99_GOAL_S)


def main() -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=None,
                    help="API processes (default: `python -m api.serve`'s, the machine's cores,"
                    " at most 4)")
    ap.add_argument("--only", choices=("submissions", "viewers"), action="append",
                    help="run this part only (repeat for both)")
    ap.add_argument("--client", choices=CLIENTS, default="stdlib",
                    help="the submitting clients' HTTP library (default: http.client)")
    args = ap.parse_args()
    if args.workers is not None and args.workers < 1:
        ap.error("--workers: at least 1")
    sec = Section("viewers", "viewers")
    run(sec, args.quick, workers=args.workers,
        parts=tuple(args.only or ("submissions", "viewers")), client=args.client)
    print(json.dumps(sec.figures, indent=1, default=str))
    for row in sec.rows:
        print(" | ".join(row))
    for g in sec.goals:
        print(g)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
