"""`trident checkpoints JOB`: a job's checkpoint tags (step, size, layout, time) and its bytes
on disk, from `TridentClient.list_checkpoints` (`GET /api/v1/jobs/{id}/checkpoints`); `trident
export JOB [--out DIR] [--list]`: a tag as a Hugging Face model folder, written by a task on the
cluster (`POST /api/v1/jobs/{id}/exports`) and downloaded file by file, or the job's exports
listed (`GET /api/v1/jobs/{id}/exports`)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import connect, fail
from cli.format import DEFAULT_SERVER, Output, OutputOpt, ServerOpt, clock, columns, dump, size
from client.exports import check
from client.payloads import CheckpointList, ExportList

HEADERS = ["STEP", "SIZE", "LAYOUT", "ATTEMPT", "SAVED"]


def layout_label(layout: dict[str, Any]) -> str:
    """`tp1 pp2 dp1 zero1` (and `v2` with virtual stages), as `trident status` lists it."""
    out = " ".join(f"{k}{layout[k]}" for k in ("tp", "pp", "dp", "zero") if k in layout)
    vs = layout.get("virtual_stages")
    return f"{out} v{vs}" if vs and vs > 1 else out or "-"


def text(job_id: int, got: CheckpointList, removed: bool) -> str:
    headers = HEADERS + (["REMOVED"] if removed else [])
    rows = [[str(c.step), size(c.bytes), layout_label(c.layout), str(c.attempt),
             clock(c.created_at)] + ([clock(c.removed_at) if c.removed_at else "-"]
                                     if removed else []) for c in got.items]
    policy = "every tag kept" if got.keep_last is None else \
        f"keep_last {got.keep_last}" + (f", keep_every {got.keep_every}"
                                        if got.keep_every else "")
    head = (f"job {job_id}: {len([c for c in got.items if c.removed_at is None])} tag(s),"
            f" {size(got.bytes_on_disk)} on disk ({policy})")
    return head + ("\n" + columns(headers, rows) if rows else "")


def checkpoints(job_id: Annotated[int, typer.Argument(help="The job.", min=1)],
                removed: Annotated[bool, typer.Option(
                    "--removed", help="List the tags the retention policy deleted too.")]
                = False,
                output: OutputOpt = Output.table, server: ServerOpt = DEFAULT_SERVER) -> None:
    """A job's checkpoints: step, size, layout and time of each tag, and the bytes on disk.

    Example: trident checkpoints 12
    """
    with connect(server) as client:
        got = client.list_checkpoints(job_id, removed=removed)
    typer.echo(dump(got, output) if output in (Output.json, Output.yaml)
               else text(job_id, got, removed))


class ExportFormat(StrEnum):
    hf = "hf"


EXPORT_HEADERS = ["ID", "STEP", "STATE", "SIZE", "FILES", "DESTINATION", "ASKED"]


def exports_text(job_id: int, got: ExportList) -> str:
    rows = [[str(e.id), str(e.step), e.state.value,
             size(e.bytes) if e.bytes is not None else "-", str(len(e.files)) if e.files else "-",
             e.destination + (f" ({e.error[:80]})" if e.error else ""), clock(e.created_at)]
            for e in got.items]
    head = f"job {job_id}: {len(got.items)} export(s)"
    return head + ("\n" + columns(EXPORT_HEADERS, rows) if rows else "")


def export(job_id: Annotated[int, typer.Argument(help="The job.", min=1)],
           out: Annotated[Path | None, typer.Option(
               "--out", help="Download the export into this folder (must not exist yet),"
               " file by file.")] = None,
           step: Annotated[int | None, typer.Option(
               help="The tag's step (default: the newest complete one).", min=1)] = None,
           format: Annotated[ExportFormat, typer.Option(  # noqa: A002 (the option's name)
               "--format", help="hf: a Hugging Face model folder (config.json,"
               " safetensors) that transformers' from_pretrained loads.")] = ExportFormat.hf,
           max_shard_size: Annotated[str, typer.Option(
               "--max-shard-size", help="The largest safetensors file (bytes, or e.g. 500MB,"
               " 5GB, 5GiB); above it the model is split into"
               " model-0000k-of-0000n.safetensors with model.safetensors.index.json.")]
           = "5GB",
           dest: Annotated[str | None, typer.Option(
               "--dest", help="Where the cluster writes the folder: a new folder under an"
               " export root the server allows (TRIDENT_EXPORT_ROOTS), in the job owner's"
               " folder there (default <root>/<owner>/job-<id>-step<N>).")] = None,
           export_id: Annotated[int | None, typer.Option(
               "--export", help="Download this finished export (with --out) instead of"
               " starting one.", min=1)] = None,
           list_: Annotated[bool, typer.Option(
               "--list", help="List the job's exports: where each went, state, size.")]
           = False,
           output: OutputOpt = Output.table, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Export a job's checkpoint as a Hugging Face model, written on the cluster: config.json
    and safetensors (sharded above --max-shard-size, with model.safetensors.index.json), TP
    shards, pipeline stages and ZeRO-3 partitions joined, by a task on the cluster into a
    folder under the server's export roots; with --out, downloaded file by file. Only the
    job's owner and admins may.

    Example: trident export 12 --step 1000 --max-shard-size 2GB --out ./my-model
    """
    if list_:
        with connect(server) as client:
            got = client.list_exports(job_id)
        typer.echo(dump(got, output) if output in (Output.json, Output.yaml)
                   else exports_text(job_id, got))
        return
    if out is not None and out.exists():
        fail(f"--out {out}: exists already; give a new folder")
    try:
        if out is not None:
            check(out)
        with connect(server) as client:
            if export_id is None:
                rec = client.start_export(job_id, step=step, max_shard_size=max_shard_size,
                                          destination=dest)
                export_id = rec.id
            rec = client.wait_export(job_id, export_id)
            if out is None:
                typer.echo(f"job {job_id}: export {rec.id} of step {rec.step} at"
                           f" {rec.destination} ({len(rec.files)} files,"
                           f" {size(rec.bytes or 0)})")
                return
            written = client.download_export(job_id, export_id, out)
    except OSError as exc:  # the folder (or the one it is made in) cannot be written
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(out) else ""
        fail(f"--out {out}: {exc.strerror or exc}{where}")
    typer.echo(f"job {job_id}: {written}")


def register(app: typer.Typer) -> None:
    app.command()(checkpoints)
    app.command()(export)
