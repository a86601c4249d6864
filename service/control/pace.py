"""How long the controller's daemon waits before its next pass (`Pace`).

A pass polls every live worker group (one call to each rank's actor, which answers on the
rank's own process) and stores what the ranks reported since the last one. The ranks keep
their reports until a poll takes them (`workers.rank.actor`), so a poll takes all of a rank's steps
since the last one in one call, and the store takes them in one write: how often that happens
is the controller's cost beside the ranks, on a machine whose cores the ranks need. So the
wait follows what the controller has to see:

- `fast_s` (0.1 s, or the base interval if that is shorter) while a group is starting:
  placed, its ranks met and launched, probing, until its first step is stored (for at most
  `FAST_FOR_S` after the attempt started). Each of those stages' ends is seen at once: that
  is the time to a job's first step.
- `base_s` (`TRIDENT_POLL_INTERVAL_S`) after a pass that changed a job's state, while no
  group runs (a newly submitted job is admitted within it), and while anything beside the
  training groups is under way (a teardown, a cluster probe, a `trident stacks` request, a
  preemption or an elastic move).
- Otherwise, every group training and nothing changed: twice the last wait, from `base_s` up
  to `max_s` (`TRIDENT_POLL_MAX_INTERVAL_S`, at most a third of the lease so that it is
  renewed in time), and never over a quarter of the shortest `monitor.hang_timeout_s` of the
  running jobs, so that a hang is still found within a quarter of its deadline of the time it
  was found before. Steps are stored as before, only in fewer, larger writes; a cancel, a
  new job that fits beside the running ones or a job's last step is seen up to `max_s` later.
"""

from __future__ import annotations

from dataclasses import dataclass

FAST_S = 0.1
"""The wait while a group starts."""

FAST_FOR_S = 120.0
"""How long after an attempt started its group may keep the controller fast (a first step
that takes longer, such as a large checkpoint's load, is waited for at the base interval)."""

HANG_SHARE = 0.25
"""The longest wait as a share of the shortest hang timeout of the running jobs."""


@dataclass(frozen=True)
class Activity:
    """What the controller's last pass saw (`Controller.activity`)."""

    starting: bool = False
    """A group is starting (no step stored from it yet)."""
    changed: bool = False
    """The pass changed a job's state."""
    steady: bool = False
    """Groups train and nothing else is under way: the wait may grow."""
    hang_timeout_s: float | None = None
    """The shortest `monitor.hang_timeout_s` of the running jobs."""


class Pace:
    """The wait before each pass, from what the last pass saw (see the module)."""

    def __init__(self, base_s: float, max_s: float, fast_s: float = FAST_S) -> None:
        self.base_s = base_s
        self.max_s = max(base_s, max_s)
        self.fast_s = min(fast_s, base_s)
        self.wait_s = base_s

    def next(self, activity: Activity) -> float:
        """The wait before the next pass."""
        if activity.starting:
            self.wait_s = self.fast_s
        elif activity.changed or not activity.steady:
            self.wait_s = self.base_s
        else:
            ceiling = self.max_s
            if activity.hang_timeout_s is not None:
                ceiling = max(self.base_s, min(ceiling, activity.hang_timeout_s * HANG_SHARE))
            self.wait_s = min(ceiling, max(self.base_s, self.wait_s * 2))
        return self.wait_s
