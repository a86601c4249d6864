"""Project budgets: what a project's jobs spent since its budget was set, and what it implies.

A budget (set by an admin, `Identity.set_budget`, on the project's row) is any of GPU-hours,
CPU-hours (of ranks without a GPU) and money (at the server's prices, `TRIDENT_PRICES`),
counted from `budget_since`. What is spent is the goodput ledger's (`service.store.goodput`):
the GPU- and CPU-seconds the project's jobs held since then, each job's time clipped to the
window, and their cost where the jobs' profiles are priced. A money budget is judged only where
prices are set (without them nothing is spent in money). A budget of 0 is spent from the start.

What follows from it (docs/goodput.md): at `WARN_AT` of any budget the controller warns the
project's jobs that have not ended once (`budget` events; `budget_warned_at` says it was
said), at 100 % new jobs are refused (`refusal`), and with `budget_stop_running` the
controller cancels the project's jobs that have not ended (queued ones included, which would
start and spend) too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from client.ledger import BudgetStatus, ProfilePrice
from service.contract.states import TERMINAL
from service.store.engine import EngineTx
from service.store.goodput import GoodputLedger
from service.store.store import Store
from service.store.tables import JobRow, ProjectRow, utcnow
from service.store.views import aware

WARN_AT = 0.8
"""The share of a budget at which the project's jobs are warned (and the dashboard shows it)."""

UNITS = {"gpu_hours": "GPU-hours", "cpu_hours": "CPU-hours", "cost": "in cost"}
"""How a message names each budget's amounts."""


@dataclass(frozen=True)
class Budget:
    """A project's budget as stored."""

    project: str
    gpu_hours: float | None
    cpu_hours: float | None
    cost: float | None
    since: datetime
    warned_at: datetime | None
    stop_running: bool


def when(t: datetime | None) -> str:
    """A budget's start as its messages write it: `2026-12-01T00:00Z`."""
    return "-" if t is None else t.strftime("%Y-%m-%dT%H:%MZ")


def _share(spent: float | None, budget: float | None) -> float | None:
    if budget is None or spent is None:
        return None
    return 1.0 + spent if budget <= 0 else spent / budget


def shares(status: BudgetStatus) -> dict[str, tuple[float, float, float]]:
    """Each budget set (and judged) of `status`: (share spent, spent, budget), by name."""
    out = {}
    for name, spent, budget in (("gpu_hours", status.spent_gpu_hours, status.gpu_hours),
                                ("cpu_hours", status.spent_cpu_hours, status.cpu_hours),
                                ("cost", status.spent_cost, status.cost)):
        share = _share(spent, budget)
        if share is not None and spent is not None and budget is not None:
            out[name] = (share, spent, budget)
    return out


def worst(status: BudgetStatus) -> tuple[str, float, float, float] | None:
    """The budget of `status` spent the most (name, share, spent, budget); None: none judged."""
    found = shares(status)
    if not found:
        return None
    name = max(found, key=lambda k: found[k][0])
    return (name, *found[name])


def spent_text(status: BudgetStatus, name: str, spent: float, budget: float) -> str:
    """`10.3 of 10 GPU-hours since 2026-12-01T00:00Z`."""
    return f"{spent:.4g} of {budget:.4g} {UNITS[name]} since {when(status.since)}"


class Budgets(EngineTx):
    """Reads the projects' budgets and what their jobs spent of them."""

    def __init__(self, store: Store, prices: Mapping[str, ProfilePrice] | None = None) -> None:
        super().__init__(store)
        self.ledgers = GoodputLedger(store, prices)

    def budgets(self, projects: Sequence[str] | None = None) -> list[Budget]:
        """The projects that have a budget (of `projects` only, if given), by name."""
        with self._tx() as s:
            q = select(ProjectRow).where(ProjectRow.budget_since.is_not(None))
            if projects is not None:
                q = q.where(ProjectRow.name.in_(list(projects)))
            rows = s.execute(q.order_by(ProjectRow.name)).scalars()
            return [Budget(project=r.name, gpu_hours=r.budget_gpu_hours,
                           cpu_hours=r.budget_cpu_hours, cost=r.budget_cost,
                           since=aware(r.budget_since) or utcnow(),
                           warned_at=aware(r.budget_warned_at),
                           stop_running=bool(r.budget_stop_running)) for r in rows
                    if any(v is not None for v in (r.budget_gpu_hours, r.budget_cpu_hours,
                                                   r.budget_cost))]

    def status(self, budget: Budget) -> BudgetStatus:
        """What the project's jobs spent of `budget` so far."""
        spent = self.ledgers.spent(project=budget.project, since=budget.since)
        out = BudgetStatus(project=budget.project, since=budget.since,
                           gpu_hours=budget.gpu_hours, cpu_hours=budget.cpu_hours,
                           cost=budget.cost, spent_gpu_hours=spent.gpu_seconds / 3600,
                           spent_cpu_hours=spent.cpu_seconds / 3600,
                           spent_cost=spent.cost if spent.cost is not None else (
                               0.0 if self.ledgers.prices else None))
        top = worst(out)
        return out.model_copy(update={"used": top[1] if top is not None else 0.0})

    def statuses(self, projects: Sequence[str] | None = None) -> list[BudgetStatus]:
        """`status` of every project with a budget (of `projects` only, if given)."""
        return [self.status(b) for b in self.budgets(projects)]

    def refusal(self, project: str) -> str | None:
        """Why a new job of `project` is refused: a budget of it is spent (100 % or more);
        None: none is."""
        found = self.budgets([project])
        if not found:
            return None
        status = self.status(found[0])
        over = [(k, v) for k, v in shares(status).items() if v[0] >= 1.0]
        if not over:
            return None
        name, (_, spent, budget) = max(over, key=lambda kv: kv[1][0])
        return (f"project {project}: budget spent: {spent_text(status, name, spent, budget)};"
                f" an admin raises or removes it (trident project budget {project})")

    def unfinished(self, project: str) -> list[int]:
        """The project's jobs that have not ended and were not asked to stop, oldest first."""
        with self._tx() as s:
            return list(s.execute(select(JobRow.id).where(
                JobRow.project == project, JobRow.cancel_requested.is_(False),
                JobRow.state.not_in([st.value for st in TERMINAL])).order_by(JobRow.id))
                .scalars())

    def mark_warned(self, budget: Budget) -> bool:
        """Record that the project's jobs were warned about `budget`: True for the one caller
        that records it (the budget unchanged since it was read, not warned yet)."""
        with self._tx() as s:
            row = s.execute(select(ProjectRow).where(ProjectRow.name == budget.project)
                            .with_for_update()).scalar()
            if row is None or row.budget_warned_at is not None or \
                    aware(row.budget_since) != budget.since:
                return False
            row.budget_warned_at = utcnow()
            return True
