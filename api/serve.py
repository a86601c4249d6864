"""Serving the API in several processes: `python -m api.serve` (the compose stack's `api`),
and `trident up --api-workers N`.

With N > 1, uvicorn starts N worker processes that share one listening socket (the kernel
hands each connection to one of them); each builds the app from the environment
(`api.app:app`) on the one database. Nothing a request relies on lives in one process's
memory only: sessions are tokens in the database, a session's CSRF token is derived from
its secret, an `Idempotency-Key` is a unique column, the stack-request limit (429) counts
rows, a log stream reads the ranks' files, and a token a process trusts is dropped when
another revokes it (`service.store.trusted_tokens.STAMP_FILE`). Each process keeps its own
Prometheus request histogram (a scrape sees the process that answers it) and its own audit
queue. The controller is not part of it: one leader, by its lease, whatever N is.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

MAX_DEFAULT_WORKERS = 4
HEALTHCHECK_TIMEOUT_S = 120
"""How long uvicorn's supervisor waits for a worker's answer before it replaces it."""
PARENT_ENV = "TRIDENT_API_PARENT_PID"
"""Set by `trident up` for its API worker processes: a worker whose parent is gone (killed
with -9) stops, instead of serving on as an orphan."""

log = logging.getLogger(__name__)


def default_workers() -> int:
    """The machine's cores this process may use, at most `MAX_DEFAULT_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def watch_parent() -> None:
    """When `PARENT_ENV` names this process's parent: a thread that stops this process
    (SIGTERM: uvicorn's graceful shutdown) once that parent is gone."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent or os.getppid() != parent:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        log.warning("API worker %s: parent %s ended, stopping", os.getpid(), parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def reserve_port(host: str, port: int) -> socket.socket:
    """The API's address, bound (not listening) by this process until it serves: `trident up`
    holds it while it starts the Ray head, whose servers take free ports (`service.cluster.rayhead`)
    and would otherwise be handed the one just checked to be free. Raises `OSError` when the
    address is in use or cannot be bound, before anything is started. SO_REUSEADDR, as
    uvicorn sets it: a port a stopped server left in TIME_WAIT is free."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def serve(host: str, port: int, workers: int, log_level: str = "warning", *,
          on_signal: Callable[[], None] | None = None,
          graceful_s: int | None = None) -> None:
    """uvicorn with `workers` processes of `api.app:app` (settings from the environment).
    `on_signal` is called as SIGTERM or SIGINT arrives (`trident up` begins its stop then);
    `graceful_s` bounds each worker's graceful shutdown (uvicorn's
    `timeout_graceful_shutdown`: its requests in flight)."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    # uvicorn kills a worker that does not answer its supervisor's ping within the health
    # check's time-out (5 s by default), and starts another: on a loaded machine a worker
    # still importing the app misses it, and the workers are replaced forever.
    if on_signal is None or workers <= 1:
        uvicorn.run("api.app:app", factory=True, host=host, port=port, workers=workers,
                    log_level=log_level, timeout_worker_healthcheck=HEALTHCHECK_TIMEOUT_S,
                    timeout_graceful_shutdown=graceful_s)
        return

    class Workers(Multiprocess):
        """uvicorn's supervisor of the worker processes, whose SIGTERM and SIGINT also
        call `on_signal`, as they arrive."""

        def __init__(self, config: uvicorn.Config, sockets: list[socket.socket]) -> None:
            super().__init__(config, sockets)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._signal)

        def _signal(self, sig: int, _frame: object) -> None:
            assert on_signal is not None
            on_signal()
            self.signal_queue.append(sig)

    config = uvicorn.Config("api.app:app", factory=True, host=host, port=port,
                            workers=workers, log_level=log_level,
                            timeout_worker_healthcheck=HEALTHCHECK_TIMEOUT_S,
                            timeout_graceful_shutdown=graceful_s)
    Workers(config, [config.bind_socket()]).run()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m api.serve", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=0,
        help="API processes (default: TRIDENT_API_WORKERS, else the machine's cores, at"
        f" most {MAX_DEFAULT_WORKERS})")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    if not 0 <= args.workers <= 64:
        ap.error("--workers: from 1 to 64 (0: the default)")
    from service.settings import Settings
    from service.store.dbcheck import Unreadable
    from service.store.opening import open_database

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    # Once, here, before any worker starts: the schema brought up to date (and, but in
    # prod, the first admin made), so that N workers never migrate at once.
    try:
        open_database(settings.db_url, settings.data_dir, first_admin=settings.env != "prod",
                      say=lambda line: print(line, flush=True))
    except Unreadable as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    workers = args.workers or settings.api_workers or default_workers()
    serve(args.host, args.port, workers, args.log_level)


if __name__ == "__main__":
    main()
