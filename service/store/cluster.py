"""The cluster's records: probes (`trident probe`, an attempt's health probe), the nodes the
controller last saw, and the calibrated hardware profiles that probes make.

`ClusterRecords` is a part of `Store` (`service.store.store`), which inherits its methods and
gives them its transactions: callers keep calling `store.list_nodes()`, and each method is one
transaction handing out the immutable views of `service.store.views`, as the job methods do.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
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
    slow_link_event,
)

_NODES = select(NodeRow.__table__).order_by(NodeRow.node_id)
_PROFILE = select(ProfileRow.__table__).where(ProfileRow.name == bindparam("name"))
# Every submission reads the nodes and its profile: one statement each, built once per
# process, outside a transaction (`service.store.engine.reads`).

NODE_EVENTS = 20
"""A node keeps its newest this many events (`Node.events`)."""
LEMON_BY = "trident"
"""Who cordoned a node the lemon rule cordoned."""


class AmbiguousNode(ValueError):
    """A HOST (`Store.find_node`) that names more than one node."""


def _event(row: NodeRow, kind: str, by: str, message: str, **data: Any) -> None:
    events = list(row.events or [])
    events.append({"time": utcnow().isoformat(), "kind": kind, "by": by, "message": message,
                   "data": data})
    row.events = events[-NODE_EVENTS:]  # a new list: SQLAlchemy sees a JSON change so


def _carry_cordon(old: NodeRow, new: NodeRow) -> None:
    """`new` (a node rejoined at `old`'s address) cordoned as `old` was; `old` no longer."""
    now = utcnow()
    new.cordoned_at, new.cordoned_by, new.cordon_reason = (old.cordoned_at, old.cordoned_by,
                                                          old.cordon_reason)
    new.drained_at = old.drained_at or (now if old.drain_deadline is not None else None)
    new.drain_deadline = old.drain_deadline
    new.events = list(old.events or [])
    _event(new, "cordon", "trident", f"rejoined as a new Ray node (was {old.node_id[:12]}):"
           " still cordoned")
    old.cordoned_at = old.cordoned_by = old.cordon_reason = None
    old.drain_deadline = old.drained_at = None


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
        """Record the live nodes; nodes not in the list are marked dead, not forgotten.

        A node new at the address of a dead cordoned one (its host rejoined: after a reboot,
        or after it was cut off long enough for Ray to mark it dead, Ray gives it a new node
        id) takes that cordon over, with an event saying so: an operator cordons a host, not
        one run of its Ray. A drain carried over is done (its jobs moved when the host was
        lost); the host stays cordoned until `uncordon`."""
        with self._tx() as s:
            seen = {n["node_id"] for n in nodes}
            rows = list(s.execute(select(NodeRow)).scalars())
            for row in rows:
                row.alive = row.node_id in seen
            cordoned = {str(r.info.get("address")): r for r in rows
                        if not r.alive and r.cordoned_at is not None and r.info.get("address")}
            for n in nodes:
                found = s.get(NodeRow, n["node_id"])
                row = found if found is not None else NodeRow(node_id=n["node_id"])
                if found is None:
                    s.add(row)
                    if (old := cordoned.pop(str(n.get("address")), None)) is not None:
                        _carry_cordon(old, row)
                row.hostname = str(n.get("hostname", ""))[:255]
                row.info = n
                row.alive = True
                row.updated_at = utcnow()

    def list_nodes(self) -> list[Node]:
        with self._reads.connect() as c:
            rows = c.execute(_NODES).all()
        return [node_of(r) for r in rows]  # type: ignore[arg-type]  # same names

    def find_node(self, host: str) -> Node:
        """The node `host` names: its id, a unique prefix of its id, its hostname or its
        address (as `trident cluster` shows them). Where several match, the one alive among
        them. NotFound when none does; AmbiguousNode when several (alive) do."""
        nodes = self.list_nodes()
        exact = [n for n in nodes if n.node_id == host]
        if exact:
            return exact[0]
        found = [n for n in nodes if n.node_id.startswith(host)
                 or host in (n.hostname, n.info.get("address"))]
        if len(found) > 1 and sum(n.alive for n in found) >= 1:
            found = [n for n in found if n.alive]
        if not found:
            raise NotFound(f"no node {host!r}: give a node id (or a unique prefix of one), a"
                           " hostname or an address, as `trident cluster` shows them")
        if len(found) > 1:
            named = ", ".join(f"{n.node_id[:12]} ({n.hostname}, {n.info.get('address', '-')})"
                              for n in found[:5])
            raise AmbiguousNode(f"{host!r} names {len(found)} nodes: {named}; give a node id"
                                " (or a longer prefix of one)")
        return found[0]

    def cordon_node(self, *, node_id: str, by: str, reason: str,
                    drain_grace_s: float | None = None) -> Node:
        """No new rank is placed on the node from the controller's next pass (a node cordoned
        already stays so, as it was cordoned). With `drain_grace_s`, a drain too: the jobs with
        ranks there are asked to save a checkpoint and move, and get that long to stop (a drain
        of a node draining or drained starts again, with this deadline)."""
        with self._tx() as s:
            row = s.get(NodeRow, node_id, with_for_update=True)
            if row is None:
                raise NotFound(f"no node {node_id!r}")
            now = utcnow()
            if row.cordoned_at is None:
                row.cordoned_at, row.cordoned_by, row.cordon_reason = now, by[:255], reason
                if drain_grace_s is None:
                    _event(row, "cordon", by, f"cordoned by {by}: {reason}")
            if drain_grace_s is not None:
                row.drain_deadline = now + timedelta(seconds=drain_grace_s)
                row.drained_at = None
                _event(row, "drain", by, f"drained by {by}: {reason}; its jobs save a"
                       f" checkpoint and move within {drain_grace_s:g} s",
                       grace_s=drain_grace_s)
            s.flush()
            return node_of(row)

    def uncordon_node(self, *, node_id: str, by: str) -> Node:
        """New ranks may be placed on the node again (a drain in progress stops asking)."""
        with self._tx() as s:
            row = s.get(NodeRow, node_id, with_for_update=True)
            if row is None:
                raise NotFound(f"no node {node_id!r}")
            if row.cordoned_at is not None:
                row.cordoned_at = row.cordoned_by = row.cordon_reason = None
                row.drain_deadline = row.drained_at = None
                row.failures = None  # the lemon rule counts afresh
                _event(row, "uncordon", by, f"uncordoned by {by}: new ranks may be placed here")
            s.flush()
            return node_of(row)

    def node_drained(self, *, node_id: str, moved: Sequence[int]) -> None:
        """The controller saw a draining node without active ranks: the drain is done."""
        with self._tx() as s:
            row = s.get(NodeRow, node_id, with_for_update=True)
            if row is None or row.drain_deadline is None or row.drained_at is not None:
                return
            row.drained_at = utcnow()
            jobs = f" (moved: job {', '.join(map(str, moved))})" if moved else ""
            _event(row, "drained", LEMON_BY, f"drained: no active job's ranks left here{jobs}",
                   moved=list(moved))

    def note_node_failures(self, *, node_ids: Sequence[str], job_id: int, attempt: int,
                           threshold: int, window_s: float) -> list[Node]:
        """An attempt whose ranks on `node_ids` failed: each node counts it within its window;
        those where `threshold` failed attempts are counted now are cordoned (the lemon rule),
        with the reason. The nodes cordoned by this call."""
        cordoned = []
        with self._tx() as s:
            now = utcnow()
            since = (now - timedelta(seconds=window_s)).isoformat()
            for node_id in sorted(set(node_ids)):
                row = s.get(NodeRow, node_id, with_for_update=True)
                if row is None:
                    continue
                kept = [f for f in row.failures or [] if f["time"] >= since]
                kept.append({"time": now.isoformat(), "job_id": job_id, "attempt": attempt})
                row.failures = kept[-max(threshold, 1):]
                if row.cordoned_at is not None or len(kept) < threshold:
                    continue
                named = ", ".join(f"job {f['job_id']} attempt {f['attempt']}"
                                  for f in row.failures)
                attempts = "attempt" if len(kept) == 1 else "attempts"
                reason = (f"lemon: ranks here failed {len(kept)} {attempts} within"
                          f" {window_s:g} s ({named}); cordoned until an admin uncordons it")
                row.cordoned_at, row.cordoned_by, row.cordon_reason = now, LEMON_BY, reason
                _event(row, "lemon", LEMON_BY, reason, failures=row.failures)
                s.flush()
                cordoned.append(node_of(row))
        return cordoned

    def mark_slow_link(self, *, node_id: str, slow: bool, by: str, message: str,
                       data: dict[str, Any] | None = None) -> bool:
        """A probe found the node's links slow (`slow`), or healthy: a `slow_link` or a
        `link_ok` event on the node when that changes what its events say (`Node.slow_link`:
        the newer of the two kinds). Whether it changed."""
        with self._tx() as s:
            row = s.get(NodeRow, node_id, with_for_update=True)
            if row is None:
                return False
            if (slow_link_event(row.events) is not None) == slow:
                return False
            _event(row, "slow_link" if slow else "link_ok", by, message, **(data or {}))
            return True

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
