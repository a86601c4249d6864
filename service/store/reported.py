"""What a job's step reports carried of the monitor's figures, and what the views say of the
rest.

Trident's own trainer measures a rank's memory and collectives (a figure it samples is "not
measured" on the steps between). A `command:` job runs the team's own script: Trident sees its
steps, and whatever memory and collectives its ranks write to `TRIDENT_REPORT`
(`docs/command.md`); a figure its script did not write is "not reported", never 0 and never
a guess. `reported` is read by the memory rows of `service.views.prediction.compare` (the job
page, `trident describe`) and by the communication view (`service.monitor.comm.comm_view`,
the dashboard's Communication tab).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.store.views import Job, Metric

MEMORY_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_peak_bytes",
                 "process_peak_bytes")
"""The figures of a step's `memory` (`service.contract.reports.MemoryReport`)."""
NOT_MEASURED = "not measured"
NOT_REPORTED = "not reported"


def by_script(job: Job) -> bool:
    """Whether `job`'s figures come from its own script (a `command:` job), not from
    Trident's trainer."""
    return getattr(job.spec, "command", None) is not None


def reported(metrics: Sequence[Metric], *, script: bool) -> dict[str, Any]:
    """Over `metrics` (steps of one attempt, oldest first): each memory figure's newest value
    (None: no step carried it), the steps whose collectives were counted, and the words for
    a figure no step carried (`missing`)."""
    memory: dict[str, float | None] = dict.fromkeys(MEMORY_FIELDS)
    for m in metrics:
        for name in MEMORY_FIELDS:
            value = getattr(m.report.memory, name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                memory[name] = value
    return {"source": "script" if script else "trainer", "steps": len(metrics),
            "memory": memory,
            "comm_steps": sum(1 for m in metrics if m.report.comm is not None),
            "missing": NOT_REPORTED if script else NOT_MEASURED}
