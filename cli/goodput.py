"""`trident goodput [ID]`: where the time and the resources of jobs went (docs/goodput.md).

With a job id, its ledger (`GET /jobs/{id}/goodput`, `TridentClient.job_goodput`): a table of
the categories (seconds, share of the wall time, rank-seconds, GPU- or CPU-seconds, and the
cost where prices are set), then its ETTR, goodput in tokens, steps counted and lost, the
plan's training time against the measured one and its costs. Without one, the totals over a
window (`GET /goodput`, `TridentClient.goodput`): the cluster, each project, each owner, the
jobs that lost the most time and the projects' budgets. `-o json|yaml` prints the API's
answer as it is.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, connect, fail
from cli.format import Output, clock, columns, dump, span
from client.ledger import GoodputSummary, GroupTotals, Ledger
from service.contract.prices import money as _money

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
LOST = ("lost", "recovery", "stall")
"""The categories a group's LOST column sums (as `top_lost` does)."""


def when(value: str | None, flag: str, *, now: datetime | None = None) -> datetime | None:
    """`7d`, `12h`, `30m`, `45s`, `2w` (that long before now) or an ISO 8601 time (UTC when it
    names no zone); a value that is neither is a one-line error naming `flag`."""
    if value is None:
        return None
    m = _AGO.match(value)
    if m:
        return (now or datetime.now(UTC)) - timedelta(
            seconds=float(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        t = datetime.fromisoformat(value.strip())
    except ValueError:
        fail(f"{flag}: {value!r} is neither a time ago (7d, 12h, 30m) nor an ISO time"
             " (2025-01-31 or 2025-01-31T12:00:00Z)")
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _secs(s: float) -> str:
    return f"{s:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"




def _hours(s: float) -> str:
    return f"{s / 3600:.2f}"


def job_text(d: Ledger) -> str:
    """A job's ledger as text: the categories' table, then its figures."""
    unit = "GPU-S" if d.gpus_per_rank else "CPU-S"
    priced = d.price is not None
    rows = []
    for c in d.categories:
        held = c.gpu_seconds if d.gpus_per_rank else c.cpu_seconds
        row = [c.category, _secs(c.seconds), _pct(c.seconds / d.wall_s if d.wall_s else None),
               _secs(c.rank_seconds), _secs(held)]
        rows.append(row + [_money(c.cost)] if priced else row)
    total = ["total", _secs(sum(c.seconds for c in d.categories)),
             _pct(1.0 if d.wall_s else None),
             _secs(sum(c.rank_seconds for c in d.categories)),
             _secs(sum(c.gpu_seconds if d.gpus_per_rank else c.cpu_seconds
                       for c in d.categories))]
    rows.append(total + [_money(d.cost)] if priced else total)
    head = ["CATEGORY", "SECONDS", "SHARE", "RANK-S", unit] + (["COST"] if priced else [])
    out = [f"Job {d.job_id} ({d.name}) of {d.owner or '-'}, project {d.project or '-'}:"
           f" {d.state}, {d.ranks} rank(s) on {d.profile}",
           f"Wall time: {span(d.wall_s)} ({d.wall_s:.1f} s), {clock(d.start)} to"
           f" {clock(d.end)}{'' if d.ended else ' (now: it has not ended)'}", ""]
    out += columns(head, rows).splitlines()
    out.append("")
    if d.queued_reasons:
        out.append("Queued:       " + ", ".join(f"{k} {span(v)}" for k, v in
                                                d.queued_reasons.items()))
    out.append(f"ETTR:         {_pct(d.ettr)} (training seconds over wall seconds)")
    rate = "-" if d.goodput_tokens_per_s is None else f"{d.goodput_tokens_per_s:,.1f}"
    tokens = "tokens not known" if d.tokens is None else f"{d.tokens:,} tokens of steps that count"
    out.append(f"Goodput:      {rate} tokens/s ({tokens})")
    out.append(f"Steps:        {d.steps_counted} counted, {d.steps_lost} lost")
    measured = d.total("training").seconds
    if d.predicted_training_s is not None:
        ratio = measured / d.predicted_training_s if d.predicted_training_s else None
        out.append(f"Training:     {d.predicted_training_s:.1f} s predicted, {measured:.1f} s"
                   f" measured{'' if ratio is None else f' (x{ratio:.2f})'}")
    else:
        out.append(f"Training:     {measured:.1f} s measured (no step time planned)")
    if priced:
        per = "-" if d.cost_per_billion_tokens is None else _money(d.cost_per_billion_tokens)
        out.append(f"Cost:         {_money(d.cost)} ({per} per billion tokens); at its plan"
                   f" {_money(d.planned_cost)}")
    else:
        out.append("Cost:         - (no price set for this profile: TRIDENT_PRICES)")
    return "\n".join(out)


def _group_row(scope: str, g: GroupTotals) -> list[str]:
    seconds: dict[str, float] = {c.category: c.seconds for c in g.categories}
    return [scope, g.key, str(g.jobs), span(g.wall_s), _pct(g.ettr),
            span(seconds.get("training", 0.0)), span(sum(seconds.get(k, 0.0) for k in LOST)),
            span(seconds.get("queued", 0.0)), _hours(g.gpu_seconds), _hours(g.cpu_seconds),
            f"{g.tokens:,}" + (f" (+{g.jobs_tokens_unknown} not known)"
                               if g.jobs_tokens_unknown else ""),
            _money(g.cost), _money(g.cost_per_billion_tokens)]


def summary_text(s: GoodputSummary) -> str:
    """The totals over a window as text: the cluster, projects and owners, then the jobs that
    lost the most time and the budgets."""
    out = [f"Goodput from {clock(s.since) if s.since else 'the first job'} to {clock(s.until)}",
           ""]
    rows = [_group_row("cluster", s.cluster)]
    rows += [_group_row("project", g) for g in s.projects]
    rows += [_group_row("owner", g) for g in s.owners]
    out += columns(["SCOPE", "KEY", "JOBS", "WALL", "ETTR", "TRAINING", "LOST", "QUEUED",
                    "GPU-H", "CPU-H", "TOKENS", "COST", "COST/BTOK"], rows).splitlines()
    out += ["", "Jobs that lost the most time (lost work, recovery, stalls):"]
    if s.top_lost:
        out += ["  " + ln for ln in columns(
            ["ID", "NAME", "PROJECT", "OWNER", "LOST", "ETTR"],
            [[str(j.job_id), j.name, j.project or "-", j.owner, span(j.lost_s), _pct(j.ettr)]
             for j in s.top_lost]).splitlines()]
    else:
        out.append("  none")
    if s.budgets:
        out += ["", "Budgets:"]
        out += ["  " + ln for ln in columns(
            ["PROJECT", "SINCE", "GPU-H", "CPU-H", "COST", "USED"],
            [[b.project, clock(b.since) if b.since else "-",
              f"{b.spent_gpu_hours:.2f}/{'-' if b.gpu_hours is None else f'{b.gpu_hours:g}'}",
              f"{b.spent_cpu_hours:.2f}/{'-' if b.cpu_hours is None else f'{b.cpu_hours:g}'}",
              f"{_money(b.spent_cost)}/{_money(b.cost)}", _pct(b.used)]
             for b in s.budgets]).splitlines()]
    return "\n".join(out)


def goodput(job_id: Annotated[int | None, typer.Argument(
                min=1, help="A job: its ledger (default: the totals over a window).",
                show_default=False)] = None,
            project: Annotated[str | None, typer.Option(
                help="Totals of this project's jobs only.")] = None,
            owner: Annotated[str | None, typer.Option(
                help="Totals of this user's jobs only.")] = None,
            since: Annotated[str | None, typer.Option(
                help="The window's start: 7d, 12h, 30m ago, or an ISO time (default: the"
                " first job).")] = None,
            until: Annotated[str | None, typer.Option(
                help="The window's end: 1d, 12h ago, or an ISO time (default: now).")] = None,
            server: ServerOpt = DEFAULT_SERVER,
            output: Annotated[Output, typer.Option(
                "--output", "-o", case_sensitive=False,
                help="table (default), json or yaml (the API's answer as it is).")
            ] = Output.table) -> None:
    """Where the time and the resources of jobs went: with a job id, its ledger (each
    category's seconds, share of the wall time, rank-seconds, GPU- or CPU-seconds and cost,
    its ETTR, goodput in tokens, steps counted and lost, predicted against measured training
    time); without, the totals over a window per cluster, project and owner, and the jobs
    that lost the most time.

    Example: trident goodput --project vision --since 7d
    """
    if job_id is not None:
        for flag, value in (("--project", project), ("--owner", owner), ("--since", since),
                            ("--until", until)):
            if value is not None:
                fail(f"{flag}: a window's filter; give it without a job id")
    now = datetime.now(UTC)
    lo, hi = when(since, "--since", now=now), when(until, "--until", now=now)
    if lo is not None and hi is not None and hi <= lo:
        fail(f"--until: {clock(hi)} is not after --since {clock(lo)}")
    as_data = output in (Output.json, Output.yaml)
    with connect(server) as client:
        if job_id is not None:
            ledger = client.job_goodput(job_id)
            typer.echo(dump(ledger, output) if as_data else job_text(ledger))
            return
        totals = client.goodput(since=lo, until=hi, project=project, owner=owner)
    typer.echo(dump(totals, output) if as_data else summary_text(totals))


def register(app: typer.Typer) -> None:
    """Add `trident goodput` to the `trident` app."""
    app.command()(goodput)
