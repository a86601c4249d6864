"""A job's checkpoints through the API: its tags (`GET /jobs/{id}/checkpoints`) and a tag
exported as a Hugging Face model (`GET /jobs/{id}/export`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.auth import Who, check_weights, require
from api.deps import JobDep, StoreDep
from api.schemas import CheckpointList, CheckpointOut, Refusal
from service.files.checkpoint_dirs import ExportRefused, default_folder
from service.files.export import (
    MAX_SHARD_SIZE,
    ExportsBusy,
    NoCompleteTag,
    complete_step,
    export_folder,
    shard_bytes,
    take_slot,
    tar_stream,
)
from service.planner.shape import ModelShape
from service.store.checkpoints import CheckpointIndex

router = APIRouter(prefix="/jobs", tags=["jobs"])
_READ = [Depends(require("jobs:read"))]
RETRY_AFTER_S = 10
"""`Retry-After` of an export refused while the server runs as many as it may."""


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


class _Sending(StreamingResponse):
    """A streamed answer that calls `done` once it ends, however it ends (sent, the client
    gone, an error): the export's slot is held until then."""

    def __init__(self, content: Iterator[bytes], done: Callable[[], None],
                 headers: dict[str, str], media_type: str) -> None:
        super().__init__(content, headers=headers, media_type=media_type)
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(self.done)


@router.get("/{job_id}/export", dependencies=[Depends(require("jobs:export"))],
            response_class=StreamingResponse,
            responses={200: {"content": {"application/x-tar": {}},
                             "description": "The Hugging Face model folder as a tar"},
                       404: {"model": Refusal,
                             "description": "No complete checkpoint tag of that step"},
                       409: {"model": Refusal,
                             "description": "The tag's layout is not exported (interleaved"
                             " stages) or the model is no Hugging Face family"},
                       429: {"model": Refusal,
                             "description": "As many exports as the server runs at once"
                             " (`TRIDENT_EXPORT_MAX_CONCURRENT`) are running: try again"
                             " after `Retry-After` seconds"}})
def export_job(job: JobDep, request: Request, who: Who,
               step: Annotated[int | None, Query(
                   ge=1, le=10_000_000, description="The tag's step (default: the newest"
                   " complete one).")] = None,
               format: Annotated[Literal["hf"], Query(  # noqa: A002 (the CLI's --format)
                   description="`hf`: a Hugging Face model folder (config.json,"
                   " safetensors).")] = "hf",
               max_shard_size: Annotated[str, Query(
                   max_length=32, description="The largest safetensors file: bytes, or a"
                   " number with KB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB, from 1KiB to"
                   " 1TiB, as transformers' `save_pretrained` reads it.")] = MAX_SHARD_SIZE,
               ) -> StreamingResponse:
    """A job's checkpoint tag as a Hugging Face model (`config.json` and safetensors:
    `model.safetensors` when it fits in `max_shard_size`, else shards
    `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`), as a tar of the folder
    `job-<id>-step<N>-hf/` that `transformers`' `from_pretrained` loads. The TP shards,
    pipeline stages and ZeRO-3 partitions are joined (`service.files.export`, which runs
    `workers.checkpoint.hf_export`). The job's weights are its owner's: admins export any job,
    members their own. The folder is written under the server's data directory (`exports/`), the tar
    streamed from its files, and the folder deleted once it is sent. At most
    `TRIDENT_EXPORT_MAX_CONCURRENT` exports run at once; one more is a 429."""
    check_weights(who, job.owner)
    try:
        max_shard_bytes = shard_bytes(max_shard_size)
    except ValueError as exc:
        raise HTTPException(status_code=422, detail=[{
            "loc": ["query", "max_shard_size"], "type": "value_error",
            "msg": f"max_shard_size: {exc}"}]) from None
    settings = request.app.state.settings
    folder = job.spec.checkpoint.dir or str(default_folder(settings.checkpoint_root, job.id))
    try:
        found = complete_step(folder, step, job.id)
        slot = take_slot(settings.data_dir, settings.export_max_concurrent)
    except NoCompleteTag as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    except ExportsBusy as exc:
        raise HTTPException(status_code=429, detail=str(exc),
                            headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    try:
        done = export_folder(folder, found, ModelShape.from_spec(job.spec.model), job.id, slot,
                             max_shard_bytes)
        length, pieces = tar_stream(done.path)
    except ExportRefused as exc:
        slot.release()
        raise HTTPException(status_code=409, detail=str(exc)) from None
    except BaseException:
        slot.release()
        raise
    return _Sending(pieces, slot.release, media_type="application/x-tar", headers={
        "Content-Length": str(length),
        "Content-Disposition": f'attachment; filename="{done.filename}"'})
