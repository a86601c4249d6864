"""What the routes of `trident stacks` and `trident profile` share: a request about a RUNNING
job, stored for the controller to answer (`service.store.job_requests`), read back by id."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import HTTPException, Request

from api.deps import StoreDep
from service.contract.states import JobState
from service.store import Job, NotFound, Store
from service.store.job_requests import TooManyOpen

T = TypeVar("T")


def made_once(attr: str, make: Callable[[Store], T]) -> Callable[..., object]:
    """A dependency giving the app's `make(store)`, made on first use and kept as
    `app.state.<attr>`. Async: no hop to the thread pool for an attribute read."""

    async def dependency(request: Request, store: StoreDep) -> T:
        found: T | None = getattr(request.app.state, attr, None)
        if found is None:
            found = make(store)
            setattr(request.app.state, attr, found)
        return found

    return dependency


def running(job: Job, doing: str) -> None:
    """409 unless the job is RUNNING: only then has it ranks for `doing`."""
    if job.state != JobState.RUNNING:
        raise HTTPException(status_code=409, detail=f"job {job.id} is {job.state.value}: only"
                            f" a RUNNING job has ranks to {doing}")


def created(make: Callable[[], T]) -> T:
    """`make()`, or a 429 when the job has as many requests waiting as allowed."""
    try:
        return make()
    except TooManyOpen as exc:
        raise HTTPException(status_code=429, detail=str(exc)) from None


def found(get: Callable[[], T]) -> T:
    """`get()`, or a 404 naming what was not found."""
    try:
        return get()
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
