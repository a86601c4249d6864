"""The control plane against Ray Jobs: submit throughput and latency, 1 and 8 concurrent clients.

Trident: `POST /api/v1/jobs` (the tiny spec: validated, planned, stored) on its real server
(uvicorn in a process of its own, as `trident up` runs it) over SQLite and over PostgreSQL.
Ray: `ray.job_submission.JobSubmissionClient.submit_job` against a local Ray head with its
dashboard (the job API's server), started here on ports and a temp dir of its own with token
authentication, and stopped here (only the processes it started). Rounds alternate between
the systems; after a Ray round the bench waits for its jobs (`true`) to end, so their drivers'
load does not fall on the next round. Also: Ray's submit-to-RUNNING on the idle cluster
(Trident's is in the orchestration comparison, where a whole stack runs).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench.auth import token_file_headers
from bench.harness import Section, dist, fmt_dist, fmt_s
from bench.scale import PG_ADMIN

ROOT = Path(__file__).resolve().parent.parent
TINY = {"name": "tiny", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}
THROUGHPUT_GOAL = 10.0
P99_GOAL_S = 0.050


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:g} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


TOKENS: dict[str, dict[str, str]] = {}
"""The admin's Authorization header of each server `trident_server` started, by address."""
PIDS: dict[str, int] = {}
"""The server process of each address `trident_server` started."""


URLS: dict[str, str] = {}
"""The database URL of each server `trident_server` started, by address."""


def server_cpu_s(api: str) -> float:
    """User and system CPU seconds the server at `api` has used so far: its process and,
    with several API workers, theirs (the processes alive now)."""
    import psutil

    root = psutil.Process(PIDS[api])
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def cpu_per_request(api: str, call: Callable[[], Any], n: int) -> float:
    """The server's CPU seconds per call of `call`, over n calls one after another."""
    for _ in range(5):
        call()
    c0 = server_cpu_s(api)
    for _ in range(n):
        call()
    return (server_cpu_s(api) - c0) / n


@contextlib.contextmanager
def trident_server(db: str, workers: int = 1) -> Iterator[str]:
    """The API alone (no controller: submissions only queue) on `db` (sqlite or postgres):
    one uvicorn process, or (`workers` > 1, 0 for the default) `python -m api.serve` with
    that many API processes, as `trident up --api-workers` and the compose stack run it."""
    tmp = Path(tempfile.mkdtemp(prefix="trident-bench-api-"))
    name = f"trident_bench_{uuid.uuid4().hex[:8]}"
    admin = None
    url = f"sqlite:///{tmp / 'trident.db'}"
    if db == "postgres":
        admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    port = _port()
    log = tmp / "api.log"
    env = {**os.environ, "TRIDENT_DATA_DIR": str(tmp), "TRIDENT_DATABASE_URL": url,
           "PYTHONPATH": str(ROOT)}
    argv = ([sys.executable, "-m", "uvicorn", "--factory", "api.app:app"] if workers == 1
            else [sys.executable, "-m", "api.serve", "--workers", str(workers)])
    proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(port), "--log-level",
                             "warning"], cwd=ROOT, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/v1/jobs?limit=1", 60, proc, log)
        api = f"http://127.0.0.1:{port}"
        PIDS[api] = proc.pid  # uvicorn (or api.serve, whose workers are its children)
        TOKENS[api] = token_file_headers(tmp)  # the app bootstraps its admin on first start
        URLS[api] = url
        yield api
    finally:
        _stop(proc)
        if admin is not None:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


@contextlib.contextmanager
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head with its dashboard on ports and a temp dir of its own, token auth on;
    stopped (its process group only) on exit. Yields the dashboard URL and the client env."""
    tmp = Path(tempfile.mkdtemp(prefix="rb-"))  # short: Ray puts sockets under it
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    low = _port()  # worker ports low..low+200; every other port outside that range
    names = ["port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "metrics-export-port", "node-manager-port",
             "object-manager-port", "runtime-env-agent-port"]
    ports: dict[str, int] = {}
    while len(ports) < len(names):
        p = _port()
        if not low <= p <= low + 200 and p not in ports.values():
            ports[names[len(ports)]] = p
    dash = ports["dashboard-port"]
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            "--node-ip-address=127.0.0.1", f"--temp-dir={tmp}", "--num-cpus=2",
            "--disable-usage-stats", f"--min-worker-port={low}", f"--max-worker-port={low + 200}",
            *[f"--{k}={v}" for k, v in ports.items()]]
    log = tmp / "head.log"
    proc = subprocess.Popen(argv, env={**os.environ, **auth}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        _wait_http(f"{url}/api/version", 180, proc, log)
        yield url, auth
    finally:
        _stop(proc, 60)
        shutil.rmtree(tmp, ignore_errors=True)


def connected(client: Any) -> Any:
    """An httpx client that has opened its connection (httpx connects on the first request;
    Ray's job client makes one request when it is made): a request to `/whoami`."""
    client.get("/api/v1/whoami").raise_for_status()
    return client


def clients(n: int, per_client: int, submit: Callable[[Any], None],
            make: Callable[[], Any]) -> tuple[list[float], float]:
    """n threads, each with its own client, submitting per_client times: latencies, seconds."""
    lat: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n + 1)
    made = [make() for _ in range(n)]  # each `make` connects: before the clock starts

    def worker(c: Any) -> None:
        mine = []
        try:
            barrier.wait()
            for _ in range(per_client):
                t0 = time.perf_counter()
                submit(c)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:  # the round fails, not hangs: the others are released
            errors.append(exc)
            barrier.abort()
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(c,)) for c in made]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise RuntimeError(f"{len(real)} client(s) failed: {real[0]!r}") from real[0]
    return lat, time.perf_counter() - t0


def run(sec: Section, quick: bool, dbs: tuple[str, ...] = ("sqlite", "postgres")) -> None:
    import httpx

    per = {1: 5, 8: 2} if quick else {1: 30, 8: 6}
    trident_per = {1: 10, 8: 4} if quick else {1: 200, 8: 40}
    rounds = 1 if quick else 2
    with ray_head() as (ray_url, auth):
        saved = {k: os.environ.get(k) for k in auth}
        os.environ.update(auth)
        try:
            from ray.job_submission import JobStatus, JobSubmissionClient

            def ray_client() -> Any:
                for attempt in range(5):  # a loaded head's dashboard may be slow to answer
                    try:
                        return JobSubmissionClient(ray_url)
                    except ConnectionError:
                        if attempt == 4:
                            raise
                        time.sleep(3)

            ids: list[str] = []

            def ray_submit(c: Any) -> None:
                ids.append(c.submit_job(entrypoint="true"))

            def drain(c: Any, timeout_s: float = 300) -> None:
                end = time.monotonic() + timeout_s
                while time.monotonic() < end and any(
                        not c.get_job_status(i).is_terminal() for i in ids):
                    time.sleep(0.5)

            main = ray_client()
            results: dict[str, dict[int, list[tuple[list[float], float]]]] = {}
            cpu: dict[str, dict[str, float]] = {}
            for db in dbs:
                with trident_server(db) as api:
                    def t_client(api: str = api) -> Any:
                        return connected(httpx.Client(base_url=api, timeout=30,
                                                      headers=TOKENS[api]))

                    def t_submit(c: Any) -> None:
                        r = c.post("/api/v1/jobs", json=TINY)
                        assert r.status_code == 201, r.text[:300]

                    t_client().post("/api/v1/jobs", json=TINY)  # warm-up
                    for rnd in range(rounds):
                        for n in (1, 8):
                            order = ("trident", "ray") if rnd % 2 == 0 else ("ray", "trident")
                            for who in order:
                                if who == "ray" and db == "postgres" and "ray" in results \
                                        and len(results["ray"].get(n, [])) >= rounds:
                                    continue  # Ray's figure does not depend on Trident's db
                                if who == "ray":
                                    got = clients(n, per[n], ray_submit, ray_client)
                                    drain(main)
                                else:
                                    c0 = server_cpu_s(api)
                                    got = clients(n, trident_per[n], t_submit, t_client)
                                    used = cpu.setdefault(db, {})
                                    used["submit_s"] = used.get("submit_s", 0) + (
                                        server_cpu_s(api) - c0)
                                    used["submits"] = used.get("submits", 0) + len(got[0])
                                key = "ray" if who == "ray" else f"trident_{db}"
                                results.setdefault(key, {}).setdefault(n, []).append(got)
                    # What one request costs the server whatever it does, and an
                    # authenticated one: the floor under a submission's CPU.
                    c = t_client()
                    cpu[db]["healthz_s"] = cpu_per_request(
                        api, lambda c=c: c.get("/api/v1/healthz"), 100 if quick else 300)
                    cpu[db]["whoami_s"] = cpu_per_request(
                        api, lambda c=c: c.get("/api/v1/whoami"), 100 if quick else 300)
            # Ray: submit to RUNNING on the idle cluster.
            to_running = []
            for _ in range(2 if quick else 5):
                t0 = time.perf_counter()
                jid = main.submit_job(entrypoint="sleep 3")
                while main.get_job_status(jid) not in (JobStatus.RUNNING, JobStatus.SUCCEEDED,
                                                       JobStatus.FAILED):
                    time.sleep(0.02)
                to_running.append(time.perf_counter() - t0)
                ids.append(jid)
                drain(main)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    _report(sec, results, to_running, dbs, cpu)


def _report(sec: Section, results: dict[str, dict[int, list[tuple[list[float], float]]]],
            to_running: list[float], dbs: tuple[str, ...],
            cpu: dict[str, dict[str, float]]) -> None:
    fig: dict[str, Any] = {}
    for key, by_n in results.items():
        for n, runs in by_n.items():
            lat = [x for xs, _ in runs for x in xs]
            rate = sum(len(xs) for xs, _ in runs) / sum(s for _, s in runs)
            fig.setdefault(key, {})[n] = {"latency": dist(lat), "per_s": rate}
    fig["ray_submit_to_running"] = dist(to_running)
    sec.figures.update(fig)
    for n in (1, 8):
        ray = fig["ray"][n]
        for db in dbs:
            t = fig[f"trident_{db}"][n]
            ratio = t["per_s"] / ray["per_s"]
            sec.row(f"{n} client(s), Trident ({db}) / Ray Jobs", f"{ratio:.1f}x submits/s",
                    f"Trident {t['per_s']:.1f}/s, p50 {fmt_s(t['latency']['median'])}, p99 "
                    f"{fmt_s(t['latency']['p99'])}; Ray {ray['per_s']:.1f}/s, p50 "
                    f"{fmt_s(ray['latency']['median'])}, p99 {fmt_s(ray['latency']['p99'])}")
            sec.goal(f"{n} client(s) {db}: throughput vs Ray Jobs", ratio,
                     f">= {THROUGHPUT_GOAL:g}x", ratio >= THROUGHPUT_GOAL)
            sec.goal(f"{n} client(s) {db}: submit p99 (s)", t["latency"]["p99"], "< 0.05",
                     t["latency"]["p99"] < P99_GOAL_S)
    for db in dbs:
        # The limit: the one server process's CPU per submission; 1 / that is its ceiling
        # in submissions a second with a whole core to itself.
        used = cpu[db]
        per = used["submit_s"] / used["submits"]
        fig.setdefault("server_cpu", {})[db] = {
            "per_submit_s": per, "healthz_s": used["healthz_s"], "whoami_s": used["whoami_s"],
            "ceiling_per_s": 1 / per}
        sec.row(f"Trident ({db}): server CPU per submission", fmt_s(per),
                f"one process, so at most {1 / per:.0f} submits/s on a core of its own "
                f"({1 / per / fig['ray'][1]['per_s']:.1f}x Ray's 1-client rate); any request "
                f"costs {fmt_s(used['healthz_s'])} (healthz), an authenticated one "
                f"{fmt_s(used['whoami_s'])} (whoami)")
    sec.row("Ray Jobs: submit to RUNNING, idle cluster", fmt_dist(fig["ray_submit_to_running"]),
            "entrypoint `sleep 3`; Trident's is in the orchestration comparison")
