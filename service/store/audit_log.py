"""The audit log: every mutating request, who made it and how it was answered.

The API's audit middleware (`api.audit`) queues an entry per mutating request and writes a
batch in one transaction (`AuditLog.record_many`); `GET /api/v1/audit` reads it
(`AuditLog.list_audit`). `service.store.identity.Identity` is an `AuditLog`: the log is read
and written beside the users and tokens it names, on the same engine.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from client.payloads import AuditEntry
from service.store.engine import EngineTx
from service.store.tables import AuditRow, utcnow
from service.store.views import aware


class AuditLog(EngineTx):
    """The audit log's rows on an engine: written in batches, read oldest first."""

    def record_many(self, entries: list[dict[str, Any]]) -> None:
        """Audit rows (`actor`, `client`, `method`, `path`, `action`, `status`), in one
        transaction."""
        with self._tx() as s:
            s.add_all(AuditRow(actor=e["actor"], client=(e["client"] or "")[:64] or None,
                               method=e["method"][:8], path=e["path"][:512],
                               action=e["action"], status=e["status"], time=e.get("time")
                               or utcnow()) for e in entries)

    def list_audit(self, *, actor: str | None = None, after_id: int = 0,
                   limit: int = 200) -> list[AuditEntry]:
        """Audit entries after `after_id`, oldest first."""
        with self._tx() as s:
            q = select(AuditRow).where(AuditRow.id > after_id)
            if actor is not None:
                q = q.where(AuditRow.actor == actor)
            rows = s.execute(q.order_by(AuditRow.id).limit(limit)).scalars()
            return [AuditEntry(id=r.id, time=aware(r.time) or utcnow(), actor=r.actor,
                               client=r.client, method=r.method, path=r.path, action=r.action,
                               status=r.status) for r in rows]
