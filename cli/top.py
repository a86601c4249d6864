"""`trident top [ID]`: a live view, refreshed every second. With a job: one line per rank
(step, step time, compute against TP/PP/DP collective time, peak memory against the plan,
age of its last heartbeat and of its newest report, straggler and hang marks), from
`TridentClient.get_ranks`. Without: the active jobs, from `list_jobs`."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import BaseModel

from cli.common import connect
from cli.format import (
    DEFAULT_SERVER,
    JobRow,
    Output,
    ServerOpt,
    ago,
    columns,
    dump,
    refresh,
    secs,
    size,
)
from client.payloads import RankCell
from client.rest import TridentClient

ACTIVE = ["PLACING", "RUNNING", "RESTARTING", "PREEMPTED"]
JOB_HEADERS = ["ID", "NAME", "OWNER", "STATE", "LAYOUT", "RANKS", "STEP", "LOSS", "EVAL", "S/STEP",
               "RESTARTS", "REPORTED"]
RANK_HEADERS = ["RANK", "TP", "PP", "DP", "NODE", "STEP", "STEP_S", "COMPUTE_S", "TP_S",
                "PP_S", "DP_S", "MEM PEAK/PLAN", "HEARTBEAT", "REPORTED", "MARK"]


class JobFrame(BaseModel):
    """One refresh of `top ID`, as `-o json|yaml` prints it (docs/cli.md)."""

    job: JobRow
    attempt: int | None
    ranks: list[RankCell]


class JobsFrame(BaseModel):
    """One refresh of `top` without an id: the active jobs."""

    items: list[JobRow]
    total: int


def mark(c: RankCell) -> str:
    """A rank's marks: a straggler (its compute against its stage's median), or a rank that
    a hang waits for."""
    marks = []
    if c.straggler:
        marks.append("straggler" + ("" if c.compute_ratio is None
                                    else f" x{c.compute_ratio:.2f}"))
    if c.hang_waits_for:
        marks.append("hang waits for it")
    return ", ".join(marks) or "-"


def _memory(c: RankCell) -> str:
    ratio = f" {c.memory_ratio:.0%}" if c.memory_ratio is not None else ""
    return f"{size(c.memory_peak_bytes)}/{size(c.memory_predicted_bytes)}{ratio}"


def _age(seconds: float | None) -> str:
    """A heartbeat's age as the controller last saw it, e.g. `0.4s ago`."""
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def job_frame(client: TridentClient, job_id: int) -> JobFrame:
    job = JobRow.of(client.get_job(job_id))
    grid = client.get_ranks(job_id)
    return JobFrame(job=job, attempt=grid.attempt, ranks=grid.cells)


def jobs_frame(client: TridentClient) -> JobsFrame:
    page = client.list_jobs(state=ACTIVE, limit=500)
    return JobsFrame(items=[JobRow.of(j) for j in page.items], total=page.total)


def job_text(f: JobFrame) -> str:
    j = f.job
    loss = "-" if j.loss is None else f"{j.loss:.4g}"
    head = (f"job {j.id} {j.name}  {j.state}  {j.layout}  attempt"
            f" {f.attempt or '-'}  step {'-' if j.step is None else j.step}/"
            f"{j.total_steps or '-'}  loss {loss}"
            f"{'' if j.eval_loss is None else f'  eval {j.eval_loss:.4g}'}"
            f"  s/step {secs(j.step_s_measured)}"
            + (" (not planned)" if j.step_s_predicted is None
               else f" (plan {secs(j.step_s_predicted)})"))
    if j.reason:
        head += f"\n{j.reason}"
    rows = [[str(c.rank), str(c.tp), str(c.pp), str(c.dp), c.node or "-",
             "-" if c.step is None else str(c.step), secs(c.step_time_s),
             secs(c.compute_s), secs(c.tp_s), secs(c.pp_s), secs(c.dp_s),
             _memory(c), _age(c.heartbeat_age_s), ago(c.reported_at), mark(c)]
            for c in f.ranks]
    return head + "\n" + columns(RANK_HEADERS, rows)


def jobs_text(f: JobsFrame) -> str:
    if not f.items:
        return "no active jobs"
    rows = [[str(r.id), r.name, r.owner, r.state, r.layout, str(r.ranks),
             f"{'-' if r.step is None else r.step}/{r.total_steps or '-'}",
             "-" if r.loss is None else f"{r.loss:.4g}",
             "-" if r.eval_loss is None else f"{r.eval_loss:.4g}",
             f"{secs(r.step_s_predicted)}/{secs(r.step_s_measured)}",
             str(r.restarts), ago(r.reported_at)] for r in f.items]
    return columns(JOB_HEADERS, rows)


def top(job_id: Annotated[int | None, typer.Argument(
            min=1, help="One job's ranks (default: the active jobs).")] = None,
        server: ServerOpt = DEFAULT_SERVER,
        interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")]
        = 1.0,
        count: Annotated[int, typer.Option("--count", "-n", min=0, help=(
            "Stop after this many refreshes (0: at Ctrl-C), as `top -n`."))] = 0,
        output: Annotated[Output, typer.Option(
            "--output", "-o", case_sensitive=False,
            help="table (wide: the same), or json/yaml: one document per refresh, JSON on"
            " one line (docs/cli.md).")]
        = Output.table) -> None:
    """A live view, redrawn every second: with ID, one line per rank (step, step time,
    compute against TP/PP/DP time, peak memory against the plan, age of its last report,
    straggler and hang marks); without, the active jobs. Ctrl-C quits.

    Example: trident top 7 --interval 2
    """
    machine = output in (Output.json, Output.yaml)
    with connect(server) as client:

        def frame() -> str:
            f = jobs_frame(client) if job_id is None else job_frame(client, job_id)
            if machine:
                return dump(f, output, stream=True)
            return jobs_text(f) if isinstance(f, JobsFrame) else job_text(f)

        refresh(frame, count=count, interval=interval, in_place=not machine)


def register(app: typer.Typer) -> None:
    app.command()(top)
