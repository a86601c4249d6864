"""The controller loop: admits jobs, starts and polls worker groups, applies the failure policy.

`Controller.step()` does one pass and returns what changed, so one iteration is testable with
a fake `Launcher`. Policies decide, the controller carries out; every state change goes through
`Store.transition`. The daemon (`service.daemon`) calls `step()` in a loop. Each attempt's
health (probe, stragglers, placement, hangs) is judged by its `AttemptHealth`, `trident probe`
runs by `ClusterProbes` (both in `service.monitor`), `trident stacks` requests by
`StackCollector` (`service.stack_collect`), the stored steps' way to MLflow and TensorBoard
by the `Exporter` (`service.tracking`), beside the loop. Nothing in a pass waits for workers to
die: groups are stopped beside the loop by `Teardowns` (`service.teardown`), so a cancelled
job is CANCELLED in the pass that sees the request, however many are cancelled at once. A
job's secrets are opened into its ranks' environment only, and kept out of what is stored
from them (`service.secrets`).

Groups outlive the controller: a controller that starts re-attaches to the live group of each
PLACING or RUNNING job (no retry used; the ranks send again what was not stored, which the
store takes once) and, after its first pass, stops every group on the cluster that belongs to
no active attempt. Reports are acknowledged to the ranks only once they are stored.

Before every attempt the stored spec is checked against today's limits (`recheck`: a spec
stored before a limit it fails reads everywhere, and fails the job here without a retry), and
the job's checkpoint folder is made its own (`service.checkpoints`); a folder that is another
job's fails the job without a retry too. The module stays one piece
(about 400 lines): one pass, each of whose parts hands its work to the modules named here.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.checkpoints import CheckpointPlaces, CheckpointWriter, JobFolders
from service.identity import Identity
from service.metrics_ingest import MetricsIngest
from service.monitor.attempt import AttemptHealth, record_stacks
from service.monitor.cluster_probe import ClusterProbes
from service.node_survey import NodeSurvey
from service.protocols import Launcher, PollResult, WorkerGroup
from service.quota import Quota, QuotaNotes, held
from service.scheduler import admit, unplaceable
from service.secrets import JobSecrets, SecretBox, SecretsUnreadable, redact
from service.spec import JobSpec
from service.spec_limits import recheck
from service.stack_collect import StackCollector
from service.stack_requests import StackRequests
from service.states import JobState, TransitionError
from service.store import AttemptStatus, Fence, Job, Store
from service.teardown import Teardown, Teardowns
from service.tracking.config import TrackingConfig
from service.tracking.exporter import Exporter
from service.worker_reports import store_poll

log = logging.getLogger(__name__)
HANG_STACKS_S = 10.0
"""How long a hung group's ranks get to send their stacks (on its teardown thread)."""

ADMIT_PAGE = 64
"""Queued jobs read per page by admission (see `Controller._admit`)."""


@dataclass
class Change:
    job_id: int
    to: JobState
    message: str


@dataclass
class StepResult:
    changes: list[Change] = field(default_factory=list)
    metrics: int = 0


@dataclass
class _Running:
    """What the controller keeps about one live attempt."""

    group: WorkerGroup
    attempt: int
    started: float
    spec: JobSpec
    health: AttemptHealth
    redact: Callable[[str], str] = field(default=str, repr=False)  # str: the text as it is
    """Takes the job's secrets out of what is stored from its ranks."""


def decide_on_failure(job: Job) -> JobState:
    """Failure policy: restart from the last checkpoint while retries are left, else fail."""
    return JobState.RESTARTING if job.attempts <= retries(job) else JobState.FAILED


def retries(job: Job) -> int:
    """Restarts the job's spec allows (`max_retries`)."""
    return job.spec.max_retries


class Controller:
    def __init__(self, store: Store, launcher: Launcher, *, checkpoint_root: Path,
                 start_timeout_s: float = 120.0, cancel_grace_s: float = 5.0,
                 poll_timeout_s: float = 0.05, inventory_every_s: float = 60.0,
                 shutdown_timeout_s: float = 20.0, fence: Fence | None = None,
                 places: CheckpointPlaces | None = None, box: SecretBox | None = None,
                 tracking: TrackingConfig | None = None) -> None:
        self.store = store
        self.ingest = MetricsIngest(store)
        """Step reports go through it: a job-level row per step, per-rank rows sampled."""
        self.fence = fence
        """The lease this controller acts under (the daemon's); attempts start only while it
        is held (`Store.start_attempt` raises NotHolder, and the pass stops, otherwise)."""
        self.launcher = launcher
        self.checkpoint_root = checkpoint_root
        self.folders = JobFolders(checkpoint_root, places)
        """Each job's checkpoint folder, made its own before every attempt."""
        self.start_timeout_s = start_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.poll_timeout_s = poll_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.running: dict[int, _Running] = {}
        self.teardowns = Teardowns(cancel_grace_s)
        self.drain_s = min(cancel_grace_s, 2.0)
        """How long a cancelled group's last poll waits for its ranks (beside the loop)."""
        self.cluster_probes = ClusterProbes(store, launcher, start_timeout_s=start_timeout_s,
                                            poll_timeout_s=poll_timeout_s,
                                            teardowns=self.teardowns)
        self.nodes = NodeSurvey(store, launcher, inventory_every_s)
        self.identity = Identity(store)
        self.quota_notes = QuotaNotes(store)
        self.stacks = StackCollector(StackRequests(store))
        """`trident stacks`: answered from the live groups, beside the loop."""
        self.secrets = JobSecrets(store, box)
        """Opens jobs' secrets for their ranks' environment (no box: a job with secrets
        fails)."""
        # An ended job's export waits out its group's stopping (its last poll) first.
        self.exporter = Exporter(store, tracking.make_sink, allowed=tracking.allows,
                                 settle_s=cancel_grace_s + 30) if tracking is not None else None
        """Sends the stored steps to MLflow and TensorBoard files, beside the loop."""
        self._swept = False

    # --- one pass -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        result = StepResult()
        for td in self.teardowns.reap():
            self._stopped(td)
        for job in self.store.active_jobs():
            if job.cancel_requested and job.id in self.running:
                self._cancel(job, self.running[job.id], result)
            elif job.cancel_requested:
                self._move(job, JobState.CANCELLED, "cancelled by request", result)
            elif job.id in self.running:
                self._watch(job, self.running[job.id], result)
            elif job.state == JobState.RESTARTING:
                # The last attempt's ranks may still hold the checkpoint directory and their
                # resources: the next attempt starts once they are gone.
                if not self.teardowns.busy(("job", job.id)):
                    self._restart(job, result)
            else:
                self._orphaned(job, result)
        if not self._swept:  # once the groups there are to re-attach are re-attached
            self._sweep()
        self._admit(result)
        self.cluster_probes.step()
        self.stacks.step({j: (run.group, run.attempt) for j, run in self.running.items()})
        self.nodes.step()
        if self.exporter is not None:
            self.exporter.step()
        return result

    def shutdown(self, *, stop_jobs: bool = False) -> None:
        """The controller is stopping (daemon exit). Groups are detached: they train on and the
        next controller re-attaches them, unless `stop_jobs`, which stops every group this
        controller watches. Teardowns in flight are waited for, up to `shutdown_timeout_s`
        (all at once, inside the 30 s `trident up` gives the daemon to exit)."""
        self.nodes.close()
        if self.exporter is not None:
            self.exporter.close()
        if stop_jobs:
            for job_id, run in list(self.running.items()):
                self._teardown(job_id, run)
        elif self.running:
            log.info("leaving %d worker group(s) running: the next controller re-attaches them",
                     len(self.running))
            self.running.clear()
        self.teardowns.wait(self.shutdown_timeout_s)
        try:  # what the finished ones drained is stored; the rest stop without us
            for td in self.teardowns.reap():
                self._stopped(td)
        except Exception:
            log.exception("storing what the stopped worker groups reported failed")

    def _sweep(self) -> None:
        keep = {(job_id, run.attempt) for job_id, run in self.running.items()}
        for name in self.launcher.sweep(keep):
            log.warning("stopped worker group %s: no active attempt of the store is its own",
                        name)
        self._swept = True

    # --- admission and placement ----------------------------------------------------------------

    def _admit(self, result: StepResult) -> None:
        """Admit from the head of the queue, read a page (`ADMIT_PAGE`) at a time: admission
        stops at the first job that does not fit, so a long queue costs a pass no more than
        its head. Jobs over their project's quota wait without blocking the others. The next
        page is read only while every job of a page was impossible or waiting for its quota
        (the free capacity is then as it was); one that admitted continues in the next pass."""
        quotas = {p: Quota(gpus, cpus) for p, (gpus, cpus) in self.identity.quotas().items()}
        holding = held(self.store.active_jobs()) if quotas else None
        offset = 0
        while True:
            queued = self.store.queued_jobs(limit=ADMIT_PAGE, offset=offset)
            if not queued:
                return
            adm = admit(queued, self.launcher.free_capacity(), self.launcher.total_capacity(),
                        quotas=quotas, holding=holding)
            for job, why in adm.impossible:
                if job.attempts:  # it ran here: the cluster shrank, and may grow back
                    offset += 1  # stays queued, ahead of the next page
                    continue
                self._move(job, JobState.FAILED, f"cannot be placed on this cluster: {why}",
                           result, error=why)
            for job, why in adm.waiting:
                offset += 1
                if job.waiting != why:
                    self.quota_notes.note(job.id, why)
            for job in adm.admitted:
                if job.waiting is not None:
                    self.quota_notes.note(job.id, None)
                placing = self._move(job, JobState.PLACING, "admitted; claiming resources",
                                     result)
                if placing is not None:
                    self._place(placing, result)
            skipped = len(adm.impossible) + len(adm.waiting)
            if adm.admitted or skipped < len(queued) or len(queued) < ADMIT_PAGE:
                return

    def _restart(self, job: Job, result: StepResult) -> None:
        """The next attempt, from the checkpoint; or, when the cluster no longer has room for
        it (it lost a node), back to the queue until it has."""
        why = unplaceable(job, self.launcher.total_capacity())
        if why is None:
            self._place(job, result)
        else:
            self._move(job, JobState.QUEUED, f"waiting for the cluster: it no longer has room"
                       f" for this job ({why}); it resumes from its checkpoint when it has",
                       result)

    def _place(self, job: Job, result: StepResult) -> None:
        """Start the next attempt of a PLACING (or RESTARTING) job: the stored spec is the
        spec that runs."""
        if job.state == JobState.RESTARTING:
            placing = self._move(job, JobState.PLACING, "placing a new attempt", result)
            if placing is None:
                return
            job = placing
        job = self.store.start_attempt(job_id=job.id, fence=self.fence)
        attempt = job.attempts
        try:  # a spec stored before a check it fails was added, a folder not the job's
            spec = recheck(job.spec)
            folder = self.folders.claim(CheckpointWriter.of(job), spec.checkpoint.dir)
            secrets = self.secrets.open(job.id)
        except (ValueError, OSError, SecretsUnreadable) as exc:  # CheckpointRefused too
            self._fail_attempt(job, attempt, f"not started: {exc}", result,
                               retry=isinstance(exc, OSError))
            return
        try:  # secrets reach the ranks' environment, never the spec each is sent (a dump)
            group = self.launcher.start(job_id=job.id, attempt=attempt,
                                        spec=spec.with_secrets(secrets),
                                        plan=job.plan, checkpoint_dir=folder,
                                        writer=CheckpointWriter.of(job))
        except Exception as exc:  # a failed start is data for the failure policy
            log.error("job %s: start failed: %s", job.id, redact(traceback.format_exc(), secrets))
            self._fail_attempt(job, attempt, redact(f"worker group failed to start: {exc!r}",
                                                    secrets), result)
            return
        self.running[job.id] = _Running(group=group, attempt=attempt, started=time.monotonic(),
                                        spec=spec, health=AttemptHealth(self.store, job, attempt,
                                                                        spec),
                                        redact=self.secrets.redactor(job.id, secrets))

    def _orphaned(self, job: Job, result: StepResult) -> None:
        """An active job with no group here: the controller restarted. Its group may still
        run (re-attached: no retry used), or be gone (the attempt is lost: restart)."""
        try:  # a stored spec that fails a check added since is lost here, refused by _place
            spec: JobSpec | None = recheck(job.spec)
        except ValueError:
            spec = None
        if spec is not None and job.attempts and job.state in (JobState.PLACING,
                                                               JobState.RUNNING):
            group = self.launcher.attach(
                job_id=job.id, attempt=job.attempts, spec=spec, plan=job.plan,
                checkpoint_dir=self.folders.folder(job.id, spec.checkpoint.dir),
                writer=CheckpointWriter.of(job))
            if group is not None:
                self.running[job.id] = _Running(
                    group=group, attempt=job.attempts, started=time.monotonic(), spec=spec,
                    health=AttemptHealth(self.store, job, job.attempts, spec),
                    redact=self.secrets.redactor(job.id))
                self.store.add_event(job_id=job.id, attempt=job.attempts, kind="reattach",
                                     message=f"re-attached to the worker group of"
                                     f" attempt {job.attempts}: no retry used; reports not"
                                     " stored yet are sent again")
                return
        msg = "controller restarted; the worker group of this attempt is gone"
        if job.attempts:
            self.store.end_attempt(job_id=job.id, number=job.attempts, status=AttemptStatus.LOST,
                                   error=msg)
        to = decide_on_failure(job)
        self._move(job, to, msg if to == JobState.FAILED else f"{msg}; restarting", result,
                   error=msg if to == JobState.FAILED else None)

    # --- watching a running group ---------------------------------------------------------------

    def _cancel(self, job: Job, run: _Running, result: StepResult) -> None:
        """CANCELLED now; the ranks are asked to stop and get the grace beside the loop, where
        a running group is drained first: what its ranks reported and is not stored yet is
        stored when the loop reaps the teardown. A group that is not running yet is not
        polled again, so it never starts training."""
        run.group.cancel()
        self._finish(job, run, AttemptStatus.CANCELLED, JobState.CANCELLED,
                     f"cancelled by request; the workers get {self.cancel_grace_s:g} s to stop"
                     " before they are killed", result, drain=job.state == JobState.RUNNING)

    def _watch(self, job: Job, run: _Running, result: StepResult) -> None:
        poll = run.group.poll(self.poll_timeout_s)
        if poll.placement:
            self.store.set_placement(job_id=job.id, number=run.attempt, placement=poll.placement)
            run.health.placed(poll.placement)
        result.metrics += self._record(job, run, poll)
        run.health.polled(poll.heartbeats)
        if poll.state == "running" and self._hung(job, run, result):
            return

        if poll.state in ("running", "succeeded") and job.state == JobState.PLACING:
            # Refused when a cancel came in since this pass read the job: the next pass
            # cancels it, and it never reports running.
            moved = self._move(job, JobState.RUNNING, f"all {job.world_size} ranks running",
                               result, attempt=run.attempt, unless_cancelled=True)
            if moved is None:
                return
            job = moved
        if poll.state == "starting" and time.monotonic() - run.started > self.start_timeout_s:
            self._teardown(job.id, run)
            self._fail_attempt(job, run.attempt, f"worker group did not start within"
                               f" {self.start_timeout_s:g} s (resources or rendezvous)", result)
        elif poll.state == "succeeded":
            self._finish(job, run, AttemptStatus.SUCCEEDED, JobState.SUCCEEDED,
                         f"all ranks finished {run.spec.train.steps} steps", result)
        elif poll.state == "failed":
            self._teardown(job.id, run)
            detail = run.redact(poll.error or "a rank failed")
            ranks = f"rank(s) {poll.failed_ranks} failed" if poll.failed_ranks else "failed"
            # A folder that is another job's now (rank 0 refused it) stays so: no retry.
            theirs = self.folders.refusal(CheckpointWriter.of(job), run.spec.checkpoint.dir)
            self._fail_attempt(job, run.attempt, f"attempt {run.attempt}: {ranks}\n{detail}"
                               + (f"\nnot retried: {theirs}" if theirs else ""), result,
                               retry=theirs is None)

    def _record(self, job: Job, run: _Running, poll: PollResult) -> int:
        n = store_poll(self.store, self.ingest, job_id=job.id, attempt=run.attempt,
                       world_size=job.world_size, poll=poll, health=run.health,
                       redact=run.redact)
        if poll.acks:  # stored: the ranks may forget them
            run.group.acknowledge(poll.acks)
        return n

    def _hung(self, job: Job, run: _Running, result: StepResult) -> bool:
        """Stop a group in which no rank made progress in time (diagnosed by its health)."""
        diagnosis = run.health.hung()
        if diagnosis is None:
            return False
        self._teardown(job.id, run, stacks=True)  # stacks taken beside the loop
        self._fail_attempt(job, run.attempt, f"hung: {diagnosis.summary}", result)
        return True

    # --- endings ------------------------------------------------------------------------------

    def _finish(self, job: Job, run: _Running, status: AttemptStatus, to: JobState, message: str,
                result: StepResult, *, drain: bool = False) -> None:
        self._teardown(job.id, run, drain=drain)
        self.store.end_attempt(job_id=job.id, number=run.attempt, status=status)
        self._move(job, to, message, result, attempt=run.attempt)

    def _fail_attempt(self, job: Job, attempt: int, error: str, result: StepResult, *,
                      retry: bool = True) -> None:
        self.store.end_attempt(job_id=job.id, number=attempt, status=AttemptStatus.FAILED,
                               error=error)
        to = decide_on_failure(job) if retry else JobState.FAILED
        if to == JobState.RESTARTING:
            left = retries(job) - job.attempts
            self._move(job, to, f"attempt {attempt} failed; restarting from the last checkpoint"
                       f" ({left} retries left)", result, attempt=attempt, data={"error": error})
        else:
            self._move(job, JobState.FAILED, f"attempt {attempt} failed: {error}", result,
                       error=error, attempt=attempt)

    def _teardown(self, job_id: int, run: _Running, *, drain: bool = False,
                  stacks: bool = False) -> None:
        """Stop the group beside the loop; this controller no longer polls it (with `drain`,
        the teardown polls it once more; with `stacks`, it takes the ranks' stacks first:
        `_stopped` stores what that brought)."""
        self.teardowns.start(("job", job_id), run.group, attempt=run.attempt,
                             drain_s=self.drain_s if drain else 0.0,
                             stacks_s=HANG_STACKS_S if stacks else 0.0)
        self.running.pop(job_id, None)

    def _stopped(self, td: Teardown) -> None:
        kind, key_id = td.key
        if td.error is not None:
            log.warning("%s %s: stopping its worker group failed: %s", kind, key_id, td.error)
        if kind != "job":
            return
        if td.stacks:
            record_stacks(self.store, key_id, td.attempt, td.stacks)
        if td.final is not None and td.attempt is not None:
            job = self.store.get_job(job_id=key_id)
            store_poll(self.store, self.ingest, job_id=key_id, attempt=td.attempt,
                       world_size=job.world_size, poll=td.final, health=None,
                       redact=self.secrets.redactor(key_id))
        self.store.add_event(
            job_id=key_id, attempt=td.attempt, kind="warning" if td.error else "teardown",
            message=f"stopping the worker group failed after {td.seconds:.1f} s: {td.error}"
            if td.error else f"worker group stopped and its resources freed in"
            f" {td.seconds:.1f} s", data={"seconds": round(td.seconds, 3)})

    def _move(self, job: Job, to: JobState, message: str, result: StepResult, *,
              error: str | None = None, attempt: int | None = None,
              data: dict[str, Any] | None = None, unless_cancelled: bool = False) -> Job | None:
        """Move the job through `Store.transition`; the job as moved, or None when the state
        machine refused (a concurrent change, logged)."""
        try:
            moved = self.store.transition(job_id=job.id, to=to, message=message, error=error,
                                          attempt=attempt, data=data,
                                          unless_cancelled=unless_cancelled)
        except TransitionError as exc:
            log.warning("job %s: %s", job.id, exc)
            return None
        result.changes.append(Change(job.id, to, message))
        return moved
