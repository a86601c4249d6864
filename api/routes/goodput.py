"""Where the time and the resources of jobs went: a job's goodput ledger
(`GET /jobs/{id}/goodput`) and the ledgers' totals over a window (`GET /goodput`), read by
`service.store.goodput` (docs/goodput.md). Any user may read them, as any user reads jobs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request

from api.auth import require
from api.deps import JobDep, StoreDep
from client.ledger import GoodputSummary, Ledger
from service.store.budgets import Budgets
from service.store.goodput import GoodputLedger
from service.store.tables import NAME_MAX

router = APIRouter(tags=["goodput"])
_READ = [Depends(require("jobs:read"))]


def ledgers(request: Request, store: StoreDep) -> GoodputLedger:
    """The store's ledgers, at the server's prices (`TRIDENT_PRICES`)."""
    return GoodputLedger(store, request.app.state.settings.prices)


LedgersDep = Annotated[GoodputLedger, Depends(ledgers)]
When = Annotated[datetime | None, Query(
    description="An ISO 8601 time (UTC when it names no zone).")]


def _refused(name: str, why: str) -> HTTPException:
    """A 422 shaped as FastAPI's own (the schema's `HTTPValidationError`), naming the query
    parameter."""
    return HTTPException(status_code=422, detail=[{
        "loc": ["query", name], "type": "value_error", "msg": f"{name}: {why}"}])


def _utc(t: datetime | None, name: str) -> datetime | None:
    if t is None:
        return None
    t = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    if t.year < 2000:
        raise _refused(name, f"{t.isoformat()} is before 2000")
    return t


@router.get("/jobs/{job_id}/goodput", response_model=Ledger, dependencies=_READ)
def job_goodput(job: JobDep, ledger: LedgersDep) -> Ledger:
    """Where the job's wall time went, from its submission to its end (or now), by category
    (they add up to it), what its ranks held meanwhile, its effective training time ratio,
    its goodput in tokens and, where prices are set, its cost."""
    return ledger.ledger(job.id)


@router.get("/goodput", response_model=GoodputSummary, dependencies=_READ)
def goodput(ledger: LedgersDep, store: StoreDep, since: When = None, until: When = None,
            project: Annotated[str | None, Query(min_length=1, max_length=NAME_MAX)] = None,
            owner: Annotated[str | None, Query(min_length=1, max_length=NAME_MAX)] = None,
            ) -> GoodputSummary:
    """The ledgers of the jobs that lived in [since, until] (each clipped to it), summed per
    project, per owner and over the cluster, with the jobs that lost the most time, and
    what the projects with a budget spent of it (since it was set)."""
    lo, hi = _utc(since, "since"), _utc(until, "until")
    if lo is not None and hi is not None and hi <= lo:
        raise _refused("until", "must be after since")
    out = ledger.summary(since=lo, until=hi, project=project, owner=owner)
    # The projects' budgets, each counted over its own window (not [since, until]).
    budgets = Budgets(store, ledger.prices).statuses([project] if project else None)
    return out.model_copy(update={"budgets": budgets})
