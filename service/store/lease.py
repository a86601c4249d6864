"""The leader's lease: a row in the database that says which controller may act, and until when.

Exactly one controller admits, starts and watches jobs: the one holding the `controller` lease.
It renews the lease every pass; a standby tries to take it every pass and gets it only once the
holder has let it expire (died, hung, or lost the database). Taking or renewing is one
transaction that reads the row under a lock (SQLite: the store's BEGIN IMMEDIATE; PostgreSQL:
SELECT ... FOR UPDATE) and writes it only when the caller holds it already or it has expired,
so two controllers can never both hold it. `epoch` counts hand-overs (a fencing token).

Times are UTC from the caller's clock (`now`, explicit in the tests): the controllers' clocks
must agree to well within the lease duration (NTP does).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from weakref import WeakKeyDictionary

from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import IntegrityError

from service.store.engine import EngineTx
from service.store.store import Store
from service.store.tables import LeaseRow, utcnow
from service.store.views import aware

CONTROLLER = "controller"
"""The lease the controller daemon holds while it acts."""


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str
    epoch: int
    acquired_at: datetime
    renewed_at: datetime
    expires_at: datetime
    last_pass_s: float | None = None
    """The duration of the holder's previous controller pass, as of the last renewal."""

    @classmethod
    def from_row(cls, row: LeaseRow) -> Lease:
        return cls(name=row.name, holder=row.holder, epoch=row.epoch,
                   acquired_at=_utc(row.acquired_at), renewed_at=_utc(row.renewed_at),
                   expires_at=_utc(row.expires_at), last_pass_s=row.last_pass_s)

    def held(self, now: datetime) -> bool:
        """Whether the lease is unexpired at `now`."""
        return self.expires_at > now


def _utc(t: datetime) -> datetime:
    out = aware(t)
    assert out is not None
    return out


_READ = select(LeaseRow.name, LeaseRow.holder, LeaseRow.epoch, LeaseRow.acquired_at,
               LeaseRow.renewed_at, LeaseRow.expires_at, LeaseRow.last_pass_s
               ).where(LeaseRow.name == bindparam("name"))


class Leases(EngineTx):
    """The lease functions, on the store's transactions (one each, keyword-only)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)

    @classmethod
    def of(cls, store: Store) -> Leases:
        """`store`'s Leases, made once per store: every `/healthz` and every scrape of
        `/metrics` reads the lease."""
        found = _OF.get(store)
        if found is None:
            found = _OF[store] = cls(store)
        return found

    def acquire(self, *, name: str, holder: str, duration_s: float,
                now: datetime | None = None,
                last_pass_s: float | None = None) -> tuple[bool, Lease | None]:
        """Take or renew `name` for `holder` until `now + duration_s`, when `holder` holds it
        or it has expired. Returns whether `holder` holds it now, and the lease as it is.
        `last_pass_s` (the holder's previous pass) is written with the renewal."""
        now = now or utcnow()
        until = now + timedelta(seconds=duration_s)
        try:
            with self._tx() as s:
                row = s.execute(select(LeaseRow).where(LeaseRow.name == name)
                                .with_for_update()).scalar()
                if row is None:
                    row = LeaseRow(name=name, holder=holder, epoch=1, acquired_at=now,
                                   renewed_at=now, expires_at=until)
                    s.add(row)
                    s.flush()
                    return True, Lease.from_row(row)
                if row.holder != holder and _utc(row.expires_at) > now:
                    return False, Lease.from_row(row)
                if row.holder != holder:
                    row.holder = holder
                    row.epoch += 1
                    row.acquired_at = now
                row.renewed_at = now
                row.expires_at = until
                row.last_pass_s = last_pass_s
                return True, Lease.from_row(row)
        except IntegrityError:
            # Another controller created the row first (PostgreSQL: both saw none): it holds it.
            return False, self.read(name=name)

    def release(self, *, name: str, holder: str, now: datetime | None = None) -> bool:
        """Let the lease expire now, if `holder` holds it, so that a standby takes over at
        once; whether it did."""
        with self._tx() as s:
            done = s.execute(update(LeaseRow)
                             .where(LeaseRow.name == name, LeaseRow.holder == holder)
                             .values(expires_at=now or utcnow()))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    def read(self, *, name: str) -> Lease | None:
        """The lease as it is: one statement, without a transaction's write lock (every
        `/healthz` reads it)."""
        with self._reads.connect() as c:
            row = c.execute(_READ, {"name": name}).first()
        if row is None:
            return None
        return Lease(name=row.name, holder=row.holder, epoch=row.epoch,
                     acquired_at=_utc(row.acquired_at), renewed_at=_utc(row.renewed_at),
                     expires_at=_utc(row.expires_at), last_pass_s=row.last_pass_s)


_OF: WeakKeyDictionary[Store, Leases] = WeakKeyDictionary()


class Role(StrEnum):
    LEADER = "leader"
    """This process holds the lease: it acts."""
    STANDBY = "standby"
    """Another process holds it: wait."""
    LOST = "lost"
    """This process held it and another one holds it now: stop acting at once."""


def holder_id() -> str:
    """A name for this process that no other process (here or on another host) shares."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Leader:
    """One process's claim on a lease: `acquire_or_renew` every pass, act only as LEADER."""

    def __init__(self, store: Store, *, duration_s: float, holder: str | None = None,
                 name: str = CONTROLLER) -> None:
        self.leases = Leases(store)
        self.duration_s = duration_s
        self.holder = holder or holder_id()
        self.name = name
        self.holding = False
        self.lease: Lease | None = None
        """The lease as last read or written (who holds it, until when)."""

    def acquire_or_renew(self, now: datetime | None = None,
                         last_pass_s: float | None = None) -> Role:
        held, self.lease = self.leases.acquire(name=self.name, holder=self.holder,
                                               duration_s=self.duration_s, now=now,
                                               last_pass_s=last_pass_s)
        was, self.holding = self.holding, held
        if held:
            return Role.LEADER
        return Role.LOST if was else Role.STANDBY

    def expired(self, now: datetime | None = None) -> bool:
        """Whether this process's own lease has run out (it could not renew in time)."""
        return self.lease is None or not self.lease.held(now or utcnow())

    def release(self, now: datetime | None = None) -> None:
        if self.holding:
            self.leases.release(name=self.name, holder=self.holder, now=now)
            self.holding = False
