"""`trident checkpoints JOB`: a job's checkpoint tags (step, size, layout, time) and its bytes
on disk, from `TridentClient.list_checkpoints` (`GET /api/v1/jobs/{id}/checkpoints`); `trident
export JOB --format hf --out DIR`: a tag as a Hugging Face model folder, from
`TridentClient.export` (`GET /api/v1/jobs/{id}/export`)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.common import connect, fail
from cli.format import DEFAULT_SERVER, Output, OutputOpt, ServerOpt, clock, columns, dump, size
from client.payloads import CheckpointList

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


def export(job_id: Annotated[int, typer.Argument(help="The job.", min=1)],
           out: Annotated[Path, typer.Option(
               "--out", help="The folder to write (must not exist yet).")],
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
           server: ServerOpt = DEFAULT_SERVER) -> None:
    """Write a job's checkpoint as a Hugging Face model: config.json and safetensors (sharded
    above --max-shard-size, with model.safetensors.index.json), TP shards, pipeline stages
    and ZeRO-3 partitions joined. Only the job's owner and admins may.

    Example: trident export 12 --step 1000 --format hf --max-shard-size 2GB --out ./my-model
    """
    if out.exists():
        fail(f"--out {out}: exists already; give a new folder")
    try:
        with connect(server) as client:
            written = client.export(job_id, out, step=step, format=format.value,
                                    max_shard_size=max_shard_size)
    except OSError as exc:  # the folder (or the one it is made in) cannot be written
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(out) else ""
        fail(f"--out {out}: {exc.strerror or exc}{where}")
    typer.echo(f"job {job_id}: {written}")


def register(app: typer.Typer) -> None:
    app.command()(checkpoints)
    app.command()(export)
