"""`trident describe ID`: everything about one job on one screen, as `kubectl describe` shows
a pod: its line of the jobs list, the plan against the measurement, the spec, every attempt
with the nodes of its ranks, the newest hang diagnosis, the failure, why it waits, and its
newest events. Read through `TridentClient` (`get_job`, `list_attempts`, `iter_events`,
`list_hangs`, `get_comm_steps`), and printed from the typed `Description`."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any

import typer
import yaml
from pydantic import BaseModel

from cli.common import connect
from cli.format import (
    DEFAULT_SERVER,
    JobRow,
    Output,
    ServerOpt,
    ago,
    clock,
    columns,
    dump,
    loss_text,
    seconds_between,
    secs,
    size,
    span,
)
from cli.memory_view import memory_gap_lines
from client.payloads import (
    Attempt,
    Event,
    Hang,
    Number,
    Placement,
    PredictedVsMeasured,
    TimeSplit,
    one_line,
)
from client.rest import TridentClient
from service.contract.spec import JobSpec

STACK_LINES = 8
"""A hang's stacks show their innermost this-many lines (`-o json` has them whole)."""
ERROR_LINES = 30


def ranges(ranks: Iterable[int]) -> str:
    """Ranks as runs: `0-3,6,8-9`."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# --- what `describe -o json|yaml` prints (docs/cli.md), its fields in this order ---------------

class NodeRanks(BaseModel):
    """The ranks (and GPUs) an attempt placed on one node."""

    hostname: str | None
    node_id: str | None
    ranks: list[int]
    gpu_ids: list[str]


class AttemptLine(BaseModel):
    number: int
    status: str
    started: datetime
    ended: datetime | None
    error: str | None
    nodes: list[NodeRanks]

    @classmethod
    def of(cls, a: Attempt) -> AttemptLine:
        return cls(number=a.number, status=a.status.value, started=a.started_at,
                   ended=a.ended_at, error=a.error, nodes=nodes_of(Placement.of(a)))


class PlanLine(BaseModel):
    layout: str
    world_size: int
    planned: bool = True
    """False for a command job without model: placed from `resources` alone, the figures
    below None (nothing predicted)."""
    step_s: Number | None
    tokens_per_s: Number | None
    memory_bytes: Number | None


class MeasuredSplit(BaseModel):
    """The mean over the recent steps of their split (`TimeSplit` without the bubble)."""

    compute: float
    tp: float
    pp: float
    dp: float
    step: float


class TimeSplits(BaseModel):
    predicted: TimeSplit | None
    """None: the job is not planned."""
    measured: MeasuredSplit | None
    steps: int
    """How many steps `measured` is the mean of."""


class EventLine(BaseModel):
    id: int
    time: datetime
    attempt: int | None
    kind: str
    message: str

    @classmethod
    def of(cls, e: Event) -> EventLine:
        return cls(id=e.id, time=e.time, attempt=e.attempt, kind=e.kind, message=e.message)


class CheckpointsLine(BaseModel):
    """The job's checkpoint tags not deleted, and their bytes on disk."""

    tags: int
    newest_step: int | None
    bytes_on_disk: int


class Description(BaseModel):
    """Everything `describe` shows."""

    job: JobRow
    spec: JobSpec
    """The spec as stored (`Job.spec`)."""
    plan: PlanLine
    predicted_vs_measured: PredictedVsMeasured | None
    time_split: TimeSplits
    attempts: list[AttemptLine]
    hang: Hang | None
    """The newest hang diagnosis."""
    error: str | None
    reason: str | None
    events: list[EventLine]
    """The newest `--events`, oldest first."""
    events_total: int
    secrets: list[str] = []
    """The names of the job's secrets (their values are never shown)."""
    env_hidden: list[str] = []
    """The `env` variables whose values you may not read (the owner's and admins' to read)."""
    checkpoints: CheckpointsLine | None = None
    """Its checkpoint tags on disk (`trident checkpoints` lists them)."""



def nodes_of(placement: Placement) -> list[NodeRanks]:
    """An attempt's placement grouped by node: hostname, node id, its ranks and GPUs."""
    by_node: dict[str, NodeRanks] = {}
    for r in placement.ranks:
        n = by_node.setdefault(r.node_id or r.hostname or "?", NodeRanks(
            hostname=r.hostname, node_id=r.node_id, ranks=[], gpu_ids=[]))
        n.ranks.append(r.rank)
        n.gpu_ids += [str(g) for g in r.gpu_ids]
    return list(by_node.values())


def _events(client: TridentClient, job_id: int, keep: int) -> tuple[list[Event], int]:
    """The newest `keep` events (oldest first) and how many there are."""
    kept: list[Event] = []
    total = 0
    for ev in client.iter_events(job_id):
        total += 1
        if keep:
            kept = (kept + [ev])[-keep:]
    return kept, total


def gather(client: TridentClient, job_id: int, events: int) -> Description:
    """Everything `describe` shows, as `-o json|yaml` prints it (docs/cli.md)."""
    j = client.get_job(job_id)
    attempts = client.list_attempts(job_id).items
    hangs = client.list_hangs(job_id).items
    split = client.get_comm_steps(job_id)
    evs, total = _events(client, job_id, events)
    tags = client.list_checkpoints(job_id)
    steps = split.steps
    measured = None
    if steps:
        measured = MeasuredSplit(**{k: sum(getattr(s, k) for s in steps) / len(steps)
                                    for k in ("compute", "tp", "pp", "dp")},
                                 step=sum(s.step_s for s in steps) / len(steps))
    row = JobRow.of(j)
    return Description(
        job=row, spec=j.spec, secrets=j.secrets, env_hidden=j.env_hidden,
        plan=PlanLine(layout=row.layout, world_size=j.plan.world_size, planned=j.plan.planned,
                      step_s=j.plan.time.step_s if j.plan.time else None,
                      tokens_per_s=j.plan.tokens_per_s,
                      memory_bytes=j.plan.memory.total if j.plan.memory else None),
        predicted_vs_measured=j.predicted_vs_measured,
        time_split=TimeSplits(predicted=split.predicted, measured=measured, steps=len(steps)),
        attempts=[AttemptLine.of(a) for a in attempts], hang=hangs[0] if hangs else None,
        error=j.error, reason=j.reason, events=[EventLine.of(e) for e in evs],
        events_total=total,
        checkpoints=CheckpointsLine(tags=len(tags.items), bytes_on_disk=tags.bytes_on_disk,
                                    newest_step=tags.items[-1].step if tags.items else None))


def _when(t: datetime | None) -> str:
    return "-" if t is None else f"{clock(t)} ({ago(t)})"


def _missing(pvm: PredictedVsMeasured | None) -> str:
    """What to say of a memory figure no step carried: a command job's script did not report
    it, Trident's trainer did not measure it."""
    return pvm.reported.missing if pvm and pvm.reported else "not measured"


NOT_PLANNED_LINE = ("Not planned (a command job without model, placed from resources alone: no"
                    " memory check, no predicted step)")


def _predicted(plan: PlanLine, shown: str) -> str:
    """A predicted figure as the table shows it: `not planned` for a job without a plan."""
    return shown if plan.planned else "not planned"


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def text(d: Description) -> str:
    """The human form: sections of `Field: value` lines, as `kubectl describe` prints."""
    r, out = d.job, []

    def field(k: str, v: Any) -> None:
        out.append(f"{k + ':':<13} {v}")

    field("Name", r.name)
    field("ID", r.id)
    field("Owner", f"{r.owner} (project {r.project or '-'})")
    field("State", r.state)
    field("Reason", d.reason or "-")
    field("Layout", f"{r.layout}, {r.ranks} ranks")
    if not d.plan.planned:
        field("Plan", "not planned: placed from resources.workers alone, nothing predicted")
    field("Priority", r.priority)
    field("Submitted", _when(r.submitted))
    field("Started", _when(r.started))
    field("Finished", _when(r.finished))
    field("Duration", span(r.duration_s))
    field("Attempts", f"{r.attempts} ({r.restarts} restart(s))")
    if d.checkpoints is not None and d.checkpoints.tags:
        c = d.checkpoints
        field("Checkpoints", f"{c.tags} tag(s), newest step {c.newest_step},"
              f" {size(c.bytes_on_disk)} on disk")
    loss = loss_text(r)
    field("Progress", f"step {'-' if r.step is None else r.step}/"
          f"{r.total_steps or '-'}, loss {loss}, last report {ago(r.reported_at)}")
    lr = "-" if r.lr is None else f"{r.lr:.3g}"
    norm = "-" if r.grad_norm is None else f"{r.grad_norm:.4g}"
    field("Recipe", f"lr {lr} at step {'-' if r.step is None else r.step}, gradient norm"
          f" {norm} before clipping (clip {d.spec.train.grad_clip or 'off'})")
    if r.eval_loss is not None or r.tokens is not None:
        evl = "-" if r.eval_loss is None else f"{r.eval_loss:.4g}"
        epoch = "" if r.epoch is None else f", epoch {r.epoch:.3g}"
        field("Data", f"eval loss {evl}, {r.tokens or 0} tokens{epoch}")
    pvm, plan = d.predicted_vs_measured, d.plan
    if plan.planned:
        out += ["", f"Plan against measurement (medians of {pvm.steps_measured if pvm else 0}"
                " steady steps, newest attempt):"]
    else:
        out += ["", f"{NOT_PLANNED_LINE}; measured (medians of"
                f" {pvm.steps_measured if pvm else 0} steady steps, newest attempt):"]
    step, tok, states = (pvm.step_s, pvm.tokens_per_s, pvm.model_state_bytes) if pvm else (
        None, None, None)
    peak = pvm.memory_bytes.measured_peak if pvm else None
    rows = [["s/step", _predicted(plan, secs(plan.step_s)), secs(step.measured if step else None),
             _ratio(step.ratio if step else None)],
            ["tokens/s", _predicted(plan, f"{plan.tokens_per_s or 0:.0f}"),
             "-" if tok is None or tok.measured is None else f"{tok.measured:.0f}",
             _ratio(tok.ratio if tok else None)],
            ["model states", _predicted(plan, size(states.predicted if states else None)),
             _missing(pvm) if states and states.measured is None and pvm and pvm.steps_measured
             else size(states.measured if states else None),
             _ratio(states.ratio if states else None)],
            ["peak memory", _predicted(plan, size(plan.memory_bytes)),
             _missing(pvm) if peak is None and pvm and pvm.steps_measured else size(peak), "-"]]
    split = d.time_split
    for k in ("compute", "tp", "pp", "dp", "bubble", "step"):
        rows.append([f"{k} s (mean of {split.steps})" if k == "step" else f"{k} s",
                     _predicted(plan, secs(getattr(split.predicted, k, None))),
                     secs(getattr(split.measured, k, None)),
                     "-"])
    out += ["  " + line for line in columns(["WHAT", "PREDICTED", "MEASURED", "RATIO"],
                                             rows).splitlines()]
    against = "planned against measured" if plan.planned else "measured"
    out += ["", f"Memory by stage, {against} (the most loaded rank of each"
            " stage):"] + memory_gap_lines(pvm.memory_by_stage if pvm else [])
    out += ["", "Spec:"] + ["  " + line for line in yaml.safe_dump(
        d.spec.model_dump(mode="json"), sort_keys=False).rstrip().splitlines()]
    if d.env_hidden:
        out.append(f"  (env values of {', '.join(d.env_hidden)}: the owner's and admins' to"
                   " read)")
    if d.secrets:
        out.append(f"  secrets: {', '.join(d.secrets)} (values never shown)")
    out += ["", "Attempts:"] + (_attempts(d.attempts) or ["  none yet"])
    if d.hang:
        h = d.hang
        out += ["", f"Hang (attempt {h.attempt}, {_when(h.time)}):", f"  {h.summary}"]
        for group in h.stacks:
            out.append(f"  ranks {ranges(group.ranks)}:")
            out += ["    " + ln for ln in group.text.rstrip().splitlines()[-STACK_LINES:]]
    if d.error:
        lines = d.error.rstrip().splitlines()
        out += ["", "Failure:"] + ["  " + ln for ln in lines[-ERROR_LINES:]]
    out += ["", f"Events (newest {len(d.events)} of {d.events_total}):"]
    out += ["  " + ln for ln in columns(
        ["TIME", "ATTEMPT", "KIND", "MESSAGE"],
        [[clock(e.time), str(e.attempt or "-"), e.kind,
          (e.message.splitlines() or [""])[0][:200]] for e in d.events]).splitlines()]
    return "\n".join(out)


def _attempts(attempts: list[AttemptLine]) -> list[str]:
    out = []
    for a in attempts:
        took = span(seconds_between(a.started, a.ended))
        out.append(f"  #{a.number}  {a.status:<9}  started {_when(a.started)},"
                   f" {'ran' if a.ended else 'running for'} {took}")
        for n in a.nodes:
            gpus = f", GPUs {','.join(n.gpu_ids)}" if n.gpu_ids else ""
            out.append(f"      node {n.hostname} ({(n.node_id or '?')[:12]}):"
                       f" ranks {ranges(n.ranks)}{gpus}")
        if a.error:
            out.append(f"      error: {one_line(a.error)}")
    return out


def describe(job_id: Annotated[int, typer.Argument(min=1, help="The job.")],
             server: ServerOpt = DEFAULT_SERVER,
             output: Annotated[Output, typer.Option(
                 "--output", "-o", case_sensitive=False,
                 help="table (the text view), json or yaml (docs/cli.md).")] = Output.table,
             events: Annotated[int, typer.Option(min=0, max=10000, help=(
                 "How many of the newest events to show."))] = 20) -> None:
    """Everything about one job: state and why it waits or failed, the plan against the
    measurement, the spec, the attempts with the nodes of their ranks, the newest hang
    diagnosis with the ranks' stacks, and the newest events.

    Example: trident describe 7 --events 50
    """
    with connect(server) as client:
        d = gather(client, job_id, events)
    typer.echo(dump(d, output) if output in (Output.json, Output.yaml) else text(d))


def register(app: typer.Typer) -> None:
    app.command()(describe)

