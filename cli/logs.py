"""`trident logs` and `trident events`: a job's rank output and its events, printed or
followed live.

Rank logs come whole lines at a time, each prefixed with its rank (and, with `--timestamps`,
the time by which it was written, from the writer's time index); `--rank`, `--stage`,
`--tail` and `--since` select on the server, `--grep` here.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import typer

from cli.common import DEFAULT_SERVER, ServerOpt, connect, fail
from client.payloads import Chunk
from client.rest import TridentClient, model_json

INTERRUPTED = 130
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`10m`, `30s`, `2h`, `1d` ago, or an ISO 8601 time (UTC unless it says otherwise)."""
    if m := DURATION.match(text.strip()):
        return (now or datetime.now(UTC)) - timedelta(seconds=float(m[1]) * UNIT_S[m[2]])
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        fail(f"--since {text!r}: expected a duration (10m, 30s, 2h, 1d) or an ISO 8601 time")
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def parse_ranks(values: list[str] | None) -> list[int]:
    """`--rank 0,3 --rank 5` as [0, 3, 5]."""
    out: list[int] = []
    for v in values or []:
        for part in v.split(","):
            if not part.strip().isdigit():
                fail(f"--rank {v!r}: expected rank numbers, e.g. --rank 0,3")
            out.append(int(part))
    return sorted(set(out))


class RankLines:
    """Whole lines of every rank, prefixed `[rank r]` (and their time); a partial line waits
    for its end. Lines that `grep` does not match are left out."""

    def __init__(self, *, prefix: bool = True, timestamps: bool = False,
                 grep: re.Pattern[str] | None = None) -> None:
        self.partial: dict[int, str] = {}
        self.partial_time: dict[int, float | None] = {}
        self.prefix, self.timestamps, self.grep = prefix, timestamps, grep

    def _echo(self, rank: int, line: str, when: float | None) -> None:
        if self.grep is not None and not self.grep.search(line):
            return
        head = ""
        if self.timestamps:
            head = (datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds")
                    .replace("+00:00", "Z") + " ") if when else "-" + " "
        if self.prefix:
            head += f"[rank {rank}] "
        typer.echo(head + line)

    def add(self, chunk: Chunk) -> None:
        r = chunk.rank
        if chunk.skipped:
            typer.echo(f"[rank {r}] ... {chunk.skipped} bytes dropped by the size cap")
        *lines, self.partial[r] = (self.partial.get(r, "") + chunk.text).split("\n")
        times = chunk.times or []  # one per line, the partial last one too
        for i, line in enumerate(lines):
            self._echo(r, line, times[i] if i < len(times) else None)
        if len(times) > len(lines):
            self.partial_time[r] = times[len(lines)]

    def flush(self) -> None:
        for r, rest in sorted(self.partial.items()):
            if rest:
                self._echo(r, rest, self.partial_time.get(r))
        self.partial.clear()


def _stage_ranks(client: TridentClient, job_id: int, stage: int) -> list[int]:
    """The ranks of pipeline stage `stage`, from the job's plan."""
    rows = client.get_job(job_id).plan.rank_layout
    stages = sorted({row.pp for row in rows})
    if stage not in stages:
        fail(f"--stage {stage}: job {job_id} has pipeline stages"
             f" {', '.join(map(str, stages)) or 'none'}")
    return [row.rank for row in rows if row.pp == stage]


def print_logs(chunks: Any, printer: RankLines) -> None:
    """Print `chunks` (a rank's whole lines once they end; a rank's last partial line when
    the next rank's output starts, and at the end)."""
    last: int | None = None
    for c in chunks:
        if last is not None and c.rank != last:
            printer.flush()
        printer.add(c)
        last = c.rank
    printer.flush()


def logs(job_id: int, server: ServerOpt = DEFAULT_SERVER,
         rank: Annotated[list[str] | None, typer.Option(
             help="Only these ranks: 0,3 (or repeat).", show_default=False)] = None,
         stage: Annotated[int | None, typer.Option(
             min=0, help="Only the ranks of this pipeline stage.")] = None,
         attempt: Annotated[int | None, typer.Option(min=1, help="Default: the newest.")]
         = None,
         follow: Annotated[bool, typer.Option(
             "--follow", "-f", help="Keep printing until the job ends.")] = False,
         tail: Annotated[int | None, typer.Option(
             min=1, max=100_000, help="Start at each rank's last N lines.")] = None,
         since: Annotated[str | None, typer.Option(
             help="Start at output written since: 10m, 30s, 2h, 1d, or an ISO time.")]
         = None,
         grep: Annotated[str | None, typer.Option(
             help="Only lines matching this regular expression ((?i) ignores case).")]
         = None,
         timestamps: Annotated[bool, typer.Option(
             "--timestamps", help="Prefix each line with the time it was written (UTC).")]
         = False,
         prefix: Annotated[bool, typer.Option(
             help="Prefix each line with its rank.")] = True) -> None:
    """Print the ranks' stdout and stderr, each line prefixed with its rank.

    Example: trident logs 12 -f --rank 0,3 --tail 20 --grep 'loss|error' --timestamps
    """
    try:
        pattern = re.compile(grep) if grep is not None else None
    except re.error as exc:
        fail(f"--grep {grep!r}: not a regular expression: {exc}")
    ranks = parse_ranks(rank)
    since_time = parse_since(since) if since else None
    printer = RankLines(prefix=prefix, timestamps=timestamps, grep=pattern)
    with connect(server) as client:
        if stage is not None:
            in_stage = _stage_ranks(client, job_id, stage)
            ranks = [r for r in ranks if r in in_stage] if ranks else in_stage
            if not ranks:
                fail(f"--rank {','.join(rank or [])}: none of them is in stage {stage}")
        select: dict[str, Any] = {"rank": ranks or None, "attempt": attempt, "tail": tail,
                                  "since_time": since_time, "timestamps": timestamps}
        if not follow:
            print_logs(client.read_logs(job_id, **select), printer)
            return
        try:
            print_logs(client.follow_logs(job_id, **select), printer)
        except KeyboardInterrupt:
            printer.flush()
            raise typer.Exit(INTERRUPTED) from None


def events(job_id: int, server: ServerOpt = DEFAULT_SERVER,
           follow: Annotated[bool, typer.Option(
               "--follow", "-f", help="Keep printing new events until the job ends.")]
           = False,
           kind: Annotated[list[str] | None, typer.Option(
               help="Only events of this kind (repeat): state, placement, failure, ...")]
           = None) -> None:
    """Print a job's events, oldest first: state changes, placement (the node of every
    rank), failures with tracebacks, hangs, cancels and teardowns.

    Example: trident events 12 -f --kind state --kind failure
    """
    after, ended = 0, False
    try:
        with connect(server) as client:
            while True:
                for ev in client.iter_events(job_id, after=after):
                    after = ev.id
                    if not kind or ev.kind in kind:
                        typer.echo(f"{model_json(ev.time)}  {ev.kind:<10} {ev.message}")
                if not follow or ended:
                    return
                # Once the job has ended, one more read gets the events written with its end.
                ended = client.get_job(job_id).state.terminal
                if not ended:
                    time.sleep(1.0)
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None


def register(app: typer.Typer) -> None:
    """Add these commands to the `trident` app."""
    app.command()(logs)
    app.command()(events)
