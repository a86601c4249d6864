"""The exporter: jobs' stored steps sent to their trackers, beside the controller's loop.

The controller calls `Exporter.step()` every pass (only the leader has a controller, so only
the leader exports); it returns at once, and a round (`cycle`) runs on the exporter's own
thread, so a tracker that is slow or down holds neither a pass nor a rank. The queue is the
store itself: each job's cursor per tracker (`exports`) says the last step sent, a round reads
the steps after it in batches (`MetricsIngest.rows_after`: whole steps only, every rank's
report in), sends them, and moves the cursor (at most `BATCHES_PER_ROUND` batches per export
in a round, so one backlog keeps no other job waiting). Memory stays bounded by one batch
however long a tracker is away, nothing is lost while it is (the store keeps every step), and
after an outage or a restart of the controller the tracker gets every step it missed.

Failures:
- The tracker does not answer (`TrackerDown`): nothing moves; the tracker is tried again after
  a backoff that doubles from `backoff_s` up to `max_backoff_s`. Each job that waits for it
  gets one `tracking` event when the outage starts and one when the tracker answers again.
- The tracker refuses a batch for good (`TrackerRefused`, a 4xx): the batch is dropped, its
  steps counted in the export's `dropped` (shown by `GET /jobs/{id}/tracking`, the job's
  page and `/metrics`), with an event; the cursor moves past it.

A job's final state goes out as soon as it ends and every stored step went; the export is
`done` then for a job that succeeded, and for one that failed or was cancelled once it has
been over for `settle_s` (the last poll of a group stopped beside the loop can store steps
just after its job ended) and those steps went too. Just before, its goodput ledger
(`service.store.goodput`) goes to the tracker once, as figures of the whole run
(`goodput_metrics`: the ETTR and each category's seconds).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from service.contract.states import JobState
from service.store import Job, NotFound, Store
from service.store.dbcheck import away
from service.store.goodput import GoodputLedger
from service.store.metrics import MetricsIngest
from service.store.tables import utcnow
from service.store.tracking_exports import Export, Exports, Sink
from service.tracking.scalars import first_rank_of_stages, scalars_of
from service.tracking.sinks import TrackerDown, TrackerRefused, TrackerSink

log = logging.getLogger("trident.tracking")

BATCH_STEPS = 200
"""Steps read and sent at a time (MLflow's batches of 1,000 values are cut from them)."""
BATCHES_PER_ROUND = 5
"""Batches one export sends in a round at most, so that a long backlog (after an outage)
does not keep the other jobs' exports waiting: the rest goes in the next rounds."""

SinkMaker = Callable[[Sink, str], TrackerSink]


def goodput_metrics(store: Store, job_id: int) -> dict[str, float]:
    """A job's goodput ledger as run metrics (docs/goodput.md): `goodput.ettr`, each
    category's seconds (`goodput.training_s`, `goodput.lost_s`, ...), `goodput.wall_s`, the
    steps counted and lost, and goodput in tokens per wall second."""
    ledger = GoodputLedger(store).ledger(job_id)
    out = {"goodput.wall_s": ledger.wall_s,
           **{f"goodput.{c.category}_s": c.seconds for c in ledger.categories},
           "goodput.steps_counted": float(ledger.steps_counted),
           "goodput.steps_lost": float(ledger.steps_lost)}
    if ledger.ettr is not None:
        out["goodput.ettr"] = ledger.ettr
    if ledger.goodput_tokens_per_s is not None:
        out["goodput.tokens_per_s"] = ledger.goodput_tokens_per_s
    return out


@dataclass
class Outage:
    """A tracker that stopped answering, and the jobs that wait for it."""

    since: float
    since_wall: datetime
    failures: int = 0
    next_try: float = 0.0
    error: str = ""
    jobs: set[int] = field(default_factory=set)


class Exporter:
    """Sends every pending export's new steps; one per controller."""

    def __init__(self, store: Store, make_sink: SinkMaker, *,
                 allowed: Callable[[Sink, str], bool] = lambda kind, target: True,
                 every_s: float = 1.0, batch_steps: int = BATCH_STEPS, budget_s: float = 10.0,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, settle_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.exports = Exports(store)
        self.ingest = MetricsIngest(store)
        self.make_sink = make_sink
        self.allowed = allowed
        """Whether a stored target may still be sent to (the server's settings now)."""
        self.every_s = every_s
        self.batch_steps = batch_steps
        self.budget_s = budget_s
        """A round stops starting batches after this long (the next round goes on)."""
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.settle_s = settle_s
        self.clock = clock
        self.outages: dict[tuple[Sink, str], Outage] = {}
        self._sinks: dict[tuple[Sink, str], TrackerSink] = {}
        self._last: float | None = None
        self._pending: Future[int] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trident-tracking")
        self._lock = threading.Lock()

    # --- beside the controller's loop ---------------------------------------------------------

    def step(self) -> None:
        """Start the next round when the last one is over and one is due; returns at once."""
        if self._pending is not None:
            if not self._pending.done():
                return
            done, self._pending = self._pending, None
            try:
                done.result()
            except Exception as exc:  # the next round starts over from the stored cursors
                if away(exc):
                    # The database is away: the daemon says so, once an outage (`Outage`).
                    log.debug("a tracking round failed: the database is away (%s)",
                              type(exc).__name__)
                else:
                    log.exception("a tracking round failed")
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        self._pending = self._pool.submit(self.cycle)

    def close(self, wait_s: float = 5.0) -> None:
        """Stop: the round in flight gets `wait_s` to end (its cursor writes are its own
        transactions, so one cut short is taken up by the next exporter); files are closed."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._pending is not None:
            # Timed out, or failed: the stored cursors say where the next exporter goes on.
            with contextlib.suppress(Exception):
                self._pending.result(timeout=wait_s)
        with self._lock:
            for sink in self._sinks.values():
                try:
                    sink.close()
                except Exception:
                    log.exception("closing %s %s failed", sink.kind, sink.target)
            self._sinks.clear()

    # --- one round ----------------------------------------------------------------------------

    def cycle(self) -> int:
        """One round over the pending exports; the steps sent. Run on the exporter's thread
        (tests call it directly)."""
        with self._lock:
            started = self.clock()
            sent = 0
            by_job: dict[int, list[Export]] = {}
            for export in self.exports.pending():
                by_job.setdefault(export.job_id, []).append(export)
            states = self.exports.job_states(job_ids=list(by_job))
            for job_id, exports in by_job.items():
                if self.clock() - started > self.budget_s:
                    break
                state = states.get(job_id)
                if state is None or all(e.state == state == JobState.QUEUED.value
                                        for e in exports):
                    continue  # gone, or queued and its trackers told so: nothing to send
                try:
                    job = self.store.get_job(job_id=job_id)
                except NotFound:
                    continue
                for export in exports:
                    sent += self._one(job, export, started)
            return sent

    def _one(self, job: Job, export: Export, started: float) -> int:
        """Export one job to one tracker, unless its tracker waits out a backoff; the steps
        sent. Its failures are handled here: one never holds the others."""
        key = (export.sink, export.target)
        outage = self.outages.get(key)
        if outage is not None and self.clock() < outage.next_try:
            return 0
        if not self.allowed(export.sink, export.target):
            self.exports.give_up(job_id=job.id, sink=export.sink, error=(
                f"{export.target} is no longer among this server's trackers"))
            return 0
        try:
            sent = self._export(job, export, started)
        except TrackerDown as exc:
            self._down(key, job, export, str(exc))
            return 0
        except TrackerRefused as exc:  # the run itself: nothing of this job can go
            self.exports.give_up(job_id=job.id, sink=export.sink, error=str(exc))
            self.store.add_event(job_id=job.id, kind="tracking", message=(
                f"{export.sink} at {export.target} refused the job's run, which is not"
                f" exported there: {exc}"), data={"sink": export.sink.value})
            return 0
        except Exception:  # one job's failure must not hold the others
            log.exception("job %s: exporting to %s failed", job.id, export.sink)
            return 0
        if key in self.outages:
            self._recovered(key)
        return sent

    def _sink(self, kind: Sink, target: str) -> TrackerSink:
        key = (kind, target)
        if key not in self._sinks:
            try:
                self._sinks[key] = self.make_sink(kind, target)
            except Exception as exc:  # MLflow's client checks the URI when made
                raise TrackerDown(f"{type(exc).__name__}: {exc}") from exc
        return self._sinks[key]

    def _export(self, job: Job, export: Export, started: float) -> int:
        sink = self._sink(export.sink, export.target)
        if export.run_id is None and (export.state is None or export.sink == Sink.MLFLOW):
            run_id, experiment_id = sink.open(job)
            if run_id is not None and not self.exports.opened(
                    job_id=job.id, sink=export.sink, run_id=run_id,
                    experiment_id=experiment_id) and self._reread(export).run_id != run_id:
                sink.discard(run_id)  # another exporter stored a run of its own first
            export = self._reread(export)
        sent, caught_up = self._send_steps(job, export, sink, started)
        export = self._reread(export)
        final = job.state.terminal and caught_up
        # Only a stopped group's last poll can store steps after its job ended.
        settled = final and (job.state == JobState.SUCCEEDED or utcnow() - (
            job.finished_at or job.updated_at) >= timedelta(seconds=self.settle_s))
        if export.state != job.state.value or (settled and not export.done):
            if settled and not export.done:  # once: a done export is never sent again
                sink.summarize(job, export, goodput_metrics(self.store, job.id))
            sink.tell(job, export, final=final)
            self.exports.told(job_id=job.id, sink=export.sink, state=job.state.value,
                              done=settled)
        return sent

    def _reread(self, export: Export) -> Export:
        found = self.exports.get(job_id=export.job_id, sink=export.sink)
        assert found is not None, "an export row goes only with its job"
        return found

    def _send_steps(self, job: Job, export: Export, sink: TrackerSink,
                    started: float) -> tuple[int, bool]:
        """Send batches after the cursor while the round's budget lasts: (steps sent,
        whether every stored step that may go went)."""
        open_attempt = job.attempts if not job.state.terminal else None
        leaders = sorted(first_rank_of_stages(job.plan).values())
        sent = 0
        for _ in range(BATCHES_PER_ROUND):
            if self.clock() - started > self.budget_s:
                break
            rows = self.ingest.rows_after(job_id=job.id, after=(export.attempt, export.step),
                                          limit=self.batch_steps, open_attempt=open_attempt,
                                          ranks=leaders)
            steps = scalars_of(rows, job.plan)
            if not steps:
                return sent, True
            last = steps[-1]
            try:
                sink.send(job, export, steps)
            except TrackerRefused as exc:
                self.exports.advance(job_id=job.id, sink=export.sink, attempt=last.attempt,
                                     step=last.step, dropped=len(steps), error=str(exc))
                self.store.add_event(job_id=job.id, kind="tracking", message=(
                    f"{export.sink} at {export.target} refused steps {steps[0].step}-"
                    f"{last.step} ({len(steps)} steps, counted as dropped): {exc}"),
                    data={"sink": export.sink.value, "dropped": len(steps)})
            else:
                self.exports.advance(job_id=job.id, sink=export.sink, attempt=last.attempt,
                                     step=last.step, exported=len(steps))
                sent += len(steps)
            export = self._reread(export)
        return sent, False

    # --- outages ------------------------------------------------------------------------------

    def _down(self, key: tuple[Sink, str], job: Job, export: Export, error: str) -> None:
        now = self.clock()
        outage = self.outages.get(key)
        if outage is None:
            outage = self.outages[key] = Outage(since=now, since_wall=utcnow())
            log.warning("%s at %s is not answering: %s", key[0], key[1], error)
        outage.failures += 1
        outage.error = error
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (outage.failures - 1))
        outage.next_try = now + delay * random.uniform(0.8, 1.0)
        self.exports.failing(job_id=job.id, sink=export.sink, error=error,
                             since=outage.since_wall)
        if job.id not in outage.jobs:
            outage.jobs.add(job.id)
            self.store.add_event(job_id=job.id, kind="tracking", message=(
                f"{key[0]} at {key[1]} is not answering ({error.splitlines()[0][:300]}); the"
                " job trains on, and its steps wait in the store until it is back"),
                data={"sink": key[0].value, "down": True})

    def _recovered(self, key: tuple[Sink, str]) -> None:
        outage = self.outages.pop(key)
        seconds = self.clock() - outage.since
        log.info("%s at %s answers again after %.1f s", key[0], key[1], seconds)
        for job_id in sorted(outage.jobs):
            try:
                self.store.add_event(job_id=job_id, kind="tracking", message=(
                    f"{key[0]} at {key[1]} answers again after {seconds:.0f} s; the steps"
                    " stored meanwhile are being sent"),
                    data={"sink": key[0].value, "down": False, "seconds": round(seconds, 1)})
            except Exception:  # the job went meanwhile
                log.exception("job %s: recording the tracker's recovery failed", job_id)
