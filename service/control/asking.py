"""What the controller's collectors of `trident stacks` and `trident profile` share
(`service.control.stack_collect`, `service.control.profile_collect`): asking a job's group on a
thread beside the loop, since ranks may take long to answer and a pass must not wait, and the
reasons a request is answered without asking."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.store.stack_requests import StackStatus


@dataclass(eq=False)
class Asking:
    """One group being asked; `answers` or `error` is set once `done`."""

    done: threading.Event = field(default_factory=threading.Event)
    answers: dict[int, Any] = field(default_factory=dict)
    error: str | None = None


def ask_beside(ask: Callable[[], dict[int, Any]], name: str) -> Asking:
    """Run `ask()` on a daemon thread called `name` (ranks that never answer must not hold
    the daemon at exit); its failure becomes the `Asking`'s error, stored with the request."""
    c = Asking()

    def run() -> None:
        try:
            c.answers = ask()
        except Exception as exc:  # stored as the request's error; the pass goes on
            c.error = f"asking the ranks failed: {type(exc).__name__}: {exc}"
        finally:
            c.done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return c


class Open(Protocol):
    @property
    def job_id(self) -> int: ...
    @property
    def status(self) -> StackStatus: ...


def unanswerable(req: Open, groups: Mapping[int, object], waiting_for: str) -> str | None:
    """Why an open request cannot be asked now, or None: a previous controller took it and
    stopped before `waiting_for` came, or its job has no live group here."""
    if req.status == StackStatus.RUNNING:
        return f"the controller asking the ranks stopped before {waiting_for} came; ask again"
    if req.job_id not in groups:
        return f"job {req.job_id} has no running ranks now (not running, or just ended)"
    return None
