"""`trident export` over REST: a job's checkpoint tag written as a Hugging Face folder by a
task on the cluster, where it went, and its files, one at a time.

The API only checks and stores the export (`service.store.exports`): the tag (complete), the
destination (under an export root, in the job owner's folder: `service.files.export`), the
shard size. The controller runs it (`service.control.export_run`) and records its files and
size. Every route is held to rule `jobs:export`, as the job's weights are its owner's: admins
for any job, members for their own (`check_weights`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import Who, check_weights, require
from api.deps import INT32_MAX, JobDep, StoreDep
from api.schemas import Refusal
from client.payloads import ExportFile, ExportFiles, ExportList, ExportRecord, ExportState
from service.files.checkpoint_dirs import default_folder
from service.files.export import (
    FIELD,
    FILE,
    MAX_SHARD_SIZE,
    ExportPlaces,
    NoCompleteTag,
    complete_step,
    file_path,
    listing,
    shard_bytes,
)
from service.store import NotFound
from service.store.exports import ExportRecords

router = APIRouter(prefix="/jobs", tags=["jobs"])
_EXPORT = [Depends(require("jobs:export"))]


class ExportAsk(BaseModel):
    """`POST /jobs/{id}/exports`: which tag, where, in shards of what size."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    step: int | None = Field(default=None, ge=1, le=10_000_000)
    """The tag's step (default: the newest complete one)."""
    max_shard_size: str = Field(default=MAX_SHARD_SIZE, max_length=32)
    """The largest safetensors file: bytes, or a number with KB/MB/GB/TB (powers of 10) or
    KiB/MiB/GiB/TiB, from 1KiB to 1TiB, as transformers' `save_pretrained` reads it."""
    destination: str | None = Field(default=None, max_length=4096)
    """The folder to write (absolute, new or empty, in `<export root>/<job owner>/`; default
    `<first export root>/<owner>/job-<id>-step<N>`)."""


ExportId = Annotated[int, Path(ge=1, le=INT32_MAX, description="An export's id.")]
FileName = Annotated[str, Path(max_length=128, pattern=FILE.pattern,
                               description="A file of the export's folder, as listed.")]


def _records(request: Request, store: StoreDep) -> ExportRecords:
    found: ExportRecords | None = getattr(request.app.state, "export_records", None)
    if found is None:
        found = request.app.state.export_records = ExportRecords(store)
    return found


Records = Annotated[ExportRecords, Depends(_records)]


def _refuse(name: str, msg: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": ["body", name], "type": "value_error",
                                                   "msg": f"{name}: {msg}"}])


@router.post("/{job_id}/exports", status_code=202, dependencies=_EXPORT,
             responses={404: {"model": Refusal,
                              "description": "No complete checkpoint tag of that step"}})
def start_export(job: JobDep, request: Request, records: Records, who: Who,
                 body: ExportAsk | None = None) -> ExportRecord:
    """Export a job's checkpoint tag as a Hugging Face model folder (`config.json`,
    `model.safetensors` or shards `model-0000k-of-0000n.safetensors` of at most
    `max_shard_size` with `model.safetensors.index.json`), written by a task on the cluster
    under an export root (`TRIDENT_EXPORT_ROOTS`). Poll `GET /jobs/{id}/exports/{export_id}`
    until `state` is `done` (or `failed`), then list and fetch its files. Admins export any
    job, members their own. 404 without a complete tag; 422 naming `destination` outside the
    owner's folder under the roots, or `max_shard_size` that is no size; 422 naming `job` for a
    command job without model."""
    check_weights(who, job.owner)
    if job.spec.model is None:
        raise _refuse("job", f"job {job.id} gives no model: its checkpoints are its command's"
                      " own, in no layout Trident converts")
    ask = body or ExportAsk()
    try:
        max_shard_bytes = shard_bytes(ask.max_shard_size)
    except ValueError as exc:
        raise _refuse("max_shard_size", str(exc)) from None
    settings = request.app.state.settings
    folder = job.spec.checkpoint.dir or str(default_folder(settings.checkpoint_root, job.id))
    try:
        step = complete_step(folder, ask.step, job.id)
    except NoCompleteTag as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    places = ExportPlaces(settings.export_root_dirs, settings.data_dir)
    try:
        destination = ask.destination or places.default(job.owner, job.id, step)
    except ValueError as exc:
        raise _refuse(FIELD, str(exc)) from None
    if why := places.refusal(destination, job.owner):
        raise _refuse(FIELD, why)
    return records.create(job_id=job.id, step=step, destination=destination,
                          checkpoint_dir=folder, max_shard_bytes=max_shard_bytes,
                          requested_by=who.name)


@router.get("/{job_id}/exports", dependencies=_EXPORT)
def list_exports(job: JobDep, records: Records, who: Who) -> ExportList:
    """A job's exports, newest first: where each went, its state, files and bytes (admins,
    the job's owner)."""
    check_weights(who, job.owner)
    return ExportList(items=records.of_job(job.id))


def _export(job: JobDep, records: ExportRecords, export_id: int) -> ExportRecord:
    try:
        return records.get(job_id=job.id, export_id=export_id)
    except NotFound as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None


@router.get("/{job_id}/exports/{export_id}", dependencies=_EXPORT)
def get_export(job: JobDep, records: Records, who: Who, export_id: ExportId) -> ExportRecord:
    """One export: its state, destination and, once done, its files and bytes."""
    check_weights(who, job.owner)
    return _export(job, records, export_id)


def _done(job: JobDep, records: ExportRecords, export_id: int) -> ExportRecord:
    rec = _export(job, records, export_id)
    if rec.state != ExportState.DONE:
        raise HTTPException(status_code=409, detail=f"export {rec.id} of job {job.id} is"
                            f" {rec.state.value}" + (f": {rec.error}" if rec.error else "")
                            + "; its files are served once it is done")
    return rec


@router.get("/{job_id}/exports/{export_id}/files", dependencies=_EXPORT,
            responses={409: {"model": Refusal, "description": "The export is not done"},
                       410: {"model": Refusal,
                             "description": "The export's folder cannot be read (removed)"}})
def export_files(job: JobDep, records: Records, who: Who, export_id: ExportId) -> ExportFiles:
    """The files of a finished export's folder, as it holds them now (the files it wrote,
    by name, with their bytes)."""
    check_weights(who, job.owner)
    rec = _done(job, records, export_id)
    try:
        held = dict(listing(rec.destination))
    except OSError as exc:
        raise HTTPException(status_code=410, detail=f"export {rec.id}'s folder"
                            f" {rec.destination} cannot be read: {exc.strerror}") from None
    return ExportFiles(export_id=rec.id, items=[ExportFile(name=n, bytes=held[n])
                                                for n in rec.files if n in held])


@router.get("/{job_id}/exports/{export_id}/files/{name}", dependencies=_EXPORT,
            response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}},
                       409: {"model": Refusal, "description": "The export is not done"}})
def export_file(job: JobDep, records: Records, who: Who, export_id: ExportId,
                name: FileName) -> FileResponse:
    """One file of a finished export, streamed from its folder (never more than a piece of
    it in memory); only the files the export wrote, inside its folder."""
    check_weights(who, job.owner)
    rec = _done(job, records, export_id)
    path = file_path(rec.destination, name) if name in rec.files else None
    if path is None:
        raise HTTPException(status_code=404, detail=f"export {rec.id} of job {job.id} has no"
                            f" file {name!r}")
    return FileResponse(path, media_type="application/octet-stream", filename=name)
