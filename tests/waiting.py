"""Waiting in tests: for a condition, or for a controller pass to bring one about.

A test waits for the event itself, with a deadline far beyond what the event needs on a quiet
machine: never a bounded count of short polls, whose outcome depends on the machine's speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.contract.states import JobState
    from service.control.controller import Controller
    from service.store import Store

DEADLINE_S = 120.0
"""The default deadline: generous, so that a loaded machine is slow, never wrong."""


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = DEADLINE_S,
             why: Callable[[], str] = lambda: "", interval_s: float = 0.05) -> None:
    """Return once `cond()` holds; fail naming `what` (and `why()`, what the test knows of
    the state it waited in) after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s\n{why()}".rstrip())
        time.sleep(interval_s)


def drive_until(controller: Controller, done: Callable[[], bool], timeout: float,
                what: str) -> None:
    """Step the controller until `done()` holds; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} not reached after {timeout} s"
        controller.step()
        time.sleep(0.1)


def drive(controller: Controller, store: Store, job_id: int, until: set[JobState],
          timeout: float) -> JobState:
    """Step the controller until job `job_id` is in one of the states `until`: that state."""
    drive_until(controller, lambda: store.get_job(job_id=job_id).state in until, timeout,
                f"job {job_id} in {sorted(until)}")
    return store.get_job(job_id=job_id).state


@contextmanager
def passes_beside(controller: Controller, interval_s: float = 0.1) -> Iterator[None]:
    """The controller's passes on a thread while the block runs (a CLI command that waits for
    what the controller brings about, as a user runs it beside a served stack)."""
    stop = threading.Event()

    def passes() -> None:
        while not stop.is_set():
            controller.step()
            stop.wait(interval_s)

    driver = threading.Thread(target=passes, name="passes")
    driver.start()
    try:
        yield
    finally:
        stop.set()
        driver.join(60)
