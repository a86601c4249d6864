"""`trident status [ID]`: the jobs list (or one job's line) as `kubectl get` prints it, in
columns, wide columns, JSON or YAML; filtered, sorted, and with `--watch` redrawn in place.
Every figure comes from `TridentClient.list_jobs` (or `get_job`), which carries each job's
newest step, loss, measured step time, restarts and the reason it waits or failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from cli.common import connect, fail
from cli.format import (
    DEFAULT_SERVER,
    JobRow,
    Output,
    OutputOpt,
    ServerOpt,
    ago,
    columns,
    dump,
    loss_text,
    refresh,
    secs,
    span,
)
from client.payloads import Sort
from client.rest import TridentClient
from service.contract.states import JobState

LOCAL_SORTS: dict[str, Callable[[JobRow], Any]] = {
    "duration": lambda r: r.duration_s, "step": lambda r: r.step, "loss": lambda r: r.loss,
    "restarts": lambda r: r.restarts, "ranks": lambda r: r.ranks,
    "step_s": lambda r: r.step_s_measured}
"""Sort keys the server does not sort by: `status` sorts the page it fetched by them."""
SORT_KEYS = sorted({s.value for s in Sort} | {"submitted"} | set(LOCAL_SORTS))

HEADERS = ["ID", "NAME", "OWNER", "LAYOUT", "RANKS", "SUBMITTED", "DURATION", "STEP", "LOSS",
           "S/STEP", "RESTARTS", "STATE", "REASON"]
WIDE = ["ID", "NAME", "OWNER", "PROJECT", "LAYOUT", "RANKS", "SUBMITTED", "DURATION", "STEP",
        "LOSS", "EVAL", "TOKENS", "LR", "GRAD_NORM", "S/STEP", "RESTARTS", "PRIORITY",
        "REPORTED", "STATE",
        "REASON"]
REASON_WIDTH = 60
"""`-o table` cuts the reason to this many characters (`-o wide` does not)."""


class Page(BaseModel):
    """`status -o json|yaml` without an id: the rows and how many jobs the filters select."""

    items: list[JobRow]
    total: int


def cells(r: JobRow, wide: bool) -> list[str]:
    """One job's cells, in the order of `WIDE` or `HEADERS`."""
    reason = r.reason or ""
    if not wide and len(reason) > REASON_WIDTH:
        reason = reason[:REASON_WIDTH - 3] + "..."
    c = {"ID": str(r.id), "NAME": r.name, "OWNER": r.owner, "PROJECT": r.project or "-",
         "LAYOUT": r.layout, "RANKS": str(r.ranks), "SUBMITTED": ago(r.submitted),
         "DURATION": span(r.duration_s),
         "STEP": f"{'-' if r.step is None else r.step}/{r.total_steps or '-'}",
         "LOSS": loss_text(r),
         "LR": "-" if r.lr is None else f"{r.lr:.3g}",
         "GRAD_NORM": "-" if r.grad_norm is None else f"{r.grad_norm:.4g}",
         "EVAL": "-" if r.eval_loss is None else f"{r.eval_loss:.4g}",
         "TOKENS": "-" if r.tokens is None else f"{r.tokens:.3g}",
         "S/STEP": f"{secs(r.step_s_predicted)}/{secs(r.step_s_measured)}",
         "RESTARTS": str(r.restarts), "PRIORITY": str(r.priority),
         "REPORTED": ago(r.reported_at), "STATE": r.state, "REASON": reason or "-"}
    return [c[h] for h in (WIDE if wide else HEADERS)]


def _states(given: list[str] | None) -> list[str]:
    out = []
    for part in (p.strip() for s in given or [] for p in s.split(",")):
        if part.upper() not in JobState.__members__:
            fail(f"--state: unknown state {part!r}; one of {', '.join(JobState)}")
        out.append(part.upper())
    return out


def _sort(key: str | None) -> tuple[str | None, bool]:
    """`--sort-by` as (key, descending); a leading `-` sorts descending."""
    if key is None:
        return None, True
    desc, name = key.startswith("-"), key.lstrip("-").lower()
    if name not in SORT_KEYS:
        fail(f"--sort-by: unknown key {name!r}; one of {', '.join(SORT_KEYS)}")
    return ("created" if name == "submitted" else name), desc


def fetch(client: TridentClient, job_id: int | None, params: dict[str, Any],
          local: tuple[str, bool] | None) -> tuple[list[JobRow], int]:
    """The rows to show and how many jobs the filters select."""
    if job_id is not None:
        return [JobRow.of(client.get_job(job_id))], 1
    page = client.list_jobs(**params)
    rows = [JobRow.of(j) for j in page.items]
    if local is not None:
        key, desc = LOCAL_SORTS[local[0]], local[1]
        # Jobs without the figure last, in either order.
        known = sorted((r for r in rows if key(r) is not None), key=key, reverse=desc)
        rows = known + [r for r in rows if key(r) is None]
    return rows, page.total


def render(rows: list[JobRow], total: int, fmt: Output, single: bool,
           no_headers: bool, stream: bool = False) -> str:
    if fmt in (Output.json, Output.yaml):
        return dump(rows[0] if single else Page(items=rows, total=total), fmt, stream=stream)
    wide = fmt == Output.wide
    return columns(WIDE if wide else HEADERS, [cells(r, wide) for r in rows],
                   headers_shown=not no_headers)


def status(job_id: Annotated[int | None, typer.Argument(
               help="One job (default: the list).", min=1)] = None,
           server: ServerOpt = DEFAULT_SERVER,
           output: OutputOpt = Output.table,
           watch: Annotated[bool, typer.Option("--watch", "-w", help=(
               "Redraw every --interval seconds until Ctrl-C (JSON/YAML: one document per"
               " refresh, JSON on one line)."))] = False,
           interval: Annotated[float, typer.Option(min=0.1, help="Seconds between"
                                                   " refreshes of --watch.")] = 2.0,
           watch_count: Annotated[int, typer.Option(min=0, hidden=True, help=(
               "Stop --watch after this many refreshes (0: never)."))] = 0,
           state: Annotated[list[str] | None, typer.Option(help=(
               "Only jobs in this state (repeat, or comma-separate: RUNNING,QUEUED)."))]
           = None,
           owner: Annotated[str | None, typer.Option(help="Only this user's jobs.")] = None,
           project: Annotated[str | None, typer.Option(help="Only this project's jobs.")]
           = None,
           name: Annotated[str | None, typer.Option(help="Jobs whose name contains this.")]
           = None,
           sort_by: Annotated[str | None, typer.Option(help=(
               f"Sort by one of {', '.join(SORT_KEYS)}; a leading '-' sorts descending"
               " (--sort-by=-created). Default: newest first."))] = None,
           limit: Annotated[int, typer.Option(min=1, max=500, help="The most jobs listed.")]
           = 50,
           no_headers: Annotated[bool, typer.Option("--no-headers",
                                                    help="Table rows only.")] = False) -> None:
    """List jobs, newest first, or one job's line: step, loss, predicted/measured s/step,
    restarts, and why it waits or failed. `trident describe ID` shows everything about one.

    Example: trident status --state RUNNING,QUEUED --sort-by=-created -o wide --watch
    """
    key, desc = _sort(sort_by)
    params: dict[str, Any] = {"limit": limit, "state": _states(state), "owner": owner or None,
                              "project": project or None, "name": name or None}
    local = None
    if key in LOCAL_SORTS:
        local = (key, desc)
    elif key is not None:
        params.update(sort=key, desc=desc)

    machine = output in (Output.json, Output.yaml)
    with connect(server) as client:

        def frame() -> str:
            rows, total = fetch(client, job_id, params, local)
            return render(rows, total, output, job_id is not None, no_headers, stream=True)

        if watch:
            refresh(frame, count=watch_count, interval=interval, in_place=not machine)
            return
        rows, total = fetch(client, job_id, params, local)
    typer.echo(render(rows, total, output, job_id is not None, no_headers))
    if output in (Output.table, Output.wide) and total > len(rows):
        typer.echo(f"({len(rows)} of {total} jobs; --limit shows more)", err=True)


def register(app: typer.Typer) -> None:
    app.command()(status)
