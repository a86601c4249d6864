"""How `trident up` stops: every process it started and stops has ended within the stop's
grace (`TRIDENT_STOP_GRACE_S`, 30 s by default), counted from the signal (SIGTERM or Ctrl-C),
whatever the database or Ray is doing.

The signal starts the clock (`Stop.begin`) and, at once, sends the controller SIGTERM, beside
the API's graceful shutdown (whose requests get `API_SHARE` of the grace), so that neither
waits for the other. Then, in a thread of its own, each step bounded by a share of the grace:

1. the controller daemon (it releases its lease, and with `--stop-jobs` stops the jobs'
   groups): by `CONTROLLER_SHARE`, else SIGKILL to its process group (it may be waiting on
   Ray, or on a database lock);
2. which jobs are still active, unless `--stop-jobs`: one query, in a thread of its own,
   waited for `STORE_ANSWER_S` at most (`active_jobs`: a database that hangs, a server
   behind a dropped route, a lock another process holds);
3. the Ray head, unless jobs are active: SIGTERM to its `ray start --block`, then SIGKILL to
   its process group by `HEAD_SHARE` (a head whose processes are stopped or hung ends so).

A watchdog (`Stop._watch`) backs all of it: `WATCHDOG_MARGIN_S` before the end of the grace,
whatever of what this stop stops still runs (the controller, the API's worker processes, the
head unless it is kept) is killed, one line says which step was still running, and
`trident up` exits with status 1.

When the store cannot say which jobs are active, the head is stopped or kept by whether the
jobs' records can be read again (`stop_head`): a damaged database (or a SQLite file that
cannot be opened) never will as it is, so no controller could re-attach the jobs, and the
head stops with the stack; a database that is away or did not answer in time (a server
restarting, a lock held elsewhere) keeps its records, so the head keeps running for the jobs
that may be active on it, and the next `trident up` adopts it and re-attaches them (stopping
that one, with the database back, stops the head if no job is active). Either is one line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Protocol

import psutil
import typer

API_SHARE = 0.15
"""The API's graceful shutdown: its requests in flight get this share of the grace."""
CONTROLLER_SHARE = 0.6
"""The controller daemon is killed if it has not ended by this share of the grace."""
STORE_ANSWER_S = 5.0
"""The longest wait for the store to say which jobs are active (and never past
`STORE_SHARE` of the grace)."""
STORE_SHARE = 0.75
HEAD_SHARE = 0.9
"""The Ray head's `ray start` gets until this share of the grace, less a second, to stop its
processes; then its process group is killed."""
WATCHDOG_MARGIN_S = 0.5
"""The watchdog acts this long before the end of the grace."""


class Stoppable(Protocol):
    def signal_stop(self) -> None: ...
    def stop(self, grace_s: float) -> bool: ...
    def kill(self) -> None: ...


class Head(Protocol):
    address: str

    def stop(self, grace_s: float) -> bool: ...
    def kill(self) -> None: ...


def active_jobs(url: str, timeout_s: float) -> list[Any]:
    """The store's active jobs, asked in a thread of its own. Raises `TimeoutError` when the
    store has not answered within `timeout_s` (the thread is left to end by itself), else
    whatever the query raised."""
    from service.store import Store

    done = threading.Event()
    answer: dict[str, Any] = {}

    def ask() -> None:
        store = None
        try:
            store = Store(url)
            answer["jobs"] = store.active_jobs()
        except BaseException as exc:  # handed to the caller
            answer["error"] = exc
        finally:
            try:
                if store is not None:
                    store.close()
            finally:
                done.set()

    threading.Thread(target=ask, name="active-jobs", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in answer:
        raise answer["error"]
    return list(answer["jobs"])


def stop_head(head: Head, url: str, stop_jobs: bool, *, answer_s: float = STORE_ANSWER_S,
              grace_s: float = 30.0) -> bool:
    """Stop the local Ray head within `grace_s`, unless jobs are still active on it (they
    train on, and the next `trident up` adopts the head and re-attaches them); whether it was
    stopped. With `stop_jobs` the store is not asked. When the store cannot say which jobs
    are active within `answer_s`: a damaged database, or a SQLite file that cannot be opened,
    stops the head all the same (no controller can re-attach a job without its records); a
    database that is away or did not answer keeps it (the records are intact, the next
    `trident up` re-attaches the jobs). Each case is one line."""
    from service.store.dbcheck import away, damaged, describe, sqlite_path, where

    deadline = time.monotonic() + grace_s
    if not stop_jobs:
        try:
            active = active_jobs(url, answer_s)
        except TimeoutError:
            typer.echo(f"the database {where(url)} did not say within {answer_s:g} s which"
                       f" jobs are active; the Ray head at {head.address} keeps running, for"
                       " the jobs that may be active on it: the next `trident up` re-attaches"
                       " them")
            return False
        except Exception as exc:  # any failure to read is the database's
            if away(exc) and not damaged(exc) and sqlite_path(url) is None:
                typer.echo(f"{describe(url, exc)}; the Ray head at {head.address} keeps"
                           " running, for the jobs that may be active on it: the next"
                           " `trident up` re-attaches them")
                return False
            typer.echo(f"{describe(url, exc)}; stopping the Ray head at {head.address} all"
                       " the same: no controller can re-attach its jobs without their"
                       " records")
            active = []
        if active:
            typer.echo(f"{len(active)} job(s) still active keep the Ray head at"
                       f" {head.address} running; `trident up` re-attaches them (--stop-jobs"
                       " stops them)")
            return False
    left = max(0.0, deadline - time.monotonic())
    if not head.stop(left):
        typer.echo(f"the Ray head at {head.address} did not stop within {left:.0f} s: killed")
    return True


class Stop:
    """One stop of `trident up`, from its signal (`begin`) to its end (`finish`)."""

    def __init__(self, grace_s: float, db_url: str, stop_jobs: bool) -> None:
        self.grace_s = grace_s
        self.db_url = db_url
        self.stop_jobs = stop_jobs
        self.controller: Stoppable | None = None
        self.head: Head | None = None
        self.began: float | None = None
        self.step = "the API"
        """What the stop waits for now: the watchdog's line names it."""
        self.keep_head = not stop_jobs
        """Whether the head is left running: until the store has said that no job is active
        (or could not say, damaged), as the watchdog must not kill what may hold jobs."""
        self.api_done = False
        self._done = threading.Event()

    def signal(self, signum: int, _frame: object) -> None:
        """The handler of SIGTERM and SIGINT while `trident up` starts and after the API: the
        first begins the stop and ends what the main thread was doing (`SystemExit`, so that
        `trident up`'s `finally` runs); any later one (a second Ctrl-C, the signal uvicorn
        raises again after its shutdown) changes nothing."""
        if self.began is None:
            self.begin()
            raise SystemExit(0)

    def at(self, share: float) -> float:
        """The monotonic time at `share` of the grace."""
        assert self.began is not None
        return self.began + share * self.grace_s

    def left(self, share: float) -> float:
        return max(0.0, self.at(share) - time.monotonic())

    def begin(self) -> None:
        """Start the stop (idempotent; from a signal handler too): the clock, the
        controller's SIGTERM, the watchdog, and the steps' thread."""
        if self.began is not None:
            return
        self.began = time.monotonic()
        if self.controller is not None:
            self.controller.signal_stop()
        threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()
        threading.Thread(target=self._run, name="stop", daemon=True).start()

    def finish(self) -> None:
        """In the main thread once the API has stopped: wait for the other steps (the
        watchdog ends the process at the grace if it must)."""
        self.api_done = True
        self.begin()
        self._done.wait()

    def _run(self) -> None:
        try:
            if self.controller is not None:
                self.step = "the controller"
                if not self.controller.stop(self.left(CONTROLLER_SHARE)):
                    typer.echo("the controller did not stop within"
                               f" {CONTROLLER_SHARE * self.grace_s:.0f} s of the"
                               " signal: killed")
            if self.head is not None:
                self.step = "the database, to say which jobs are active"
                answer_s = min(STORE_ANSWER_S, self.left(STORE_SHARE))
                self.keep_head = not stop_head(
                    _Steps(self, self.head), self.db_url, self.stop_jobs, answer_s=answer_s,
                    grace_s=max(0.0, self.left(HEAD_SHARE) - 1.0))
        except Exception as exc:  # the watchdog still ends what is left
            typer.echo(f"stopping failed at {self.step}: {type(exc).__name__}: {exc}")
        finally:
            self._done.set()

    def _watch(self) -> None:
        """Until `WATCHDOG_MARGIN_S` before the end of the grace; if this process still runs
        then (a step that outlived its bound, or a thread that holds its exit), kill what is
        left and end it."""
        assert self.began is not None
        end = self.at(1.0) - WATCHDOG_MARGIN_S
        while (wait := end - time.monotonic()) > 0:
            time.sleep(min(wait, 0.5))
        if self._done.is_set() and self.api_done:
            what = "this process's exit (a thread still in a call)"
        else:
            what = self.step if self.api_done else f"the API and {self.step}"
        typer.echo(f"the stop outlived its grace of {self.grace_s:g} s, waiting for {what}:"
                   " killing what is left", err=True)
        self.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def kill(self) -> None:
        """SIGKILL what this stop stops: the controller's process group, the head's unless
        it is kept, and every other child of this process (the API's worker processes)."""
        keep = set()
        if self.controller is not None:
            self.controller.kill()
        if self.head is not None:
            if self.keep_head:
                keep.add(getattr(self.head, "pid", None))
            else:
                self.head.kill()
        for child in psutil.Process().children():
            if child.pid not in keep:
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signal.SIGKILL)


class _Steps:
    """The head as `stop_head` stops it, telling the stop's watchdog which step runs."""

    def __init__(self, stop: Stop, head: Head) -> None:
        self._stop = stop
        self._head = head
        self.address = head.address

    def stop(self, grace_s: float) -> bool:
        self._stop.step = "the Ray head"
        self._stop.keep_head = False
        return self._head.stop(grace_s)

    def kill(self) -> None:
        self._head.kill()
