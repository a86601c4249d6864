"""Where each request's time goes: the common routes' CPU per request and their top costs.

`python -m bench.profile_api [--n 300] [--top 12] [--route NAME]`

The real app (`api.app.create_app`) on a SQLite store of its own (a temp dir), driven in
process by a bare ASGI caller (no HTTP client, no socket: what is measured is the app's own
work, middleware, routing, validation, the store and serialisation), with FastAPI's thread
pool replaced by an inline call so that cProfile (which sees one thread) sees the routes'
bodies too. For each route: the process CPU per request (`time.process_time`, so that other
work on a shared machine does not count) over `n` requests after a warm-up, then a cProfile
of another `n` and its top functions by own time and by cumulative time. uvicorn's HTTP
parsing is not included; the control-plane benchmark (`bench/control_plane.py`) measures
the server's whole CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

TINY = {"name": "tiny", "model": {"preset": "gpt-tiny"},
        "train": {"steps": 6, "global_batch": 8, "micro_batch": 2, "precision": "fp32"},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 2},
        "resources": {"gpus_per_worker": 0, "cpus_per_worker": 0.5}}


@contextlib.contextmanager
def inline_threadpool() -> Iterator[None]:
    """Sync routes and dependencies run in the calling thread (cProfile sees them)."""
    import anyio.to_thread
    import starlette.concurrency

    saved = anyio.to_thread.run_sync

    async def inline(func: Callable[..., T], *args: Any, **_: Any) -> T:
        return func(*args)

    anyio.to_thread.run_sync = inline  # type: ignore[assignment]
    try:
        yield
    finally:
        anyio.to_thread.run_sync = saved
        del starlette.concurrency  # imported for its module-level use of anyio.to_thread


class Caller:
    """Calls an ASGI app as uvicorn would (one `http` scope per request), in one loop."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()

    def __call__(self, method: str, path: str, headers: dict[str, str],
                 body: bytes = b"") -> tuple[int, bytes]:
        return self.loop.run_until_complete(self._one(method, path, headers, body))

    async def _one(self, method: str, path: str, headers: dict[str, str],
                   body: bytes) -> tuple[int, bytes]:
        raw_path, _, query = path.partition("?")
        hs = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        hs.append((b"host", b"bench"))
        if body:
            hs += [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": raw_path,
                 "raw_path": raw_path.encode(), "query_string": query.encode(),
                 "root_path": "", "headers": hs, "client": ("127.0.0.1", 5000),
                 "server": ("127.0.0.1", 8000), "state": {}}
        sent = False
        status = 0
        out = bytearray()

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.sleep(3600)
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                out.extend(message.get("body", b""))

        await self.app(scope, receive, send)
        return status, bytes(out)

    def lifespan(self) -> Callable[[], None]:
        """Run the app's lifespan start-up; returns what shuts it down."""
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        started = asyncio.Event()
        done = asyncio.Event()

        async def receive() -> dict[str, Any]:
            return await q.get()

        async def send(message: dict[str, Any]) -> None:
            if message["type"].endswith("startup.complete"):
                started.set()
            elif message["type"].startswith("lifespan.startup.failed"):
                raise RuntimeError(message.get("message"))
            elif message["type"].endswith("shutdown.complete"):
                done.set()

        task = self.loop.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"},
                                               "state": {}}, receive, send))
        q.put_nowait({"type": "lifespan.startup"})
        self.loop.run_until_complete(started.wait())

        def stop() -> None:
            q.put_nowait({"type": "lifespan.shutdown"})
            self.loop.run_until_complete(done.wait())
            self.loop.run_until_complete(task)

        return stop


def setup(data_dir: Path, queued: int = 0
          ) -> tuple[Caller, Callable[[], None], dict[str, str], int]:
    """The app on a fresh SQLite store in `data_dir`, started; a job with 200 steps of
    metrics on 2 ranks; the admin's header. With `queued`, that many more jobs queued ahead
    of the routes' own (`lengthen_queue`)."""
    from api.app import create_app
    from bench.scale import _reports
    from service.contract.reports import StepReport
    from service.settings import Settings
    from service.store.metrics import MetricsIngest

    os.environ["TRIDENT_DATA_DIR"] = str(data_dir)
    settings = Settings(data_dir=data_dir, database_url=f"sqlite:///{data_dir / 't.db'}")
    app = create_app(settings)
    call = Caller(app)
    stop = call.lifespan()
    headers = {"authorization": f"Bearer {(data_dir / 'admin.token').read_text().strip()}"}
    body = json.dumps(TINY).encode()
    for _ in range(30):
        status, out = call("POST", "/api/v1/jobs", headers, body)
        assert status == 201, out[:300]
    job_id = json.loads(out)["id"]
    import random

    lengthen_queue(app.state.store, queued)
    ing = MetricsIngest(app.state.store)
    rng = random.Random(0)
    for step in range(1, 201):
        rows = [StepReport.model_validate(x).row() for x in _reports(2, step, rng)]
        ing.record(job_id=job_id, attempt=1, world_size=2, rows=rows)
    return call, stop, headers, job_id


def lengthen_queue(store: Any, n: int) -> None:
    """`n` more queued jobs, copies of the first one's row at a higher priority: a queue as
    long as a sweep of `n` submissions leaves, all of it ahead of the routes' job and of each
    new submission."""
    if n <= 0:
        return
    from sqlalchemy import insert, select

    from service.store.tables import JobRow

    t = JobRow.__table__
    with store.engine.begin() as c:
        row = dict(c.execute(select(t).order_by(t.c.id).limit(1)).mappings().one())
        del row["id"]
        c.execute(insert(t), [{**row, "priority": row["priority"] + 1}] * n)


def routes(job_id: int) -> dict[str, tuple[str, str, bool, bytes]]:
    """name: (method, path, authenticated, body)."""
    j = f"/api/v1/jobs/{job_id}"
    return {
        "healthz": ("GET", "/api/v1/healthz", False, b""),
        "whoami": ("GET", "/api/v1/whoami", True, b""),
        "job detail": ("GET", j, True, b""),
        "job list": ("GET", "/api/v1/jobs?limit=50", True, b""),
        "job events": ("GET", f"{j}/events?after=0&limit=1000", True, b""),
        "metrics series": ("GET", f"{j}/series", True, b""),
        "submit": ("POST", "/api/v1/jobs", True, json.dumps(TINY).encode()),
        "/metrics": ("GET", "/metrics", True, b""),
    }


def measure(call: Caller, headers: dict[str, str], route: tuple[str, str, bool, bytes],
            n: int) -> float:
    """Process CPU seconds per request over n requests (after 5 not counted)."""
    method, path, auth, body = route
    hs = headers if auth else {}
    for _ in range(5):
        status, out = call(method, path, hs, body)
        assert status < 400 or path.endswith("healthz"), (path, status, out[:300])
    c0 = time.process_time()
    for _ in range(n):
        call(method, path, hs, body)
    return (time.process_time() - c0) / n


def profile(call: Caller, headers: dict[str, str], route: tuple[str, str, bool, bytes],
            n: int, top: int) -> str:
    method, path, auth, body = route
    hs = headers if auth else {}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call(method, path, hs, body)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(r"/(api|service)/", top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="requests per route and phase")
    ap.add_argument("--top", type=int, default=12, help="functions listed per profile")
    ap.add_argument("--route", action="append", help="only these routes (repeat)")
    ap.add_argument("--no-profile", action="store_true", help="CPU per request only")
    ap.add_argument("--queued", type=int, default=0,
                    help="jobs queued ahead of the routes' own (a long queue)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trident-profile-") as tmp, inline_threadpool():
        call, stop, headers, job_id = setup(Path(tmp), args.queued)
        try:
            table = routes(job_id)
            names = args.route or list(table)
            cpu = {}
            for name in names:
                cpu[name] = measure(call, headers, table[name], args.n)
                print(f"{name:16s} {cpu[name] * 1e3:7.3f} ms CPU per request"
                      f" (load average {os.getloadavg()[0]:.2f})", flush=True)
            if not args.no_profile:
                for name in names:
                    print(f"\n===== {name}: {cpu[name] * 1e3:.3f} ms CPU per request =====")
                    print(profile(call, headers, table[name], args.n, args.top))
        finally:
            stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
