"""What `trident status`, `describe` and `top` share: output formats, the stable job row of
their JSON and YAML (docs/cli.md), aligned columns, human times and sizes, and the refresh
loop of `--watch` and `top` (redrawn in place on a terminal, one frame after another when
piped)."""

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
from rich.console import Console
from rich.live import Live
from rich.text import Text

ServerOpt = Annotated[str, typer.Option("--server", envvar="TRIDENT_SERVER",
                                        help="Base URL of the Trident API.")]
DEFAULT_SERVER = "http://127.0.0.1:8000"


class Output(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


OutputOpt = Annotated[Output, typer.Option("--output", "-o", case_sensitive=False,
                                           help="table, wide (more columns), json or yaml"
                                           " (stable shapes: docs/cli.md).")]


def dump(obj: Any, fmt: Output, *, stream: bool = False) -> str:
    """`obj` as JSON or YAML, keys in the order built. `stream` (one document per refresh):
    JSON on one line (JSON Lines), YAML starting with `---`."""
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


def when(iso: str | None) -> datetime | None:
    return None if iso is None else datetime.fromisoformat(iso).astimezone(UTC)


def seconds_between(start: str | None, end: str | None = None) -> float | None:
    """Seconds from `start` to `end` (default: now); None without a start."""
    t0 = when(start)
    if t0 is None:
        return None
    return max(0.0, ((when(end) or datetime.now(UTC)) - t0).total_seconds())


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


def ago(iso: str | None) -> str:
    return "-" if iso is None else f"{span(seconds_between(iso))} ago"


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


def layout(plan: dict[str, Any]) -> str:
    """A job's layout from the REST JSON of its plan, e.g. `tp1 pp1 dp2 zero2`."""
    from service.planner.stored import StoredPlan

    return StoredPlan.from_json(plan).layout.label


def job_row(j: dict[str, Any]) -> dict[str, Any]:
    """One job as `status -o json|yaml` prints it (the documented, stable shape), from the
    REST JSON of `GET /jobs` or `GET /jobs/{id}`."""
    end = j["finished_at"]
    return {
        "id": j["id"], "name": j["name"], "owner": j["owner"], "project": j["project"],
        "state": j["state"], "layout": layout(j["plan"]), "ranks": j["world_size"],
        "priority": j["priority"], "submitted": j["created_at"], "started": j["started_at"],
        "finished": end, "duration_s": seconds_between(j["started_at"], end),
        "step": j.get("step"), "total_steps": j.get("total_steps"), "loss": j.get("loss"),
        "step_s_predicted": j["plan"]["time"]["step_s"],
        "step_s_measured": j.get("step_time_s"), "reported_at": j.get("reported_at"),
        "attempts": j["attempts"], "restarts": j.get("restarts", 0),
        "queue_position": j.get("queue_position"), "reason": j.get("reason"),
        "error": j["error"]}


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
