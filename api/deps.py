"""FastAPI dependencies, declared once as `Annotated` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request

from service.store import Job, NotFound, Store


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


StoreDep = Annotated[Store, Depends(get_store)]


def get_job(store: StoreDep, job_id: Annotated[int, Path(ge=1)]) -> Job:
    try:
        return store.get_job(job_id=job_id)
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None


JobDep = Annotated[Job, Depends(get_job)]
