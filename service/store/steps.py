"""A stored step, typed on the way out: what a metrics row's `data` column holds.

`service.contract.reports.StepReport.row()` stores a step as the columns of `METRIC_COLUMNS`
plus one `data` JSON column; `Metric.report` (`service.store.views`) reads that column once into a
`StoredStep`: its collectives per dimension as `CommOpStats`, its memory as `MemoryReport`,
whether its collectives were timed, its pipeline bubble, its custom metrics and the other
figures, under the step report's own names. No reader outside the store's views takes a key
of `data` (a test greps for it).

`Metric.step_split()` is the one place a step's seconds in each dimension's collectives and
its compute (the rest of the step) are added up: the dashboard's communication steps, the
ranks grid (`service.views.rank_status`, and through it `GET /metrics`), the tracking
scalars and the monitor's `/comm` view (`service.monitor.comm.summarize_comm`, which reads
each op's bytes and calls from `StoredStep.comm`) read it; `GET /metrics`' per-op gauges
read `StoredStep.comm` as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.contract.reports import CommOpStats, CustomValue, MemoryReport

NESTED = frozenset({"memory", "comm", "custom"})
"""Parts of `data` read into their own types, not as figures at its top."""


@dataclass(frozen=True)
class StepSplit:
    """One timed step's seconds: in each dimension's collectives, and the compute left."""

    step_time_s: float
    comm_s: dict[str, float]
    """Seconds in each dimension's collectives (tp, pp, dp, or another group's name), in the
    order the step reported them."""
    compute_s: float
    """The step less every collective's seconds (never below 0)."""

    def dim_s(self, dim: str) -> float:
        """Seconds in `dim`'s collectives (0 for a dimension the step did not report)."""
        return self.comm_s.get(dim, 0.0)


@dataclass(frozen=True)
class StoredStep:
    """The `data` of one stored step report (`StepReport` less its columns), typed."""

    comm: dict[str, dict[str, CommOpStats]] | None
    """dim -> op -> stats; None when the step's collectives were not counted."""
    timed: bool
    """Whether `comm` carries times (False: bytes and calls only)."""
    memory: MemoryReport
    bubble_s: float | None
    custom: dict[str, CustomValue]
    loss_nonfinite: bool
    tokens: int | None
    epoch: float | None
    pp_rank: int | None
    """The pipeline stage the rank said it ran (None: not said)."""
    figures: dict[str, Any]
    """Every value at the top of `data` but the nested parts (`NESTED`), by its name: what
    the trackers export as it is (`service.tracking.scalars.row_numbers`)."""

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> StoredStep:
        """The step of a row's `data`, as stored (validated when the report was received;
        not again here: a page reads thousands of rows)."""
        mem = data.get("memory")
        comm = data.get("comm")
        custom = data.get("custom")
        return cls(
            comm=comm if isinstance(comm, dict) else None,
            timed=bool(data.get("timed", True)),
            memory=MemoryReport.model_construct(**mem) if isinstance(mem, dict)
            else MemoryReport(),
            bubble_s=b if isinstance(b := data.get("bubble_s"), int | float)
            and not isinstance(b, bool) else None,
            custom=dict(custom) if isinstance(custom, dict) else {},
            loss_nonfinite=bool(data.get("loss_nonfinite")),
            tokens=data.get("tokens"), epoch=data.get("epoch"),
            pp_rank=p if isinstance(p := data.get("pp_rank"), int)
            and not isinstance(p, bool) else None,
            figures={k: v for k, v in data.items() if k not in NESTED})

    def memory_figures(self) -> dict[str, Any]:
        """The memory fields the rank reported (None ones left out), by name."""
        return {k: v for k, v in self.memory.__dict__.items() if v is not None}

    def split(self, step_time_s: float) -> StepSplit | None:
        """Collective seconds per dimension and compute; None when the step's collectives
        were not counted or not timed."""
        if self.comm is None or not self.timed:
            return None
        per_dim = {dim: sum(o["time_s"] for o in ops.values())
                   for dim, ops in self.comm.items()}
        total = sum(o["time_s"] for ops in self.comm.values() for o in ops.values())
        return StepSplit(step_time_s=step_time_s, comm_s=per_dim,
                         compute_s=max(0.0, step_time_s - total))
