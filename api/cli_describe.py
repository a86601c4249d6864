"""`trident describe ID`: everything about one job on one screen, as `kubectl describe` shows
a pod: its line of the jobs list, the plan against the measurement, the spec, every attempt
with the nodes of its ranks, the newest hang diagnosis, the failure, why it waits, and its
newest events. Read from the REST API only (`/jobs/{id}`, `/attempts`, `/events`, `/hangs`,
`/comm/steps`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import typer
import yaml

from api.cli_common import _call
from api.cli_format import (
    DEFAULT_SERVER,
    Output,
    ServerOpt,
    ago,
    columns,
    dump,
    job_row,
    seconds_between,
    secs,
    size,
    span,
)
from service.dashboard import one_line

EVENT_PAGE = 1000
"""Events per request (the API's most)."""
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


def nodes_of(placement: dict[str, Any]) -> list[dict[str, Any]]:
    """An attempt's placement grouped by node: hostname, node id, its ranks and GPUs."""
    by_node: dict[str, dict[str, Any]] = {}
    for r in placement.get("ranks") or []:
        n = by_node.setdefault(r.get("node_id") or r.get("hostname") or "?", {
            "hostname": r.get("hostname"), "node_id": r.get("node_id"), "ranks": [],
            "gpu_ids": []})
        n["ranks"].append(r["rank"])
        n["gpu_ids"] += [str(g) for g in r.get("gpu_ids") or []]
    return list(by_node.values())


def _events(server: str, job_id: int, keep: int) -> tuple[list[dict[str, Any]], int]:
    """The newest `keep` events (oldest first) and how many there are."""
    kept: list[dict[str, Any]] = []
    after, total = 0, 0
    while True:
        page = _call(server, "GET", f"/jobs/{job_id}/events",
                     params={"after": after, "limit": EVENT_PAGE}, retries=2)["items"]
        total += len(page)
        kept = (kept + page)[-keep:] if keep else []
        if len(page) < EVENT_PAGE:
            return kept, total
        after = page[-1]["id"]


def gather(server: str, job_id: int, events: int) -> dict[str, Any]:
    """Everything `describe` shows, as `-o json|yaml` prints it (docs/cli.md)."""
    j = _call(server, "GET", f"/jobs/{job_id}", retries=2)
    attempts = _call(server, "GET", f"/jobs/{job_id}/attempts", retries=2)["items"]
    hangs = _call(server, "GET", f"/jobs/{job_id}/hangs", retries=2)["items"]
    split = _call(server, "GET", f"/jobs/{job_id}/comm/steps", retries=2)
    evs, total = _events(server, job_id, events)
    steps = split["steps"]
    measured = None
    if steps:
        measured = {k: sum(s[k] for s in steps) / len(steps)
                    for k in ("compute", "tp", "pp", "dp", "step_s")}
        measured["step"] = measured.pop("step_s")
    plan = j["plan"]
    return {
        "job": job_row(j), "spec": j["spec"],
        "plan": {"layout": job_row(j)["layout"], "world_size": plan["world_size"],
                 "step_s": plan["time"]["step_s"], "tokens_per_s": plan["tokens_per_s"],
                 "memory_bytes": plan["memory"]["total"]},
        "predicted_vs_measured": j["predicted_vs_measured"],
        "time_split": {"predicted": split["predicted"], "measured": measured,
                       "steps": len(steps)},
        "attempts": [{"number": a["number"], "status": a["status"],
                      "started": a["started_at"], "ended": a["ended_at"], "error": a["error"],
                      "nodes": nodes_of(a["placement"])} for a in attempts],
        "hang": hangs[0] if hangs else None,
        "error": j["error"], "reason": j.get("reason"),
        "events": [{"id": e["id"], "time": e["time"], "attempt": e["attempt"],
                    "kind": e["kind"], "message": e["message"]} for e in evs],
        "events_total": total}


def _when(iso: str | None) -> str:
    return "-" if iso is None else f"{iso[:19].replace('T', ' ')} ({ago(iso)})"


def _ratio(row: dict[str, Any] | None) -> str:
    return "-" if not row or row.get("ratio") is None else f"{row['ratio']:.2f}"


def text(d: dict[str, Any]) -> str:
    """The human form: sections of `Field: value` lines, as `kubectl describe` prints."""
    r, out = d["job"], []

    def field(k: str, v: Any) -> None:
        out.append(f"{k + ':':<13} {v}")

    field("Name", r["name"])
    field("ID", r["id"])
    field("Owner", f"{r['owner']} (project {r['project'] or '-'})")
    field("State", r["state"])
    field("Reason", d["reason"] or "-")
    field("Layout", f"{r['layout']}, {r['ranks']} ranks")
    field("Priority", r["priority"])
    field("Submitted", _when(r["submitted"]))
    field("Started", _when(r["started"]))
    field("Finished", _when(r["finished"]))
    field("Duration", span(r["duration_s"]))
    field("Attempts", f"{r['attempts']} ({r['restarts']} restart(s))")
    loss = "-" if r["loss"] is None else f"{r['loss']:.4g}"
    field("Progress", f"step {'-' if r['step'] is None else r['step']}/"
          f"{r['total_steps'] or '-'}, loss {loss}, last report {ago(r['reported_at'])}")
    pvm, plan = d["predicted_vs_measured"] or {}, d["plan"]
    out += ["", f"Plan against measurement (medians of {pvm.get('steps_measured', 0)} steady"
            " steps, newest attempt):"]
    mem = pvm.get("memory_bytes") or {}
    states = pvm.get("model_state_bytes") or {}
    tok = pvm.get("tokens_per_s") or {}
    step = pvm.get("step_s") or {}
    rows = [["s/step", secs(plan["step_s"]), secs(step.get("measured")), _ratio(step)],
            ["tokens/s", f"{plan['tokens_per_s']:.0f}",
             "-" if tok.get("measured") is None else f"{tok['measured']:.0f}", _ratio(tok)],
            ["model states", size(states.get("predicted")), size(states.get("measured")),
             _ratio(states)],
            ["peak memory", size(plan["memory_bytes"]), size(mem.get("measured_peak")), "-"]]
    split = d["time_split"]
    meas = split["measured"] or {}
    for k in ("compute", "tp", "pp", "dp", "bubble", "step"):
        rows.append([f"{k} s (mean of {split['steps']})" if k == "step" else f"{k} s",
                     secs(split["predicted"].get(k)), secs(meas.get(k)), "-"])
    out += ["  " + line for line in columns(["WHAT", "PREDICTED", "MEASURED", "RATIO"],
                                             rows).splitlines()]
    out += ["", "Spec:"] + ["  " + line for line in yaml.safe_dump(
        d["spec"], sort_keys=False).rstrip().splitlines()]
    out += ["", "Attempts:"] + (_attempts(d["attempts"]) or ["  none yet"])
    if d["hang"]:
        h = d["hang"]
        out += ["", f"Hang (attempt {h['attempt']}, {_when(h['time'])}):", f"  {h['summary']}"]
        for group in h["stacks"]:
            out.append(f"  ranks {ranges(group['ranks'])}:")
            out += ["    " + ln for ln in group["text"].rstrip().splitlines()[-STACK_LINES:]]
    if d["error"]:
        lines = d["error"].rstrip().splitlines()
        out += ["", "Failure:"] + ["  " + ln for ln in lines[-ERROR_LINES:]]
    out += ["", f"Events (newest {len(d['events'])} of {d['events_total']}):"]
    out += ["  " + ln for ln in columns(
        ["TIME", "ATTEMPT", "KIND", "MESSAGE"],
        [[e["time"][:19].replace("T", " "), str(e["attempt"] or "-"), e["kind"],
          (e["message"].splitlines() or [""])[0][:200]] for e in d["events"]]).splitlines()]
    return "\n".join(out)


def _attempts(attempts: list[dict[str, Any]]) -> list[str]:
    out = []
    for a in attempts:
        took = span(seconds_between(a["started"], a["ended"]))
        out.append(f"  #{a['number']}  {a['status']:<9}  started {_when(a['started'])},"
                   f" {'ran' if a['ended'] else 'running for'} {took}")
        for n in a["nodes"]:
            gpus = f", GPUs {','.join(n['gpu_ids'])}" if n["gpu_ids"] else ""
            out.append(f"      node {n['hostname']} ({(n['node_id'] or '?')[:12]}):"
                       f" ranks {ranges(n['ranks'])}{gpus}")
        if a["error"]:
            out.append(f"      error: {one_line(a['error'])}")
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
    d = gather(server, job_id, events)
    typer.echo(dump(d, output) if output in (Output.json, Output.yaml) else text(d))


def register(app: typer.Typer) -> None:
    app.command()(describe)

