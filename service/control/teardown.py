"""Worker groups being stopped beside the controller's loop.

Stopping a group (`WorkerGroup.shutdown`) gives its ranks up to the grace to end, then kills
them and frees their placement group: seconds, far longer than a controller pass. A cancelled
group is drained first, on the same thread: its last poll (`Teardown.final`) carries what the
ranks reported and the controller has not stored yet, which the controller stores when it
reaps the teardown; a hung group's stacks (`Teardown.stacks`) are taken there too. `Teardowns`
runs each one on a thread of its own, so the controller moves the job on at once and one slow
group never delays another or the next pass. It keeps what is still in flight by key, so the
controller starts no new attempt of a job whose last group still holds its resources and
checkpoint directory, and it waits for them (bounded) when the daemon exits.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from service.cluster.data_plane import PollResult, WorkerGroup

log = logging.getLogger(__name__)

Key = tuple[str, int]
"""What a group belongs to: ("job", job id) or ("probe", probe id)."""


@dataclass(eq=False)
class Teardown:
    """One group being stopped; `seconds` and `error` are set once it is done."""

    key: Key
    attempt: int | None
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: str | None = None
    final: PollResult | None = None
    """The group's last poll, before it was stopped (only when asked for: `drain_s`)."""
    stacks: dict[int, str] | None = None
    """Every rank's Python stacks, taken before it was stopped (asked for: `stacks_s`)."""


class Teardowns:
    """The groups this controller is stopping."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._inflight: list[Teardown] = []

    def start(self, key: Key, group: WorkerGroup, attempt: int | None = None,
              drain_s: float = 0.0, stacks_s: float = 0.0) -> Teardown:
        """Stop `group` on a thread of its own; returns at once. With `drain_s`, poll it once
        first (waiting up to `drain_s` for its ranks to answer): `Teardown.final`. With
        `stacks_s`, take its ranks' stacks first (a hung group): `Teardown.stacks`."""
        td = Teardown(key=key, attempt=attempt, started=time.monotonic())

        def run() -> None:
            try:
                if drain_s > 0:
                    try:
                        td.final = group.poll(drain_s)
                    except Exception:  # its reports are lost; the group must still stop
                        log.exception("%s %s: the last poll before stopping failed", *key)
                if stacks_s > 0:
                    try:
                        td.stacks = group.stacks(stacks_s)
                    except Exception:  # the diagnosis stands without them
                        log.exception("%s %s: taking the ranks' stacks failed", *key)
                group.shutdown(self.grace_s)
            except Exception as exc:  # reported by `reap`; the next pass must not die of it
                td.error = f"{type(exc).__name__}: {exc}"
            finally:
                td.seconds = time.monotonic() - td.started
                td.done.set()

        self._inflight.append(td)
        # A daemon thread: a teardown stuck in an unreachable cluster must not hold the
        # process at exit (`wait` bounds how long the daemon waits for it).
        threading.Thread(target=run, name=f"teardown-{key[0]}{key[1]}", daemon=True).start()
        return td

    def busy(self, key: Key) -> bool:
        """Whether a group of `key` is still being stopped."""
        return any(td.key == key and not td.done.is_set() for td in self._inflight)

    @property
    def pending(self) -> int:
        return sum(not td.done.is_set() for td in self._inflight)

    def reap(self) -> list[Teardown]:
        """The teardowns that finished since the last call."""
        finished = [td for td in self._inflight if td.done.is_set()]
        self._inflight = [td for td in self._inflight if td not in finished]
        return finished

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every teardown in flight; whether all finished."""
        deadline = time.monotonic() + timeout_s
        for td in list(self._inflight):
            if not td.done.wait(max(0.0, deadline - time.monotonic())):
                log.warning("%s %s: worker group still stopping after %.0f s", *td.key,
                            time.monotonic() - td.started)
                return False
        return True
