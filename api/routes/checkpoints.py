"""A job's checkpoints through the API: its tags (`GET /jobs/{id}/checkpoints`) and a tag
exported as a Hugging Face model (`GET /jobs/{id}/export`)."""

from __future__ import annotations

import shutil
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from api.auth import Who, check_weights, require
from api.deps import JobDep, StoreDep
from api.schemas import CheckpointList, CheckpointOut, Refusal
from service.checkpoints import ExportRefused, default_folder
from service.export import NoCompleteTag, export_tar
from service.planner.shape import ModelShape
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


@router.get("/{job_id}/export", dependencies=[Depends(require("jobs:export"))],
            response_class=FileResponse,
            responses={200: {"content": {"application/x-tar": {}},
                             "description": "The Hugging Face model folder as a tar"},
                       404: {"model": Refusal,
                             "description": "No complete checkpoint tag of that step"},
                       409: {"model": Refusal,
                             "description": "The tag's layout is not exported (interleaved"
                             " stages) or the model is no Hugging Face family"}})
def export_job(job: JobDep, request: Request, who: Who,
               step: Annotated[int | None, Query(
                   ge=1, le=10_000_000, description="The tag's step (default: the newest"
                   " complete one).")] = None,
               format: Annotated[Literal["hf"], Query(  # noqa: A002 (the CLI's --format)
                   description="`hf`: a Hugging Face model folder (config.json,"
                   " safetensors).")] = "hf") -> FileResponse:
    """A job's checkpoint tag as a Hugging Face model (`config.json` and safetensors,
    sharded above 5 GiB with `model.safetensors.index.json`), as a tar of the folder
    `job-<id>-step<N>-hf/` that `transformers`' `from_pretrained` loads. The TP shards,
    pipeline stages and ZeRO-3 partitions are joined (`service.export`, which runs
    `workers.hf_export`). The job's weights are its owner's: admins export any job, members
    their own. The folder is written on the server's disk, then sent and deleted."""
    check_weights(who, job.owner)
    settings = request.app.state.settings
    folder = job.spec.checkpoint.dir or str(default_folder(settings.checkpoint_root, job.id))
    try:
        done = export_tar(folder, step, ModelShape.from_spec(job.spec.model), job.id)
    except NoCompleteTag as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    except ExportRefused as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    return FileResponse(done.archive, media_type="application/x-tar", filename=done.filename,
                        background=BackgroundTask(shutil.rmtree, done.work, ignore_errors=True))
