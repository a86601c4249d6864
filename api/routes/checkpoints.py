"""A job's checkpoints through the API: its tags (`GET /jobs/{id}/checkpoints`). Exports of
a tag as a Hugging Face model are `api.routes.exports`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from api.auth import require
from api.deps import JobDep, StoreDep
from api.schemas import CheckpointList, CheckpointOut
from service.store.checkpoints import CheckpointIndex

router = APIRouter(prefix="/jobs", tags=["jobs"])
_READ = [Depends(require("jobs:read"))]


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, dependencies=_READ)
def checkpoints(job: JobDep, store: StoreDep,
                removed: Annotated[bool, Query(description="The deleted tags too.")] = False,
                ) -> CheckpointList:
    """A job's checkpoint tags by step (size, layout, time) and its bytes on disk."""
    index = CheckpointIndex(store)
    return CheckpointList(
        items=[CheckpointOut.model_validate(c.to_json())
               for c in index.list(job_id=job.id, removed=removed)],
        bytes_on_disk=index.bytes_on_disk(job_id=job.id),
        keep_last=job.spec.checkpoint.keep_last, keep_every=job.spec.checkpoint.keep_every)
