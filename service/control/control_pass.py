"""What the controller's loop (`service.control.controller`) shares with the collaborators that
carry
out its longer moves beside it (`service.control.preempting`, `service.control.rescaling`): a live
attempt (`LiveAttempt`), what one pass changed (`StepResult`), and `Loop`, the controller's
hands a collaborator moves a job with, so that every state change still goes through the
controller (`Store.transition`, the pass's result, its teardowns, its lease).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.cluster.data_plane import PollResult, WorkerGroup
from service.contract.spec import JobSpec
from service.contract.states import JobState
from service.monitor.attempt import AttemptHealth
from service.store import Job


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
class LiveAttempt:
    """What the controller keeps about one live attempt."""

    group: WorkerGroup
    attempt: int
    started: float
    spec: JobSpec
    health: AttemptHealth
    redact: Callable[[str], str] = field(default=str, repr=False)  # str: the text as it is
    """Takes the job's secrets out of what is stored from its ranks."""
    placement: dict[str, Any] | None = None
    """Where its ranks are (node of each), once known: what preempting it would free."""
    stepped: bool = False
    """Whether a step of it was stored: until then it is starting (`activity`)."""


class Loop(Protocol):
    """The controller as its collaborators see it."""

    running: dict[int, LiveAttempt]
    """The attempts whose groups the loop polls, by job id."""

    def move(self, job: Job, to: JobState, message: str, result: StepResult, *,
             error: str | None = None, attempt: int | None = None,
             data: dict[str, Any] | None = None,
             unless_cancelled: bool = False) -> Job | None:
        """Move the job (None: the state machine refused)."""

    def record(self, job: Job, run: LiveAttempt, poll: PollResult) -> int:
        """Store what a poll of the job's group brought; the steps stored."""

    def teardown(self, job_id: int, run: LiveAttempt) -> None:
        """Stop the group beside the loop; the loop no longer polls it."""

    def succeed(self, job: Job, run: LiveAttempt, result: StepResult) -> None:
        """Every rank finished: the job ends as a finished one does."""

    def fail_attempt(self, job: Job, attempt: int, error: str, result: StepResult) -> None:
        """The attempt failed: the failure policy restarts the job or fails it."""

    def fenced(self) -> None:
        """Raise NotHolder unless the loop still holds its lease (stopping ranks is the
        leader's to do)."""
