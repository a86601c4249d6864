"""What every comparison of `make bench` shares: percentiles, alternated pairs, goals, the
report (`var/bench/report.json`) and its Markdown table (`var/bench/report.md`).

This machine is shared and noisy, so the headline of each comparison is a ratio of two things
measured in the same process run, alternated (A B B A ...), not an absolute time.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def pct(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))]


def dist(xs: Sequence[float]) -> dict[str, float]:
    """median, p10, p90, p99 and n of a sample."""
    return {"median": statistics.median(xs) if xs else float("nan"), "p10": pct(xs, 10),
            "p90": pct(xs, 90), "p99": pct(xs, 99), "n": len(xs)}


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    """Seconds of each of n calls."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def alternate(a: Callable[[], float], b: Callable[[], float],
              reps: int) -> tuple[list[float], list[float]]:
    """Run a and b in ABBA order `reps` times each, so load drift falls on both alike."""
    xa: list[float] = []
    xb: list[float] = []
    for i in range(reps):
        if i % 2 == 0:
            xa.append(a())
            xb.append(b())
        else:
            xb.append(b())
            xa.append(a())
    return xa, xb


@dataclass
class Goal:
    name: str
    value: float | None
    target: str
    met: bool | None
    note: str = ""


@dataclass
class Section:
    """One comparison: figures (free-form JSON), rows for the table, goals."""

    name: str
    title: str
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    """(what, headline, detail) for the Markdown table."""
    goals: list[Goal] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def row(self, what: str, headline: str, detail: str = "") -> None:
        self.rows.append((what, headline, detail))

    def goal(self, name: str, value: float | None, target: str, met: bool | None,
             note: str = "") -> None:
        self.goals.append(Goal(name, value, target, met, note))


def machine() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "memory_bytes": mem,
            "python": platform.python_version(), "platform": platform.platform(),
            "load_avg": load}


def fmt_s(x: float | None) -> str:
    if x is None or x != x:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def fmt_dist(d: dict[str, float]) -> str:
    return f"median {fmt_s(d['median'])} (p10 {fmt_s(d['p10'])}, p90 {fmt_s(d['p90'])})"


def write(sections: list[Section], out_dir: Path, args: dict[str, Any],
          started: float) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"command": "make bench" + (" (quick)" if args.get("quick") else ""),
              "args": args, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "seconds": round(time.time() - started, 1), "machine": machine(),
              "sections": {s.name: {"title": s.title, "seconds": round(s.seconds, 1),
                                    "error": s.error, "figures": s.figures,
                                    "rows": [list(r) for r in s.rows],
                                    "goals": [g.__dict__ for g in s.goals]}
                           for s in sections}}
    js = out_dir / "report.json"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md = out_dir / "report.md"
    md.write_text(markdown(report))
    return js, md


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    mem = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "?"
    lines = [f"# Trident benchmarks ({report['command']})", "",
             f"{report['started']}, {m['cpus']} CPUs, {mem} memory, load {m.get('load_avg')};"
             f" {report['seconds']:.0f} s", ""]
    for s in report["sections"].values():
        lines += [f"## {s['title']}", ""]
        if s["error"]:
            lines += [f"**failed**: `{s['error']}`", ""]
        if s["rows"]:
            lines += ["| what | headline | detail |", "|---|---|---|"]
            lines += [f"| {a} | {b} | {c} |" for a, b, c in s["rows"]]
            lines.append("")
        if s["goals"]:
            lines += ["| goal | measured | target | met |", "|---|---|---|---|"]
            for g in s["goals"]:
                v = g["value"]
                shown = "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
                met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
                note = f" ({g['note']})" if g["note"] else ""
                lines.append(f"| {g['name']} | {shown} | {g['target']} | {met}{note} |")
            lines.append("")
    return "\n".join(lines)


def cpu_ranks(script: Path, args: Callable[[int, int], list[str]], world: int, tree: Path,
              what: str) -> list[dict[str, Any]]:
    """Run `world` ranks of `script` on CPU (gloo, one thread each) from `tree`, each given
    `args(rank, port)` (`port`: a free one for their rendezvous), and return what each printed
    last, as JSON; a rank that fails raises with its stderr's end, naming `what`."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree), "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), *args(rank, port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=tree)
             for rank in range(world)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"a rank of {what} failed: {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out
