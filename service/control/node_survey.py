"""The cluster's node inventory, refreshed beside the controller's loop.

The first inventory is taken in the controller's first pass: admission and the submission's
placement check read the recorded nodes. Later ones run on a thread of their own and are
stored by the first pass after they finish, so a node slow to answer (the launcher waits up
to a minute for it) holds no pass, and no cancel waits behind it.

One is taken every `every_s`, and at once when the cluster's live nodes are not those of the
last one (looked at every `watch_every_s`, from the launcher's `total_capacity`, one call to
Ray's GCS): a host that died or joined is in the inventory within seconds, not a minute, so
that the submission's placement check and `trident cluster` do not go by a cluster that was.
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
    def __init__(self, store: Store, launcher: Launcher, every_s: float = 60.0,
                 watch_every_s: float = 2.0) -> None:
        self.store = store
        self.launcher = launcher
        self.every_s = every_s
        self.watch_every_s = watch_every_s
        self._taken_at: float | None = None
        self._watched_at = 0.0
        self._live: frozenset[str] | None = None
        """The live nodes when the last inventory was started."""
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
        live = self._live_nodes(now)
        if (self._taken_at is not None and now - self._taken_at < self.every_s
                and (live is None or live == self._live)):
            return
        first = self._taken_at is None
        self._taken_at = now
        self._live = live if live is not None else self._live
        if first:
            self.store.upsert_nodes(nodes=self.launcher.inventory())
        else:
            self._pending = self._pool.submit(self.launcher.inventory)

    def _live_nodes(self, now: float) -> frozenset[str] | None:
        """The cluster's live nodes, at most every `watch_every_s` (None between, or when
        the launcher cannot say)."""
        if now - self._watched_at < self.watch_every_s:
            return None
        self._watched_at = now
        try:
            return frozenset(c.node_id for c in self.launcher.total_capacity())
        except Exception:  # Ray away: the inventory when due says more
            log.debug("live nodes unknown", exc_info=True)
            return None

    def close(self) -> None:
        """Stop taking inventories; one in flight ends on its own (its result is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
