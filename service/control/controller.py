"""The controller loop: admits jobs, starts and polls worker groups, applies the failure policy.

`Controller.step()` does one pass and returns what changed, so one iteration is testable with
a fake `Launcher`. Policies decide, the controller carries out; every state change goes through
`Store.transition`. The daemon (`service.control.daemon`) calls `step()` in a loop. Each attempt's
health (probe, stragglers, placement, hangs) is judged by its `AttemptHealth`, `trident probe`
runs by `ClusterProbes` (both in `service.monitor`), `trident stacks` requests by
`StackCollector` (`service.control.stack_collect`), the stored steps' way to MLflow and TensorBoard
by the `Exporter` (`service.tracking`), beside the loop. Nothing in a pass waits for workers to
die: groups are stopped beside the loop by `Teardowns` (`service.control.teardown`), so a cancelled
job is CANCELLED in the pass that sees the request, however many are cancelled at once. A
job's secrets are opened into its ranks' environment only, and kept out of what is stored
from them (`service.secrets`).

Groups outlive the controller: a controller that starts re-attaches to the live group of each
PLACING or RUNNING job (no retry used; the ranks send again what was not stored, which the
store takes once) and, after its first pass, stops every group on the cluster that belongs to
no active attempt. Reports are acknowledged to the ranks only once they are stored. Behind
that, each checkpoint tag carries its ranks' reports not acknowledged yet: the job's folder is
read (`service.control.tag_recovery`) in a controller's first pass, after each group is stopped and
before each attempt starts, so a tag's steps are stored however its attempt ended, and the
tags its predecessor never heard of are indexed.

Before every attempt the stored spec is checked against today's limits (`recheck`: a spec
stored before a limit it fails reads everywhere, and fails the job here without a retry), and
the job's checkpoint folder is made its own (`service.files.checkpoint_dirs`); a folder that is
another job's fails the job without a retry too, as does an attempt the training guard stopped
(`service.contract.reports.GUARD_STOP`). A group whose ranks all finished ends SUCCEEDED
unless its last losses were all NaN or infinite (`succeed`: FAILED, without a retry). A
queued job that cannot be placed may preempt running jobs of lower priority
(`service.policy.preemption` chooses and words it; `Preemptions` in `service.control.preempting`
asks them to save and stop, watches them while they do, and requeues them, beside the loop). An
elastic job that lost its ranks and waited `wait_s` for them is re-planned onto what is free,
and with `scale_up` moved back when the room returns (`service.policy.elastic_replan` decides and
words
it; `Rescaling` in `service.control.rescaling` changes its stored layout, asks its ranks to save and
stop for a move up and watches them, beside the loop). Those collaborators move jobs through
the controller's hands (`service.control.control_pass.Loop`: `move`, `record`, `teardown`,
`succeed`,
`fail_attempt`, `fenced`); the controller keeps admission, placement, watching and endings.
Cordoned nodes are kept off placement, drained nodes' jobs moved (as preempted ones are) and
the lemon rule applied by `Cordons` (`service.control.cordons`). Projects' budgets are read
every few seconds by `BudgetWatch` (`service.control.budget_watch`): the 80 % warning, and
the stop at 100 % where the admin asked for it.
One module because it is one pass (about 600 lines), each of whose parts hands its work to
the modules named here.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.cluster.data_plane import Launcher, PollResult
from service.contract.prices import ProfilePrice
from service.contract.reports import GUARD_STOP
from service.contract.spec import JobSpec
from service.contract.spec_limits import recheck
from service.contract.states import JobState, TransitionError
from service.control.budget_watch import EVERY_S, BudgetWatch
from service.control.cluster_probes import ClusterProbes
from service.control.control_pass import Change, LiveAttempt, StepResult
from service.control.cordons import Cordons
from service.control.corpus_admission import READY, SCANNING, CorpusAdmission
from service.control.export_run import ExportRunner
from service.control.node_survey import NodeSurvey
from service.control.pace import FAST_FOR_S, Activity
from service.control.preempting import Preemptions
from service.control.profile_collect import ProfileCollector
from service.control.rescaling import Rescaling
from service.control.stack_collect import StackCollector
from service.control.tag_recovery import recover
from service.control.teardown import Teardown, Teardowns
from service.control.worker_reports import store_poll
from service.files.checkpoint_dirs import (
    CheckpointPlaces,
    CheckpointRefused,
    CheckpointWriter,
    JobFolders,
    seed,
)
from service.files.data_check import changed_corpus
from service.files.profiles import ProfileFiles, profile_root
from service.monitor.attempt import AttemptHealth, record_stacks
from service.policy.elastic_replan import fitting_ranks
from service.policy.quota import Quota, held
from service.policy.scheduler import admit, bundles, pack, unplaceable
from service.redaction import redact
from service.secrets import JobSecrets, SecretBox, SecretsUnreadable
from service.store import AttemptStatus, Fence, Job, NotFound, Store
from service.store.identity import Identity
from service.store.metrics import MetricsIngest
from service.store.profile_requests import ProfileRequests
from service.store.quota_waits import QuotaNotes
from service.store.stack_requests import StackRequests
from service.tracking.config import TrackingConfig
from service.tracking.exporter import Exporter

log = logging.getLogger(__name__)
HANG_STACKS_S = 10.0
"""How long a hung group's ranks get to send their stacks (on its teardown thread)."""

ADMIT_PAGE = 64
"""Queued jobs read per page by admission (see `Controller._admit`)."""

RESTART_SETTLE_S = 5.0
"""How long after its old group stopped a restarting job whose room does not show free yet
keeps its claim before it is requeued: Ray gives a removed placement group's resources back a
moment later, so the job is neither requeued nor preempts on that stale view."""

def decide_on_failure(job: Job) -> JobState:
    """Failure policy: restart from the last checkpoint while retries are left, else fail.
    Attempts stopped by a preemption spend none."""
    return JobState.RESTARTING if failures(job) <= retries(job) else JobState.FAILED


def failures(job: Job) -> int:
    """Attempts that spent a retry: all but those a preemption or an elastic move up
    stopped."""
    return job.attempts - job.preemptions - job.moves_up


def retries(job: Job) -> int:
    """Restarts the job's spec allows (`max_retries`)."""
    return job.spec.max_retries


class Controller:
    def __init__(self, store: Store, launcher: Launcher, *, checkpoint_root: Path,
                 start_timeout_s: float = 120.0, cancel_grace_s: float = 5.0,
                 poll_timeout_s: float = 0.05, inventory_every_s: float = 60.0,
                 shutdown_timeout_s: float = 20.0, fence: Fence | None = None,
                 places: CheckpointPlaces | None = None, box: SecretBox | None = None,
                 tracking: TrackingConfig | None = None,
                 preempt_grace_s: float = 300.0, tag_steps_max_bytes: int = 64 << 20,
                 nonfinite_loss_steps: int = 10, lemon_failures: int = 0,
                 lemon_window_s: float = 3600.0,
                 prices: Mapping[str, ProfilePrice] | None = None,
                 budget_every_s: float = EVERY_S, data_dir: Path | None = None,
                 exports: ExportRunner | None = None) -> None:
        self.store = store
        self.exports = exports
        """`trident export`: each export a task on the cluster, beside the loop (None: this
        controller runs none; they wait for one that does)."""
        self.corpora = CorpusAdmission(data_dir)
        """Queued jobs' corpora that no record describes, scanned before admission, beside
        the loop (`data_dir`: the server's, where the scans are recorded)."""
        self.ingest = MetricsIngest(store)
        """Step reports go through it: a job-level row per step, per-rank rows sampled."""
        self.fence = fence
        """The lease this controller acts under (the daemon's); attempts start only while it
        is held (`Store.start_attempt` raises NotHolder, and the pass stops, otherwise), and
        ranks are launched only while it is (`fenced`: before a group is started, before a
        starting group is polled, whose poll launches its ranks; `ClusterProbes` likewise)."""
        self.launcher = launcher
        self.checkpoint_root = checkpoint_root
        self.folders = JobFolders(checkpoint_root, places)
        """Each job's checkpoint folder, made its own before every attempt."""
        self.start_timeout_s = start_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.poll_timeout_s = poll_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.running: dict[int, LiveAttempt] = {}
        self.teardowns = Teardowns(cancel_grace_s)
        self.drain_s = min(cancel_grace_s, 2.0)
        """How long a cancelled group's last poll waits for its ranks (beside the loop)."""
        self.cluster_probes = ClusterProbes(store, launcher, start_timeout_s=start_timeout_s,
                                            poll_timeout_s=poll_timeout_s,
                                            teardowns=self.teardowns, fence=fence)
        self.nodes = NodeSurvey(store, launcher, inventory_every_s)
        self.identity = Identity(store)
        self.quota_notes = QuotaNotes(store)
        self.stacks = StackCollector(StackRequests(store))
        """`trident stacks`: answered from the live groups, beside the loop."""
        self.profiles = ProfileCollector(
            ProfileRequests(store),
            ProfileFiles(profile_root(data_dir)) if data_dir is not None else None)
        """`trident profile`: the live groups' ranks profile, beside the loop; their traces
        are stored under `data_dir`."""
        self.secrets = JobSecrets(store, box)
        """Opens jobs' secrets for their ranks' environment (no box: a job with secrets
        fails)."""
        # An ended job's export waits out its group's stopping (its last poll) first.
        self.exporter = Exporter(store, tracking.make_sink, allowed=tracking.allows,
                                 settle_s=cancel_grace_s + 30) if tracking is not None else None
        """Sends the stored steps to MLflow and TensorBoard files, beside the loop."""
        self._swept = False
        self._read_folders = False
        """Whether the first pass read the active jobs' checkpoint folders (`_recover`)."""
        self.tag_steps_max_bytes = tag_steps_max_bytes
        """The most bytes read of one rank's file of step reports in a tag."""
        self.nonfinite_loss_steps = nonfinite_loss_steps
        """A job whose last this many losses were not finite does not succeed (`succeed`)."""
        self.preemptions = Preemptions(self, store, launcher, self.teardowns, self.quota_notes,
                                       grace_s=preempt_grace_s, poll_timeout_s=poll_timeout_s)
        """Preempted jobs, asked to save and stop, watched and requeued beside the loop."""
        self.rescaling = Rescaling(self, store, launcher, grace_s=preempt_grace_s,
                                   poll_timeout_s=poll_timeout_s)
        """Elastic jobs re-planned down and moved up, beside the loop."""
        self.cordons = Cordons(self, store, launcher, self.teardowns, self.preemptions,
                               lemon_failures=lemon_failures, lemon_window_s=lemon_window_s)
        """Cordoned nodes kept off placement, drained nodes' jobs moved, the lemon rule."""
        self.budgets = BudgetWatch(store, prices, every_s=budget_every_s)
        """Projects' budgets: the 80 % warning, the stop at 100 % (`stop_running`)."""
        self.stopped_at: dict[int, float] = {}
        """When each job's last group was seen stopped (`time.monotonic()`), until its restart
        is placed or requeued (`_restart`)."""
        self.blocked: int | None = None
        """The queued job admission stopped at in this pass: no move up takes its room."""

    # --- one pass -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        result = StepResult()
        for td in self.teardowns.reap():
            self._stopped(td)
        active = self.store.active_jobs()
        keeping: list[Job] = []  # RESTARTING, the last group still stopping: admission
        # keeps their room (`_admit`)
        for job in active:
            if job.cancel_requested and job.id in self.running:
                self._cancel(job, self.running[job.id], result)
            elif job.cancel_requested:
                self.move(job, JobState.CANCELLED, "cancelled by request", result)
            elif job.id in self.running and job.state == JobState.PREEMPTED:
                self.preemptions.watch(job, self.running[job.id], result)
            elif job.id in self.running and job.id in self.rescaling.moving:
                self.rescaling.watch(job, self.running[job.id], result)
            elif job.id in self.running:
                self._watch(job, self.running[job.id], result)
            elif job.state == JobState.PREEMPTED:  # its group is gone (a new controller)
                self.preemptions.requeue(job, job.attempts, "its worker group is gone", result)
            elif job.state == JobState.RESTARTING:
                # The last attempt's ranks may still hold the checkpoint directory and their
                # resources: the next attempt starts once they are gone.
                if self.teardowns.busy(("job", job.id)) or not self._restart(job, result):
                    keeping.append(job)
            else:
                self._orphaned(job, result)
        kept = {j.id for j in keeping}  # the others restarted, requeued or ended
        self.stopped_at = {j: t for j, t in self.stopped_at.items() if j in kept}
        if not self._read_folders:  # what the controller before this one never heard of
            for job in active:
                if job.attempts:
                    self._recover(job)
            self._read_folders = True
        if not self._swept:  # once the groups there are to re-attach are re-attached
            self._sweep()
        self.cordons.step(result, stopping=self.rescaling.moving)
        self.budgets.step(active)
        self.rescaling.down()
        self._admit(result, active, keeping)
        self.rescaling.up(active, self.blocked)
        self.cluster_probes.step()
        live = {j: (run.group, run.attempt) for j, run in self.running.items()}
        self.stacks.step(live)
        self.profiles.step(live)
        self.nodes.step()
        if self.exporter is not None:
            self.exporter.step()
        if self.exports is not None:
            self.exports.step()
        return result

    def activity(self, result: StepResult) -> Activity:
        """What the pass that returned `result` saw, for the daemon's wait
        (`service.control.pace`)."""
        runs = list(self.running.values())
        now = time.monotonic()
        beside = (self.teardowns.pending or self.cluster_probes.running or self.stacks.pending
                  or self.profiles.pending or self.rescaling.moving or self.preemptions.victims
                  or self.corpora.scanning or (self.exports is not None and self.exports.pending))
        return Activity(
            starting=any(not r.stepped and now - r.started < FAST_FOR_S for r in runs),
            changed=bool(result.changes), steady=bool(runs) and not beside,
            hang_timeout_s=min((r.spec.monitor.hang_timeout_s for r in runs), default=None))

    def shutdown(self, *, stop_jobs: bool = False) -> None:
        """The controller is stopping (daemon exit). Groups are detached: they train on and the
        next controller re-attaches them, unless `stop_jobs`, which stops every group this
        controller watches. Teardowns in flight are waited for, up to `shutdown_timeout_s`
        (all at once, inside the part of `trident up`'s stop it is given: `cli.stopping`)."""
        self.nodes.close()
        self.corpora.close()
        if self.exporter is not None:
            self.exporter.close()
        if self.exports is not None:
            self.exports.shutdown()
        if stop_jobs:
            for job_id, run in list(self.running.items()):
                self.teardown(job_id, run)
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

    def fenced(self) -> None:
        """Raise NotHolder (the pass stops; the daemon exits) when this controller acts under
        a lease it no longer holds: a pass that outlived its lease launches nothing."""
        if self.fence is not None:
            self.store.check_fence(self.fence)

    def _sweep(self) -> None:
        keep = {(job_id, run.attempt) for job_id, run in self.running.items()}
        for name in self.launcher.sweep(keep):
            log.warning("stopped worker group %s: no active attempt of the store is its own",
                        name)
        self._swept = True

    # --- admission and placement ----------------------------------------------------------------

    def _admit(self, result: StepResult, active: list[Job], keeping: list[Job]) -> None:
        """Admit from the head of the queue, read a page (`ADMIT_PAGE`) at a time: admission
        stops at the first job that does not fit, so a long queue costs a pass no more than
        its head. Jobs over their project's quota wait without blocking the others. The next
        page is read only while every job of a page was impossible or waiting for its quota
        (the free capacity is then as it was); one that admitted continues in the next pass.
        The `keeping` restarting jobs keep their room from the jobs behind them by priority
        (`service.policy.scheduler.admit`); one admission stops at preempts nothing: its old group's
        room is coming back (`_restart` requeues it, to preempt, if that room is gone)."""
        self.blocked = None
        quotas = {p: Quota(gpus, cpus) for p, (gpus, cpus) in self.identity.quotas().items()}
        holding = held(self.store.active_jobs()) if quotas else None
        offset = 0
        while True:
            queued = self.store.queued_jobs(limit=ADMIT_PAGE, offset=offset)
            if not queued:
                return
            ready = []
            for job in queued:
                verdict = self.corpora.verdict(job)
                if verdict == READY:
                    ready.append(job)
                elif verdict == SCANNING:
                    offset += 1  # stays queued while its corpus is scanned
                else:
                    self.move(job, JobState.FAILED, verdict, result, error=verdict)
            if not ready:
                if len(queued) < ADMIT_PAGE:
                    return
                continue
            adm = admit(ready, self.launcher.free_capacity(), self.launcher.total_capacity(),
                        quotas=quotas, holding=holding, restarting=keeping)
            for job, why in adm.impossible:
                if job.attempts:  # it ran here: the cluster shrank, and may grow back
                    offset += 1  # stays queued, ahead of the next page
                    continue
                self.move(job, JobState.FAILED, f"cannot be placed on this cluster: {why}",
                           result, error=why)
            for job, why in adm.waiting:
                offset += 1
                if job.waiting != why:
                    self.quota_notes.note(job.id, why)
            for job in adm.admitted:
                if job.waiting is not None:
                    self.quota_notes.note(job.id, None)
                placing = self.move(job, JobState.PLACING, "admitted; claiming resources",
                                     result)
                if placing is not None:
                    self._place(placing, result)
            skipped = len(adm.impossible) + len(adm.waiting)
            if adm.admitted or skipped < len(ready) or len(queued) < ADMIT_PAGE:
                self.blocked = adm.blocked.id if adm.blocked is not None else None
                restart = adm.blocked is not None and adm.blocked.state == JobState.RESTARTING
                if adm.blocked is not None and not adm.admitted and not restart:
                    self.preemptions.start(adm.blocked, active, result,
                                           stopping=self.rescaling.moving)
                return

    # --- restarts ------------------------------------------------------------------------------

    def _restart(self, job: Job, result: StepResult) -> bool:
        """The next attempt, from the checkpoint, into free room only (a group started
        without room would wait out `start_timeout_s` and spend a retry); else back to the
        queue, by its priority, where admission places it when there is room (preempting
        jobs of lower priority if it may). When the cluster no longer has room for it (it
        lost a node) it waits there until it has; an elastic job waits for free room, to be
        re-planned after `wait_s`. False: it keeps its claim a moment longer, its old group
        stopped less than `RESTART_SETTLE_S` ago (its room may not show free yet)."""
        lost = unplaceable(job, self.launcher.total_capacity())
        free = self.launcher.free_capacity()
        if lost is None and pack(bundles(job), free) is not None:
            self._place(job, result)
            return True
        since = self.stopped_at.pop(job.id, None)
        if lost is None and since is not None and time.monotonic() - since < RESTART_SETTLE_S:
            self.stopped_at[job.id] = since
            return False
        why = lost or f"the free room holds {fitting_ranks(job.spec, free)} of its" \
            f" {job.world_size} ranks"
        elastic = job.spec.elastic
        if elastic is not None:
            self.move(job, JobState.QUEUED, f"waiting for room: {why}; elastic: when the room"
                       f" is not back within wait_s ({elastic.wait_s:g} s) it is re-planned onto"
                       " what is free and resumes from its checkpoint", result)
        elif lost is not None:
            self.move(job, JobState.QUEUED, f"waiting for the cluster: it no longer has room"
                       f" for this job ({why}); it resumes from its checkpoint when it has",
                       result)
        else:
            self.move(job, JobState.QUEUED, f"waiting for room: {why}; it keeps its priority"
                       f" ({job.priority}) in the queue and resumes from its checkpoint when"
                       " there is room (a job of lower priority may be preempted for it),"
                       " without spending a retry", result)
        return True

    def _place(self, job: Job, result: StepResult) -> None:
        """Start the next attempt of a PLACING (or RESTARTING) job: the stored spec is the
        spec that runs."""
        if job.state == JobState.RESTARTING:
            placing = self.move(job, JobState.PLACING, "placing a new attempt", result)
            if placing is None:
                return
            job = placing
        job = self.store.start_attempt(job_id=job.id, fence=self.fence)
        attempt = job.attempts
        try:  # a spec stored before a check it fails was added, a folder not the job's
            spec = recheck(job.spec)
            folder = self.folders.claim(CheckpointWriter.of(job), spec.checkpoint.dir)
            if spec.checkpoint.resume_from is not None:
                self._seed(job, attempt, spec, folder)
            self._recover(job)  # no attempt resumes from a tag whose steps are not stored
            secrets = self.secrets.open(job.id)
        except (ValueError, OSError, SecretsUnreadable) as exc:  # CheckpointRefused too
            self.fail_attempt(job, attempt, f"not started: {exc}", result,
                               retry=isinstance(exc, OSError))
            return
        self.fenced()  # the lease may have gone while the folder and secrets were readied
        try:  # secrets reach the ranks' environment, never the spec each is sent (a dump)
            group = self.launcher.start(job_id=job.id, attempt=attempt,
                                        spec=spec.with_secrets(secrets),
                                        plan=job.plan, checkpoint_dir=folder,
                                        writer=CheckpointWriter.of(job))
        except Exception as exc:  # a failed start is data for the failure policy
            log.error("job %s: start failed: %s", job.id, redact(traceback.format_exc(), secrets))
            self.fail_attempt(job, attempt, redact(f"worker group failed to start: {exc!r}",
                                                    secrets), result)
            return
        self.running[job.id] = LiveAttempt(group=group, attempt=attempt, started=time.monotonic(),
                                        spec=spec, health=AttemptHealth(self.store, job, attempt,
                                                                        spec),
                                        redact=self.secrets.redactor(job.id, secrets))

    def _seed(self, job: Job, attempt: int, spec: JobSpec, folder: str) -> None:
        """A job started from another job's checkpoint finds that tag in its own folder
        (`service.files.checkpoint_dirs.seed`) unless it has one of its own already;
        CheckpointRefused
        when the source job or its tag is gone."""
        rf = spec.checkpoint.resume_from
        assert rf is not None
        try:
            source = self.store.get_job(job_id=rf.job)
        except NotFound:
            raise CheckpointRefused(f"checkpoint.resume_from: job {rf.job} is gone") from None
        named = source.spec.checkpoint.dir
        done = seed(folder, self.folders.folder(source.id, named), CheckpointWriter.of(source),
                    rf.step, adopt=named is None)
        if done is not None:
            how = "hard-linked" if done.linked else "copied"
            self.store.add_event(job_id=job.id, attempt=attempt, kind="checkpoint",
                                 message=f"starts from job {source.id}'s checkpoint of step"
                                 f" {done.step}: {done.files} file(s), {done.bytes} bytes"
                                 f" {how} into its own folder in {done.seconds:.2f} s",
                                 data={"source_job": source.id, "step": done.step,
                                       "bytes": done.bytes, "linked": done.linked})

    def _recover(self, job: Job) -> None:
        """Store what the job's checkpoint folder holds that the store lacks: its tags in the
        index, the step reports they carry (`service.control.tag_recovery`). Not read when the
        folder
        is not the job's."""
        named = job.spec.checkpoint.dir
        if self.folders.refusal(CheckpointWriter.of(job), named) is None:
            recover(self.store, self.ingest, job=job, folder=self.folders.folder(job.id, named),
                    max_bytes=self.tag_steps_max_bytes)

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
                placed = [a.placement for a in self.store.list_attempts(job_id=job.id)
                          if a.number == job.attempts]
                self.running[job.id] = LiveAttempt(
                    group=group, attempt=job.attempts, started=time.monotonic(), spec=spec,
                    health=AttemptHealth(self.store, job, job.attempts, spec),
                    redact=self.secrets.redactor(job.id),
                    placement=placed[0] if placed and placed[0] else None)
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
        self.move(job, to, msg if to == JobState.FAILED else f"{msg}; restarting", result,
                   error=msg if to == JobState.FAILED else None)

    # --- watching a running group ---------------------------------------------------------------

    def _cancel(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        """CANCELLED now; the ranks are asked to stop and get the grace beside the loop, where
        a running group is drained first: what its ranks reported and is not stored yet is
        stored when the loop reaps the teardown. A group that is not running yet is not
        polled again, so it never starts training."""
        run.group.cancel()
        self._finish(job, run, AttemptStatus.CANCELLED, JobState.CANCELLED,
                     f"cancelled by request; the workers get {self.cancel_grace_s:g} s to stop"
                     " before they are killed", result, drain=job.state == JobState.RUNNING)

    def _watch(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        if job.state == JobState.PLACING:  # its poll may launch the ranks (rendezvous)
            self.fenced()
        poll = run.group.poll(self.poll_timeout_s)
        if poll.placement:
            run.placement = poll.placement
            self.store.set_placement(job_id=job.id, number=run.attempt, placement=poll.placement)
            run.health.placed(poll.placement)
        result.metrics += self.record(job, run, poll)
        run.health.polled(poll.heartbeats)
        if poll.state == "running" and self._hung(job, run, result):
            return

        if poll.state in ("running", "succeeded") and job.state == JobState.PLACING:
            # Refused when a cancel came in since this pass read the job: the next pass
            # cancels it, and it never reports running.
            moved = self.move(job, JobState.RUNNING, f"all {job.world_size} ranks running",
                               result, attempt=run.attempt, unless_cancelled=True)
            if moved is None:
                return
            job = moved
        if poll.state == "starting" and time.monotonic() - run.started > self.start_timeout_s:
            self.teardown(job.id, run)
            self.fail_attempt(job, run.attempt, f"worker group did not start within"
                               f" {self.start_timeout_s:g} s (resources or rendezvous)", result)
        elif poll.state == "succeeded":
            self.succeed(job, run, result)
        elif poll.state == "failed":
            # Drained: the ranks that did not fail may hold steps no poll brought yet.
            self.teardown(job.id, run, drain=True)
            self.cordons.failed(job, run, poll.failed_ranks)
            detail = run.redact(poll.error or "a rank failed")
            ranks = f"rank(s) {poll.failed_ranks} failed" if poll.failed_ranks else "failed"
            # A folder that is another job's now (rank 0 refused it) stays so, and a corpus
            # replaced since submission stays replaced: no retry.
            final = (self.folders.refusal(CheckpointWriter.of(job), run.spec.checkpoint.dir)
                     or changed_corpus(run.spec)
                     or ("the training guard stopped it: a restart would meet the same data"
                         if GUARD_STOP in (poll.error or "") else None))
            self.fail_attempt(job, run.attempt, f"attempt {run.attempt}: {ranks}\n{detail}"
                               + (f"\nnot retried: {final}" if final else ""), result,
                               retry=final is None)

    def record(self, job: Job, run: LiveAttempt, poll: PollResult) -> int:
        n = store_poll(self.store, self.ingest, job_id=job.id, attempt=run.attempt,
                       world_size=job.world_size, poll=poll, health=run.health,
                       redact=run.redact)
        if poll.acks:  # stored: the ranks may forget them
            run.group.acknowledge(poll.acks)
        run.stepped = run.stepped or n > 0
        return n

    def _hung(self, job: Job, run: LiveAttempt, result: StepResult) -> bool:
        """Stop a group in which no rank made progress in time (diagnosed by its health)."""
        diagnosis = run.health.hung()
        if diagnosis is None:
            return False
        self.teardown(job.id, run, stacks=True)  # stacks taken beside the loop
        self.fail_attempt(job, run.attempt, f"hung: {diagnosis.summary}", result)
        return True

    # --- endings ------------------------------------------------------------------------------

    def _finish(self, job: Job, run: LiveAttempt, status: AttemptStatus, to: JobState, message: str,
                result: StepResult, *, drain: bool = False) -> None:
        self.teardown(job.id, run, drain=drain)
        self.store.end_attempt(job_id=job.id, number=run.attempt, status=status)
        self.move(job, to, message, result, attempt=run.attempt)

    def succeed(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        """Every rank finished: SUCCEEDED, unless its last losses were not finite
        (`_diverged`): FAILED then, without a retry (a restart would resume from the
        checkpoints that hold those weights)."""
        why = self._diverged(job.id)
        if why is None:
            self._finish(job, run, AttemptStatus.SUCCEEDED, JobState.SUCCEEDED,
                         f"all ranks finished {run.spec.train.steps} steps", result)
            return
        self.teardown(job.id, run)
        self.fail_attempt(job, run.attempt, why, result, retry=False)

    def _diverged(self, job_id: int) -> str | None:
        """Why the job's last `nonfinite_loss_steps` losses (rank 0's, of its newest attempt;
        all of them when it ran fewer steps) say it did not succeed: every one NaN or
        infinite. None when any was finite, or none was reported."""
        n = self.nonfinite_loss_steps
        last = self.ingest.recent_metrics(job_id=job_id, rank=0, limit=n)
        if not last or not all(m.loss is None and m.report.loss_nonfinite for m in last):
            return None
        steps = f"step {last[0].step}" if len(last) == 1 else \
            f"steps {last[0].step}-{last[-1].step}"
        return (f"the last {len(last)} losses ({steps} of attempt {last[0].attempt}) were not"
                " finite (NaN or infinite): the weights diverged or were damaged, and so are"
                f" the checkpoints saved since; not a success (nonfinite_loss_steps {n})")

    def fail_attempt(self, job: Job, attempt: int, error: str, result: StepResult, *,
                      retry: bool = True) -> None:
        self.store.end_attempt(job_id=job.id, number=attempt, status=AttemptStatus.FAILED,
                               error=error)
        to = decide_on_failure(job) if retry else JobState.FAILED
        if to == JobState.RESTARTING:
            left = retries(job) - failures(job)
            self.move(job, to, f"attempt {attempt} failed; restarting from the last checkpoint"
                       f" ({left} retries left)", result, attempt=attempt, data={"error": error})
        else:
            self.move(job, JobState.FAILED, f"attempt {attempt} failed: {error}", result,
                       error=error, attempt=attempt)

    def teardown(self, job_id: int, run: LiveAttempt, *, drain: bool = False,
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
        self.stopped_at[key_id] = time.monotonic()
        if td.stacks:
            record_stacks(self.store, key_id, td.attempt, td.stacks)
        if td.final is not None and td.attempt is not None:
            job = self.store.get_job(job_id=key_id)
            store_poll(self.store, self.ingest, job_id=key_id, attempt=td.attempt,
                       world_size=job.world_size, poll=td.final, health=None,
                       redact=self.secrets.redactor(key_id))
        if td.attempt is not None:  # its ranks are gone: what their tags hold is stored
            self._recover(self.store.get_job(job_id=key_id))
        self.store.add_event(
            job_id=key_id, attempt=td.attempt, kind="warning" if td.error else "teardown",
            message=f"stopping the worker group failed after {td.seconds:.1f} s: {td.error}"
            if td.error else f"worker group stopped and its resources freed in"
            f" {td.seconds:.1f} s", data={"seconds": round(td.seconds, 3)})

    def move(self, job: Job, to: JobState, message: str, result: StepResult, *,
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

