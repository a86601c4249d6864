"""Projects' budgets, beside the controller's loop: the 80 % warning and the stop at 100 %.

At most every `every_s` seconds (a ledger is read per project, not per pass), for each project
with a budget and active jobs (`service.store.budgets`): once its spend passes `WARN_AT` of a
budget, each of its jobs that has not ended gets one `budget` event and the project's row
records that it was said (`budget_warned_at`, cleared when the budget is set again), so it is
said once per budget; once a budget is spent and the admin set `stop_running`, each of its
jobs that has not ended (queued ones too: they would start and spend) gets a `budget` event
saying why and is cancelled as a cancel request is (the next pass stops its ranks). Without
`stop_running` they are left to finish; new ones are refused at submission
(`api.routes.jobs`). Only projects with jobs that hold resources are read: no other project's
spend grows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from service.contract.prices import ProfilePrice
from service.contract.states import TransitionError
from service.store import Job, Store
from service.store.budgets import WARN_AT, Budgets, spent_text, worst

log = logging.getLogger(__name__)

EVERY_S = 5.0
"""How often the budgets are read (seconds)."""


class BudgetWatch:
    """Warns a project's jobs at 80 % of its budget; stops them at 100 % where asked."""

    def __init__(self, store: Store, prices: Mapping[str, ProfilePrice] | None = None, *,
                 every_s: float = EVERY_S) -> None:
        self.store = store
        self.budgets = Budgets(store, prices)
        self.every_s = every_s
        self._last: float | None = None

    def step(self, active: Sequence[Job]) -> None:
        """Read the budgets of the projects with jobs in `active` (the pass's jobs that hold
        resources: those whose spend grows), unless they were read less than `every_s` ago."""
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        projects = sorted({j.project for j in active if j.project is not None})
        if not projects:
            return
        for budget in self.budgets.budgets(projects):
            status = self.budgets.status(budget)
            top = worst(status)
            if top is None:
                continue
            name, share, spent, amount = top
            said = spent_text(status, name, spent, amount)
            data = {"project": budget.project, "budget": name, "spent": spent,
                    "amount": amount, "used": share, "since": status.since.isoformat()
                    if status.since else None}
            if share >= WARN_AT and budget.warned_at is None and \
                    self.budgets.mark_warned(budget):
                for job_id in self.budgets.unfinished(budget.project):
                    self.store.add_event(
                        job_id=job_id, kind="budget", data={**data, "warning": True},
                        message=f"project {budget.project} spent {share:.0%} of its budget:"
                        f" {said}; its new jobs are refused at 100 %" + (
                            " and its jobs cancelled" if budget.stop_running else ""))
            if share >= 1.0 and budget.stop_running:
                for job_id in self.budgets.unfinished(budget.project):
                    self._stop(job_id, f"project {budget.project}: budget spent: {said}; its"
                               " jobs are cancelled (stop_running)", data)

    def _stop(self, job_id: int, message: str, data: dict[str, object]) -> None:
        self.store.add_event(job_id=job_id, kind="budget", message=message,
                             data={**data, "stopped": True})
        try:
            self.store.request_cancel(job_id=job_id)
        except TransitionError:  # it ended meanwhile
            return
        log.info("job %s: %s", job_id, message)
