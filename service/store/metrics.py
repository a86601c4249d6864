"""Metrics of jobs of any size: a job-level row per step, per-rank rows only where they tell.

Every rank reports every optimizer step. Stored as they come, a 4,096-rank job at a step a
second would write 350 million rows a day, and every chart would read them back. So the
controller hands each poll's reports to `MetricsIngest.record`, which writes in one
transaction:

- one `step_metrics` row per (job, attempt, step): how many ranks reported, the mean, spread
  (standard deviation, min, max) of their step times, the worst rank, the loss and the job's
  tokens/s (set by its slowest rank). Reports of one step that come in several polls are merged
  into it; which ranks are merged is kept (`rank_bits`) until all have reported, so a report
  sent again (stored, but its acknowledgement lost) is merged once;
- per-rank `metrics` rows (`Store.list_metrics`, `latest_metric`, the API's `/metrics`) for
  every rank of a job of up to `FULL_RANKS` ranks (as before); for a larger job for rank 0,
  about `SAMPLED_RANKS` ranks spread evenly over the job, and every straggler in full (a rank
  whose step took over `STRAGGLER` times the step's median);
- retention: a job's per-rank rows other than rank 0's are kept for its last `RETAIN_STEPS`
  steps, then for every `KEEP_EVERY`-th step only (`compact`, run as the steps go by). The
  step rows stay: they are the job's history, one row a step, and a chart over a long run
  reads them downsampled (`list_steps(every=N)`).

Writes are batched: one INSERT of all per-rank rows of a poll, one read and one write per step
touched. `service.store.store` keeps the queries of the other tables; this module keeps those of
`step_metrics` and the retention of `metrics` (every table is declared in
`service.store.tables`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    and_,
    bindparam,
    delete,
    or_,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from service.store.engine import EngineTx
from service.store.store import Metric, Store
from service.store.tables import MetricRow, StepMetricRow, utcnow
from service.store.views import aware

FULL_RANKS = 64
"""Jobs of up to this many ranks keep every rank's row for every step."""
SAMPLED_RANKS = 32
"""Larger jobs keep about this many ranks (evenly spread, rank 0 among them) every step."""
STRAGGLER = 1.10
"""A rank whose step time exceeds this times the step's median is kept in full."""
RETAIN_STEPS = 86_400
"""Per-rank rows (rank 0 aside) of a job's newest steps kept in full: a day at a step a second."""
KEEP_EVERY = 100
"""Beyond `RETAIN_STEPS`, the per-rank rows of every this-many-th step are kept."""
COMPACT_EVERY = 1_000
"""Retention runs when a job's step passes a multiple of this."""


_NEWEST = (select(MetricRow.attempt, MetricRow.step, MetricRow.id, MetricRow.time)
           .where(MetricRow.job_id == bindparam("job_id"), MetricRow.rank == bindparam("rank"))
           .order_by(MetricRow.attempt.desc(), MetricRow.step.desc()).limit(1))
"""`newest_in`, which every poll of a job's page runs: built once per process."""


Newest = tuple[int, int, int, datetime]
"""(attempt, step, row id, time) of a rank's newest row in its newest attempt: the row
`MetricsIngest.recent_metrics` would end with."""


def newest_in(c: Connection, job_id: int, rank: int = 0) -> Newest | None:
    """Rank `rank`'s `Newest` row of job `job_id`, read on `c`: what says that a job's
    comparison with its plan is still the one worked out before (a job's page reads it with
    the job, `service.store.dashboard.job_page`)."""
    row = c.execute(_NEWEST, {"job_id": job_id, "rank": rank}).first()
    return None if row is None else (row[0], row[1], row[2], row[3])


@dataclass(frozen=True)
class StepMetric:
    """A step of a job over all of its ranks, as the dashboard charts it."""

    attempt: int
    step: int
    ranks: int
    world_size: int
    loss: float | None
    step_time_mean: float
    step_time_std: float
    step_time_min: float
    step_time_max: float
    worst_rank: int
    tokens_per_s: float | None
    stragglers: int
    time: datetime
    lr: float | None = None
    grad_norm: float | None = None
    eval_loss: float | None = None
    tokens: int | None = None
    epoch: float | None = None

    @property
    def complete(self) -> bool:
        return self.ranks >= self.world_size

    @classmethod
    def from_row(cls, r: StepMetricRow) -> StepMetric:
        mean = r.step_time_sum / r.ranks
        var = max(0.0, r.step_time_sumsq / r.ranks - mean * mean)
        return cls(attempt=r.attempt, step=r.step, ranks=r.ranks, world_size=r.world_size,
                   loss=r.loss, step_time_mean=mean, step_time_std=math.sqrt(var),
                   step_time_min=r.step_time_min, step_time_max=r.step_time_max,
                   worst_rank=r.worst_rank, tokens_per_s=r.tokens_per_s,
                   stragglers=r.stragglers, time=aware(r.time) or r.time, lr=r.lr,
                   grad_norm=r.grad_norm, eval_loss=r.eval_loss, tokens=r.tokens,
                   epoch=r.epoch)


def sample_stride(world_size: int) -> int:
    """Ranks r with r % stride == 0 are kept every step (1: all of them)."""
    return 1 if world_size <= FULL_RANKS else max(1, world_size // SAMPLED_RANKS)


def kept(rows: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """The per-rank rows of one step's reports that are stored: all of a small job's; of a
    large job's, the sampled ranks and the stragglers (against this batch's median)."""
    stride = sample_stride(world_size)
    if stride == 1:
        return list(rows)
    slow = STRAGGLER * statistics.median(r["step_time_s"] for r in rows)
    return [r for r in rows if r["rank"] % stride == 0 or r["step_time_s"] > slow]


def _merge_spans(row: StepMetricRow, reports: Iterable[dict[str, Any]]) -> None:
    """The goodput ledger's step columns, over the ranks reported so far: the step ended
    when its slowest rank's update did, and its evaluation, save and load took as long as
    the longest rank's."""
    for r in reports:
        data = r.get("data") or {}
        ended = data.get("ended_at")
        if ended is not None:
            at = datetime.fromtimestamp(ended, UTC)
            current = aware(row.ended_at)
            if current is None or at > current:
                row.ended_at = at
        for name in ("eval_s", "save_s", "load_s"):
            value = data.get(name)
            if value is not None and (getattr(row, name) is None or value > getattr(row, name)):
                setattr(row, name, value)


class MetricsIngest(EngineTx):
    """Writes and reads a job's metrics at any number of ranks, on the store's transactions."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._dialect = postgresql if store.engine.dialect.name == "postgresql" else sqlite

    def record(self, *, job_id: int, attempt: int, world_size: int,
               rows: Sequence[dict[str, Any]]) -> int:
        """Store a poll's step reports (`StepReport.row()`, already validated) in one
        transaction; return how many per-rank rows were kept. Idempotent: reports stored
        before change nothing."""
        if not rows:
            return 0
        by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_step[r["step"]].append(r)
        now = utcnow()
        per_rank = [{"job_id": job_id, "attempt": attempt, "step": r["step"], "rank": r["rank"],
                     "loss": r.get("loss"), "step_time_s": r["step_time_s"],
                     "tokens_per_s": r["tokens_per_s"], "lr": r.get("lr"),
                     "grad_norm": r.get("grad_norm"), "data": r.get("data") or {},
                     "time": now}
                    for step_rows in by_step.values() for r in kept(step_rows, world_size)]
        with self._tx() as s:
            if per_rank:
                s.execute(self._dialect.insert(MetricRow).on_conflict_do_nothing(), per_rank)
            self._merge_steps(s, job_id, attempt, world_size, by_step, now)
        crossed = [st for st in by_step if st % COMPACT_EVERY == 0 and st > RETAIN_STEPS]
        if crossed:
            self.compact(job_id=job_id, attempt=attempt, before_step=max(crossed) - RETAIN_STEPS)
        return len(per_rank)

    def _merge_steps(self, s: Session, job_id: int, attempt: int, world_size: int,
                     by_step: dict[int, list[dict[str, Any]]], now: datetime) -> None:
        found = {r.step: r for r in s.execute(
            select(StepMetricRow).where(StepMetricRow.job_id == job_id,
                                        StepMetricRow.attempt == attempt,
                                        StepMetricRow.step.in_(list(by_step)))
            .with_for_update()).scalars()}
        for step, reports in by_step.items():
            row = found.get(step)
            if row is not None and row.rank_bits is None:
                continue  # complete: every report is a repeat
            bits = int.from_bytes(row.rank_bits, "little") if row is not None and row.rank_bits \
                else 0
            fresh: dict[int, dict[str, Any]] = {}
            for r in reports:
                if not bits >> r["rank"] & 1:
                    fresh[r["rank"]] = r
            if not fresh:
                continue
            times = [r["step_time_s"] for r in fresh.values()]
            slow = STRAGGLER * statistics.median(times)
            worst = max(fresh.values(), key=lambda r: r["step_time_s"])
            if row is None:
                row = StepMetricRow(job_id=job_id, attempt=attempt, step=step, ranks=0,
                                    world_size=world_size, loss=None, step_time_sum=0.0,
                                    step_time_sumsq=0.0, step_time_min=math.inf,
                                    step_time_max=-1.0, worst_rank=worst["rank"],
                                    tokens_per_s=None, stragglers=0)
                s.add(row)
            for rank in fresh:
                bits |= 1 << rank
            row.ranks += len(fresh)
            row.step_time_sum += sum(times)
            row.step_time_sumsq += sum(t * t for t in times)
            row.step_time_min = min(row.step_time_min, min(times))
            if worst["step_time_s"] > row.step_time_max:
                row.step_time_max, row.worst_rank = worst["step_time_s"], worst["rank"]
            rates = [r["tokens_per_s"] for r in fresh.values() if r["tokens_per_s"] is not None]
            if row.tokens_per_s is not None:
                rates.append(row.tokens_per_s)
            row.tokens_per_s = min(rates) if rates else None  # None: no rank knew it
            row.stragglers += sum(1 for t in times if t > slow)
            first = fresh.get(0) or next(iter(fresh.values()))
            if row.loss is None:
                row.loss = first.get("loss")
            if row.lr is None:  # one value for the step, whichever rank brings it
                row.lr, row.grad_norm = first.get("lr"), first.get("grad_norm")
            data = first.get("data") or {}
            for name in ("eval_loss", "tokens", "epoch", "resumed_from"):  # every rank's
                if getattr(row, name) is None and data.get(name) is not None:
                    setattr(row, name, data[name])
            _merge_spans(row, fresh.values())
            row.rank_bits = None if row.ranks >= world_size else \
                bits.to_bytes((world_size + 7) // 8, "little")
            row.time = now

    def whole(self, *, job_id: int, attempt: int, step: int) -> bool:
        """Whether every rank's report of the step is stored (`service.control.tag_recovery`)."""
        with self._tx() as s:
            return s.execute(select(StepMetricRow.step).where(
                StepMetricRow.job_id == job_id, StepMetricRow.attempt == attempt,
                StepMetricRow.step == step, StepMetricRow.rank_bits.is_(None))).first() \
                is not None

    def compact(self, *, job_id: int, attempt: int, before_step: int) -> int:
        """Retention: drop the per-rank rows (rank 0's aside) of steps before `before_step`,
        except every `KEEP_EVERY`-th step's. Returns how many rows went."""
        with self._tx() as s:
            res = s.execute(delete(MetricRow).where(
                MetricRow.job_id == job_id, MetricRow.attempt == attempt,
                MetricRow.step < before_step, MetricRow.rank != 0,
                MetricRow.step % KEEP_EVERY != 0))
            return int(getattr(res, "rowcount", 0) or 0)

    def list_steps(self, *, job_id: int, attempt: int | None = None, after_step: int = 0,
                   limit: int = 10000, every: int = 1) -> list[StepMetric]:
        """A job's steps over all ranks, oldest first; `every` > 1 keeps the steps that are
        multiples of it (a long run's chart)."""
        with self._tx() as s:
            q = select(StepMetricRow).where(StepMetricRow.job_id == job_id,
                                            StepMetricRow.step > after_step)
            if attempt is not None:
                q = q.where(StepMetricRow.attempt == attempt)
            if every > 1:
                q = q.where(StepMetricRow.step % every == 0)
            q = q.order_by(StepMetricRow.attempt, StepMetricRow.step).limit(limit)
            return [StepMetric.from_row(r) for r in s.execute(q).scalars()]

    def recent_metrics(self, *, job_id: int, rank: int = 0, limit: int = 1000) -> list[Metric]:
        """The newest `limit` steps of one rank in its newest attempt, oldest first: what a
        job's page compares with the plan, read from the end of the index however long the
        job has run."""
        with self._rx() as s:  # read-only: no write lock on SQLite
            newest = s.execute(select(MetricRow.attempt)
                               .where(MetricRow.job_id == job_id, MetricRow.rank == rank)
                               .order_by(MetricRow.attempt.desc()).limit(1)).scalar()
            if newest is None:
                return []
            rows = s.execute(select(MetricRow)
                             .where(MetricRow.job_id == job_id, MetricRow.rank == rank,
                                    MetricRow.attempt == newest)
                             .order_by(MetricRow.step.desc()).limit(limit)).scalars()
            return [Metric.from_row(r) for r in reversed(list(rows))]

    def rows_after(self, *, job_id: int, after: tuple[int, int], limit: int,
                   open_attempt: int | None = None, ranks: Sequence[int] = ()) -> list[Metric]:
        """Rank 0's rows after (attempt, step) `after`, oldest first, at most `limit` steps,
        and the rows of `ranks` of those steps: what the exporter sends next
        (`service.tracking`). Of `open_attempt` (the one still running), only the steps
        every rank has reported, up to the first that one has not: a step is sent whole."""
        attempt, step = after
        with self._tx() as s:
            rank0 = list(s.execute(
                select(MetricRow).where(
                    MetricRow.job_id == job_id, MetricRow.rank == 0,
                    or_(MetricRow.attempt > attempt,
                        and_(MetricRow.attempt == attempt, MetricRow.step > step)))
                .order_by(MetricRow.attempt, MetricRow.step).limit(limit)).scalars())
            if open_attempt is not None:
                steps = [r.step for r in rank0 if r.attempt == open_attempt]
                complete = set(s.execute(
                    select(StepMetricRow.step).where(
                        StepMetricRow.job_id == job_id, StepMetricRow.attempt == open_attempt,
                        StepMetricRow.step.in_(steps), StepMetricRow.rank_bits.is_(None))
                ).scalars()) if steps else set()
                for i, r in enumerate(rank0):
                    if r.attempt == open_attempt and r.step not in complete:
                        rank0 = rank0[:i]
                        break
            out = [Metric.from_row(r) for r in rank0]
            others = [r for r in ranks if r != 0]
            if rank0 and others:
                pairs = {(r.attempt, r.step) for r in rank0}
                first, last = rank0[0], rank0[-1]
                rows = s.execute(select(MetricRow).where(
                    MetricRow.job_id == job_id, MetricRow.rank.in_(others),
                    MetricRow.attempt >= first.attempt, MetricRow.attempt <= last.attempt,
                    MetricRow.step >= min(p[1] for p in pairs),
                    MetricRow.step <= max(p[1] for p in pairs))).scalars()
                out += [Metric.from_row(r) for r in rows if (r.attempt, r.step) in pairs]
            return out


    def sampled(self, *, job_id: int, every: int = 1, limit: int = 100_000) -> list[Metric]:
        """Rank 0's rows of every attempt at the steps that are multiples of `every` (all of
        them for 1), oldest first: a long run's curves at a bounded cost."""
        with self._tx() as s:
            q = select(MetricRow).where(MetricRow.job_id == job_id, MetricRow.rank == 0)
            if every > 1:
                q = q.where(MetricRow.step % every == 0)
            rows = s.execute(q.order_by(MetricRow.attempt, MetricRow.step).limit(limit))
            return [Metric.from_row(r) for r in rows.scalars()]
