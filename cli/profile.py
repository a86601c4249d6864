"""`trident profile ID`: torch.profiler traces of a running job's ranks, on request.

Through the REST API only: `POST /jobs/{id}/profile` asks, the controller has the named ranks
profile their next steps and stores the traces with the job, `GET /jobs/{id}/profile/{request}`
is polled until they are there, and `--out DIR` downloads them file by file. `--list` lists
the job's stored traces. The traces (`rank-<r>.pt.trace.json.gz`) open in Perfetto
(ui.perfetto.dev, "Open trace file") or in TensorBoard's profile plugin (`pip install
torch-tb-profiler`, then `tensorboard --logdir DIR`): docs/cluster.md says more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, answered, connect, fail
from cli.stacks import rank_ranges
from client.payloads import PROFILE_MAX_STEPS, ProfileList, ProfileRequest, StackStatus
from client.rest import model_json


def parse_ranks(text: str | None) -> list[int] | None:
    """`0,1,4-7` as ranks; None for none given (every rank)."""
    if not text:
        return None
    ranks: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            ranks.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise typer.BadParameter(f"not ranks: {text[:80]!r} (e.g. 0,1 or 0-3)",
                                 param_hint="--ranks") from None
    return ranks


def render(req: ProfileRequest) -> str:
    """A request and its files as text."""
    what = f"{req.steps} step(s) of rank(s) {rank_ranges(req.ranks)}" + \
        (" with memory" if req.memory else "")
    lines = [f"request {req.id} (job {req.job_id}, attempt {req.attempt}): {what},"
             f" {req.status.value}" + (f", by {req.requested_by}" if req.requested_by else "")]
    for f in req.files:
        span = req.profiled_steps.get(str(f.rank))
        steps = f" steps {span[0]}-{span[1]}" if span else ""
        lines.append(f"  {f.name}  {f.bytes} bytes{steps}")
    for m in req.missing:
        lines.append(f"  no trace from rank {m.get('rank')}: {m.get('reason')}")
    for o in req.left_out:
        lines.append(f"  left out {o.get('name')} ({o.get('bytes')} bytes): {o.get('why')}")
    if req.dropped:
        lines.append(f"  {req.dropped}")
    if req.error and not req.missing:
        lines.append(f"  {req.error}")
    return "\n".join(lines)


def render_list(listing: ProfileList) -> str:
    head = (f"{len(listing.items)} request(s), {listing.stored_bytes} bytes stored (at most"
            f" {listing.max_job_bytes} per job, {listing.max_trace_bytes} per file)")
    return "\n".join([head] + [render(r) for r in listing.items])


def profile(job_id: Annotated[int, typer.Argument(min=1, help="A job's id.")],
            server: ServerOpt = DEFAULT_SERVER,
            steps: Annotated[int, typer.Option(
                min=1, max=PROFILE_MAX_STEPS, help="How many of the next steps to profile.")]
            = 3,
            ranks: Annotated[str | None, typer.Option(
                help="The ranks to profile, e.g. 0,1 or 0-3 (default: every rank).")] = None,
            memory: Annotated[bool, typer.Option(
                "--memory", help="Record memory too: allocations, the memory timeline and,"
                " on CUDA, a memory snapshot.")] = False,
            list_: Annotated[bool, typer.Option(
                "--list", help="List the job's stored traces instead of profiling.")] = False,
            request: Annotated[int | None, typer.Option(
                min=1, help="With --out: download this earlier request's traces instead of"
                " profiling.")] = None,
            out: Annotated[Path | None, typer.Option(
                help="Download the traces into this folder (made if missing).")] = None,
            timeout: Annotated[float, typer.Option(
                min=1, max=7200, help="Seconds to wait for the traces.")] = 900,
            output: Annotated[Literal["text", "json"], typer.Option(
                "--output", "-o", help="text, or the request (list) as JSON.")] = "text"
            ) -> None:
    """Run torch.profiler on a running job's ranks over their next steps, store the traces
    with the job, and print (or with --out download) them; --list lists the stored ones.
    The traces open in Perfetto (ui.perfetto.dev) or TensorBoard's profile plugin.

    Example: trident profile 12 --steps 3 --ranks 0,1 --out traces/
    """
    with connect(server) as client:
        if list_:
            listing = client.list_profiles(job_id)
            typer.echo(json.dumps(model_json(listing), indent=2) if output == "json"
                       else render_list(listing))
            return
        if request is not None:
            req = client.get_profile(job_id, request)
        else:
            req = client.request_profile(job_id, steps=steps, ranks=parse_ranks(ranks),
                                         memory=memory)
        req = answered(req, lambda i: client.get_profile(job_id, i), noun="profile request",
                       job_id=job_id, timeout=timeout, every_s=0.5)
        if output == "json":
            typer.echo(json.dumps(model_json(req), indent=2))
        else:
            typer.echo(render(req))
        if req.status == StackStatus.FAILED:
            fail(f"profile request {req.id} of job {job_id} failed: {req.error}", 1)
        if out is not None:
            try:
                paths = client.download_profile(job_id, req.id, out)
            except FileExistsError as exc:
                fail(f"{exc.filename} exists already: give an empty folder", 1)
            if output == "text":
                typer.echo(f"{len(paths)} file(s) in {out}")


def register(app: typer.Typer) -> None:
    """Add `trident profile` to the `trident` app."""
    app.command()(profile)
