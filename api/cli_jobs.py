"""`trident submit`, `cancel` and `resubmit`: acting on jobs through the REST API.

`submit` follows the job it queued until it ends, as `ray job submit` does, and its exit
status says how it ended (`EXIT`); `--detach` returns at once. Following draws a progress bar
of steps on a terminal and prints a line per step otherwise (pipes, CI logs).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import click
import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from api.cli_common import DEFAULT_SERVER, ServerOpt, _call, _client, fail, refusal, unreachable
from api.cli_spec import SetOpt, load_spec
from service.planner.stored import StoredPlan
from service.states import JobState

EXIT = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3}
"""`trident submit`'s exit status by the job's final state. 2 is a request that was refused
or could not be made (a bad spec, a 4xx, an unreachable server); 130 is Ctrl-C (the job
trains on)."""
INTERRUPTED = 130
ACTIVE = [s.value for s in JobState if not s.terminal]


class Output(StrEnum):
    text = "text"
    json = "json"


def layout(plan: dict[str, Any]) -> str:
    """A job's layout from the REST JSON of its plan, e.g. `tp1 pp1 dp2 zero2`."""
    return StoredPlan.from_json(plan).layout.label


def submit(spec: Annotated[Path, typer.Argument(help="The job spec (YAML or JSON).")],
           server: ServerOpt = DEFAULT_SERVER,
           sets: SetOpt = None,
           detach: Annotated[bool, typer.Option(
               "--detach", "-d", help="Print the job id and return at once.")] = False,
           output: Annotated[Output, typer.Option(
               "--output", "-o", help="json: print the created job as JSON (the follow goes"
               " to stderr).")] = Output.text,
           project: Annotated[str | None, typer.Option(
               help="Project to submit under (default: your first).")] = None) -> None:
    """Submit a job spec and follow it until it ends: state changes, events, a progress bar
    of steps (a line per step when not on a terminal), then the final state. Exits 0 if it
    SUCCEEDED, 1 if it FAILED, 3 if it was CANCELLED, 2 if the submission was refused;
    Ctrl-C stops following (130) and the job trains on. Retried on connection errors under
    one Idempotency-Key, so that a retry never queues the job twice.

    Example: trident submit examples/tiny.yaml --set train.steps=100 --set parallel.dp=2
    """
    body = load_spec(spec, sets).model_dump(mode="json")
    job = _call(server, "POST", "/jobs", json=body,
                params={"project": project} if project else None,
                headers={"Idempotency-Key": f"cli-{uuid.uuid4().hex}"}, retries=4)
    as_json = output == Output.json
    if as_json:
        typer.echo(json.dumps(job, indent=2))
    elif detach:
        typer.echo(job["id"])
    if detach:
        return
    if not as_json:
        typer.echo(f"job {job['id']} submitted: {job['name']}, {layout(job['plan'])},"
                   f" {job['world_size']} ranks")
    try:
        state = follow(server, job["id"], err=as_json)
    except KeyboardInterrupt:
        typer.echo(f"\nstopped following job {job['id']}; it trains on (`trident cancel"
                   f" {job['id']}` stops it, `trident logs -f {job['id']}` follows its output)",
                   err=True)
        raise typer.Exit(INTERRUPTED) from None
    raise typer.Exit(EXIT[state])


class _Lines:
    """Following as lines: one per state change, event and step."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def step(self, m: dict[str, Any], total: int) -> None:
        loss = "-" if m["loss"] is None else f"{m['loss']:.4f}"
        self.note(f"  step {m['step']:>5}/{total}  loss {loss}  {m['step_time_s'] * 1000:8.1f}"
                  f" ms  {m['tokens_per_s']:10.0f} tok/s")

    def close(self) -> None:
        pass


class _Bar(_Lines):
    """Following on a terminal: a progress bar of steps, notes printed above it."""

    def __init__(self, console: Console, job_id: int, total: int) -> None:
        super().__init__(console)
        self.progress = Progress(TextColumn(f"job {job_id}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("steps  {task.fields[info]}"),
                                 TimeElapsedColumn(), console=console, transient=False)
        self.task = self.progress.add_task("steps", total=total, info="")
        self.progress.start()

    def note(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def step(self, m: dict[str, Any], total: int) -> None:
        loss = "-" if m["loss"] is None else f"{m['loss']:.4f}"
        self.progress.update(self.task, completed=m["step"],
                             info=f"loss {loss}  {m['step_time_s']:.3f} s/step")

    def close(self) -> None:
        self.progress.stop()


def follow(server: str, job_id: int, interval: float = 1.0, err: bool = False) -> str:
    """Print state changes, events and new steps until the job ends; its final state."""
    console = Console(file=sys.stderr if err else sys.stdout, highlight=False)
    job = _call(server, "GET", f"/jobs/{job_id}", retries=2)
    total = int(job["spec"]["train"]["steps"])
    out = _Bar(console, job_id, total) if console.is_interactive else _Lines(console)
    last_state, last_step, last_event, attempt = "", 0, 0, 0
    try:
        while True:
            for ev in _call(server, "GET", f"/jobs/{job_id}/events", retries=2,
                            params={"after": last_event, "limit": 1000})["items"]:
                last_event = ev["id"]
                if ev["kind"] != "state":
                    out.note(f"  [{ev['kind']}] {ev['message'].splitlines()[0][:200]}")
            if job["attempts"] != attempt:  # a retry counts its steps from 1 again
                attempt, last_step = job["attempts"], 0
            if attempt:
                for m in _call(server, "GET", f"/jobs/{job_id}/metrics", retries=2,
                               params={"after_step": last_step, "attempt": attempt})["items"]:
                    last_step = max(last_step, m["step"])
                    out.step(m, total)
            if job["state"] != last_state:
                last_state = job["state"]
                out.note(f"job {job_id} {last_state}")
            if last_state in EXIT:
                break
            time.sleep(interval)
            job = _call(server, "GET", f"/jobs/{job_id}", retries=2)
    finally:
        out.close()
    if job.get("error"):
        typer.echo(job["error"], err=True)
    return last_state


def parse_states(given: list[str] | None) -> list[str]:
    """`--state RUNNING,queued --state PLACING` as state names; an unknown one is an error."""
    out = []
    for part in (p.strip().upper() for g in given or [] for p in g.split(",")):
        if part not in JobState.__members__:
            fail(f"--state: unknown state {part!r}; one of {', '.join(JobState)}")
        out.append(part)
    return out


def _targets(server: str, states: list[str], owner: str | None) -> list[dict[str, Any]]:
    """The jobs `cancel --all` selects: not ended, in `states`, of `owner`."""
    found: list[dict[str, Any]] = []
    wanted = [s for s in states if s in ACTIVE] if states else ACTIVE
    params: dict[str, Any] = {"state": wanted, "limit": 500,
                              **({"owner": owner} if owner else {})}
    while wanted:
        page = _call(server, "GET", "/jobs", params={**params, "offset": len(found)})
        found += page["items"]
        if not page["items"] or len(found) >= page["total"]:
            break
    return found


def cancel(ids: Annotated[list[int] | None, typer.Argument(
               help="Job ids (or --all).", show_default=False)] = None,
           server: ServerOpt = DEFAULT_SERVER,
           all_: Annotated[bool, typer.Option(
               "--all", help="Every job that has not ended (narrowed by --state, --owner).")]
           = False,
           state: Annotated[list[str] | None, typer.Option(
               help="With --all: only jobs in this state (repeat, or comma-separate:"
                    " RUNNING,QUEUED).", autocompletion=lambda: ACTIVE)] = None,
           owner: Annotated[str | None, typer.Option(
               help="With --all: only this user's jobs.")] = None,
           yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask to confirm.")]
           = False) -> None:
    """Cancel jobs, after a confirmation (unless --yes); the controller stops their
    workers within seconds. Exits 1 if any cancel was refused (each is named).

    Example: trident cancel --all --state QUEUED --owner alice --yes
    """
    if ids and all_:
        fail("give job ids or --all, not both")
    if not ids and not all_:
        fail("give job ids, or --all (with --state/--owner to narrow it)")
    if (state or owner) and not all_:
        fail("--state and --owner select jobs for --all")
    if all_:
        jobs = _targets(server, parse_states(state), owner)
        if not jobs:
            typer.echo("no job that has not ended matches; nothing to cancel")
            return
        lines = [f"  {j['id']:>5}  {j['state']:<10} {j['owner']:<12} {j['name']}" for j in jobs]
        targets = [j["id"] for j in jobs]
    else:
        targets = list(dict.fromkeys(ids or []))
        lines = [f"  {i}" for i in targets]
    if not yes:
        typer.echo(f"cancel {len(targets)} job(s):\n" + "\n".join(lines))
        try:
            if not typer.confirm("proceed?", default=False):
                fail("not confirmed: nothing cancelled", 1)
        except click.Abort:
            fail("not confirmed: nothing cancelled (--yes skips the question)", 1)
    refused = 0
    with _client(server) as client:
        for job_id in targets:
            try:
                r = client.post(f"/jobs/{job_id}/cancel")
            except httpx.HTTPError as exc:
                fail(unreachable(server, exc))
            if r.status_code >= 400:
                refused += 1
                typer.echo(f"job {job_id}: {refusal(server, r)}", err=True)
            else:
                typer.echo(f"job {job_id}: {r.json()['state']} (cancel requested)")
    if refused:
        raise typer.Exit(1)


def resubmit(job_id: int, server: ServerOpt = DEFAULT_SERVER) -> None:
    """Queue a new job with a job's spec (members: their own jobs); prints the new id.

    Example: trident resubmit 12
    """
    typer.echo(_call(server, "POST", f"/jobs/{job_id}/resubmit")["id"])


def register(app: typer.Typer) -> None:
    """Add these commands to the `trident` app."""
    app.command()(submit)
    app.command()(cancel)
    app.command()(resubmit)
