"""`GET /metrics`: Prometheus exposition (`prometheus-client`), read from the store per scrape.

Names follow Prometheus conventions: base units (`_seconds`, `_bytes`), ratios 0-1
(`_ratio`), `_total` only on counters. Per-job series are for active jobs only (placing,
running, restarting), so the number of series stays bounded by what runs, not by history;
per-rank series (`trident_rank_*`, one per rank of every active job) can be turned off with
`TRIDENT_METRICS_PER_RANK=false`. Rank series carry `node` (the host name) and `gpu` (the
device index, empty on CPU) so they join with the DCGM exporter's series.

The API's own request latency is a histogram in the app's registry; the controller pass
duration comes from the controller's lease row (the controller is another process), and the
exporter's counts (steps sent to each tracker, dropped, exports failing now) from its cursors
in the store (`service.store.tracking_exports`). Custom metrics (`StepReport.custom`, numbers) of an
active job's newest step are `trident_job_custom{name=...}`.

The goodput ledgers (docs/goodput.md) of every job, summed: `trident_job_seconds_total{category}`
(wall seconds) and per project `trident_project_gpu_seconds_total{project,category}` (GPU
ranks) and `trident_project_cpu_seconds_total{project,category}` (CPU ranks); a job without a
project is `project=""`. They are read once a scrape (`GoodputLedger.ledgers`: an ended job's
ledger is kept on its row, a live one's computed up to now). A live job's last stretch is
named when it ends (its tail, counted as training while it runs, may turn out lost work or a
stall): a category can then go down, which Prometheus's `rate` reads as a counter reset. The
first read of a job's ledger after it settled computes and keeps it (a few ms a job; once, for
every job, after an upgrade): while a scrape computes them, another scrape of the same process
answers the totals of the scrape before instead of computing them again beside it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from client.ledger import CATEGORIES, Ledger
from service.contract.reports import GUARD_EVENTS
from service.contract.states import JobState
from service.store import Job, Store
from service.store.dashboard import count_by_state, measured_bubble_ratio
from service.store.goodput import SETTLED, GoodputLedger
from service.store.lease import CONTROLLER, Leases
from service.store.tables import utcnow
from service.store.tracking_exports import Exports
from service.tracking.scalars import custom
from service.views.rank_status import rank_status

ACTIVE = [JobState.PLACING, JobState.RUNNING, JobState.RESTARTING, JobState.PREEMPTED]
JOB = ["job_id"]
RANK = ["job_id", "rank", "node", "gpu"]
RANK_WINDOW = 5
"""Steps per rank a scrape reads: a rank's newest report is within the last few steps."""


def _g(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


Totals = tuple[dict[str, float], dict[str, dict[str, list[float]]]]
"""(wall seconds by category, project -> category -> [GPU-s, CPU-s]) of jobs' ledgers."""


def _add(into: Totals, ledgers: Iterable[Ledger]) -> None:
    wall, held = into
    for ledger in ledgers:
        per = held.setdefault(ledger.project or "", {c: [0.0, 0.0] for c in CATEGORIES})
        for c in ledger.categories:
            wall[c.category] += c.seconds
            per[c.category][0] += c.gpu_seconds
            per[c.category][1] += c.cpu_seconds


def _copy(totals: Totals) -> Totals:
    wall, held = totals
    return dict(wall), {p: {c: list(v) for c, v in cats.items()} for p, cats in held.items()}


class StoreCollector(Collector):
    """Reads jobs, their newest steps and the controller's lease at every scrape."""

    def __init__(self, store: Callable[[], Store], per_rank: bool) -> None:
        self.store = store
        self.per_rank = per_rank
        self._ledgers = threading.Lock()
        """Held while a scrape reads the ledgers (`_goodput`)."""
        self._last: Totals | None = None
        """The goodput totals the last scrape that read them found."""
        self._settled: Totals = ({c: 0.0 for c in CATEGORIES}, {})
        """The goodput totals of the jobs that ended before `_horizon` (kept: theirs are
        final)."""
        self._horizon: datetime | None = None

    def collect(self) -> Iterator[Metric]:
        store = self.store()
        jobs = _g("trident_jobs", "Jobs by state.", ["state"])
        for state, n in count_by_state(store).items():
            jobs.add_metric([state.value], n)
        yield jobs
        yield from self._controller(store)
        yield from self._tracking(store)
        yield from self._goodput(store)
        fams = {
            "info": _g("trident_job_info", "An active job (value 1) and its layout.",
                       ["job_id", "name", "owner", "state", "tp", "pp", "dp", "zero"]),
            "step": _g("trident_job_step", "Newest step rank 0 reported.", JOB),
            "steps": _g("trident_job_steps", "Steps the job trains for.", JOB),
            "step_s": _g("trident_job_step_duration_seconds",
                         "Wall time of the newest step (rank 0).", JOB),
            "step_pred": _g("trident_job_step_duration_predicted_seconds",
                            "The plan's predicted step time.", JOB),
            "err": _g("trident_job_step_duration_prediction_error_ratio",
                      "(measured - predicted) / predicted step time, newest step.", JOB),
            "tok": _g("trident_job_tokens_per_second", "Global tokens per second, newest"
                      " step.", JOB),
            "tok_pred": _g("trident_job_tokens_per_second_predicted", "The plan's predicted"
                           " tokens per second.", JOB),
            "mfu": _g("trident_job_mfu_ratio", "Model FLOPs utilisation, newest step.", JOB),
            "mfu_pred": _g("trident_job_mfu_predicted_ratio", "The plan's predicted MFU.", JOB),
            "loss": _g("trident_job_loss", "Training loss, newest step.", JOB),
            "lr": _g("trident_job_learning_rate", "The learning rate the newest step ran at"
                     " (the schedule's).", JOB),
            "grad_norm": _g("trident_job_grad_norm", "Global gradient norm of the newest"
                            " step, before clipping.", JOB),
            "eval_loss": _g("trident_job_eval_loss", "Validation loss, newest step that"
                            " evaluated (data.eval_every).", JOB),
            "tokens": _g("trident_job_tokens", "Tokens the job has trained on, newest step.",
                         JOB),
            "epoch": _g("trident_job_epoch", "Passes over the first training corpus, newest"
                        " step.", JOB),
            "custom": _g("trident_job_custom", "A custom metric an entrypoint reported"
                         " (StepReport.custom), newest step of rank 0.", [*JOB, "name"]),
            "comm_s": _g("trident_job_comm_seconds", "Seconds in collectives in rank 0's"
                         " newest timed step, by dimension and op.", [*JOB, "dim", "op"]),
            "comm_b": _g("trident_job_comm_bytes", "Bytes moved by collectives in rank 0's"
                         " newest step, by dimension and op.", [*JOB, "dim", "op"]),
            "bubble": _g("trident_pipeline_bubble_ratio", "Pipeline bubble as a share of the"
                         " step: the plan's (kind=predicted), and measured by the ranks, the"
                         " mean over the newest step's reporting ranks (kind=measured).",
                         [*JOB, "kind"]),
            "mem": _g("trident_rank_memory_peak_bytes", "Measured peak memory of a rank"
                      " (the largest its newest steps reported).", RANK),
            "mem_pred": _g("trident_rank_memory_predicted_bytes", "The plan's predicted"
                           " memory of the rank's pipeline stage.", RANK),
            "age": _g("trident_rank_last_report_age_seconds", "Seconds since the rank's"
                      " newest stored step report.", RANK),
            "hb_age": _g("trident_rank_heartbeat_age_seconds", "Seconds since the rank's last"
                         " heartbeat as the controller saw it (newest attempt).", RANK),
        }
        guard = CounterMetricFamily(
            "trident_job_guard_events", "The training guard's events of the job, by kind:"
            " guard_skip (a step's update skipped), guard_spike (a spike judged after the"
            " update), guard_rollback (docs/guards.md).", labels=[*JOB, "kind"])
        for job in store.list_jobs(states=ACTIVE, limit=10000)[0]:
            self._job(store, job, fams, guard)
        yield from fams.values()
        yield guard

    def _controller(self, store: Store) -> Iterator[Metric]:
        lease = Leases.of(store).read(name=CONTROLLER)
        g = _g("trident_controller_pass_duration_seconds",
               "Duration of the lease holder's previous controller pass.", [])
        if lease is not None and lease.last_pass_s is not None:
            g.add_metric([], lease.last_pass_s)
        yield g

    def _tracking(self, store: Store) -> Iterator[Metric]:
        sent = CounterMetricFamily("trident_tracking_exported_steps", "Steps the exporter"
                                   " sent, by tracker (mlflow, tensorboard).", labels=["sink"])
        dropped = CounterMetricFamily("trident_tracking_dropped_steps", "Steps a tracker"
                                      " refused for good, by tracker.", labels=["sink"])
        failing = _g("trident_tracking_failing_exports", "Jobs' exports whose tracker does"
                     " not answer now, by tracker.", ["sink"])
        for sink, (e, d, f) in Exports(store).totals().items():
            sent.add_metric([sink.value], e)
            dropped.add_metric([sink.value], d)
            failing.add_metric([sink.value], f)
        yield from (sent, dropped, failing)

    def _goodput_totals(self, store: Store) -> Totals | None:
        """(wall seconds by category, project -> category -> [GPU-s, CPU-s]) of every job's
        ledger; the last scrape's while another scrape reads them (None: none read yet)."""
        if not self._ledgers.acquire(blocking=False):
            return self._last
        try:
            # The jobs that ended long enough ago are added once to running totals (their
            # ledgers never change); the others are read whole at every scrape.
            ledgers = GoodputLedger(store)
            upto = utcnow() - SETTLED
            _add(self._settled, ledgers.settled(after=self._horizon, upto=upto))
            self._horizon = upto
            wall, held = _copy(self._settled)
            _add((wall, held), ledgers.unsettled(after=upto))
            self._last = wall, held
            return self._last
        finally:
            self._ledgers.release()

    def _goodput(self, store: Store) -> Iterator[Metric]:
        totals = self._goodput_totals(store)
        if totals is None:  # the first read is under way: no counters rather than zeros
            return
        wall, held = totals
        seconds = CounterMetricFamily("trident_job_seconds", "Wall seconds of every job, by"
                                      " goodput ledger category (docs/goodput.md).",
                                      labels=["category"])
        for category, s in wall.items():
            seconds.add_metric([category], s)
        gpu = CounterMetricFamily("trident_project_gpu_seconds", "GPU-seconds held by a"
                                  " project's jobs, by goodput ledger category.",
                                  labels=["project", "category"])
        cpu = CounterMetricFamily("trident_project_cpu_seconds", "CPU-seconds held by a"
                                  " project's jobs on CPU ranks, by goodput ledger category.",
                                  labels=["project", "category"])
        for project, cats in sorted(held.items()):
            for category, (gpu_s, cpu_s) in cats.items():
                gpu.add_metric([project, category], gpu_s)
                cpu.add_metric([project, category], cpu_s)
        yield from (seconds, gpu, cpu)

    def _job(self, store: Store, job: Job, f: dict[str, GaugeMetricFamily],
             guard: CounterMetricFamily) -> None:
        jid = [str(job.id)]
        lay, plan = job.plan.layout, job.plan
        f["info"].add_metric([str(job.id), job.name, job.owner, job.state.value, str(lay.tp),
                              str(lay.pp), str(lay.dp), str(lay.zero)], 1)
        f["steps"].add_metric(jid, job.spec.train.steps)
        # A job that is not planned has no predicted series (no sample, never a zero).
        t, mfu_pred = plan.time, plan.mfu
        if t is not None:
            f["step_pred"].add_metric(jid, t.step_s)
        if plan.tokens_per_s is not None:
            f["tok_pred"].add_metric(jid, plan.tokens_per_s)
        if mfu_pred is not None:
            f["mfu_pred"].add_metric(jid, mfu_pred)
        if t is not None and t.step_s:
            f["bubble"].add_metric([*jid, "predicted"], t.bubble_s / t.step_s)
        for kind, n in store.count_events(job_id=job.id, kinds=GUARD_EVENTS).items():
            guard.add_metric([*jid, kind], n)
        latest = store.latest_metric(job_id=job.id)
        if self.per_rank:
            self._ranks(store, job, f)
        if latest is None:
            return
        f["step"].add_metric(jid, latest.step)
        f["step_s"].add_metric(jid, latest.step_time_s)
        if t is not None and t.step_s:
            f["err"].add_metric(jid, (latest.step_time_s - t.step_s) / t.step_s)
        if latest.tokens_per_s is not None:  # None: not known, no sample (as for the loss)
            f["tok"].add_metric(jid, latest.tokens_per_s)
        if mfu_pred is not None and plan.tokens_per_s and latest.tokens_per_s is not None:
            f["mfu"].add_metric(jid, mfu_pred * latest.tokens_per_s / plan.tokens_per_s)
        if latest.loss is not None:
            f["loss"].add_metric(jid, latest.loss)
        if latest.lr is not None:
            f["lr"].add_metric(jid, latest.lr)
        if latest.grad_norm is not None:
            f["grad_norm"].add_metric(jid, latest.grad_norm)
        for name, value in (("tokens", latest.report.tokens), ("epoch", latest.report.epoch)):
            if value is not None:
                f[name].add_metric(jid, value)
        evaluated = store.latest_eval(job_id=job.id)
        if evaluated is not None:
            f["eval_loss"].add_metric(jid, evaluated)
        for name, value in custom(latest).items():
            f["custom"].add_metric([*jid, name], value)
        for dim, ops in (latest.report.comm or {}).items():
            for op, st in ops.items():
                if latest.report.timed:
                    f["comm_s"].add_metric([*jid, dim, op], st["time_s"])
                f["comm_b"].add_metric([*jid, dim, op], st["bytes"])
        measured = measured_bubble_ratio(store, job.id, latest.attempt, latest.step)
        if measured is not None:
            f["bubble"].add_metric([*jid, "measured"], measured)

    def _ranks(self, store: Store, job: Job, f: dict[str, GaugeMetricFamily]) -> None:
        """The ranks grid's status of every rank (`service.views.rank_status`), over the newest
        `RANK_WINDOW` steps."""
        now = utcnow()
        for r in rank_status(store, job, window=RANK_WINDOW).ranks:
            labels = [str(job.id), str(r.rank), r.node or "", r.gpu or ""]
            if r.memory_predicted_bytes is not None:  # None: the job is not planned
                f["mem_pred"].add_metric(labels, r.memory_predicted_bytes)
            if r.heartbeat_age_s is not None:
                f["hb_age"].add_metric(labels, r.heartbeat_age_s)
            if r.memory_peak_bytes is not None:
                f["mem"].add_metric(labels, r.memory_peak_bytes)
            if r.reported_at is not None:
                f["age"].add_metric(labels, (now - r.reported_at).total_seconds())


def request_latency(registry: CollectorRegistry) -> Histogram:
    return Histogram("trident_api_request_duration_seconds",
                     "Time from a request's arrival to its response's headers.",
                     ["method", "route", "status"], registry=registry,
                     buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))


_ID = re.compile(r"/\d+(?=/|$)")


def route_label(scope: Scope) -> str:
    """The route, bounded: ids become `{id}`, static files one label, no match `unmatched`."""
    if "route" not in scope:
        return "unmatched"
    path: str = scope["path"]
    if path.startswith("/static/"):
        return "/static"
    return _ID.sub("/{id}", path)


class RequestTimer:
    """ASGI middleware: observes every HTTP request's latency by route template (bounded)."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.histogram.labels(scope["method"], route_label(scope),
                                      str(message["status"])).observe(
                    time.perf_counter() - started)
            await send(message)

        await self.app(scope, receive, timed_send)
