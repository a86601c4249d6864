"""`trident submit`, `cancel` and `resubmit`: acting on jobs through the REST API.

`submit` follows the job it queued until it ends, as `ray job submit` does, and its exit
status says how it ended (`EXIT`); `--detach` returns at once. Following draws a progress bar
of steps on a terminal and prints a line per step otherwise (pipes, CI logs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.common import DEFAULT_SERVER, ServerOpt, connect, error_line, fail
from cli.spec import SetOpt, check_path, load_spec
from client.payloads import JobOut, MetricOut, one_line
from client.rest import ApiError, TridentClient, model_json
from service.contract.spec import JobSpec
from service.contract.specfile import load_yaml
from service.contract.states import JobState

EXIT = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3}
"""`trident submit`'s exit status by the job's final state. 2 is a request that was refused
or could not be made (a bad spec, a 4xx, an unreachable server); 130 is Ctrl-C (the job
trains on)."""
INTERRUPTED = 130
ACTIVE = [s.value for s in JobState if not s.terminal]


class Output(StrEnum):
    text = "text"
    json = "json"


SecretOpt = Annotated[list[str] | None, typer.Option(
    "--secret", metavar="NAME[=@FILE]",
    help="A secret for the ranks' environment, write-only on the server: the value of this"
    " shell's variable NAME, or NAME=@FILE the file's text (a final newline dropped). Never"
    " a value on the command line. Repeat for more.")]


def with_secrets(spec: JobSpec, secrets: list[str]) -> JobSpec:
    """`spec` with `--secret`s added (read here, on the client; sent in the submission only)."""
    values: dict[str, str] = {}
    for item in secrets:
        name, sep, source = item.partition("=")
        if not sep:
            if name not in os.environ:
                fail(f"--secret {name}: no variable {name} in this shell's environment (set"
                     f" it, or give --secret {name}=@FILE)")
            values[name] = os.environ[name]
        elif source.startswith("@"):
            try:
                values[name] = Path(source[1:]).read_text().removesuffix("\n")
            except OSError as exc:
                fail(f"--secret {name}: cannot read {source[1:]}: {exc.strerror}")
        else:
            fail(f"--secret {name}: give the value from the environment (--secret {name}) or"
                 f" a file (--secret {name}=@FILE), never on the command line")
    merged = {**spec.secret_values(), **values}
    try:
        return JobSpec.model_validate({**spec.model_dump(mode="json"), "secrets": merged})
    except ValidationError as exc:  # its text quotes the input: say the messages only
        fail("--secret: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                      for e in exc.errors()))


def submit(spec: Annotated[Path, typer.Argument(help="The job spec (YAML or JSON).")],
           server: ServerOpt = DEFAULT_SERVER,
           sets: SetOpt = None,
           detach: Annotated[bool, typer.Option(
               "--detach", "-d", help="Print the job id and return at once.")] = False,
           output: Annotated[Output, typer.Option(
               "--output", "-o", help="json: print the created job as JSON (the follow goes"
               " to stderr).")] = Output.text,
           project: Annotated[str | None, typer.Option(
               help="Project to submit under (default: your first).")] = None,
           secret: SecretOpt = None) -> None:
    """Submit a job spec and follow it until it ends: state changes, events, a progress bar
    of steps (a line per step when not on a terminal), then the final state. Exits 0 if it
    SUCCEEDED, 1 if it FAILED, 3 if it was CANCELLED, 2 if the submission was refused;
    Ctrl-C stops following (130) and the job trains on. Retried on connection errors under
    one Idempotency-Key, so that a retry never queues the job twice.

    Example: trident submit examples/tiny.yaml --set train.steps=100 --secret HF_TOKEN
    """
    checked = load_spec(spec, sets)
    if secret:
        checked = with_secrets(checked, secret)
    with connect(server) as client:
        job = client.submit(checked, project=project)
        show_and_follow(client, job, output, detach)


def show_and_follow(client: TridentClient, job: JobOut, output: Output, detach: bool) -> None:
    """What `submit` and `resubmit` do with the job they queued: print it (its id with -d, its
    JSON with -o json, a line otherwise), then, unless detached, follow it until it ends and
    exit with its state's code (Ctrl-C: 130, the job trains on)."""
    as_json = output == Output.json
    if as_json:
        typer.echo(json.dumps(model_json(job), indent=2))
    elif detach:
        typer.echo(job.id)
    if detach:
        return
    if not as_json:
        typer.echo(f"job {job.id} submitted: {job.name}, {job.plan.layout.label},"
                   f" {job.world_size} ranks" + ("" if job.plan.planned else ", not planned"))
    try:
        state = follow(client, job.id, err=as_json)
    except KeyboardInterrupt:
        typer.echo(f"\nstopped following job {job.id}; it trains on (`trident cancel"
                   f" {job.id}` stops it, `trident logs -f {job.id}` follows its output)",
                   err=True)
        raise typer.Exit(INTERRUPTED) from None
    raise typer.Exit(EXIT[state])


class _Lines:
    """Following as lines: one per state change, event and step."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def note(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def step(self, m: MetricOut, total: int) -> None:
        loss = "-" if m.loss is None else f"{m.loss:.4f}"
        rate = "-" if m.tokens_per_s is None else f"{m.tokens_per_s:.0f}"
        self.note(f"  step {m.step:>5}/{total}  loss {loss}  {m.step_time_s * 1000:8.1f}"
                  f" ms  {rate:>10} tok/s")

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

    def step(self, m: MetricOut, total: int) -> None:
        loss = "-" if m.loss is None else f"{m.loss:.4f}"
        self.progress.update(self.task, completed=m.step,
                             info=f"loss {loss}  {m.step_time_s:.3f} s/step")

    def close(self) -> None:
        self.progress.stop()


def follow(client: TridentClient, job_id: int, interval: float = 1.0,
           err: bool = False) -> str:
    """Print state changes, events and new steps until the job ends; its final state."""
    console = Console(file=sys.stderr if err else sys.stdout, highlight=False)
    job: JobOut = client.get_job(job_id)
    total = job.total_steps or 0
    out = _Bar(console, job_id, total) if console.is_interactive else _Lines(console)
    last_state, last_step, last_event, attempt = "", 0, 0, 0
    try:
        while True:
            for ev in client.iter_events(job_id, after=last_event):
                last_event = ev.id
                if ev.kind != "state":
                    out.note(f"  [{ev.kind}] {(ev.message.splitlines() or [''])[0][:200]}")
            if job.attempts != attempt:  # a retry counts its steps from 1 again
                attempt, last_step = job.attempts, 0
            if attempt:
                for m in client.list_metrics(job_id, after_step=last_step,
                                             attempt=attempt).items:
                    last_step = max(last_step, m.step)
                    out.step(m, total)
            if job.state.value != last_state:
                last_state = job.state.value
                out.note(f"job {job_id} {last_state}")
            if last_state in EXIT:
                break
            time.sleep(interval)
            job = client.get_job(job_id)
    finally:
        out.close()
    if job.error:  # its telling line: the whole text (a traceback) is describe's and logs'
        typer.echo(f"error: job {job_id} {last_state}: {one_line(job.error)} (`trident describe"
                   f" {job_id}` shows the error, `trident logs {job_id}` the ranks' output)",
                   err=True)
    return last_state


def parse_states(given: list[str] | None) -> list[str]:
    """`--state RUNNING,queued --state PLACING` as state names; an unknown one is an error."""
    out = []
    for part in (p.strip().upper() for g in given or [] for p in g.split(",")):
        if part not in JobState.__members__:
            fail(f"--state: unknown state {part!r}; one of {', '.join(JobState)}")
        out.append(part)
    return out


def _targets(client: TridentClient, states: list[str], owner: str | None) -> list[JobOut]:
    """The jobs `cancel --all` selects: not ended, in `states`, of `owner`."""
    wanted = [s for s in states if s in ACTIVE] if states else ACTIVE
    return list(client.iter_jobs(state=wanted, owner=owner or None)) if wanted else []


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
    with connect(server) as client:
        if all_:
            jobs = _targets(client, parse_states(state), owner)
            if not jobs:
                typer.echo("no job that has not ended matches; nothing to cancel")
                return
            lines = [f"  {j.id:>5}  {j.state.value:<10} {j.owner:<12} {j.name}" for j in jobs]
            targets = [j.id for j in jobs]
        else:
            targets = list(dict.fromkeys(ids or []))
            lines = [f"  {i}" for i in targets]
        if not yes:
            typer.echo(f"cancel {len(targets)} job(s):\n" + "\n".join(lines))
            confirm("nothing cancelled (--yes cancels without asking)")
        refused = 0
        for job_id in targets:
            try:
                job = client.cancel_job(job_id)
            except ApiError as exc:
                refused += 1
                typer.echo(f"error: job {job_id}: {error_line(exc)}", err=True)
            else:
                typer.echo(f"job {job_id}: {job.state.value} (cancel requested)")
    if refused:
        raise typer.Exit(1)


def confirm(otherwise: str) -> None:
    """Ask `proceed? [y/N]`; anything but yes (or no answer: stdin closed, no terminal) is
    `error: not confirmed: <otherwise>` and exit 1."""
    try:
        if typer.confirm("proceed?", default=False):
            return
    except typer.Abort:  # end of input before an answer
        typer.echo("")  # end the prompt's line, so that the error is a line of its own
        fail(f"no answer on stdin: {otherwise}", 1)
    fail(f"not confirmed: {otherwise}", 1)


def resubmit(job_id: Annotated[int, typer.Argument(min=1, help="The job.")],
             step: Annotated[int | None, typer.Argument(
                 min=1, help="With --from-checkpoint: the tag's step (default: the newest).",
                 show_default=False)] = None,
             from_checkpoint: Annotated[bool, typer.Option(
                 "--from-checkpoint", help="Start from the job's checkpoint (any job whose"
                 " weights you may export), on the layout --set gives it.")] = False,
             sets: SetOpt = None,
             detach: Annotated[bool, typer.Option(
                 "--detach", "-d", help="Print the new job's id and return at once.")] = False,
             output: Annotated[Output, typer.Option(
                 "--output", "-o", help="json: print the new job as JSON (the follow goes"
                 " to stderr).")] = Output.text,
             server: ServerOpt = DEFAULT_SERVER) -> None:
    """Queue a new job with a job's spec (members: their own jobs), --set fields changed, and
    follow it as `submit` does. With --from-checkpoint [STEP] it starts from that job's
    checkpoint (its newest, or STEP's), possibly on another layout or cluster size.

    Example: trident resubmit 12 --from-checkpoint 400 --set parallel.dp=2 --set parallel.tp=1
    """
    if step is not None and not from_checkpoint:
        fail("STEP: only with --from-checkpoint (trident resubmit JOB --from-checkpoint STEP)")
    changes = dict(_set_pairs(sets or []))
    with connect(server) as client:
        job = client.resubmit_job(job_id, from_checkpoint=(step or 0) if from_checkpoint
                                  else None, changes=changes)
        show_and_follow(client, job, output, detach)


def _set_pairs(sets: list[str]) -> list[tuple[str, object]]:
    """`--set FIELD=VALUE` as (field, value), the value read as YAML, as `submit` reads it;
    the field is checked against the spec's fields here."""
    out = []
    for item in sets:
        field, eq, text = item.partition("=")
        field = field.strip()
        if not eq or not field:
            fail(f"--set {item!r}: expected FIELD=VALUE, e.g. train.steps=100")
        check_path(field)
        try:
            value = load_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            fail(f"--set {field}: {text!r} is not a YAML value")
        out.append((field, value))
    return out


def register(app: typer.Typer) -> None:
    """Add these commands to the `trident` app."""
    app.command()(submit)
    app.command()(cancel)
    app.command()(resubmit)
