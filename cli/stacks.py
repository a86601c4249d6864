"""`trident stacks ID`: the Python stacks of a running job's ranks, now, grouped where identical.

Through the REST API only: `POST /jobs/{id}/stacks` asks, the controller collects every rank's
stacks, and `GET /jobs/{id}/stacks/{request_id}` is polled until the answer is there. Ranks
whose stacks are identical are printed once, as one group, largest group first: a rank that
waits somewhere else than its peers stands out before a hang times out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Literal

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, answered, connect, fail
from client.payloads import StackAnswer, StackRequest, StackStatus
from client.rest import model_json

TRAIN_THREAD = "train"
"""The rank's work thread (`service.control.stack_collect.TRAIN_THREAD`)."""


def rank_ranges(ranks: Iterable[int]) -> str:
    """`0-3,6,8-9` for ranks 0, 1, 2, 3, 6, 8, 9."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def render(req: StackRequest, all_threads: bool = False) -> str:
    """A done stack request as text: per thread (the work thread `train` only, unless
    `all_threads`) each group of ranks with identical stacks, then the ranks without any."""
    res = StackAnswer.of(req)
    total = res.ranks
    lines = [f"job {req.job_id}, attempt {req.attempt}: stacks of {total} rank(s)"
             f" (request {req.id})"]
    shown = [t for t in res.threads if all_threads or t.thread == TRAIN_THREAD]
    for t in shown:
        lines.append("")
        lines.append(f"=== thread {t.thread}: {len(t.groups)} distinct stack(s)")
        for g in t.groups:
            who = f"rank {g.ranks[0]}" if len(g.ranks) == 1 else f"ranks {rank_ranges(g.ranks)}"
            lines.append(f"--- {who} ({len(g.ranks)} of {total})")
            lines.append((g.stack or "(left out: the answer's size limit was reached)\n")
                         .rstrip("\n"))
    for m in res.missing:
        lines.append(f"no stacks from rank(s) {rank_ranges(m.ranks)}: {m.reason}")
    hidden = sorted(t.thread for t in res.threads if t not in shown)
    if hidden:
        lines.append(f"({len(hidden)} other thread(s): {', '.join(hidden)[:300]};"
                     " --all-threads shows them)")
    return "\n".join(lines)


def stacks(job_id: Annotated[int, typer.Argument(min=1, help="A RUNNING job's id.")],
           server: ServerOpt = DEFAULT_SERVER,
           all_threads: Annotated[bool, typer.Option(
               "--all-threads", help="Every thread of each rank, not only its work thread.")]
           = False,
           timeout: Annotated[float, typer.Option(
               min=1, max=3600, help="Seconds to wait for the answer.")] = 60,
           output: Annotated[Literal["text", "json"], typer.Option(
               "--output", "-o", help="text, or the request as JSON (stable fields).")]
           = "text") -> None:
    """Ask every rank of a running job for its Python stacks now, and print them grouped:
    ranks with identical stacks once, largest group first.

    Example: trident stacks 12 --all-threads
    """
    with connect(server) as client:
        req = answered(client.request_stacks(job_id), lambda i: client.get_stacks(job_id, i),
                       noun="stack request", job_id=job_id, timeout=timeout, every_s=0.3)
    if output == "json":
        typer.echo(json.dumps(model_json(req), indent=2))
    elif req.status == StackStatus.FAILED:
        fail(f"stack request {req.id} of job {job_id} failed: {req.error}", 1)
    else:
        typer.echo(render(req, all_threads))


def register(app: typer.Typer) -> None:
    """Add `trident stacks` to the `trident` app."""
    app.command()(stacks)
