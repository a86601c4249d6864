"""The cluster's records: probes (`trident probe`, an attempt's health probe), the nodes the
controller last saw, and the calibrated hardware profiles that probes make.

`ClusterRecords` is a part of `Store` (`service.store.store`), which inherits its methods and
gives them its transactions: callers keep calling `store.list_nodes()`, and each method is one
transaction handing out the immutable views of `service.store.views`, as the job methods do.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from service.store.tables import NodeRow, ProbeRow, ProfileRow, utcnow
from service.store.views import (
    CalibratedProfile,
    Node,
    NotFound,
    Probe,
    ProbeStatus,
    node_of,
    probe_of,
)

_NODES = select(NodeRow.__table__).order_by(NodeRow.node_id)
_PROFILE = select(ProfileRow.__table__).where(ProfileRow.name == bindparam("name"))
# Every submission reads the nodes and its profile: one statement each, built once per
# process, outside a transaction (`service.store.engine.reads`).


class ClusterRecords:
    """Probes, nodes and calibrated profiles; `Store` supplies `_tx` and `_reads`."""

    _reads: Engine
    """Single reads outside a transaction (`service.store.engine.reads`)."""

    def _tx(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _check_fence(self, s: Session, fence: Any) -> None:
        """`Store`'s: NotHolder unless the `Fence`'s holder holds its lease."""
        raise NotImplementedError

    def create_probe(self, *, scope: str, request: dict[str, Any], job_id: int | None = None,
                     attempt: int | None = None,
                     status: ProbeStatus = ProbeStatus.PENDING) -> Probe:
        with self._tx() as s:
            row = ProbeRow(scope=scope, job_id=job_id, attempt=attempt, status=status.value,
                           request=request, results=[], summary={})
            s.add(row)
            s.flush()
            return probe_of(row)

    def claim_probes(self, *, scope: str, fence: Any = None) -> list[Probe]:
        """Pending probes of `scope`, marked running in the same transaction (with a `fence`,
        a `service.store.store.Fence`, only while its holder holds that lease: NotHolder
        otherwise)."""
        with self._tx() as s:
            if fence is not None:
                self._check_fence(s, fence)
            pending = ProbeRow.status == ProbeStatus.PENDING.value
            rows = list(s.execute(select(ProbeRow).where(ProbeRow.scope == scope, pending)
                                  .order_by(ProbeRow.id).with_for_update()).scalars())
            for r in rows:
                r.status = ProbeStatus.RUNNING.value
            return [probe_of(r) for r in rows]

    def finish_probe(self, *, probe_id: int, status: ProbeStatus, results: list[Any],
                     summary: dict[str, Any], error: str | None = None) -> None:
        with self._tx() as s:
            s.execute(update(ProbeRow).where(ProbeRow.id == probe_id)
                      .values(status=status.value, results=results, summary=summary, error=error,
                              finished_at=utcnow()))

    def get_probe(self, *, probe_id: int) -> Probe:
        with self._tx() as s:
            row = s.get(ProbeRow, probe_id)
            if row is None:
                raise NotFound(f"probe {probe_id} not found")
            return probe_of(row)

    def list_probes(self, *, job_id: int | None = None, scope: str | None = None,
                    limit: int = 20) -> list[Probe]:
        with self._tx() as s:
            q = select(ProbeRow)
            if job_id is not None:
                q = q.where(ProbeRow.job_id == job_id)
            if scope is not None:
                q = q.where(ProbeRow.scope == scope)
            rows = s.execute(q.order_by(ProbeRow.id.desc()).limit(limit)).scalars()
            return [probe_of(r) for r in rows]

    def upsert_nodes(self, *, nodes: Sequence[dict[str, Any]]) -> None:
        """Record the live nodes; nodes not in the list are marked dead, not forgotten."""
        with self._tx() as s:
            seen = {n["node_id"] for n in nodes}
            for row in s.execute(select(NodeRow)).scalars():
                row.alive = row.node_id in seen
            for n in nodes:
                found = s.get(NodeRow, n["node_id"])
                row = found if found is not None else NodeRow(node_id=n["node_id"])
                if found is None:
                    s.add(row)
                row.hostname = str(n.get("hostname", ""))[:255]
                row.info = n
                row.alive = True
                row.updated_at = utcnow()

    def list_nodes(self) -> list[Node]:
        with self._reads.connect() as c:
            rows = c.execute(_NODES).all()
        return [node_of(r) for r in rows]  # type: ignore[arg-type]  # same names

    def save_profile(self, *, name: str, profile: dict[str, Any],
                     probe_id: int | None = None) -> None:
        with self._tx() as s:
            row = s.get(ProfileRow, name)
            if row is None:
                row = ProfileRow(name=name)
                s.add(row)
            row.profile = profile
            row.probe_id = probe_id
            row.created_at = utcnow()

    def get_profile(self, *, name: str) -> CalibratedProfile | None:
        """The calibrated profile stored under `name`, if a probe has made one."""
        with self._reads.connect() as c:
            row = c.execute(_PROFILE, {"name": name}).first()
        return None if row is None else CalibratedProfile.from_row(row)  # type: ignore[arg-type]
