"""One job's goodput ledger, built from its rows (`service.store.goodput` reads it).

A job's wall time, from its submission to its end (or now), is split into the categories of
`client.ledger.CATEGORIES` (docs/goodput.md defines each), as segments that tile it:

- its state changes (`state` events) cut it into spans: queued (by reason: `quota` events
  say when its project's quota held it, a requeue after `PREEMPTED` is a preempted wait, the
  rest waited for room), the attempts' windows, restarting (recovery), stopping;
- each attempt's window, from its `PLACING` to the change that ended it, is placement (until
  its `placement` event: the resources held), start (actors, rendezvous, model build, the
  probe), checkpoint load (its first step's `load_s`), its training loop, and a tail;
- the loop runs from the first step's beginning (its end, `ended_at`, less its step time) to
  its last step's end. The steps' ends are its boundaries, so the steps' spans add up to the
  loop exactly; the evaluations and saves after each step (`eval_s`, `save_s`) are read out
  of the span they fall in. Steps past the checkpoint the next attempt resumed from (its
  `resumed_from`; before it reports, the newest checkpoint the attempt saved) were redone:
  lost work. The rest counts: training;
- the tail, after the last step (and its evaluation and save), is named by how the attempt
  ended: finishing (it succeeded), stopping (preempted, drained, moved or cancelled), stall
  then recovery (a hang: stalled until it was declared), recovery (a failure).

A job's steps are read by index seeks: each attempt's first and last (and the one at its
checkpoint boundary), and the few that evaluated or saved (`ix_step_metrics_extras`): a
long job's ledger costs what its evaluations and saves do, not its steps (`python -m
bench.ledger`: 59 ms for a million steps on SQLite, 28 ms on PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from client.ledger import Category, Ledger, QueueReason, Segment
from client.payloads import AttemptStatus
from service.contract.spec import GPU_DEFAULT
from service.contract.states import JobState
from service.store.ledger_sums import summed
from service.store.tables import (
    AttemptRow,
    CheckpointRow,
    EventRow,
    JobRow,
    StepMetricRow,
)
from service.store.views import aware


def _t(value: datetime | None) -> datetime:
    out = aware(value)
    assert out is not None
    return out


@dataclass
class _Loop:
    """An attempt's stored steps, as the ledger reads them."""

    first: int
    last: int
    begin: datetime
    """The first step's beginning: its end less its step time."""
    ended: dict[int, datetime]
    """The end of the first and last steps, and of the boundary step (if any)."""
    load_s: float
    resumed_from: int | None
    world_size: int


@dataclass
class _Window:
    attempt: int
    start: datetime
    end: datetime
    ended_to: JobState | None
    """The state the attempt's last change moved the job to (None: it still runs)."""
    hung: bool = False
    moved: bool = False
    """It ended to move the job to another layout (its ranks saved and stopped on request)."""
    placed: datetime | None = None
    cancel: datetime | None = None
    """When its ranks were asked to stop (a cancel, a preemption, a drain, a move): the rest
    of its window is stopping."""


class _Builder:
    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def add(self, start: datetime, end: datetime, category: Category,
            seconds: Mapping[Category, float] | None = None, *, ranks: int = 0,
            attempt: int | None = None, reason: QueueReason | None = None) -> None:
        span = (end - start).total_seconds()
        if span <= 0:
            return
        parts = {k: v for k, v in (seconds or {category: span}).items() if v > 0}
        known = sum(parts.values())
        if known > span:  # reported seconds past the span (clocks apart): scaled into it
            parts = {k: v * span / known for k, v in parts.items()}
        elif known < span:
            parts[category] = parts.get(category, 0.0) + span - known
        self.segments.append(Segment(start=start, end=end, category=category, seconds=parts,
                                     ranks=ranks, attempt=attempt, reason=reason))


def _clamp(t: datetime, lo: datetime, hi: datetime) -> datetime:
    return max(lo, min(hi, t))


def compute(s: Session, row: JobRow, now: datetime) -> Ledger:
    start = _t(row.created_at)
    state = JobState(row.state)
    end = _t(row.finished_at) if state.terminal and row.finished_at else now
    end = max(end, start)
    events = list(s.execute(
        select(EventRow.time, EventRow.kind, EventRow.attempt, EventRow.data, EventRow.message)
        .where(EventRow.job_id == row.id,
               EventRow.kind.in_(("state", "quota", "placement", "cancel")))
        .order_by(EventRow.id)))
    loops = _loops(s, row.id)
    spec = row.spec or {}
    train = spec.get("train") or {}
    tokens_per_step = int(train.get("global_batch") or 0) * int(
        (spec.get("model") or {}).get("seq_len") or 0)

    b = _Builder()
    # The state spans: (state, start, end, the change that ended it).
    spans: list[tuple[JobState, datetime, datetime, dict[str, Any], str]] = []
    current, since = JobState.QUEUED, start
    previous = JobState.QUEUED
    began: int | None = None  # the attempt of the change that began the current span
    quota: list[tuple[datetime, bool]] = []  # (time, waiting for quota from then)
    placed: dict[int, datetime] = {}
    cancel_at: datetime | None = None
    for time, kind, attempt, data, message in events:
        at = _clamp(_t(time), start, end)
        data = data or {}
        if kind == "quota":
            quota.append((at, not data.get("cleared")))
        elif kind == "placement" and attempt is not None:
            placed.setdefault(attempt, at)
        elif kind == "cancel":
            cancel_at = cancel_at or at
        elif kind == "state":
            to = JobState(data.get("to", current))
            spans.append((current, since, at, {**data, "attempt": attempt, "previous":
                                               previous.value, "began": began}, message or ""))
            previous, current, since, began = current, to, at, attempt
    spans.append((current, since, end, {"previous": previous.value, "began": began}, ""))
    # Attempts that ended to move the job (an elastic move up) stopped on request too.
    moved = set(s.execute(select(AttemptRow.number).where(
        AttemptRow.job_id == row.id, AttemptRow.status == AttemptStatus.MOVED.value)).scalars())

    ranks_default = row.world_size
    windows = _windows(spans, placed, cancel_at)
    resumed = {n: lp.resumed_from for n, lp in loops.items()}
    checkpoints = [(c.step, c.attempt) for c in s.execute(
        select(CheckpointRow).where(CheckpointRow.job_id == row.id)).scalars()]
    counted = lost = 0
    for state_, a, z, data, _ in spans:
        if state_ == JobState.QUEUED:
            _queued(b, a, z, quota, preempted=data["previous"] == JobState.PREEMPTED.value)
        elif state_ == JobState.RESTARTING:
            b.add(a, z, "stopping" if data["began"] in moved else "recovery",
                  ranks=ranks_default)
    for w in windows:
        w.moved = w.attempt in moved
        loop = loops.get(w.attempt)
        later = [n for n in loops if n > w.attempt]
        boundary: int | None = None
        if loop is not None and w.ended_to in (JobState.RESTARTING, JobState.QUEUED,
                                               JobState.PREEMPTED) and (later or w.ended_to):
            nxt = resumed.get(min(later)) if later else None
            if nxt is None:
                saved = [st for st, att in checkpoints if att <= w.attempt and st <= loop.last]
                nxt = max(saved, default=0)
            boundary = nxt if nxt < loop.last else None
        c, lo = _attempt(s, b, row.id, w, loop, boundary, ranks=loop.world_size if loop
                         else ranks_default)
        counted += c
        lost += lo
    b.segments.sort(key=lambda seg: seg.start)
    _fill_gaps(b, start, end, ranks_default)

    plan = row.plan or {}
    step_s = ((plan.get("time") or {}).get("step_s"))
    steps_planned = int(train.get("steps") or 0)
    base = Ledger(
        job_id=row.id, name=row.name, project=row.project, owner=row.owner, state=row.state,
        profile=_profile(spec, gpus=float(row.gpus or 0.0)), start=start, end=end,
        ended=state.terminal, wall_s=0.0, categories=[], steps_counted=counted,
        steps_lost=lost, tokens=counted * tokens_per_step if tokens_per_step else None,
        ranks=ranks_default,
        gpus_per_rank=float(row.gpus or 0.0), cpus_per_rank=float(row.cpus or 0.0),
        predicted_training_s=step_s * counted if step_s else None,
        # rank-seconds of the plan: `_priced` turns them into money
        planned_cost=step_s * steps_planned * row.world_size if step_s else None)
    return summed(base, b.segments, start=start, end=end)


def _profile(spec: Mapping[str, Any], *, gpus: float) -> str:
    """The node profile the job is priced at: its `cluster`'s, or, as the planner targets it
    (`JobSpec.target`), `cpu` for ranks without a GPU and the default GPU otherwise."""
    cluster = spec.get("cluster") or {}
    if cluster.get("gpu"):
        return str(cluster["gpu"])
    return "cpu" if gpus == 0 else GPU_DEFAULT


def _queued(b: _Builder, a: datetime, z: datetime, quota: list[tuple[datetime, bool]], *,
            preempted: bool) -> None:
    if preempted:
        b.add(a, z, "queued", reason="preempted")
        return
    waiting = False
    for at, flag in quota:
        if at <= a:
            waiting = flag
    t = a
    for at, flag in quota:
        if a < at < z and flag != waiting:
            b.add(t, at, "queued", reason="quota" if waiting else "room")
            t, waiting = at, flag
    b.add(t, z, "queued", reason="quota" if waiting else "room")


def _windows(spans: list[tuple[JobState, datetime, datetime, dict[str, Any], str]],
             placed: Mapping[int, datetime], cancel_at: datetime | None) -> list[_Window]:
    """Each attempt's window: from the change to PLACING that began it to the change that
    took the job out of PLACING, RUNNING and PREEMPTED."""
    out: list[_Window] = []
    number = 0
    open_: _Window | None = None
    for state_, a, z, data, message in spans:
        if state_ == JobState.PLACING and open_ is None:
            number += 1
            att = data.get("attempt")
            open_ = _Window(attempt=att if isinstance(att, int) else number, start=a, end=z,
                            ended_to=None)
            number = open_.attempt
        if open_ is None:
            continue
        if state_ in (JobState.PLACING, JobState.RUNNING, JobState.PREEMPTED):
            open_.end = z
            to = data.get("to")
            if to is not None and JobState(to) not in (JobState.RUNNING, JobState.PREEMPTED):
                open_.ended_to = JobState(to)
                error = str(data.get("error") or "") + message
                open_.hung = "hung:" in error
                open_.placed = placed.get(open_.attempt)
                if cancel_at is not None and open_.start <= cancel_at < z:
                    open_.cancel = min(cancel_at, open_.cancel or cancel_at)
                out.append(open_)
                open_ = None
            elif to == JobState.PREEMPTED.value:
                open_.cancel = z  # the stop was asked for here
    if open_ is not None:  # it still runs
        open_.placed = placed.get(open_.attempt)
        if cancel_at is not None and open_.start <= cancel_at:
            open_.cancel = min(cancel_at, open_.cancel or cancel_at)
        out.append(open_)
    return out


def _loops(s: Session, job_id: int) -> dict[int, _Loop]:
    """Each attempt's first and last steps (two index seeks each)."""
    out: dict[int, _Loop] = {}
    numbers = s.execute(select(AttemptRow.number).where(AttemptRow.job_id == job_id)).scalars()
    for attempt in numbers:
        of = select(StepMetricRow).where(StepMetricRow.job_id == job_id,
                                         StepMetricRow.attempt == attempt)
        f = s.execute(of.order_by(StepMetricRow.step).limit(1)).scalar()
        if f is None:
            continue
        la = s.execute(of.order_by(StepMetricRow.step.desc()).limit(1)).scalar()
        assert la is not None
        f_end = _end_of(f)
        out[attempt] = _Loop(
            first=f.step, last=la.step, begin=f_end - timedelta(seconds=f.step_time_max),
            ended={f.step: f_end, la.step: _end_of(la)}, load_s=f.load_s or 0.0,
            resumed_from=f.resumed_from, world_size=f.world_size)
    return out


def _end_of(r: StepMetricRow) -> datetime:
    return _t(r.ended_at) if r.ended_at is not None else _t(r.time)


def _extras(s: Session, job_id: int, attempt: int, lo: int, hi: int) -> tuple[float, float]:
    """(eval_s, save_s) summed over the attempt's steps lo..hi."""
    if hi < lo:
        return 0.0, 0.0
    ev, sv = s.execute(select(func.sum(StepMetricRow.eval_s), func.sum(StepMetricRow.save_s))
                       .where(StepMetricRow.job_id == job_id, StepMetricRow.attempt == attempt,
                              StepMetricRow.step >= lo, StepMetricRow.step <= hi,
                              or_(StepMetricRow.eval_s.is_not(None),
                                  StepMetricRow.save_s.is_not(None)))  # the index's rows
                       ).one()
    return float(ev or 0.0), float(sv or 0.0)


def _attempt(s: Session, b: _Builder, job_id: int, w: _Window, loop: _Loop | None,
             boundary: int | None, *, ranks: int) -> tuple[int, int]:
    """Add one attempt's window; (steps that count, steps lost). Once its ranks were asked
    to stop, the rest of the window is stopping: the loop is read up to then."""
    a, end = w.start, w.end
    z = _clamp(w.cancel, a, end) if w.cancel is not None else end
    placed = _clamp(w.placed or a, a, z)
    if loop is None:
        b.add(a, placed, "placement", ranks=ranks, attempt=w.attempt)
        b.add(placed, z, "start", ranks=ranks, attempt=w.attempt)
        b.add(z, end, "stopping", ranks=ranks, attempt=w.attempt)
        return 0, 0
    begin = _clamp(loop.begin, placed, z)
    first_end = _clamp(loop.ended[loop.first], begin, z)
    last_end = _clamp(loop.ended[loop.last], first_end, z)
    b.add(a, placed, "placement", ranks=ranks, attempt=w.attempt)
    load = min(loop.load_s, (begin - placed).total_seconds())
    b.add(placed, begin, "start", {"checkpoint_load": load}, ranks=ranks, attempt=w.attempt)
    cut = boundary if boundary is not None and loop.first <= boundary < loop.last else None
    if cut is None and boundary is not None and boundary < loop.first:
        cut = loop.first - 1  # every step of the attempt is redone
    if cut is None:
        ev, sv = _extras(s, job_id, w.attempt, loop.first, loop.last - 1)
        b.add(begin, last_end, "training", {"evaluation": ev, "checkpoint_save": sv},
              ranks=ranks, attempt=w.attempt)
        counted, lost = loop.last - loop.first + 1, 0
    else:
        if cut >= loop.first:
            row = s.execute(select(StepMetricRow).where(
                StepMetricRow.job_id == job_id, StepMetricRow.attempt == w.attempt,
                StepMetricRow.step == cut)).scalar()
            cut_end = _clamp(_end_of(row), begin, last_end) if row is not None else begin
            ev, sv = _extras(s, job_id, w.attempt, loop.first, cut - 1)
            b.add(begin, cut_end, "training", {"evaluation": ev, "checkpoint_save": sv},
                  ranks=ranks, attempt=w.attempt)
        else:
            cut_end = begin
        ev, sv = _extras(s, job_id, w.attempt, max(cut, loop.first), loop.last - 1)
        b.add(cut_end, last_end, "lost", {"evaluation": ev, "checkpoint_save": sv},
              ranks=ranks, attempt=w.attempt)
        counted, lost = max(0, cut - loop.first + 1), loop.last - max(cut, loop.first - 1)
    # The last step's own evaluation and save, then the tail named by the attempt's end.
    ev, sv = _extras(s, job_id, w.attempt, loop.last, loop.last)
    after = min(z, last_end + timedelta(seconds=ev + sv))
    b.add(last_end, after, "evaluation" if ev >= sv else "checkpoint_save",
          {"evaluation": ev, "checkpoint_save": sv}, ranks=ranks, attempt=w.attempt)
    if w.cancel is not None:  # the step on its way when the ranks were asked to stop
        b.add(after, z, "training", ranks=ranks, attempt=w.attempt)
        b.add(z, end, "stopping", ranks=ranks, attempt=w.attempt)
        return counted, lost
    tail = _tail(w)
    b.add(after, end, "stall" if tail == "recovery" and w.hung else tail, ranks=ranks,
          attempt=w.attempt)
    return counted, lost


def _tail(w: _Window) -> Category:
    if w.moved or w.ended_to in (JobState.QUEUED, JobState.CANCELLED):
        return "stopping"
    if w.ended_to is None:
        return "training"  # it still runs: its next step is on its way
    if w.ended_to == JobState.SUCCEEDED:
        return "finishing"
    return "recovery"


def _fill_gaps(b: _Builder, start: datetime, end: datetime, ranks: int) -> None:
    """Segments that overlap (a clock apart) are cut to follow each other; a gap (none is
    expected) is recovery, so that the segments tile the wall time."""
    out: list[Segment] = []
    t = start
    for seg in b.segments:
        if seg.end <= t:
            continue
        if seg.start > t:
            out.append(Segment(start=t, end=seg.start, category="recovery",
                               seconds={"recovery": (seg.start - t).total_seconds()},
                               ranks=ranks))
        if seg.start < t:
            share = (seg.end - t) / (seg.end - seg.start)
            seg = seg.model_copy(update={"start": t, "seconds": {
                k: v * share for k, v in seg.seconds.items()}})
        out.append(seg)
        t = seg.end
    if t < end:
        out.append(Segment(start=t, end=end, category="recovery",
                           seconds={"recovery": (end - t).total_seconds()}, ranks=ranks))
    b.segments = out
