"""The cluster's node inventory, refreshed beside the controller's loop.

The first inventory is taken in the controller's first pass: admission and the submission's
placement check read the recorded nodes. Later ones run on a thread of their own and are
stored by the first pass after they finish, so a node slow to answer (the launcher waits up
to a minute for it) holds no pass, and no cancel waits behind it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from service.cluster.data_plane import Launcher
from service.store import Store

log = logging.getLogger("trident.controller")


class NodeSurvey:
    def __init__(self, store: Store, launcher: Launcher, every_s: float = 60.0) -> None:
        self.store = store
        self.launcher = launcher
        self.every_s = every_s
        self._taken_at: float | None = None
        self._pending: Future[list[dict[str, Any]]] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trident-inventory")

    def step(self) -> None:
        """Store a finished inventory, or start the next one when it is due."""
        if self._pending is not None:
            if not self._pending.done():
                return
            done, self._pending = self._pending, None
            try:
                nodes = done.result()
            except Exception:  # the next one is taken when due; the recorded nodes stay
                log.exception("node inventory failed")
                return
            self.store.upsert_nodes(nodes=nodes)
            return
        now = time.monotonic()
        if self._taken_at is not None and now - self._taken_at < self.every_s:
            return
        first = self._taken_at is None
        self._taken_at = now
        if first:
            self.store.upsert_nodes(nodes=self.launcher.inventory())
        else:
            self._pending = self._pool.submit(self.launcher.inventory)

    def close(self) -> None:
        """Stop taking inventories; one in flight ends on its own (its result is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
