"""What `trident status`, `describe` and `top` share: output formats, the stable job row of
their JSON and YAML (`JobRow`, docs/cli.md), aligned columns, human times and sizes, and the
refresh loop of `--watch` and `top` (redrawn in place on a terminal, one frame after another
when piped). Rows are read from the client's typed records (`api.schemas.JobOut`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

import typer
import yaml
from pydantic import BaseModel
from rich.console import Console
from rich.live import Live
from rich.text import Text

from cli.common import DEFAULT_SERVER, ServerOpt
from client.payloads import JobOut, Number
from client.rest import model_json

__all__ = ["DEFAULT_SERVER", "ServerOpt"]


class Output(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


OutputOpt = Annotated[Output, typer.Option("--output", "-o", case_sensitive=False,
                                           help="table, wide (more columns), json or yaml"
                                           " (stable shapes: docs/cli.md).")]


def dump(obj: Any, fmt: Output, *, stream: bool = False) -> str:
    """`obj` (a model, or JSON-ready data) as JSON or YAML, keys in the order of its fields.
    `stream` (one document per refresh): JSON on one line (JSON Lines), YAML starting with
    `---`."""
    if isinstance(obj, BaseModel):
        obj = model_json(obj)
    if fmt == Output.json:
        return json.dumps(obj) if stream else json.dumps(obj, indent=2)
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False,
                          explicit_start=stream).rstrip("\n")


def columns(headers: Sequence[str], rows: Sequence[Sequence[str]], *,
            headers_shown: bool = True) -> str:
    """Left-aligned columns two spaces apart (the last one unpadded), as `kubectl get`
    prints them: one line per row, nothing wrapped, so that `awk` and `grep` work."""
    lines = ([list(headers)] if headers_shown else []) + [list(r) for r in rows]
    if not lines:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(line[:-1], widths, strict=False)]
                               + [line[-1]]).rstrip() for line in lines)


def seconds_between(start: datetime | None, end: datetime | None = None) -> float | None:
    """Seconds from `start` to `end` (default: now); None without a start."""
    if start is None:
        return None
    return max(0.0, ((end or datetime.now(UTC)) - start).total_seconds())


def span(s: float | None) -> str:
    """A duration as `45s`, `3m12s`, `2h05m`, `3d04h`; `-` for none."""
    if s is None:
        return "-"
    n = int(s)
    if n < 60:
        return f"{n}s"
    if n < 3600:
        return f"{n // 60}m{n % 60:02d}s"
    if n < 86400:
        return f"{n // 3600}h{n % 3600 // 60:02d}m"
    return f"{n // 86400}d{n % 86400 // 3600:02d}h"


def ago(t: datetime | None) -> str:
    return "-" if t is None else f"{span(seconds_between(t))} ago"


def clock(t: datetime) -> str:
    """A time as the API gave it, to the second: `2025-01-02 03:04:05` (UTC)."""
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def secs(s: float | None) -> str:
    """Seconds, three significant digits: `0.512`, `12.3`; `-` for none."""
    return "-" if s is None else f"{s:.3g}"


def size(b: float | None) -> str:
    """Bytes in binary units: `512B`, `1.5Ki`, `3.2Gi`; `-` for none."""
    if b is None:
        return "-"
    for unit in ("B", "Ki", "Mi", "Gi", "Ti"):
        if abs(b) < 1024 or unit == "Ti":
            return f"{b:.0f}{unit}" if unit == "B" else f"{b:.1f}{unit}"
        b /= 1024
    raise AssertionError("unreachable")


class JobRow(BaseModel):
    """One job as `status -o json|yaml` prints it: the documented, stable shape (docs/cli.md),
    its fields in this order."""

    id: int
    name: str
    owner: str
    project: str | None
    state: str
    layout: str
    """`tp1 pp1 dp2 zero2`."""
    ranks: int
    priority: int
    submitted: datetime
    started: datetime | None
    finished: datetime | None
    duration_s: float | None
    step: int | None
    total_steps: int | None
    loss: float | None
    loss_nonfinite: bool = False
    """The loss at `step` was NaN or infinite (`loss` is None)."""
    lr: float | None = None
    """The learning rate of `step`."""
    grad_norm: float | None = None
    """The global gradient norm of `step`, before clipping."""
    eval_loss: float | None = None
    """The newest validation loss (`data.eval_every`)."""
    tokens: int | None = None
    epoch: float | None = None
    step_s_predicted: Number | None
    """None: the job is not planned."""
    step_s_measured: float | None
    reported_at: datetime | None
    attempts: int
    restarts: int
    queue_position: int | None
    reason: str | None
    error: str | None

    @classmethod
    def of(cls, j: JobOut) -> JobRow:
        return cls(
            id=j.id, name=j.name, owner=j.owner, project=j.project, state=j.state.value,
            layout=j.plan.layout.label, ranks=j.world_size, priority=j.priority,
            submitted=j.created_at, started=j.started_at, finished=j.finished_at,
            duration_s=seconds_between(j.started_at, j.finished_at), step=j.step,
            total_steps=j.total_steps, loss=j.loss, loss_nonfinite=j.loss_nonfinite, lr=j.lr,
            grad_norm=j.grad_norm,
            eval_loss=j.eval_loss, tokens=j.tokens, epoch=j.epoch,
            step_s_predicted=j.plan.time.step_s if j.plan.time else None,
            step_s_measured=j.step_time_s, reported_at=j.reported_at, attempts=j.attempts,
            restarts=j.restarts, queue_position=j.queue_position, reason=j.reason,
            error=j.error)


NONFINITE = "NaN/inf"
"""A loss that was NaN or infinite, as the CLI and the dashboard print it."""


def loss_text(r: JobRow) -> str:
    """The loss at the job's newest step: `NaN/inf` when it was not finite, `-` when none
    was reported."""
    return NONFINITE if r.loss_nonfinite else "-" if r.loss is None else f"{r.loss:.4g}"


def refresh(render: Callable[[], str], *, count: int, interval: float,
            in_place: bool = True) -> None:
    """Print `render()` `count` times (0: until Ctrl-C), `interval` seconds apart. With
    `in_place` on a terminal, each frame replaces the last (rich Live); piped, the frames
    follow each other with a blank line between them. Without `in_place` (JSON, YAML) the
    documents follow each other as they are. Ctrl-C ends it quietly."""
    console = Console(highlight=False, soft_wrap=True)
    live = in_place and console.is_terminal
    n = 0
    try:
        with Live(console=console, auto_refresh=False,
                  redirect_stdout=False) if live else nullcontext() as view:
            while True:
                frame = render()
                if view is not None:
                    view.update(Text(frame), refresh=True)
                else:
                    typer.echo(("\n" if n and in_place else "") + frame)
                n += 1
                if count and n >= count:
                    return
                time.sleep(interval)
    except KeyboardInterrupt:
        return
