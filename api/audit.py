"""The audit log: every request that changes something (submit, cancel, probes, users, tokens,
projects, dashboard log-in and out), recorded with who, when, from where and the outcome;
`GET /api/v1/audit` lists it for admins.

`Audit` is an ASGI middleware, outermost, so that refusals (401, 403, 413, 422) are recorded
too. It reads who asked from the request state the authentication dependency fills in, and
hands the entry, once the response is sent, to `AuditWriter`: one thread that writes the
entries waiting in its queue in one transaction, `LINGER_S` after the first of them came. So
no request waits for an audit write (a submit's latency stays that of the submit), and a
burst of requests costs one commit every `LINGER_S`, not one each: on SQLite every commit
takes the database's one write lock, which a burst of submissions to several API processes
queues for. `GET /api/v1/audit` flushes the queue first (without lingering), so it lists
every request answered before it; only entries still queued when the process is killed (at
most `LINGER_S` of them) are lost.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.store.identity import Identity, Principal
from service.store.tables import utcnow

log = logging.getLogger(__name__)

SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_STOP = object()


LINGER_S = 0.1
"""How long the audit writer lets entries gather after the first before it writes them."""


class AuditWriter:
    """Writes queued audit entries from a thread of its own, a batch per transaction."""

    def __init__(self, identity: Identity, batch: int = 500, linger_s: float = LINGER_S
                 ) -> None:
        self.identity = identity
        self.batch = batch
        self.linger_s = linger_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._hurry = threading.Event()
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    def put(self, entry: dict[str, Any]) -> None:
        self._queue.put(entry)

    def flush(self) -> None:
        """Return once every entry queued so far is written (or its write failed), without
        waiting for the batch to linger."""
        self._hurry.set()
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._hurry.set()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            if items[0] is not _STOP:
                self._hurry.wait(self.linger_s)
            # Cleared before the batch is taken: what a flush after this waits for is in
            # this batch or, set again, makes the next one go without lingering.
            self._hurry.clear()
            while len(items) < self.batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            entries = [i for i in items if i is not _STOP]
            try:
                if entries:
                    self.identity.record_many(entries)
            except Exception:  # an audit that fails must not end the writer
                log.exception("writing %d audit entries failed", len(entries))
            finally:
                for _ in items:
                    self._queue.task_done()
            if len(entries) < len(items):
                return


class Audit:
    """ASGI middleware recording every request with an unsafe method."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE:
            await self.app(scope, receive, send)
            return
        status = 500

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self._record(scope, status)

    @staticmethod
    def _record(scope: Scope, status: int) -> None:
        writer: AuditWriter | None = getattr(scope["app"].state, "audit", None)
        if writer is None:
            return
        state: dict[str, Any] = scope.get("state") or {}
        who: Principal | None = state.get("principal")
        client = scope.get("client")
        writer.put({"time": utcnow(), "actor": who.name if who else None,
                    "client": client[0] if client else None,
                    "method": scope["method"], "path": scope["path"],
                    "action": state.get("action"), "status": status})
