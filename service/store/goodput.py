"""The goodput ledger: where every second of a job went, read from what the store holds.

A job's wall time, from its submission to its end (or now), is split into the categories of
`client.ledger.CATEGORIES` (docs/goodput.md defines each), as segments that tile it:
`service.store.job_ledger` builds them from the job's events, attempts and steps,
`service.store.ledger_sums` adds them up, clips them to a window and prices them. This module
reads them: one job's, or those of the jobs that lived in a window, with their totals per
project, per owner and over the cluster, and what a project spent since a time (its budget).
An ended job's ledger never changes: it is kept on its row (`jobs.ledger`) once the job has
settled (`SETTLED`), and its costs are applied at the prices of the day it is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from client.ledger import GoodputSummary, GroupTotals, Ledger, LostJob, ProfilePrice
from service.contract.states import JobState
from service.store.engine import EngineTx
from service.store.job_ledger import compute
from service.store.ledger_sums import clip, cost_of, lost_s, totals
from service.store.store import Store
from service.store.tables import JobRow, utcnow
from service.store.views import aware

__all__ = ["GoodputLedger", "clip", "totals"]

SETTLED = timedelta(seconds=60)
"""An ended job's ledger is kept once it ended this long ago: the last poll of a stopped
group (its last steps) is stored beside the loop, after the job's end."""
TOP_LOST = 10
"""Jobs `GoodputSummary.top_lost` lists."""


class GoodputLedger(EngineTx):
    """Reads jobs' ledgers and their totals over a window."""

    def __init__(self, store: Store, prices: Mapping[str, ProfilePrice] | None = None) -> None:
        super().__init__(store)
        self.prices = dict(prices or {})

    # --- one job ------------------------------------------------------------------------------

    def ledger(self, job_id: int, *, now: datetime | None = None) -> Ledger:
        """The job's ledger (`NotFound`-free: the caller has read the job)."""
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                raise LookupError(f"job {job_id} not found")
            return self._priced(self._ledger_of(s, row, now or utcnow()))

    def _ledger_of(self, s: Session, row: JobRow, now: datetime) -> Ledger:
        if row.ledger:
            return Ledger.model_validate(row.ledger)
        out = compute(s, row, now)
        if JobState(row.state).terminal and row.finished_at is not None and \
                now - (aware(row.finished_at) or now) > SETTLED:
            row.ledger = out.model_dump(mode="json")
        return out

    def _priced(self, ledger: Ledger) -> Ledger:
        price = self.prices.get(ledger.profile)
        if price is None or (price.gpu_hour is None and price.cpu_hour is None):
            return ledger
        cats = [c.model_copy(update={"cost": cost_of(c.gpu_seconds, c.cpu_seconds, price)})
                for c in ledger.categories]
        cost = sum(c.cost or 0.0 for c in cats)
        per_rank = cost_of(ledger.gpus_per_rank, ledger.cpus_per_rank if not ledger.gpus_per_rank
                         else 0.0, price) or 0.0  # a rank-second's price, in hours
        planned = None
        if ledger.planned_cost is not None:  # stored as rank-seconds of the plan
            planned = ledger.planned_cost * per_rank
        return ledger.model_copy(update={
            "categories": cats, "cost": cost, "price": price, "planned_cost": planned,
            "cost_per_billion_tokens": cost / ledger.tokens * 1e9 if ledger.tokens else None})

    # --- many jobs ----------------------------------------------------------------------------

    def ledgers(self, *, since: datetime | None = None, until: datetime | None = None,
                project: str | None = None, owner: str | None = None,
                owners: Sequence[str] | None = None,
                projects: Sequence[str] | None = None) -> list[Ledger]:
        """The ledgers of the jobs that lived in [since, until], clipped to it; `owners` or
        `projects` (either) limit them to what a caller may see."""
        now = utcnow()
        until = min(until or now, now)
        with self._tx() as s:
            q = select(JobRow).where(JobRow.created_at <= until)
            if since is not None:
                q = q.where((JobRow.finished_at.is_(None)) | (JobRow.finished_at >= since))
            if project is not None:
                q = q.where(JobRow.project == project)
            if owner is not None:
                q = q.where(JobRow.owner == owner)
            if owners is not None or projects is not None:
                q = q.where(JobRow.owner.in_(list(owners or [])) |
                            JobRow.project.in_(list(projects or [])))
            out = []
            for row in s.execute(q.order_by(JobRow.id)).scalars():
                ledger = clip(self._ledger_of(s, row, now), since, until)
                if ledger.wall_s > 0:
                    out.append(self._priced(ledger))
            return out

    def settled(self, *, after: datetime | None, upto: datetime) -> list[Ledger]:
        """The whole ledgers of the jobs that ended in (after, upto], `upto` at least `SETTLED`
        ago: what a running total adds once and keeps (`GET /metrics`), since such a job's
        ledger never changes again."""
        upto = min(upto, utcnow() - SETTLED)
        q = select(JobRow).where(JobRow.finished_at.is_not(None), JobRow.finished_at <= upto)
        if after is not None:
            q = q.where(JobRow.finished_at > after)
        return self._whole(q)

    def unsettled(self, *, after: datetime) -> list[Ledger]:
        """The whole ledgers of the jobs that have not ended, or ended after `after`: the
        rest of every job's, beside `settled(upto=after)`."""
        return self._whole(select(JobRow).where(
            JobRow.finished_at.is_(None) | (JobRow.finished_at > after)))

    def _whole(self, q: Any) -> list[Ledger]:
        now = utcnow()
        with self._tx() as s:
            return [self._priced(self._ledger_of(s, row, now))
                    for row in s.execute(q.order_by(JobRow.id)).scalars()]

    def summary(self, *, since: datetime | None = None, until: datetime | None = None,
                project: str | None = None, owner: str | None = None,
                owners: Sequence[str] | None = None,
                projects: Sequence[str] | None = None) -> GoodputSummary:
        """Totals of `ledgers(...)`: per project, per owner and the cluster, and the jobs that
        lost the most time."""
        until = min(until or utcnow(), utcnow())
        found = self.ledgers(since=since, until=until, project=project, owner=owner,
                             owners=owners, projects=projects)
        by_project: dict[str, list[Ledger]] = {}
        by_owner: dict[str, list[Ledger]] = {}
        for ledger in found:
            by_project.setdefault(ledger.project or "", []).append(ledger)
            by_owner.setdefault(ledger.owner, []).append(ledger)
        lost = sorted(found, key=lost_s, reverse=True)[:TOP_LOST]
        return GoodputSummary(
            since=since, until=until, cluster=totals("cluster", found),
            projects=[totals(k, v) for k, v in sorted(by_project.items())],
            owners=[totals(k, v) for k, v in sorted(by_owner.items())],
            top_lost=[LostJob(job_id=x.job_id, name=x.name, project=x.project, owner=x.owner,
                              lost_s=lost_s(x), ettr=x.ettr) for x in lost if lost_s(x) > 0])

    def spent(self, *, project: str, since: datetime | None) -> GroupTotals:
        """What a project's jobs held since `since` (a budget's count)."""
        return totals(project, self.ledgers(since=since, project=project))
