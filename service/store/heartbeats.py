"""Each rank's last heartbeat as the controller saw it, kept in the database for the API.

The controller reads every rank's heartbeat at each poll (`service.monitor.attempt`), but the
API (`GET /metrics`, the ranks grid) is another process. `HeartbeatLog.record` writes, per
(job, attempt, rank), the wall time of the rank's last heartbeat on the controller's clock
(the poll's time less the heartbeat's monotonic `age_s`, as the hang detector judges it), so
its age, now - `seen_at`, grows while a rank is stuck in a collective and while it no longer
answers polls. `HeartbeatThrottle` keeps the cost bounded: one multi-row upsert per attempt
at most every `WRITE_EVERY_S` (so at most once a second per rank), of the ranks that changed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import RankHeartbeatRow
from service.store.views import aware

WRITE_EVERY_S = 1.0
"""An attempt's heartbeats are written at most this often."""


class HeartbeatLog(EngineTx):
    """Writes and reads the `rank_heartbeats` table on the store's engine."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._dialect = postgresql if store.engine.dialect.name == "postgresql" else sqlite

    def record(self, *, job_id: int, attempt: int, seen: Mapping[int, float]) -> None:
        """Upsert the ranks' last heartbeat times (`seen`: rank -> Unix seconds), one
        statement for all of them."""
        if not seen:
            return
        rows = [{"job_id": job_id, "attempt": attempt, "rank": rank,
                 "seen_at": datetime.fromtimestamp(t, UTC)} for rank, t in seen.items()]
        stmt = self._dialect.insert(RankHeartbeatRow)
        stmt = stmt.on_conflict_do_update(index_elements=["job_id", "attempt", "rank"],
                                          set_={"seen_at": stmt.excluded.seen_at})
        with self._tx() as s:
            s.execute(stmt, rows)

    def last_seen(self, *, job_id: int, attempt: int) -> dict[int, datetime]:
        """Every rank's last heartbeat time in `attempt` (ranks never seen are absent)."""
        with self._tx() as s:
            rows = s.execute(select(RankHeartbeatRow.rank, RankHeartbeatRow.seen_at).where(
                RankHeartbeatRow.job_id == job_id, RankHeartbeatRow.attempt == attempt)).all()
        return {int(rank): aware(seen) or seen for rank, seen in rows}


def ages(last: Mapping[int, datetime], now: datetime) -> dict[int, float]:
    """Seconds since each rank's last heartbeat (never negative: the clocks are one)."""
    return {rank: max(0.0, (now - t).total_seconds()) for rank, t in last.items()}


class HeartbeatThrottle:
    """What one attempt has written: writes the changed ranks at most every `every_s`."""

    def __init__(self, log: HeartbeatLog, job_id: int, attempt: int,
                 every_s: float = WRITE_EVERY_S) -> None:
        self.log = log
        self.job_id = job_id
        self.attempt = attempt
        self.every_s = every_s
        self._written: dict[int, float] = {}
        self._at = -every_s

    def offer(self, seen: Mapping[int, float], now: float | None = None) -> bool:
        """The ranks' newest heartbeat times; written when `every_s` has passed since the last
        write and one of them changed. Whether it wrote."""
        now = time.monotonic() if now is None else now
        if now - self._at < self.every_s:
            return False
        changed = {r: t for r, t in seen.items() if self._written.get(r) != t}
        if not changed:
            return False
        self.log.record(job_id=self.job_id, attempt=self.attempt, seen=changed)
        self._written.update(changed)
        self._at = now
        return True
