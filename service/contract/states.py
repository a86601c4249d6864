"""Job states and the transitions between them; `Store.transition` (`service.store.store`) is
their only writer.

    QUEUED -> PLACING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED
    RUNNING -> RESTARTING -> PLACING        (recoverable failure, retries left)
    QUEUED | PLACING | RESTARTING -> CANCELLED | FAILED
    PLACING -> RESTARTING                   (the group failed before it ran)
    RESTARTING -> QUEUED                    (the cluster lost the room it ran in: it waits)
    RUNNING -> PREEMPTED -> QUEUED          (a job of higher priority needs the room: its
                                             ranks checkpoint and stop, no retry is spent)
    PREEMPTED -> SUCCEEDED | FAILED | CANCELLED
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"
    """Asked to checkpoint now and stop, for a job of higher priority; QUEUED once stopped."""

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def active(self) -> bool:
        """Holds (or is claiming) cluster resources."""
        return self in (JobState.PLACING, JobState.RUNNING, JobState.RESTARTING,
                        JobState.PREEMPTED)


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.PLACING, JobState.CANCELLED, JobState.FAILED}),
    JobState.PLACING: frozenset(
        {JobState.RUNNING, JobState.RESTARTING, JobState.FAILED, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.RESTARTING,
         JobState.PREEMPTED}),
    JobState.PREEMPTED: frozenset(
        {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}),
    JobState.RESTARTING: frozenset(
        {JobState.PLACING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class TransitionError(ValueError):
    """A transition the state machine does not allow (a 409 at the API)."""


def check_transition(current: JobState, to: JobState) -> None:
    if to not in ALLOWED[current]:
        allowed = ", ".join(sorted(ALLOWED[current])) or "none (terminal)"
        raise TransitionError(f"cannot move a job from {current} to {to}; allowed: {allowed}")
