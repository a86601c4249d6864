"""The controller daemon, and the composition root: the one place where `service/` meets
`workers/`, by a lazy import, so that the control plane's modules never load Ray or torch.

Run by `trident up` (which restarts it when it exits) as its own process, or alone:
`python -m service.control.daemon`. When it stops, the jobs' worker groups train on (they are
detached Ray actors) and the next controller re-attaches them; `TRIDENT_STOP_JOBS` stops them
with it on SIGTERM. It acts only while it holds the controller's lease
(`service.store.lease`): a second daemon against the same database waits as standby and takes over
once the leader stops renewing. A leader that finds the lease taken stops at once, without
touching a job, and exits with LEASE_LOST; its supervisor starts it again, as a standby.
A database it cannot read (`service.store.dbcheck`) is one line in its log, at start (it exits with
DATABASE_UNREADABLE) and for every pass that fails on a damaged one; a server database that is
away (stopped or unreachable) is one line when a pass, or a start, first finds it away and one
when it answers again (`Outage`), not a traceback per failed pass nor an exit per start.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import FrameType

from service.cluster.rayhead import LOOPBACK_ENV, UNUSED_OFF_ENV, WORKER_NICENESS_ENV, metric_ports
from service.control.controller import Controller, StepResult
from service.control.export_run import ExportRunner
from service.control.heap import freeze_startup_objects
from service.control.pace import Pace
from service.files.checkpoint_dirs import CheckpointPlaces
from service.files.diskfull import tolerate_full_disk
from service.files.order_cache import ServerData
from service.secrets import SecretBox, forget_server_secrets
from service.settings import Settings
from service.store import Fence, NotHolder, Store
from service.store.dbcheck import (
    Unreadable,
    away,
    check,
    damaged,
    describe,
    sqlite_path,
)
from service.store.lease import CONTROLLER, Leader, Role
from service.store.opening import upgrade_schema
from service.tracking.config import TrackingConfig

log = logging.getLogger("trident.controller")

LEASE_LOST = 3
"""Exit status of a daemon whose lease another controller took."""
DATABASE_UNREADABLE = 4
"""Exit status of a daemon that cannot read its database (`service.store.dbcheck`): one line in
its log says which, what is wrong and how to restore it."""


class LeaseLost(Exception):
    """Another controller holds the lease this one held."""


def connect_ray(settings: Settings) -> object:
    """Connect to the configured Ray cluster, or start a local one; returns the launcher."""
    if not settings.ray_address:
        # A Ray of this process only: on loopback, like `trident up`'s head, its metrics
        # collection off (`UNUSED_OFF_ENV`), its workers at niceness 0, with free ports
        # for its metrics servers (read by Ray when it is imported, and by the processes it
        # starts). Its processes run jobs: the server's secrets (read into `settings`
        # already) stay out of the environment they inherit.
        os.environ.update({**LOOPBACK_ENV, **UNUSED_OFF_ENV, **WORKER_NICENESS_ENV,
                           **metric_ports()})
        forget_server_secrets()
    ray = importlib.import_module("ray")
    # ray.init replaces the SIGTERM handler with a bare sys.exit, so that the daemon's own
    # (which logs, stops the loop and releases the lease) would never run: keep ours.
    on_main = threading.current_thread() is threading.main_thread()
    ours = signal.getsignal(signal.SIGTERM) if on_main else None
    group = importlib.import_module("workers.launch.group")
    launcher = importlib.import_module("workers.launch.launcher")
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=group.NAMESPACE, log_to_driver=False)
    else:
        # "local": a Ray of its own, not whichever cluster `ray start` last left on this host.
        ray.init(address="local", include_dashboard=False, namespace=group.NAMESPACE,
                 log_to_driver=False)
    if on_main and callable(ours):
        signal.signal(signal.SIGTERM, ours)
    # From here a SIGTERM is the daemon's own again (a stop that waits on it reads this line).
    log.info("driver of the Ray cluster at %s", settings.ray_address or "local")
    return launcher.RayLauncher(  # type: ignore[no-any-return]
        log_root=settings.log_root, log_max_bytes=settings.rank_log_max_bytes,
        server=ServerData.of(settings), light_ranks=settings.light_ranks)


def retry_wait_s(failures: int, poll_interval_s: float, lease_s: float) -> float:
    """The wait before the next pass after `failures` failed passes in a row (the database is
    away): doubling from twice the poll interval, and never over a third of the lease, so
    that the lease is still renewed when the database is back within it."""
    return min(poll_interval_s * 2 ** failures, lease_s / 3)


class Outage:
    """The database away, as the controller's log says it: one line when a pass first fails
    on it (which database, the error, what to check), nothing for each pass that fails after
    it while it stays away, and one line when a pass succeeds again (how long it was away,
    how many passes failed)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.since: float | None = None
        self.failed = 0

    def away(self, exc: BaseException, wait_s: float) -> None:
        self.failed += 1
        if self.since is None:
            self.since = time.monotonic()
            log.error("database away: %s; the controller retries with backoff (next in %g s)"
                      " and says when it is back", describe(self.url, exc), wait_s)

    def back(self) -> None:
        if self.since is None:
            return
        log.warning("database back after %.1f s (%d controller pass(es) failed meanwhile)",
                    time.monotonic() - self.since, self.failed)
        self.since, self.failed = None, 0


class LeaderLoop:
    """One daemon pass: renew the lease, then step the controller only while leading.

    The controller (and the Ray connection) is made when the lease is first held, so that a
    standby touches nothing but the lease row.
    """

    def __init__(self, leader: Leader, make_controller: Callable[[], Controller]) -> None:
        self.leader = leader
        self.make_controller = make_controller
        self.controller: Controller | None = None
        self._standby_logged: str | None = None
        self.last_pass_s: float | None = None
        """How long the last controller pass took; written with the next renewal."""
        self.last_result: StepResult | None = None
        """What the last controller pass did (None: no pass as leader yet)."""

    def tick(self, now: datetime | None = None) -> Role:
        """Renew (or try to take) the lease and, as leader, do one controller pass. Raises
        LeaseLost when another controller took the lease: nothing more is done."""
        role = self.leader.acquire_or_renew(now, last_pass_s=self.last_pass_s)
        lease = self.leader.lease
        if role == Role.LOST:
            holder = lease.holder if lease else "?"
            log.error("lease lost to %s: stopping at once, without touching any job", holder)
            raise LeaseLost(holder)
        if role == Role.STANDBY:
            if lease is not None and self._standby_logged != lease.holder:
                self._standby_logged = lease.holder
                log.info("standby: the lease is held by %s until %s; waiting", lease.holder,
                         lease.expires_at.isoformat(timespec="seconds"))
            return role
        if self.controller is None:
            assert lease is not None
            log.info("lease acquired by %s (epoch %s): acting as the controller",
                     self.leader.holder, lease.epoch)
            self.controller = self.make_controller()
            # Connecting to Ray takes seconds of the lease: renew it before the first pass,
            # so that a standby cannot take it over while that pass still acts.
            if self.leader.acquire_or_renew(now) != Role.LEADER:
                holder = self.leader.lease.holder if self.leader.lease else "?"
                log.error("lease lost to %s while connecting: stopping at once", holder)
                raise LeaseLost(holder)
        started = time.monotonic()
        try:
            result = self.controller.step()
            self.last_pass_s = time.monotonic() - started
            self.last_result = result
        except NotHolder as exc:  # taken over in the middle of this pass
            log.error("%s: stopping at once, without touching any job", exc)
            raise LeaseLost(str(exc)) from exc
        for change in result.changes:
            log.info("job %s -> %s: %s", change.job_id, change.to, change.message)
        return role

    def wait_s(self, pace: Pace, standby_s: float) -> float:
        """The wait before the next tick: `pace`'s after a pass as leader (from what that
        pass saw), else `standby_s`."""
        if self.controller is None or self.last_result is None:
            return standby_s
        return pace.next(self.controller.activity(self.last_result))


def wait_for_database(settings: Settings, stop: threading.Event) -> None:
    """Return once the database answers. A server database that is away (a controller
    started again while PostgreSQL restarts: its lease ran out during the outage) is waited
    for, said in one line when it is first found away and one when it is back (`Outage`), as
    a pass does; anything else (a damaged database, a SQLite file that cannot be opened, a
    stop asked for meanwhile) raises `Unreadable` with its line."""
    outage = Outage(settings.db_url)
    failures = 0
    while True:
        try:
            check(settings.db_url, budget_s=0)
        except Unreadable as exc:
            cause = exc.__cause__
            if sqlite_path(settings.db_url) is not None or cause is None or not away(cause) \
                    or stop.is_set():
                raise
            failures += 1
            wait = retry_wait_s(failures, settings.poll_interval_s, settings.lease_s)
            outage.away(cause, wait)
            stop.wait(wait)
            continue
        outage.back()
        return


def run(settings: Settings, stop: threading.Event) -> int:
    """The daemon's loop until `stop` is set; its exit status (LEASE_LOST, or 0)."""
    upgrade_schema(settings.db_url)
    store = Store(settings.db_url)
    leader = Leader(store, duration_s=settings.lease_s)
    secret = settings.secrets_key.get_secret_value() if settings.secrets_key else None
    box = SecretBox.of(secret, settings.data_dir)

    def make_controller() -> Controller:
        launcher = connect_ray(settings)
        exports = ExportRunner(store, importlib.import_module(
            "workers.launch.export_task").ray_export, settings.export_max_concurrent)
        return Controller(store, launcher,  # type: ignore[arg-type]
                          checkpoint_root=settings.checkpoint_root,
                          places=CheckpointPlaces(settings.checkpoint_root_dirs,
                                                  settings.data_dir),
                          start_timeout_s=settings.start_timeout_s,
                          nonfinite_loss_steps=settings.nonfinite_loss_steps,
                          lemon_failures=settings.lemon_failures,
                          lemon_window_s=settings.lemon_window_s,
                          prices=settings.prices,
                          cancel_grace_s=settings.cancel_grace_s,
                          # Within the part of `trident up`'s stop it is given
                          # (`cli.stopping.CONTROLLER_SHARE`).
                          shutdown_timeout_s=0.4 * settings.stop_grace_s,
                          fence=Fence(CONTROLLER, leader.holder), box=box,
                          tracking=TrackingConfig.of(settings), data_dir=settings.data_dir,
                          tag_steps_max_bytes=settings.tag_steps_max_bytes,
                          exports=exports)

    loop = LeaderLoop(leader, make_controller)
    # Renewed every pass: the longest wait is a third of the lease (as `retry_wait_s`).
    pace = Pace(settings.poll_interval_s,
                min(settings.poll_max_interval_s, settings.lease_s / 3))
    log.info("controller %s starting against %s (lease %g s)", leader.holder,
             settings.db_url, settings.lease_s)
    parent = int(os.environ.get("TRIDENT_PARENT_PID", "0"))
    status = 0
    failures = 0
    outage = Outage(settings.db_url)
    frozen = False
    try:
        while not stop.is_set():
            if parent and os.getppid() != parent:  # `trident up` is gone: so are we
                log.info("parent process %s ended: stopping", parent)
                break
            try:
                loop.tick()
                if not frozen and loop.controller is not None:
                    # After the first pass that acted, Ray and the controller are loaded:
                    # full collections skip them from now on (service.control.heap).
                    frozen = bool(freeze_startup_objects())
            except LeaseLost:
                status = LEASE_LOST
                break
            except Exception as exc:  # one bad pass must not end the daemon
                failures += 1
                wait = retry_wait_s(failures, settings.poll_interval_s, settings.lease_s)
                if away(exc):  # one line per outage
                    outage.away(exc, wait)
                elif damaged(exc):  # the same line every pass, not a traceback every pass
                    log.error("controller pass failed (%d in a row): %s; retrying in %g s",
                              failures, describe(settings.db_url, exc), wait)
                else:
                    log.exception("controller pass failed (%d in a row); retrying in %g s",
                                  failures, wait)
                if leader.holding and leader.expired():
                    # Not renewed in time (the database is away): another controller may act
                    # now, so this one must not.
                    log.error("lease not renewed before it expired: stopping")
                    status = LEASE_LOST
                    break
                stop.wait(wait)
                continue
            outage.back()
            failures = 0
            stop.wait(loop.wait_s(pace, settings.poll_interval_s))
    finally:
        if status != LEASE_LOST:
            if loop.controller is not None:
                # Jobs train on, detached, unless a signal stopped us with stop_jobs set (a
                # controller whose `trident up` died leaves them to the next one).
                loop.controller.shutdown(stop_jobs=settings.stop_jobs and stop.is_set())
            try:
                leader.release()  # the standby need not wait for the lease to expire
            except Exception as exc:
                if damaged(exc):  # one line, as every pass that failed on it
                    log.error("releasing the lease failed (%s); it expires by itself",
                              describe(settings.db_url, exc))
                else:
                    log.exception("releasing the lease failed; it expires by itself")
        store.close()
        log.info("controller %s stopped", leader.holder)
    return status


def main() -> None:
    # Under `trident up` both streams are controller.log, in the data directory: when its
    # disk is full, a log line (or Ray's forwarding of a worker's output) is lost, counted
    # and said later, instead of raising in whichever thread wrote it.
    sys.stdout = tolerate_full_disk(sys.stdout)
    sys.stderr = tolerate_full_disk(sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr, force=True)
    stop = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        wait_for_database(settings, stop)  # `trident up` and `trident controller` did more
        status = run(settings, stop)
    except Unreadable as exc:
        log.error("%s", exc)
        status = DATABASE_UNREADABLE
    sys.exit(status)


if __name__ == "__main__":
    main()
